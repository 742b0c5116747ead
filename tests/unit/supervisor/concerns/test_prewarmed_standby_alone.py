"""PrewarmedStandby alone (no Supervisor): its hooks called as the loop calls them, on the fake process table with
the fake standby spawner (tests/fixtures/fakes/standby.py), a fake clock.  A standby is spawned where a restart
becomes likely (a stall, an exit the policy restarts, a graceful restart) and not otherwise, released to the next
attempt, discarded — killed, then reaped — when no restart follows; `always` keeps one ready from the first step."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Optional

from fixtures.fakes.fake_supervisor import FakeProcessTable
from fixtures.fakes.standby import FakeStandbySpawn

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import ENV_ATTEMPT
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import PassState, RunContext
from hangwatch.supervisor.concerns.events import (
    AttemptStarted,
    Beat,
    Closing,
    OutcomeReached,
    PassBegins,
    PassSettled,
    StopRequested,
)
from hangwatch.supervisor.concerns.prewarmed_standby import PrewarmedStandby
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.processes.standby import STANDBY_FLAG, STANDBY_LOG_NAME
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.outcome import Intent, Outcome
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.rules.states import State
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired

T0 = 1000.0
STALL = Expired("step", 2.0, 3.0, rank=0, phase="train", step=3)


class Setup:
    def __init__(self, tmp_path: Path, prewarm=True, **worker):
        cfg = Config.model_validate(
            {
                "run_dir": str(tmp_path / "run"),
                "data": {"train": "train.jsonl"},
                "restart": {"prewarm": prewarm},
                "worker": worker,
            }
        )
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True)
        self.state = State.RUNNING
        self.table = FakeProcessTable()
        self.spawner = FakeStandbySpawn(self.table)
        self.run = RunContext(
            cfg,
            self.run_dir,
            FsOps(),
            IncidentStore(self.run_dir),
            Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
            RunRecord(),
            where=lambda: PassState(self.state, Intent.NONE, None, None, None, None),
        )
        self.concern = PrewarmedStandby(
            self.run, table=self.table, config_path=self.run_dir / "config.yaml", spawn=self.spawner
        )
        self.attempt = self.make_attempt(1)

    def make_attempt(self, number: int) -> Attempt:
        d = attempt_dir(self.run_dir, number)
        d.mkdir(parents=True, exist_ok=True)
        p = self.table.add()
        return Attempt(number, d, Worker(p.pid, p.create_time, ["python"], d / WORKER_LOG_NAME, T0), HeartbeatTail(d))

    def episode(self, kind: Optional[str], now: float, expired=None, decision=None) -> Episode:
        inc = self.run.incidents.create(kind, attempt=self.attempt.number) if kind else None
        return Episode(kind, inc, now, expired=expired, proposed=decision)

    def step(self, now: float) -> None:
        rec = {"rank": 0, "pid": 1, "event": "step", "step": 1}
        tr = self.run.deadlines.observe(rec, now)
        self.concern.observe(Beat(self.attempt, tr, rec, "train", now, now))

    def standby_pid(self) -> int:
        return self.spawner.standbys[-1].worker.pid


def test_a_stall_spawns_the_next_attempts_standby_and_the_restart_takes_it(tmp_path):
    s = Setup(tmp_path)
    c = s.concern
    assert c.own_pids() == set() and c.readers(T0)["standby"]() is None
    assert c.episode_opened(s.attempt, s.episode("stall", T0, expired=STALL), Intent.NONE, T0) == {}
    assert len(s.spawner.standbys) == 1
    argv, env = s.spawner.calls[0]
    assert env[ENV_ATTEMPT] == "2" and argv[-1] == STANDBY_FLAG
    pid = s.standby_pid()
    assert c.own_pids() == {pid} and pid in s.attempt.foreign  # not the failed attempt's orphan
    shown = c.readers(T0 + 1)["standby"]()
    assert shown["attempt"] == 2 and shown["pid"] == pid and shown["state"] == "loading" and shown["why"] == "stall"
    # the tree is gone, the policy restarts: the next attempt takes it instead of spawning cold
    c.observe(OutcomeReached(Outcome(State.STARTING, "restart"), T0 + 5))
    adir = attempt_dir(s.run_dir, 2)
    adir.mkdir(parents=True)
    w = c.take_worker(2, adir, "checkpoints/step-3", T0 + 5)
    assert w is not None and w.pid == pid and w.log_path == adir / WORKER_LOG_NAME and w.started_at == T0 + 5
    assert (adir / WORKER_LOG_NAME).read_text() == "standby log\n" and not (s.run_dir / STANDBY_LOG_NAME).exists()
    (line,) = s.spawner.standbys[0].lines
    assert json.loads(line) == {"attempt": 2, "resume_from": "checkpoints/step-3"}
    assert c.own_pids() == set() and c.take_worker(3, adir, "", T0 + 6) is None  # released once
    assert not [sig for target, sig in s.table.sent if target in (pid, -pid)]


def test_no_restart_discards_the_standby_it_is_killed_then_reaped(tmp_path):
    s = Setup(tmp_path)
    c = s.concern
    c.episode_opened(s.attempt, s.episode("stall", T0, expired=STALL), Intent.NONE, T0)
    pid = s.standby_pid()
    c.observe(OutcomeReached(Outcome(State.FAILED, "crash loop"), T0 + 5))
    assert (pid, signal.SIGKILL) in s.table.sent and (-pid, signal.SIGKILL) in s.table.sent
    assert c.readers(T0 + 5)["standby"]() is None
    assert c.take_worker(2, attempt_dir(s.run_dir, 2), "", T0 + 6) is None
    c.observe(PassBegins(T0 + 6))
    assert pid in s.table.reaped and c.own_pids() == set()


def test_an_exit_spawns_one_only_when_the_policy_restarts_it(tmp_path):
    s = Setup(tmp_path)
    c = s.concern
    fail = s.episode("crash", T0, decision=Decision("fail", "exit 78"))
    c.episode_opened(s.attempt, fail, Intent.NONE, T0)
    finished = s.episode(None, T0 + 1, decision=Decision("finish", "done"))
    c.episode_opened(s.attempt, finished, Intent.NONE, T0 + 1)
    assert s.spawner.standbys == []
    c.episode_opened(s.attempt, s.episode("crash", T0 + 2, decision=Decision("restart", "crash")), Intent.NONE, T0 + 2)
    assert len(s.spawner.standbys) == 1 and c.readers(T0 + 2)["standby"]()["why"] == "crash"
    # a second episode of the same attempt keeps the one there is
    c.episode_opened(s.attempt, s.episode("stall", T0 + 3, expired=STALL), Intent.NONE, T0 + 3)
    assert len(s.spawner.standbys) == 1


def test_an_operators_stop_spawns_nothing_a_graceful_restart_does(tmp_path):
    s = Setup(tmp_path)
    c = s.concern
    c.observe(StopRequested(s.attempt, Intent.EXIT, T0))
    c.observe(StopRequested(s.attempt, Intent.PAUSE, T0))
    assert s.spawner.standbys == []
    c.observe(StopRequested(s.attempt, Intent.RESTART, T0 + 1))
    assert len(s.spawner.standbys) == 1 and c.readers(T0 + 1)["standby"]()["why"] == "restart requested"
    # the stop's exit is an episode while STOPPING: the request already decided
    s.state = State.STOPPING
    c.episode_opened(s.attempt, s.episode(None, T0 + 2), Intent.RESTART, T0 + 2)
    assert len(s.spawner.standbys) == 1


def test_during_a_stop_an_episode_spawns_nothing(tmp_path):
    s = Setup(tmp_path)
    s.state = State.STOPPING
    s.concern.episode_opened(s.attempt, s.episode("stall", T0, expired=STALL), Intent.NONE, T0)
    assert s.spawner.standbys == []


def test_always_keeps_one_ready_from_the_first_step_and_replaces_it_when_it_dies(tmp_path):
    s = Setup(tmp_path, prewarm="always")
    c = s.concern
    running = PassState(State.RUNNING, Intent.NONE, s.attempt, None, None, None)
    c.observe(PassSettled(running, T0))
    assert s.spawner.standbys == []  # no step yet
    s.step(T0 + 1)
    c.observe(
        PassSettled(PassState(State.RUNNING, Intent.NONE, s.attempt, s.episode("stall", T0 + 1), None, None), T0 + 1)
    )
    assert s.spawner.standbys == []  # not while an episode is handled
    c.observe(PassSettled(running, T0 + 1))
    assert len(s.spawner.standbys) == 1 and c.readers(T0 + 1)["standby"]()["why"] == "always"
    c.observe(PassSettled(running, T0 + 2))
    assert len(s.spawner.standbys) == 1  # one is enough
    first = s.standby_pid()
    s.table.end(first, code=1)  # it died
    c.observe(PassBegins(T0 + 3))
    assert c.readers(T0 + 3)["standby"]() is None and first in s.table.reaped
    c.observe(PassSettled(running, T0 + 3))
    assert len(s.spawner.standbys) == 1  # replaced, but not at once
    c.observe(PassSettled(running, T0 + 60))
    assert len(s.spawner.standbys) == 2 and "replacing a standby that died" in c.readers(T0 + 60)["standby"]()["why"]
    # a new attempt must step again before its successor is prewarmed
    c.observe(AttemptStarted(s.make_attempt(2), None, T0 + 61))
    assert c.stepped is False


def test_close_kills_the_standby_nobody_will_release(tmp_path):
    s = Setup(tmp_path)
    s.concern.observe(StopRequested(s.attempt, Intent.RESTART, T0))
    pid = s.standby_pid()
    s.concern.observe(Closing(T0 + 1))
    assert (pid, signal.SIGKILL) in s.table.sent and pid in s.table.reaped and s.concern.own_pids() == set()


def test_a_run_that_cannot_be_prewarmed_spawns_nothing(tmp_path):
    s = Setup(tmp_path, nproc_per_node=2)
    assert "only a single-process worker" in s.concern.keeper.why_not
    s.concern.episode_opened(s.attempt, s.episode("stall", T0, expired=STALL), Intent.NONE, T0)
    s.concern.observe(StopRequested(s.attempt, Intent.RESTART, T0))
    assert s.spawner.standbys == [] and s.concern.take_worker(2, attempt_dir(s.run_dir, 2), "", T0) is None
