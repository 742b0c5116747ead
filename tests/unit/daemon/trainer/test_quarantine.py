"""NaN quarantine: who is quarantined (pure table), the data order that skips them, and the worker end to end
in process: poisoned ids → one rollback, exactly those ids quarantined, no further rollback, and every
other example in its place."""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.workers import make_config, read_beats, run_in_process

from hangwatch.daemon.data import Example, ShuffledEpochs
from hangwatch.daemon.trainer import quarantine as q
from hangwatch.daemon.trainer.quarantine import BadStep
from hangwatch.daemon.worker_errors import DataError


@pytest.mark.parametrize(
    "streak, streaks, want",
    [
        # the examples whose own loss was non-finite, and only they
        ([BadStep(5, ["a", "b"], ["b"]), BadStep(5, ["c", "d"], [])], [], [("b", q.OWN_LOSS, 5)]),
        # nothing attributable the first time: no quarantine (the rollback alone may cure it)
        ([BadStep(5, ["a", "b"], []), BadStep(5, ["c", "d"], [])], [], []),
        # the same optimizer step fails again after a rollback: widened to every example of the streak
        (
            [BadStep(5, ["a", "b"], []), BadStep(5, ["c", "b"], ["b"])],
            [{"steps": [5]}],
            [("a", q.AGAIN, 5), ("b", q.AGAIN, 5), ("c", q.AGAIN, 5)],
        ),
        # another step failing is a new streak, judged on its own
        ([BadStep(9, ["e", "f"], ["f"])], [{"steps": [5]}], [("f", q.OWN_LOSS, 9)]),
    ],
)
def test_culprits(streak, streaks, want):
    assert q.culprits(streak, [], streaks) == want


def test_record_never_repeats_an_id_and_keeps_every_streak(tmp_path):
    first = q.record(tmp_path, [BadStep(3, ["a", "b"], ["a"])], attempt=1, now=1.0)
    assert first == [{"id": "a", "reason": q.OWN_LOSS, "step": 3, "attempt": 1, "t": 1.0}]
    again = q.record(tmp_path, [BadStep(3, ["a", "c"], [])], attempt=2, now=2.0)
    assert [r["id"] for r in again] == ["c"]  # widened, but "a" is in already
    assert q.quarantined_ids(tmp_path) == {"a", "c"}
    assert [s["steps"] for s in q.read_streaks(tmp_path)] == [[3], [3]]
    with open(q.path_for(tmp_path), "a") as f:
        f.write('{"id": "torn')  # a crash mid-append leaves a torn last line: ignored
    assert q.quarantined_ids(tmp_path) == {"a", "c"}


def _examples(n):
    return [Example(id=f"f:{i}", input_ids=[1, 2], labels=[-100, 2]) for i in range(n)]


def test_data_order_skips_only_the_quarantined():
    ex = _examples(10)
    full = [e.id for e in ShuffledEpochs(ex, 3).take(60)]
    skip = frozenset({full[2], full[7]})
    skipped = ShuffledEpochs(ex, 3, skip=skip)
    got = [e.id for e in skipped.take(21)]
    assert got == [i for i in full if i not in skip][:21]
    # The position still counts the skipped, so a resume from it continues the same order.
    again = ShuffledEpochs(ex, 3, skip=skip)
    again.restore(skipped.position())
    assert [e.id for e in again.take(3)] == [i for i in full if i not in skip][21:24]
    with pytest.raises(DataError, match="every training example"):
        ShuffledEpochs(ex[:2], 0, skip=frozenset({"f:0", "f:1"}))


def step_ids(beats):
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_poisoned_examples_one_rollback_then_quarantined_and_skipped(tmp_path):
    clean = make_config(
        tmp_path / "clean",
        train={"max_steps": 12, "max_nonfinite_streak": 1},
        checkpoint={"every_steps": 2, "confirm_steps": 0},
    )
    assert run_in_process(clean) == 0
    by_step = step_ids(read_beats(tmp_path / "clean" / "run", 1))
    reference = [i for s in sorted(by_step) for i in by_step[s]]
    poison = [by_step[3][1], by_step[3][6]]  # two examples of step 3

    config = make_config(
        tmp_path,
        train={"max_steps": 10, "max_nonfinite_streak": 1},
        checkpoint={"every_steps": 2, "confirm_steps": 0},
        faults=[{"kind": "poison", "example_ids": poison}],
    )
    run = tmp_path / "run"
    codes = []
    while len(codes) < 4:  # what the supervisor does: restart after 75, until the run ends
        codes.append(run_in_process(config))
        if codes[-1] != 75:
            break
    assert codes == [75, 0]  # one rollback, then no further one
    records = q.read(run)
    assert sorted(r["id"] for r in records) == sorted(poison)
    assert {r["reason"] for r in records} == {q.OWN_LOSS} and {(r["step"], r["attempt"]) for r in records} == {(3, 1)}

    # Everything else in the data order is unchanged: the run's examples, step by step, are the order
    # of the unpoisoned run with the two ids taken out.
    first, second = step_ids(read_beats(run, 1)), step_ids(read_beats(run, 2))
    resumed = read_beats(run, 2)[0]["resumed_step"]
    assert resumed == 2 and sorted(first) == [1, 2] and sorted(second) == list(range(3, 11))
    trained = [i for s in sorted(first) for i in first[s]] + [i for s in sorted(second) for i in second[s]]
    assert not set(trained) & set(poison)
    assert trained == [i for i in reference if i not in poison][:80] and len(trained) == 80
    warn = [b for b in read_beats(run, 1) if b["event"] == "warn" and b.get("quarantined")]
    assert sorted(warn[0]["quarantined"]) == sorted(poison)
    assert json.loads((run / "attempts" / "0001" / "exit.json").read_text())["kind"] == "nan"
