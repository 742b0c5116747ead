"""OomRecovery alone (no Supervisor): its `decision` hook on an ended attempt's episode, with a real IncidentStore and
the run dir's remediation.json.  An OOM the policy restarts is restarted with a smaller micro-batch (the incident
says which), once per incident; anything else keeps the policy's decision; with every remedy tried the run fails."""

from __future__ import annotations

from pathlib import Path

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns import oom_remediation as rem
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.oom_recovery import OomRecovery
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

T0 = 1000.0
RESTART = Decision("restart", "exit 1 (out of memory)")


def setup(tmp_path: Path):
    cfg = Config.model_validate(
        {"run_dir": str(tmp_path / "run"), "data": {"train": "train.jsonl"}, "train": {"micro_batch_size": 4}}
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    run = RunContext(
        cfg, run_dir, FsOps(), IncidentStore(run_dir), Deadlines(cfg.watchdog, Calibration(cfg.watchdog)), RunRecord()
    )
    return run, OomRecovery(run)


def attempt(run: RunContext, number: int) -> Attempt:
    d = attempt_dir(run.run_dir, number)
    d.mkdir(parents=True, exist_ok=True)
    return Attempt(number, d, Worker(4000 + number, 1.0, ["python"], d / WORKER_LOG_NAME, T0), HeartbeatTail(d))


def ended(run: RunContext, number: int, kind: str) -> Episode:
    return Episode(kind, run.incidents.create(kind, attempt=number, step=12), T0 + number)


def test_an_oom_restarts_with_a_smaller_micro_batch_and_the_incident_says_so(tmp_path):
    run, concern = setup(tmp_path)
    a1, ep = attempt(run, 1), ended(run, 1, "oom")
    got = concern.decision(a1, ep, RESTART, T0 + 1)
    assert got is not None and got.action == "restart" and got.rollback
    assert got.reason.startswith(RESTART.reason + "; ")
    saved = rem.load(run.run_dir)
    assert saved["micro_batch_size"] < 4 and saved["configured"]["micro_batch_size"] == 4
    inc = run.incidents.get(ep.incident.id)
    assert inc["remediation"]["to"]["micro_batch_size"] == saved["micro_batch_size"]
    # asked again for the same incident (the exit, then the end): nothing more, no second rung
    assert concern.decision(a1, ep, RESTART, T0 + 2) is None
    assert rem.load(run.run_dir)["micro_batch_size"] == saved["micro_batch_size"]


def test_other_failures_and_no_decision_keep_the_policys_decision(tmp_path):
    run, concern = setup(tmp_path)
    a1 = attempt(run, 1)
    assert concern.decision(a1, ended(run, 1, "crash"), RESTART, T0) is None
    assert concern.decision(a1, ended(run, 1, "oom"), None, T0) is None
    assert concern.decision(a1, ended(run, 1, "oom"), Decision("fail", "crash loop"), T0) is None
    assert concern.decision(a1, Episode(None, None, T0), RESTART, T0) is None
    assert rem.load(run.run_dir) is None


def test_with_every_remedy_tried_an_oom_ends_the_run(tmp_path):
    run, concern = setup(tmp_path)
    decisions = []
    for n in range(1, 10):
        got = concern.decision(attempt(run, n), ended(run, n, "oom"), RESTART, T0 + n)
        decisions.append(got.action)
        if got.action == "fail":
            break
    # 4 → 2 → 1 → 1 with gradient checkpointing → failed
    assert decisions == ["restart", "restart", "restart", "fail"]
    last = run.incidents.get(run.incidents.list()[-1]["id"])
    assert last["remediation"]["action"] == "failed"
