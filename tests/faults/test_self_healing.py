"""Self-healing under the real supervisor (`python -m hangwatch.supervisor run`, the built-in worker, tiny model):

* an out-of-memory failure at micro-batch 4 restarts from the last good checkpoint at micro-batch 2 with the
  accumulation doubled — recorded in the incident, remediation.json and the next attempt's start beat — and the
  run finishes (the same examples per optimizer step as an uninterrupted micro-batch-2 run is shown in
  tests/unit/daemon/trainer/test_remediation.py, in process);
* a poisoned example makes one step's loss non-finite: one rollback, exactly that example quarantined (the `nan`
  incident and quarantine.jsonl say so), and the run finishes with no further rollback, never training it again.
"""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.sup_harness import incidents, run_supervisor
from fixtures.fakes.workers import make_config, read_beats

pytestmark = pytest.mark.slow

WATCH = {"startup_timeout_s": 60, "silence_timeout_s": 30, "py_spy": False, "poll_interval_s": 0.1}


def test_an_oom_restarts_at_half_the_micro_batch_and_the_run_finishes(tmp_path):
    config = make_config(
        tmp_path,
        watchdog=WATCH,
        restart={"backoff_initial_s": 0, "max_restarts": 3},
        train={"max_steps": 8, "micro_batch_size": 4, "grad_accum": 2},
        checkpoint={"every_steps": 2, "confirm_steps": 1},
        faults=[{"kind": "oom", "at_step": 5}],
    )
    run = tmp_path / "run"
    rc, out = run_supervisor(config, timeout=180)
    assert rc == 0, out[-3000:]
    (inc,) = [i for i in incidents(run) if i["kind"] == "oom"]
    assert inc["remediation"]["from"]["micro_batch_size"] == 4
    assert (inc["remediation"]["to"]["micro_batch_size"], inc["remediation"]["to"]["grad_accum"]) == (2, 4)
    record = json.loads((run / "remediation.json").read_text())
    assert len(record["history"]) == 1
    start = next(b for b in read_beats(run, 2) if b["event"] == "start")
    assert (start.get("micro_batch_size"), start.get("grad_accum")) == (2, 4), start
    steps = [b["step"] for b in read_beats(run, 2) if b["event"] == "step"]
    assert steps and steps[-1] == 8 and steps[0] <= 5  # resumed from a checkpoint before the OOM, ran to the end
    # every step of attempt 2 still trains micro × accum = 8 examples: the effective batch is unchanged
    assert all(len(b["example_ids"]) == 8 for b in read_beats(run, 2) if b["event"] == "step")


def test_a_poisoned_example_is_quarantined_after_one_rollback(tmp_path):
    poisoned = "train.jsonl:7"
    config = make_config(
        tmp_path,
        watchdog=WATCH,
        restart={"backoff_initial_s": 0, "max_restarts": 3},
        train={"max_steps": 10, "max_nonfinite_streak": 1},
        checkpoint={"every_steps": 2, "confirm_steps": 0},
        faults=[{"kind": "poison", "example_ids": [poisoned]}],
    )
    run = tmp_path / "run"
    rc, out = run_supervisor(config, timeout=180)
    assert rc == 0, out[-3000:]
    nans = [i for i in incidents(run) if i["kind"] == "nan"]
    assert len(nans) == 1, [i["kind"] for i in incidents(run)]  # one rollback, none after the quarantine
    assert [q["id"] for q in nans[0]["quarantined"]] == [poisoned]
    records = [json.loads(line) for line in (run / "quarantine.jsonl").read_text().splitlines() if line.strip()]
    assert [r["id"] for r in records] == [poisoned]
    trained_after = [i for b in read_beats(run, 2) if b["event"] == "step" for i in b["example_ids"]]
    assert trained_after and poisoned not in trained_after
