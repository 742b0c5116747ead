"""OomRecovery alone (no Supervisor): its `decision` hook on an ended attempt's episode, asked once the tree is gone
through the decision's one owner (`concerns.decide`, which writes what the answer wants written and settles its
fields into the incident), with a real IncidentStore and the run dir's remediation.json.  An OOM the policy restarts
is restarted with a smaller micro-batch (the incident says which), its record written once; anything else keeps the
policy's decision; with every remedy tried the run fails.  Then the supervisor's handle (`OomRemediation`,
`after_exit`) on its own, and remediation.json written through the run's `FsOps`: a refused write ends the run rather
than restart at the size that ran out of memory."""

from __future__ import annotations

import errno
from pathlib import Path
from types import SimpleNamespace

from fixtures.deciding import RecordingFs, decided
from fixtures.fakes.failing_fs import FailingFs
from fixtures.fakes.oom_config import oom_cfg as cfg

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.oom_ladder import Rung as Setting
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns import carried_out
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.events import Beat
from hangwatch.supervisor.concerns.oom_recovery import OomRecovery, OomRemediation, after_exit
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records import healing
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.answer import Answer
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

T0 = 1000.0
RESTART = Decision("restart", "exit 1 (out of memory)")


def setup(tmp_path: Path, fs: FsOps | None = None):
    cfg = Config.model_validate(
        {"run_dir": str(tmp_path / "run"), "data": {"train": "train.jsonl"}, "train": {"micro_batch_size": 4}}
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    run = RunContext(
        cfg,
        run_dir,
        fs or FsOps(),
        IncidentStore(run_dir),
        Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
        RunRecord(),
    )
    return run, OomRecovery(run)


def attempt(run: RunContext, number: int) -> Attempt:
    d = attempt_dir(run.run_dir, number)
    d.mkdir(parents=True, exist_ok=True)
    return Attempt(number, d, Worker(4000 + number, 1.0, ["python"], d / WORKER_LOG_NAME, T0), HeartbeatTail(d))


def ended(run: RunContext, number: int, kind: str) -> Episode:
    return Episode(kind, run.incidents.create(kind, attempt=number, step=12), T0 + number)


def test_an_oom_restarts_with_a_smaller_micro_batch_and_the_incident_says_so(tmp_path):
    fs = RecordingFs()
    run, concern = setup(tmp_path, fs)
    a1, ep = attempt(run, 1), ended(run, 1, "oom")
    got = decided([concern], a1, ep, RESTART, T0 + 1, fs=fs, store=run.incidents)
    assert got is not None and got.action == "restart" and got.rollback
    assert got.reason.startswith(RESTART.reason + "; ")
    saved = healing.load(run.run_dir)
    assert saved["micro_batch_size"] < 4 and saved["configured"]["micro_batch_size"] == 4
    inc = run.incidents.get(ep.incident.id)
    assert inc["remediation"]["to"]["micro_batch_size"] == saved["micro_batch_size"]
    # asked once, when the tree is gone: the decision settled on the episode, one rung, its record written once
    assert ep.decision is got and fs.written == [healing.path_for(run.run_dir)]
    assert len(saved["history"]) == 1


def test_other_failures_and_no_decision_keep_the_policys_decision(tmp_path):
    fs = RecordingFs()
    run, concern = setup(tmp_path, fs)
    a1 = attempt(run, 1)
    crash_loop = Decision("fail", "crash loop")
    for ep, proposed in [
        (ended(run, 1, "crash"), RESTART),
        (ended(run, 1, "oom"), None),
        (ended(run, 1, "oom"), crash_loop),
        (Episode(None, None, T0), RESTART),
    ]:
        assert decided([concern], a1, ep, proposed, T0, fs=fs, store=run.incidents) is proposed
        assert ep.decision is proposed
        if ep.incident is not None:  # nothing added to the incident
            assert "remediation" not in run.incidents.get(ep.incident.id)
    assert healing.load(run.run_dir) is None and fs.written == []


def test_with_every_remedy_tried_an_oom_ends_the_run(tmp_path):
    run, concern = setup(tmp_path)
    decisions = []
    for n in range(1, 10):
        got = decided([concern], attempt(run, n), ended(run, n, "oom"), RESTART, T0 + n, store=run.incidents)
        decisions.append(got.action)
        if got.action == "fail":
            break
    # 4 → 2 → 1 → 1 with gradient checkpointing → failed
    assert decisions == ["restart", "restart", "restart", "fail"]
    last = run.incidents.get(run.incidents.list()[-1]["id"])
    assert last["remediation"]["action"] == "failed"


# ---- the handle alone


def test_oom_remediation_can_be_turned_off(tmp_path):
    assert OomRemediation(cfg(on=False), tmp_path).on_failure("oom", attempt=1, step=3, incident="0001") is None
    assert not (tmp_path / "remediation.json").exists()


def test_supervisor_handle_persists_across_a_new_supervisor(tmp_path):
    c = cfg(4, 2)
    first = OomRemediation(c, tmp_path)
    assert first.on_failure("crash", attempt=1, step=2, incident="a") is None  # only OOMs are remedied
    remedy = first.on_failure("oom", attempt=1, step=2, incident="inc-1", now=5.0)
    assert remedy.to == Setting(2, 4) and "effective batch 8 unchanged" in remedy.message
    saved = healing.load(tmp_path)
    assert saved["micro_batch_size"] == 2 and saved["grad_accum"] == 4 and saved["configured"]["micro_batch_size"] == 4
    second = OomRemediation(c, tmp_path)  # a restarted supervisor escalates from the file, not the config
    assert second.on_failure("oom", attempt=2, step=2, incident="inc-2").to == Setting(1, 8)
    assert second.summary()["now"] == {"micro_batch_size": 1, "grad_accum": 8, "gradient_checkpointing": False}
    assert second.summary()["oom_restarts"] == 2


def test_own_script_is_never_remedied(tmp_path):
    handle = OomRemediation(cfg(command=["python", "train.py"]), tmp_path)
    assert handle.on_failure("oom", attempt=1, step=1, incident=None) is None
    assert not healing.path_for(tmp_path).exists()


def test_after_exit_turns_the_policy_decision_into_the_remedy(tmp_path):
    from hangwatch.supervisor.rules.policy import Decision

    handle = OomRemediation(cfg(2, 1), tmp_path)
    restart = Decision("restart", "worker exited with code 1", delay_s=2.0)

    def done(answer):  # its writes made, as the decision's owner makes them: the next call escalates from the file
        return carried_out(answer, FsOps(), lambda exc, path: None)

    # no replacement (the decision so far stands), no field, nothing to write
    assert after_exit(handle, "crash", "0001", restart, attempt=1, step=3) == Answer()
    giving_up = Decision("fail", "crash loop", crash_loop=True)
    assert after_exit(handle, "oom", "0001", giving_up, attempt=1, step=3) == Answer()  # the policy wins
    answer = after_exit(handle, "oom", "0001", restart, attempt=1, step=3)
    d, fields = answer.decision, answer.fields
    assert d.action == "restart" and d.rollback and d.delay_s == 2.0
    assert "micro-batch 2 → 1, accumulation 1 → 2 (effective batch 2 unchanged)" in d.reason
    assert fields["remediation"]["to"] == {"micro_batch_size": 1, "grad_accum": 2, "gradient_checkpointing": False}
    # the record it wants written, and none written by it
    assert [w.path for w in answer.writes] == [healing.path_for(tmp_path)] and healing.load(tmp_path) is None
    assert done(answer) is answer and healing.load(tmp_path)["micro_batch_size"] == 1
    answer = done(after_exit(handle, "oom", "0002", restart, attempt=2, step=3))
    assert "gradient checkpointing turned on" in answer.decision.reason
    answer = done(after_exit(handle, "oom", "0003", restart, attempt=3, step=3))
    d, fields = answer.decision, answer.fields
    assert d.action == "fail" and "every remedy tried" in d.reason and "gradient checkpointing" in d.reason
    assert fields["remediation"]["action"] == "failed" and answer.writes == ()


# ---- remediation.json through the run's FsOps


def test_a_remedy_the_disk_refuses_ends_the_run_and_writes_nothing(tmp_path):
    fs = FailingFs(lambda p: p.name == "remediation.json")
    run, concern = setup(tmp_path, fs)
    failed, ep = [], ended(run, 1, "oom")
    got = decided(
        [concern], attempt(run, 1), ep, RESTART, T0 + 1, fs=fs, write_failed=lambda exc, path: failed.append(path)
    )
    assert got.action == "fail" and "the smaller micro-batch could not be recorded" in got.reason
    assert fs.refused == [healing.path_for(run.run_dir)] and failed == fs.refused  # reported through write_failed
    assert ep.decision is got and "remediation" not in ep.incident.data  # no remedy for the incident to name
    assert healing.load(run.run_dir) is None and not [p for p in run.run_dir.iterdir() if p.name.startswith(".tmp-")]


def test_the_new_processs_measure_goes_through_the_runs_fsops_and_a_refusal_is_reported(tmp_path):
    fs = FailingFs(lambda p: p.name == "remediation.json")
    run, concern = setup(tmp_path, fs)
    failed = []
    run.write_failed = lambda exc, path: failed.append((exc.errno, path))
    # the OOM's remedy, recorded by a supervisor with room on its disk: the new process is to measure
    OomRemediation(run.cfg, run.run_dir, FsOps()).on_failure("oom", attempt=1, step=3, incident="x")
    before = healing.load(run.run_dir)
    assert isinstance(before.get("probe"), dict)
    measure = {"picked": 1, "to": {"micro_batch_size": 1, "grad_accum": 8, "gradient_checkpointing": False}}
    beat = {"event": "warn", "t": T0, "remediation_probe": measure}
    concern.observe(Beat(SimpleNamespace(number=2), SimpleNamespace(rank=0), beat, None, T0, T0))
    assert failed == [(errno.ENOSPC, healing.path_for(run.run_dir))] and healing.load(run.run_dir) == before
    run.fs = FsOps()  # the disk has room again: the same beat is recorded
    concern.observe(Beat(SimpleNamespace(number=2), SimpleNamespace(rank=0), beat, None, T0, T0))
    assert "probe" not in healing.load(run.run_dir) and healing.load(run.run_dir)["micro_batch_size"] == 1


def test_the_new_processs_measure_is_its_own_finding_linked_to_the_oom_never_a_rewrite_of_it(tmp_path):
    run, concern = setup(tmp_path)
    inc = run.incidents.create("oom", attempt=1, step=3)
    OomRemediation(run.cfg, run.run_dir, FsOps()).on_failure("oom", attempt=1, step=3, incident=inc.id)
    before = (inc.dir / "incident.json").read_bytes()
    measure = {
        "picked": 1,
        "why": "fits",
        "to": {"micro_batch_size": 1, "grad_accum": 8, "gradient_checkpointing": False},
    }
    beat = {"event": "warn", "t": T0, "remediation_probe": measure}
    concern.observe(Beat(SimpleNamespace(number=2), SimpleNamespace(rank=0), beat, None, T0, T0))
    assert (inc.dir / "incident.json").read_bytes() == before  # the earlier attempt's incident is left as it was
    (recorded,) = healing.load(run.run_dir)["measures"]
    assert recorded == {**measure, "attempt": 2, "incident": inc.id}
    joined = run.incidents.get(inc.id)  # what `hangwatch incidents ID` and the report read
    assert joined["measured"] == recorded
