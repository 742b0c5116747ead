"""The resume audit, pure: comparisons, the words of a difference, the replay window read back from the earlier
attempts' heartbeat files (only the tail), verified / diverged / partial / unverifiable."""

from __future__ import annotations

import json
import math

import pytest

from hangwatch.common.protocol import encode
from hangwatch.common.rundir import attempt_dir, heartbeat_path
from hangwatch.supervisor.watch.replay_check import (
    FOREIGN_RTOL,
    ReplayAudit,
    default_rtol,
    differences,
    earlier_beats,
    explain,
    same,
)


@pytest.mark.parametrize(
    "a, b, rtol, expected",
    [
        (2.5, 2.5, 0.0, True),
        (2.5, math.nextafter(2.5, 3.0), 0.0, False),
        (2.5, 2.52, 0.01, True),
        (2.5, 2.6, 0.01, False),
        (float("nan"), float("nan"), 0.0, True),
        (float("inf"), float("inf"), 0.0, True),
        (float("nan"), 1.0, 0.5, False),
        (0.0, 0.0, 0.0, True),
    ],
)
def test_same(a, b, rtol, expected):
    assert same(a, b, rtol) is expected


def test_the_learning_rate_is_held_to_a_tight_tolerance_whatever_rtol_says():
    diffs = differences({"loss": 2.0, "lr": 1.0e-4}, {"loss": 2.01, "lr": 1.01e-4}, 0.05)
    assert diffs == [("lr", 1.0e-4, 1.01e-4)]


def test_default_rtol():
    assert default_rtol(None, own_command=False) == 0.0
    assert default_rtol(None, own_command=True) == FOREIGN_RTOL
    assert default_rtol(0.2, own_command=False) == 0.2


@pytest.mark.parametrize(
    "diffs, words",
    [
        ([("lr", 1.2e-4, 2.0e-4)], "the learning-rate schedule was not restored"),
        ([("loss", 2.3104, 2.4471), ("lr", 1.2e-4, 2.0e-4)], "the learning-rate schedule was not restored"),
        ([("loss", 2.3104, 2.4471)], "data order"),
        ([("grad_norm", 1.5, 0.7)], "the data, the model or the optimizer state"),
    ],
)
def test_explain_names_the_figure_and_what_was_not_restored(diffs, words):
    text = explain(31, diffs)
    assert text.startswith("step 31: " + diffs[0][0]) and "before the restart" in text and words in text


def _write(run_dir, attempt, rank, lines):
    d = attempt_dir(run_dir, attempt)
    d.mkdir(parents=True, exist_ok=True)
    with open(heartbeat_path(d, rank), "ab") as f:
        for ev, step, extra in lines:
            f.write(
                encode(
                    {
                        "v": 1,
                        "t": 0.0,
                        "pid": 1,
                        "rank": rank,
                        "attempt": attempt,
                        "event": ev,
                        "step": step,
                        "phase": "train",
                        **extra,
                    }
                )
            )


def _steps(lo, hi, attempt=1, **over):
    return [("step", s, {"loss": 10.0 / s, "lr": 1e-3 * s, **over.get(s, {})}) for s in range(lo, hi + 1)]


def test_earlier_beats_reads_the_window_from_the_newest_attempt_that_beat_each_step(tmp_path):
    run = tmp_path / "run"
    _write(run, 1, 0, [("start", 0, {})] + _steps(1, 25) + [("checkpoint", 20, {"path": "c", "good": False})])
    _write(run, 2, 0, [("start", 20, {})] + [("step", s, {"loss": 99.0}) for s in range(21, 23)])
    _write(run, 2, 1, [("step", 21, {"loss": 5.0, "grad_norm": 2.0})])
    got = earlier_beats(run, 3, after_step=20)
    assert sorted(k for k in got if k[0] == 0) == [(0, s) for s in range(21, 26)]
    assert got[(0, 21)] == (2, {"loss": 99.0})  # attempt 2 beat it last
    assert got[(0, 24)] == (1, {"loss": 10.0 / 24, "lr": 0.024})
    assert got[(1, 21)] == (2, {"loss": 5.0, "grad_norm": 2.0})


def test_earlier_beats_reads_only_the_tail_of_a_long_file(tmp_path):
    run = tmp_path / "run"
    # A line at the head that a reader going all the way back would take (its step is beyond the resume point):
    # reading backwards stops at the first step at or before the resume point, long before it.
    _write(run, 1, 0, [("step", 50000, {"loss": 1.0})] + _steps(1, 30000))
    assert heartbeat_path(attempt_dir(run, 1), 0).stat().st_size > 1 << 20
    got = earlier_beats(run, 2, after_step=29990)
    assert sorted(s for _, s in got) == list(range(29991, 30001))


def test_a_torn_or_foreign_line_is_skipped(tmp_path):
    run = tmp_path / "run"
    _write(run, 1, 0, _steps(1, 5))
    with open(heartbeat_path(attempt_dir(run, 1), 0), "ab") as f:
        f.write(b'{"event": "step", "step": 6, "lo')  # torn last line
    got = earlier_beats(run, 2, after_step=3)
    assert sorted(s for _, s in got) == [4, 5]


def _audit(before_steps=range(31, 40), rtol=0.0, ranks=(0,)):
    before = {(r, s): (2, {"loss": 10.0 / s, "lr": 1e-4 * s}) for r in ranks for s in before_steps}
    return ReplayAudit(3, 30, before, rtol, incident="0002")


def test_a_replay_that_matches_is_verified_once_the_window_is_through():
    a = _audit()
    for s in range(31, 39):
        assert a.observe(0, s, {"loss": 10.0 / s, "lr": 1e-4 * s}) is None
    assert a.observe(0, 39, {"loss": 10.0 / 39, "lr": 1e-4 * 39}) == "verified"
    assert a.text == "resume verified: steps 31–39 replayed, loss and lr bitwise equal"
    rec = a.record()
    assert rec["verdict"] == "verified" and rec["replayed"] == [31, 39] and rec["compared"] == [31, 39]
    assert rec["steps_compared"] == 9 and rec["previous_attempt"] == 2 and rec["incident"] == "0002"
    assert a.observe(0, 40, {"loss": 0.0}) is None  # said once


def test_an_unrestored_schedule_diverges_at_the_first_replayed_step_naming_lr():
    a = _audit()
    assert a.observe(0, 31, {"loss": 10.0 / 31, "lr": 1e-4}) == "diverged"
    d = a.record()["difference"]
    assert (d["step"], d["figure"], d["before"]) == (31, "lr", pytest.approx(1e-4 * 31))
    assert a.text.startswith("step 31: lr 0.0001 vs 0.0031 before the restart — the learning-rate schedule")


def test_a_different_loss_within_rtol_is_verified_with_the_tolerance_said():
    a = _audit(rtol=0.01)
    for s in range(31, 40):
        a.observe(0, s, {"loss": 10.0 / s * 1.001, "lr": 1e-4 * s})
    assert a.verdict == "verified" and "within rtol 0.01" in a.text


def test_an_attempt_that_ends_in_the_window_is_partial_and_one_with_no_figures_unverifiable():
    a = _audit()
    a.observe(0, 31, {"loss": 10.0 / 31})
    a.observe(0, 32, {"loss": 10.0 / 32})
    assert a.ended() == "partial"
    assert a.text.startswith("resume partly verified: steps 31–32 of 31–39 replayed before the attempt ended, loss")
    b = _audit()
    b.observe(0, 31, {"tokens_per_s": 5.0})
    assert b.ended() == "unverifiable" and "carry no loss" in b.text
    c = ReplayAudit(2, 10, {}, 0.0)
    assert c.ended() == "unverifiable" and "nothing replayed" in c.text


def test_several_ranks_name_the_rank_that_differs():
    a = _audit(ranks=(0, 1))
    assert a.observe(0, 31, {"loss": 10.0 / 31, "lr": 1e-4 * 31}) is None
    assert a.observe(1, 31, {"loss": 1.0, "lr": 1e-4 * 31}) == "diverged"
    assert a.text.startswith("step 31 on rank 1: loss 1 vs 0.3226")
    assert json.dumps(a.record())  # the record is plain JSON


def test_a_step_that_was_not_finite_before_the_restart_ends_the_window():
    before = {
        (0, s): (1, {"loss": (float("nan") if s == 9 else 1.0 / s), "grad_norm": 0.0 if s == 9 else 1.0})
        for s in range(5, 11)
    }
    a = ReplayAudit(2, 4, before, 0.0)
    assert a.window == (5, 8) and a.cutoff == 9
    for s in range(5, 9):
        a.observe(0, s, {"loss": 1.0 / s, "grad_norm": 1.0})
    assert a.verdict == "verified" and "steps 5–8" in a.text and "not finite before the restart" in a.text
    assert a.observe(0, 9, {"loss": 4.0, "grad_norm": 1.4}) is None  # the failure's own step: no divergence
    only = ReplayAudit(2, 8, {(0, 9): (1, {"loss": float("inf")})}, 0.0)
    assert only.ended() == "unverifiable" and "step 9, the first replayed one, was not finite" in only.text
