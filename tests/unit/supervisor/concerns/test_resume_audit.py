"""ResumeAudit alone (no Supervisor): the earlier attempts' beats written as heartbeat files in the run dir's
layout, the resumed attempt's step lines handed to the concern as the loop hands them, a real IncidentStore and a
fake clock.  Verified and diverged replays, the `resume_diverged` incident, the abort under `on_divergence: stop`,
`resume-audit.json` linking the audit to the failure it recovered from — and that failure's own incident.json left
as it was (the store joins the finding on read)."""

from __future__ import annotations

import json
from pathlib import Path

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import encode
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir, heartbeat_path
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.events import AttemptEnded, AttemptStarted, Beat
from hangwatch.supervisor.concerns.oom_recovery import OomRemediation
from hangwatch.supervisor.concerns.resume_audit import ResumeAudit
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.incidents.store import RECORD_NAME
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines
from hangwatch.supervisor.watch.replay_check import AUDITS_NAME, REBATCHED_RTOL

T0 = 1000.0


def make_run(tmp_path: Path, **resume_audit) -> tuple[RunContext, list]:
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": "train.jsonl"},
            "watchdog": {"resume_audit": resume_audit},
        }
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    failed: list = []
    run = RunContext(
        cfg,
        run_dir,
        FsOps(),
        IncidentStore(run_dir),
        Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
        RunRecord(),
        write_failed=lambda exc, path: failed.append((exc, path)),
    )
    return run, failed


def make_attempt(run: RunContext, number: int, resume_from: str = "") -> Attempt:
    d = attempt_dir(run.run_dir, number)
    d.mkdir(parents=True, exist_ok=True)
    worker = Worker(4000 + number, 1.0, ["python"], d / WORKER_LOG_NAME, T0)
    return Attempt(number, d, worker, HeartbeatTail(d), resume_from=resume_from)


def loss(step: int) -> float:
    return 10.0 / step


def lr(step: int) -> float:
    return 1e-4 * step


def write_beats(run_dir: Path, attempt: int, rank: int, steps, **over) -> None:
    """An earlier attempt's heartbeat file, as the worker writes it (as tests/unit/supervisor/watch does)."""
    d = attempt_dir(run_dir, attempt)
    d.mkdir(parents=True, exist_ok=True)
    with open(heartbeat_path(d, rank), "ab") as f:
        f.write(encode({"v": 1, "t": 0.0, "pid": 1, "rank": rank, "event": "start", "step": 0, "phase": "train"}))
        for s in steps:
            figures = {"loss": loss(s), "lr": lr(s), **over.get(s, {})}
            f.write(
                encode(
                    {"v": 1, "t": 0.0, "pid": 1, "rank": rank, "event": "step", "step": s, "phase": "train", **figures}
                )
            )


def step(run: RunContext, concern: ResumeAudit, attempt: Attempt, s: int, now: float, rank: int = 0, **over):
    rec = {"rank": rank, "pid": 2, "event": "step", "step": s, "loss": loss(s), "lr": lr(s), **over}
    before = run.deadlines.ranks.get(rank)
    left = before.phase if before is not None else None
    tr = run.deadlines.observe(rec, now)
    concern.observe(Beat(attempt, tr, rec, left, now, now))


def failed_first_attempt(run: RunContext, concern: ResumeAudit, steps=range(1, 11)):
    """Attempt 1 beat `steps` and stalled: its episode's incident is what attempt 2 recovers from."""
    a1 = make_attempt(run, 1)
    concern.observe(AttemptStarted(a1, None, T0))
    write_beats(run.run_dir, 1, 0, steps)
    inc = run.incidents.create("stall", attempt=1, step=max(steps), summary="step deadline exceeded", status="final")
    concern.observe(AttemptEnded(a1, Episode("stall", inc, T0 + 50), T0 + 60))
    return inc


def resumed(run, concern, resume_step=5, number=2):
    a = make_attempt(run, number, resume_from=f"checkpoints/step-{resume_step}")
    run.deadlines.arm_startup(T0 + 70)
    run.deadlines.observe({"rank": 0, "event": "start", "step": resume_step, "phase": "train"}, T0 + 71)
    concern.observe(AttemptStarted(a, resume_step, T0 + 70))
    return a


def audits(run) -> list[dict]:
    return json.loads((run.run_dir / AUDITS_NAME).read_text())["audits"]


def raw_record(inc) -> dict:
    return json.loads((inc.dir / RECORD_NAME).read_text())


def test_a_replay_equal_to_the_earlier_beats_is_verified_and_linked_to_the_failure_it_recovered_from(tmp_path):
    run, failed = make_run(tmp_path)
    concern = ResumeAudit(run)
    failure = failed_first_attempt(run, concern)
    before = raw_record(failure)
    a2 = resumed(run, concern)
    pending = audits(run)
    assert len(pending) == 1 and pending[0]["verdict"] == "pending" and pending[0]["replayed"] == [6, 10]
    assert pending[0]["incident"] == failure.id and pending[0]["attempt"] == 2 and pending[0]["resumed_step"] == 5
    for i, s in enumerate(range(6, 11)):
        step(run, concern, a2, s, T0 + 80 + i)
        assert concern.while_running(a2, T0 + 80 + i) is None
    (rec,) = audits(run)
    assert rec["verdict"] == "verified" and rec["compared"] == [6, 10] and rec["steps_compared"] == 5
    assert rec["figures"] == ["loss", "lr"] and rec["rtol"] == 0.0 and rec["previous_attempt"] == 1
    assert "bitwise equal" in rec["text"] and rec["incident"] == failure.id
    assert [i["kind"] for i in run.incidents.list()] == ["stall"]  # no new incident
    # the failure's own file is untouched; the store joins the finding on read
    assert raw_record(failure) == before and "resume_audit" not in raw_record(failure)
    joined = run.incidents.get(failure.id)
    assert joined["resume_audit"]["verdict"] == "verified" and joined["resume_audit"]["attempt"] == 2
    assert failed == []


def test_a_replayed_step_that_differs_is_a_resume_diverged_incident_and_training_goes_on_under_warn(tmp_path):
    run, _ = make_run(tmp_path)
    concern = ResumeAudit(run)
    failure = failed_first_attempt(run, concern)
    before = raw_record(failure)
    a2 = resumed(run, concern)
    step(run, concern, a2, 6, T0 + 80)
    step(run, concern, a2, 7, T0 + 81, loss=loss(7) * 1.1)  # the data order was not restored
    assert concern.while_running(a2, T0 + 81) is None  # warn: the run goes on
    kinds = [i["kind"] for i in run.incidents.list()]
    assert kinds == ["stall", "resume_diverged"]
    div = run.incidents.get(run.incidents.list()[1]["id"])
    assert div["attempt"] == 2 and div["step"] == 7 and div["status"] == "final"
    assert div["on_divergence"] == "warn" and div["resumed_from"] == "checkpoints/step-5"
    assert div["resume_audit"]["verdict"] == "diverged" and div["resume_audit"]["difference"]["figure"] == "loss"
    assert div["summary"].startswith("step 7: loss") and "training goes on" in div["summary"]
    assert run.facts.last_incident["id"] == div["id"]
    (rec,) = audits(run)
    assert rec["verdict"] == "diverged" and rec["incident"] == failure.id and rec["diverged_incident"] == div["id"]
    # later steps are not compared again, and no second incident
    step(run, concern, a2, 8, T0 + 82, loss=99.0)
    assert len(run.incidents.list()) == 2 and audits(run)[0]["diverged_incident"] == div["id"]
    assert raw_record(failure) == before
    assert run.incidents.get(failure.id)["resume_audit"]["verdict"] == "diverged"


def test_on_divergence_stop_ends_the_run_with_the_reason(tmp_path):
    run, _ = make_run(tmp_path, on_divergence="stop")
    concern = ResumeAudit(run)
    failed_first_attempt(run, concern)
    a2 = resumed(run, concern)
    step(run, concern, a2, 6, T0 + 80, lr=lr(6) * 2)  # the schedule was not restored
    why = concern.while_running(a2, T0 + 80)
    assert why is not None and why.startswith("resume diverged — step 6: ") and "learning-rate schedule" in why
    div = run.incidents.get(run.incidents.list()[-1]["id"])
    assert div["kind"] == "resume_diverged" and div["on_divergence"] == "stop" and "the run ends here" in div["summary"]
    # the reason is the attempt's: the next attempt starts without it
    concern.observe(AttemptEnded(a2, Episode("manual", None, T0 + 90), T0 + 91))
    a3 = make_attempt(run, 3, resume_from="checkpoints/step-5")
    concern.observe(AttemptStarted(a3, 5, T0 + 100))
    assert concern.while_running(a3, T0 + 100) is None


def test_an_attempt_that_ends_before_the_window_is_replayed_records_a_partial_audit(tmp_path):
    run, _ = make_run(tmp_path)
    concern = ResumeAudit(run)
    failure = failed_first_attempt(run, concern)
    a2 = resumed(run, concern)
    step(run, concern, a2, 6, T0 + 80)
    step(run, concern, a2, 7, T0 + 81)
    assert audits(run)[0]["verdict"] == "pending"
    crash = run.incidents.create("crash", attempt=2, step=7)
    concern.observe(AttemptEnded(a2, Episode("crash", crash, T0 + 82), T0 + 83))
    (rec,) = audits(run)
    assert rec["verdict"] == "partial" and rec["compared"] == [6, 7] and rec["incident"] == failure.id
    # the next attempt recovers from attempt 2's crash: its audit is a second record naming that incident
    write_beats(run.run_dir, 2, 0, range(6, 8))
    resumed(run, concern, number=3)
    assert [r["attempt"] for r in audits(run)] == [2, 3] and audits(run)[1]["incident"] == crash.id


def test_a_resume_after_an_oom_remedy_compares_within_the_rebatched_tolerance(tmp_path):
    run, _ = make_run(tmp_path)
    concern = ResumeAudit(run)
    failed_first_attempt(run, concern)  # attempt 1 ran with the config's micro-batch (no remediation.json)
    remedy = OomRemediation(run.cfg, run.run_dir).on_failure("oom", attempt=1, step=10, incident="0001", now=T0)
    assert remedy is not None and remedy.to is not None
    a2 = resumed(run, concern)
    assert audits(run)[0]["rtol"] == REBATCHED_RTOL and "micro-batch changed" in audits(run)[0]["note"]
    for i, s in enumerate(range(6, 11)):
        step(run, concern, a2, s, T0 + 80 + i, loss=loss(s) * (1 + 1e-4))  # the same sums in another order
    assert audits(run)[0]["verdict"] == "verified"
    assert [i["kind"] for i in run.incidents.list()] == ["stall"]


def test_no_audit_for_a_first_attempt_an_unknown_resume_step_or_nothing_to_replay(tmp_path):
    run, _ = make_run(tmp_path)
    concern = ResumeAudit(run)
    a1 = make_attempt(run, 1)
    concern.observe(AttemptStarted(a1, None, T0))
    assert concern.audit is None
    write_beats(run.run_dir, 1, 0, range(1, 11))
    concern.observe(AttemptEnded(a1, Episode("stall", run.incidents.create("stall", attempt=1), T0 + 5), T0 + 6))
    concern.observe(AttemptStarted(make_attempt(run, 2, resume_from="checkpoints/somewhere"), None, T0 + 10))
    assert concern.audit is None  # resumed from a checkpoint whose step is unknown
    concern.observe(AttemptStarted(make_attempt(run, 3, resume_from="checkpoints/step-10"), 10, T0 + 20))
    assert concern.audit is None  # nothing beaten after step 10
    assert not (run.run_dir / AUDITS_NAME).exists()


def test_a_start_from_scratch_replays_from_step_one(tmp_path):
    run, _ = make_run(tmp_path)
    concern = ResumeAudit(run)
    failed_first_attempt(run, concern, steps=range(1, 4))
    a2 = make_attempt(run, 2)  # no checkpoint: resume_from "" and no resume step
    concern.observe(AttemptStarted(a2, None, T0 + 70))
    assert audits(run)[0]["replayed"] == [1, 3] and audits(run)[0]["resumed_step"] == 0
    for s in (1, 2, 3):
        step(run, concern, a2, s, T0 + 80 + s)
    assert audits(run)[0]["verdict"] == "verified"


def test_a_refused_write_of_the_audit_file_is_reported_not_raised(tmp_path):
    run, failed = make_run(tmp_path)
    concern = ResumeAudit(run)
    failed_first_attempt(run, concern)

    class FullDisk(FsOps):
        def write_json(self, path, data, durable=True):
            raise OSError(28, "No space left on device")

    run.fs = FullDisk()
    a2 = resumed(run, concern)
    assert concern.audit is not None and [p for _, p in failed] == [run.run_dir / AUDITS_NAME]
    step(run, concern, a2, 6, T0 + 80, loss=1.0)
    assert [i["kind"] for i in run.incidents.list()] == ["stall", "resume_diverged"]
