"""One restart per OOM, under the real supervisor (`python -m hangwatch.supervisor run`, the built-in worker, tiny model
on the CPU, `restart.in_process: false`: the restart path), with the `memory_limit` fault's fake allocator: a device
capped at `capacity_mb` on which the model takes `weights_mb` and each example of a training forward
`per_example_mb`, allocated in 8 pieces, torch's out-of-memory error raised at the first piece that does not fit.

* the first OOM: the OOM's figures are a lower bound and nothing is picked from them; the restart goes one rung down
  and the new process measures one step at micro-batch 1 before training (the device's peak) and trains at the
  largest micro-batch that measure says fits — exactly one restart, at the micro-batch the rule predicts, the
  effective batch and the examples of every optimizer step the same as an uninterrupted run's;
* no figures to measure (the injected `oom` fault on the CPU): the rung stands, saying so;
* a later OOM after the measured pick goes on down the ladder from the pick.
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


def predicted_micro(weights: float, per_example: float, capacity: float, rung: int, effective: int) -> int:
    """The rule: the largest divisor of the effective batch, at most the rung the restart went to, whose measured
    need fits in 90 % of the capacity."""
    return max(d for d in range(1, rung + 1) if effective % d == 0 and weights + d * per_example <= 0.9 * capacity)


def step_ids(beats) -> dict:
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def history(run) -> list:
    record = json.loads((run / "remediation.json").read_text())
    return [(h["basis"], h["to"]["micro_batch_size"], h["to"]["grad_accum"]) for h in record["history"]]


def test_one_restart_one_rung_down_then_the_micro_batch_the_new_process_measured(tmp_path):
    config = make_config(
        tmp_path / "a", watchdog=WATCH, restart=RESTART, train=TRAIN, checkpoint=CHECKPOINT, faults=[DEVICE]
    )
    run = tmp_path / "a" / "run"
    rc, out = run_supervisor(config, timeout=240)
    assert rc == 0, out[-3000:]
    micro = predicted_micro(700, 1000, 4096, 8, 16)
    assert micro == 2  # 700 MiB + 2 × 1000 MiB fits 90 % of 4 GiB; 4 would not (and 8, the rung, OOMs)
    (inc,) = incidents(run)  # one failure, one restart
    assert inc["kind"] == "oom" and len(attempts(run)) == 2
    r = inc["remediation"]
    assert r["basis"] == "probe" and (r["to"]["micro_batch_size"], r["to"]["grad_accum"]) == (8, 2)
    ev = r["evidence"]
    # what the error said: allocated + requested, less than the need (a lower bound), never picked from
    assert ev["lower_bound"] is True and ev["need_mb"] < 700 + 16 * 1000
    assert "a lower bound" in r["message"] and "nothing is picked from them" in r["message"]
    assert history(run) == [("probe", 8, 2), ("measured", micro, 16 // micro)]
    record = json.loads((run / "remediation.json").read_text())
    first, then = record["history"]
    assert then["evidence"]["per_example_mb"] == 1000.0 and then["evidence"]["weights_mb"] == 700.0
    assert first["t"] <= then["t"] < first["t"] + 600  # both wall clock
    beats2 = read_beats(run, 2)
    start = next(b for b in beats2 if b["event"] == "start")
    assert (start["micro_batch_size"], start["grad_accum"], start["effective_batch"]) == (8, 2, 16)
    assert start["resumed_step"] == 2
    assert any("from a probe step" in b.get("message", "") for b in beats2 if b["event"] == "warn")

    # The same run on a device with room for it: the same examples in every optimizer step.
    reference = make_config(tmp_path / "b", train=TRAIN, checkpoint=CHECKPOINT)
    assert run_worker(reference, timeout=180) == 0
    remedied = {**step_ids(read_beats(run, 1)), **step_ids(beats2)}
    assert sorted(remedied) == list(range(1, 7))
    assert remedied == step_ids(read_beats(tmp_path / "b" / "run", 1))
    assert all(len(ids) == 16 for ids in remedied.values())


def test_without_figures_to_measure_the_rung_stands(tmp_path):
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
    assert (r["to"]["micro_batch_size"], r["to"]["grad_accum"]) == (2, 4)
    assert history(run) == [(r["basis"], 2, 4)]  # nothing measured: no second entry
    start = next(b for b in read_beats(run, 2) if b["event"] == "start")
    assert (start["micro_batch_size"], start["grad_accum"]) == (2, 4)
    assert all(len(b["example_ids"]) == 8 for b in read_beats(run, 2) if b["event"] == "step")


def test_an_oom_after_the_measured_pick_goes_on_down_the_ladder(tmp_path):
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
    assert history(run) == [("probe", 8, 2), ("measured", 2, 8), ("ladder", 1, 16)]
    start = next(b for b in read_beats(run, 3) if b["event"] == "start")
    assert (start["micro_batch_size"], start["grad_accum"]) == (1, 16)
