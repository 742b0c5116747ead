"""InProcessRecovery alone (no Supervisor): real Deadlines fed heartbeat lines, a real IncidentStore, a fake clock.
Which stalls are asked to recover in the worker's process (and why the others are not, in the incident), the order
file, the answer, a refusal and the grace, a second stall at the same step; the worker's `oom_adapted` and in-process
`nan` lines turned into incidents and remediation.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import ABANDON_NAME, ABANDON_REFUSED_FIELD, RECOVERED_FIELD
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import PassState, RunContext
from hangwatch.supervisor.concerns.events import Beat
from hangwatch.supervisor.concerns.in_process_recovery import InProcessRecovery, abandoned_words, eligible
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired

T0 = 1000.0


def make(tmp_path: Path, intent: Intent = Intent.NONE, **sections):
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": "train.jsonl"},
            "watchdog": {"abandon_grace_s": 4},
            **sections,
        }
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    where = PassState(State.DUMPING, intent, None, None, None, None)
    run = RunContext(
        cfg,
        run_dir,
        FsOps(),
        IncidentStore(run_dir),
        Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
        RunRecord(),
        where=lambda: where,
    )
    concern = InProcessRecovery(run)
    d = attempt_dir(run_dir, 1)
    d.mkdir(parents=True)
    attempt = Attempt(1, d, Worker(4001, 1.0, ["python"], d / WORKER_LOG_NAME, T0), HeartbeatTail(d))
    run.deadlines.arm_startup(T0)
    feed(run, concern, attempt, T0, event="start", phase="train", step=0)
    for s in (1, 2, 3):
        feed(run, concern, attempt, T0 + s, event="step", step=s)
    return run, concern, attempt


def feed(run, concern, attempt, now, **rec):
    rec = {"rank": 0, "pid": 1, **rec}
    before = run.deadlines.ranks.get(0)
    left = before.phase if before is not None else None
    tr = run.deadlines.observe(rec, now)
    concern.observe(Beat(attempt, tr, rec, left, now, now))


def stall(run, kind="stall", phase="train"):
    inc = run.incidents.create(kind, attempt=1, phase=phase, step=3, summary="step deadline exceeded", status="x")
    expired = Expired("step", 2.0, 2.5, rank=0, phase=phase, step=3)
    return Episode(kind, inc, T0 + 10, expired=expired, store=run.incidents)


def order_file(attempt) -> dict:
    return json.loads((attempt.dir / ABANDON_NAME).read_text())


def test_a_stall_in_training_is_asked_once_and_its_answer_completes_the_incident(tmp_path):
    run, concern, attempt = make(tmp_path)
    ep = stall(run)
    why = concern.before_kill(attempt, ep, T0 + 10)
    assert why and "abandon its stuck step" in why
    assert order_file(attempt)["order"] == 1 and order_file(attempt)["step"] == 3
    assert concern.recovering(attempt, ep, T0 + 10.5) is None  # no answer yet, within the grace
    assert concern.next_due_s(T0 + 10.5) == pytest.approx(3.5)
    answer = {"kind": "stall", "order": 1, "failed_step": 4, "phase": "train", "landed_at": "x.py:9 in f"}
    feed(run, concern, attempt, T0 + 10.6, event="warn", **{RECOVERED_FIELD: {**answer, "restored_step": 0}})
    assert concern.recovering(attempt, ep, T0 + 10.7) is True
    rec = json.loads((ep.incident.dir / "incident.json").read_text())
    assert rec["recovery"]["path"] == "in_process" and rec["recovery"]["answered_after_s"] == 0.7
    assert rec["summary"].endswith(
        "— recovered in the worker's process: step 4 abandoned (stuck at x.py:9 in f), the state of the start put "
        "back from memory; nothing restarted"
    )
    # the same step stalls again in this attempt: not asked again
    again = stall(run)
    assert concern.before_kill(attempt, again, T0 + 20) is None
    assert "recovered in the process once already" in again.incident.data["recovery"]["why"]


def test_no_answer_within_the_grace_or_a_refusal_is_the_kill_and_the_incident_says_why(tmp_path):
    run, concern, attempt = make(tmp_path)
    ep = stall(run)
    concern.before_kill(attempt, ep, T0 + 10)
    assert concern.recovering(attempt, ep, T0 + 13.9) is None
    assert concern.recovering(attempt, ep, T0 + 14.0) is False
    r = ep.incident.data["recovery"]
    assert r["path"] == "restart" and r["asked"] and "no answer within 4 s" in r["why"] and "blocked in C" in r["why"]

    feed(run, concern, attempt, T0 + 15, event="step", step=4)
    ep2 = stall(run)
    ep2.incident.data["step"] = 4
    feed(run, concern, attempt, T0 + 16, event="phase", phase="eval")
    concern.before_kill(attempt, ep2, T0 + 20)
    feed(run, concern, attempt, T0 + 20.2, event="warn", **{ABANDON_REFUSED_FIELD: {"order": 2, "why": "loading"}})
    assert concern.recovering(attempt, ep2, T0 + 20.3) is False
    assert ep2.incident.data["recovery"]["why"] == "the worker refused: loading"


@pytest.mark.parametrize(
    "sections, kind, phase, intent, why",
    [
        ({"worker": {"nproc_per_node": 2}}, "stall", "train", Intent.NONE, "several ranks"),
        ({"data": {"inbox": True}}, "stall", "train", Intent.NONE, "continuous mode"),
        ({}, "stall", "checkpoint", Intent.NONE, "outside the training loop"),
        ({}, "stall", "load", Intent.NONE, "outside the training loop"),
        ({}, "manual", "train", Intent.NONE, None),  # restart now: a person asked for the restart
        ({}, "stall", "train", Intent.EXIT, None),  # a stop under way
    ],
)
def test_what_is_not_asked(tmp_path, sections, kind, phase, intent, why):
    run, concern, attempt = make(tmp_path, intent, **sections)
    if phase != "train":
        feed(run, concern, attempt, T0 + 5, event="phase", phase=phase)
    ep = stall(run, kind, phase)
    assert concern.before_kill(attempt, ep, T0 + 10) is None
    assert not (attempt.dir / ABANDON_NAME).exists()
    if why is None:
        assert "recovery" not in ep.incident.data
    else:
        assert ep.incident.data["recovery"]["path"] == "restart" and why in ep.incident.data["recovery"]["why"]


def test_eligibility():
    assert eligible(Config.model_validate({"data": {"train": "t.jsonl"}})) is None
    assert "your own" in eligible(Config.model_validate({"worker": {"command": ["python", "t.py"]}}))
    assert abandoned_words({"failed_step": 41, "phase": "generate"}) == "the generate at step 40"
    assert abandoned_words({"failed_step": 41, "phase": "train"}) == "step 41"


def test_an_oom_adapted_in_the_process_is_an_incident_and_the_setting_for_later_attempts(tmp_path):
    run, concern, attempt = make(tmp_path, train={"micro_batch_size": 16, "grad_accum": 1})
    message = (
        "CUDA out of memory. Tried to allocate 500.00 MiB. GPU 0 has a total capacity of 79.65 GiB of which 75.00 GiB "
        "is free. Including non-PyTorch memory, this process has 4.09 GiB memory in use. 4.00 GiB allowed; Of the "
        "allocated memory 3.61 GiB is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
    )
    record = {
        "kind": "oom",
        "step": 4,
        "from": {"micro_batch_size": 16, "grad_accum": 1, "gradient_checkpointing": False},
        "to": {"micro_batch_size": 8, "grad_accum": 2, "gradient_checkpointing": False},
        "message": message,
    }
    feed(run, concern, attempt, T0 + 5, event="warn", oom_adapted=record)
    (inc,) = [i for i in run.incidents.list() if i["kind"] == "oom_adapted"]
    full = run.incidents.get(inc["id"])
    assert full["status"] == "handled" and full["remediation"]["action"] == "adapted_in_process"
    assert "tried to allocate 500 MiB; 4.0 GiB allowed; 3.6 GiB allocated by PyTorch" in full["summary"]
    assert "micro_batch_size 16 → 8, grad_accum 1 → 2 (effective batch 16 unchanged)" in full["summary"]
    saved = json.loads((run.run_dir / "remediation.json").read_text())
    assert (saved["micro_batch_size"], saved["grad_accum"]) == (8, 2) and saved["history"][0]["basis"] == "in_process"
    assert concern.readers(T0)["in_process"]()["recovered"]["oom"] == 1


class RecordingFs(FsOps):
    """Records each file written through the seam; refuses `remediation.json` when told to."""

    def __init__(self, refuse: bool = False):
        self.written, self.refuse = [], refuse

    def write_file(self, path, data, durable=True):
        if self.refuse and path.name == "remediation.json":
            raise OSError(28, "No space left on device", str(path))
        self.written.append((path.name, durable))
        super().write_file(path, data, durable)


ADAPTED = {
    "kind": "oom",
    "step": 4,
    "from": {"micro_batch_size": 16, "grad_accum": 1, "gradient_checkpointing": False},
    "to": {"micro_batch_size": 8, "grad_accum": 2, "gradient_checkpointing": False},
}


def test_remediation_json_is_written_through_the_runs_write_seam_as_it_always_was(tmp_path):
    run, concern, attempt = make(tmp_path, train={"micro_batch_size": 16, "grad_accum": 1})
    run.fs = fs = RecordingFs()
    feed(run, concern, attempt, T0 + 5, event="warn", oom_adapted=ADAPTED)
    assert ("remediation.json", True) in fs.written  # durably: the next attempt must find it
    written = (run.run_dir / "remediation.json").read_text()
    assert written == json.dumps(json.loads(written), indent=2) + "\n"  # the file's format: indented by 2
    assert json.loads(written)["micro_batch_size"] == 8


def test_a_refused_remediation_json_is_reported_and_the_incident_stands(tmp_path):
    run, concern, attempt = make(tmp_path, train={"micro_batch_size": 16, "grad_accum": 1})
    refused = []
    run.fs, run.write_failed = RecordingFs(refuse=True), lambda exc, path: refused.append(path)
    feed(run, concern, attempt, T0 + 5, event="warn", oom_adapted=ADAPTED)
    assert refused == [run.run_dir / "remediation.json"] and not refused[0].exists()
    assert [i["kind"] for i in run.incidents.list()] == ["oom_adapted"]


def test_a_nonfinite_streak_rolled_back_in_the_process_is_a_nan_incident_naming_the_quarantined(tmp_path):
    run, concern, attempt = make(tmp_path)
    (run.run_dir / "quarantine.jsonl").write_text(
        json.dumps({"id": "train.jsonl:7", "reason": "own loss non-finite", "step": 5, "attempt": 1}) + "\n"
    )
    r = {"kind": "nonfinite", "streak": 3, "failed_step": 5, "restored_step": 3, "restored_from": "/c/step-00000003"}
    feed(run, concern, attempt, T0 + 5, event="warn", **{RECOVERED_FIELD: {**r, "quarantined": ["train.jsonl:7"]}})
    (inc,) = [i for i in run.incidents.list() if i["kind"] == "nan"]
    full = run.incidents.get(inc["id"])
    assert full["recovery"]["path"] == "in_process" and full["quarantined"][0]["id"] == "train.jsonl:7"
    assert full["summary"] == (
        "3 non-finite steps in a row at step 5: rolled back in the worker's process to checkpoint step 3 (its state "
        "held in memory); quarantined train.jsonl:7; nothing restarted"
    )
