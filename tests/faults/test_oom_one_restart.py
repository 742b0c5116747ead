"""One restart per OOM, under the real supervisor (`python -m hangwatch.supervisor run`, the built-in worker, tiny model
on the CPU), with the `memory_limit` fault's fake allocator: a device capped at `capacity_mb` on which the model takes
`weights_mb` and each example of a training forward `per_example_mb`, raising torch's out-of-memory error in torch's
words when a batch does not fit.

* evidence sufficient: the first OOM's figures (allocated + requested of the allowed, the weights' share the worker
  measured) pick the micro-batch at once — exactly one remediation restart, at the micro-batch the rule predicts, the
  effective batch and the examples of every optimizer step the same as an uninterrupted run's;
* evidence missing (the injected `oom` fault's message has no figures, and the CPU none either): the halving ladder,
  as before, saying why;
* a later OOM after an evidence-based pick goes on down the ladder from the pick.
"""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.sup_harness import attempts, incidents, run_supervisor
from fixtures.fakes.workers import make_config, read_beats, run_worker

pytestmark = pytest.mark.slow

WATCH = {"startup_timeout_s": 60, "silence_timeout_s": 30, "py_spy": False, "poll_interval_s": 0.1}
RESTART = {"backoff_initial_s": 0, "max_restarts": 4}
TRAIN = {"max_steps": 6, "micro_batch_size": 16, "grad_accum": 1}
CHECKPOINT = {"every_steps": 2, "confirm_steps": 0}
DEVICE = {"kind": "memory_limit", "weights_mb": 700, "per_example_mb": 1000, "capacity_mb": 4096, "at_step": 3}


def predicted_micro(weights: float, per_example: float, capacity: float, micro: int, effective: int) -> int:
    """The rule: the largest divisor of the effective batch, at most half the failed micro-batch, whose need fits in
    90 % of the capacity."""
    return max(
        d for d in range(1, micro // 2 + 1) if effective % d == 0 and weights + d * per_example <= 0.9 * capacity
    )


def step_ids(beats) -> dict:
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_enough_evidence_means_one_restart_at_the_predicted_micro_batch(tmp_path):
    config = make_config(
        tmp_path / "a", watchdog=WATCH, restart=RESTART, train=TRAIN, checkpoint=CHECKPOINT, faults=[DEVICE]
    )
    run = tmp_path / "a" / "run"
    rc, out = run_supervisor(config, timeout=240)
    assert rc == 0, out[-3000:]
    micro = predicted_micro(700, 1000, 4096, 16, 16)
    assert micro == 2  # 700 MiB + 2 × 1000 MiB fits 90 % of 4 GiB; 4 would not (and 8, the ladder's next, OOMs)
    (inc,) = incidents(run)  # one failure, one restart
    assert inc["kind"] == "oom" and len(attempts(run)) == 2
    r = inc["remediation"]
    assert r["basis"] == "evidence" and r["evidence"]["picked"] == micro
    assert (r["to"]["micro_batch_size"], r["to"]["grad_accum"]) == (micro, 16 // micro)
    assert r["message"].startswith(
        "out of memory at micro-batch 16: 700 MiB allocated + 15.6 GiB requested of 4.0 GiB "
        "allowed, weights 700 MiB → about 0.98 GiB per example; restarting from the last good "
        "checkpoint with micro-batch 2 × accumulation 8 (effective batch 16 unchanged)"
    )
    record = json.loads((run / "remediation.json").read_text())
    assert [h["basis"] for h in record["history"]] == ["evidence"]
    words = json.loads((run / "attempts" / "0001" / "exit.json").read_text())
    assert words["memory"]["weights_mb"] == 700.0 and "4.00 GiB allowed;" in words["message"]
    start = next(b for b in read_beats(run, 2) if b["event"] == "start")
    assert (start["micro_batch_size"], start["grad_accum"], start["effective_batch"]) == (micro, 16 // micro, 16)
    assert start["resumed_step"] == 2

    # The same run on a device with room for it: the same examples in every optimizer step.
    reference = make_config(tmp_path / "b", train=TRAIN, checkpoint=CHECKPOINT)
    assert run_worker(reference, timeout=180) == 0
    remedied = {**step_ids(read_beats(run, 1)), **step_ids(read_beats(run, 2))}
    assert sorted(remedied) == list(range(1, 7))
    assert remedied == step_ids(read_beats(tmp_path / "b" / "run", 1))
    assert all(len(ids) == 16 for ids in remedied.values())


def test_without_evidence_the_ladder_halves_as_before(tmp_path):
    config = make_config(
        tmp_path,
        watchdog=WATCH,
        restart=RESTART,
        checkpoint=CHECKPOINT,
        train={"max_steps": 6, "micro_batch_size": 4, "grad_accum": 2},
        faults=[{"kind": "oom", "at_step": 3}],
    )
    run = tmp_path / "run"
    rc, out = run_supervisor(config, timeout=180)
    assert rc == 0, out[-3000:]
    (inc,) = incidents(run)
    r = inc["remediation"]
    assert r["basis"] == "ladder" and "no weights' share was recorded" in r["why"]
    assert (r["to"]["micro_batch_size"], r["to"]["grad_accum"]) == (2, 4)
    assert (
        "micro-batch 4 → 2, accumulation 2 → 4 (effective batch 8 unchanged); the ladder: no weights' share"
        in r["message"]
    )
    record = json.loads((run / "remediation.json").read_text())
    assert [h["basis"] for h in record["history"]] == ["ladder"]
    assert all(len(b["example_ids"]) == 8 for b in read_beats(run, 2) if b["event"] == "step")


def test_an_oom_after_the_pick_goes_on_down_the_ladder(tmp_path):
    config = make_config(
        tmp_path,
        watchdog=WATCH,
        restart=RESTART,
        train=TRAIN,
        checkpoint=CHECKPOINT,
        faults=[DEVICE, {"kind": "oom", "at_step": 5}],
    )
    run = tmp_path / "run"
    rc, out = run_supervisor(config, timeout=240)
    assert rc == 0, out[-3000:]
    assert [i["kind"] for i in incidents(run)] == ["oom", "oom"]
    record = json.loads((run / "remediation.json").read_text())
    assert [(h["basis"], h["to"]["micro_batch_size"], h["to"]["grad_accum"]) for h in record["history"]] == [
        ("evidence", 2, 8),
        ("ladder", 1, 16),
    ]
    start = next(b for b in read_beats(run, 3) if b["event"] == "start")
    assert (start["micro_batch_size"], start["grad_accum"]) == (1, 16)
