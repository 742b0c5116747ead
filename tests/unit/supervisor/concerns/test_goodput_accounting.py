"""GoodputAccounting alone (no Supervisor): the loop's situation played as a script of settled passes, heartbeat
lines and episodes on a fake clock, with real Deadlines (the main rank), a real TreeKiller's `gone_at` and the
real ledger.  Every second lands in one category — start-up, training, detection, dumps, kill, GPU release,
backoff, restart start-up, redone steps — and goodput.json says so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
from fixtures.fakes.fake_supervisor import FakeProcessTable

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import PassState, RunContext
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat, OutputProgress, PassSettled, Prepared
from hangwatch.supervisor.concerns.goodput_accounting import GoodputAccounting
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.escalation.tree_killer import TreeKiller
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.goodput import GOODPUT_NAME
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

T0 = 1000.0


class Script:
    """The loop's side: its state, current attempt and episode, as `RunContext.where` reports them."""

    def __init__(self, tmp_path: Path, fs: Optional[FsOps] = None):
        cfg = Config.model_validate({"run_dir": str(tmp_path / "run"), "data": {"train": "train.jsonl"}})
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.failed: list = []
        self.state = State.STARTING
        self.attempt: Optional[Attempt] = None
        self.episode: Optional[Episode] = None
        self.table = FakeProcessTable()
        self.run = RunContext(
            cfg,
            self.run_dir,
            fs or FsOps(),
            IncidentStore(self.run_dir),
            Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
            RunRecord(),
            write_failed=lambda exc, path: self.failed.append(path),
            where=self.where,
        )
        self.concern = GoodputAccounting(self.run)

    def where(self) -> PassState:
        dl = self.run.deadlines
        return PassState(
            self.state,
            Intent.NONE,
            self.attempt,
            self.episode,
            None,
            dl.ranks.get(dl.main_rank()) if self.attempt is not None else None,
        )

    def settle(self, now: float, state: Optional[State] = None) -> None:
        if state is not None:
            self.state = state
        self.concern.observe(PassSettled(self.where(), now))

    def start(self, number: int, now: float, resume_step=None) -> None:
        d = attempt_dir(self.run_dir, number)
        d.mkdir(parents=True, exist_ok=True)
        self.attempt = Attempt(
            number, d, Worker(4000 + number, 1.0, ["python"], d / WORKER_LOG_NAME, now), HeartbeatTail(d)
        )
        self.episode = None
        self.run.deadlines.arm_startup(now)
        self.state = State.STARTING
        self.concern.observe(AttemptStarted(self.attempt, resume_step, now))

    def beat(self, now: float, rank: int = 0, **rec) -> None:
        rec = {"rank": rank, "pid": 1, **rec}
        before = self.run.deadlines.ranks.get(rank)
        left = before.phase if before is not None else None
        tr = self.run.deadlines.observe(rec, now)
        if rec["event"] == "start" and self.state is State.STARTING:
            self.state = State.RUNNING
        self.concern.observe(Beat(self.attempt, tr, rec, left, now, now))

    def open_episode(self, kind: Optional[str], now: float) -> Episode:
        inc = self.run.incidents.create(kind, attempt=self.attempt.number) if kind else None
        self.episode = Episode(kind, inc, now)
        assert self.concern.episode_opened(self.attempt, self.episode, Intent.NONE, now) == {}
        return self.episode

    def killer(self) -> TreeKiller:
        w = self.attempt.worker
        return TreeKiller(w, [], self.table, term_grace_s=1.0, gpu_release_timeout_s=2.0)

    def categories(self) -> dict:
        return json.loads((self.run_dir / GOODPUT_NAME).read_text())["categories"]


def test_a_failure_and_its_recovery_land_each_second_in_its_category(tmp_path):
    s = Script(tmp_path)
    c = s.concern
    c.observe(Prepared(T0))
    s.start(1, T0)
    s.settle(T0)  # starting: the worker loads
    s.beat(T0 + 5, event="start", phase="train", step=0)
    for i in (1, 2, 3):
        s.beat(T0 + 5 + i, event="step", step=i)  # steps 1–3 at +6, +7, +8
    s.settle(T0 + 12)  # still running, nothing proven since step 3
    s.state = State.STALLED
    s.open_episode("stall", T0 + 20)  # detected: +8 → +20 was lost
    s.settle(T0 + 20)
    s.settle(T0 + 23, State.DUMPING)
    s.episode.killer = s.killer()
    s.settle(T0 + 25, State.KILLING)
    s.episode.killer.gone_at = T0 + 27  # the tree is gone: waiting for the GPU memory
    s.settle(T0 + 27)
    s.episode = None
    s.settle(T0 + 28, State.BACKOFF)
    s.start(2, T0 + 30, resume_step=1)
    s.settle(T0 + 30)
    s.beat(T0 + 34, event="start", phase="train", step=1)
    for i, step in enumerate((2, 3, 4)):  # 2 and 3 again: redone; 4 is new
        s.beat(T0 + 35 + i, event="step", step=step)
    s.state = State.KILLING
    s.open_episode(None, T0 + 40)  # the worker finished: a clean end proves the time before it
    s.episode.killer = s.killer()
    s.episode.killer.gone_at = T0 + 40
    s.settle(T0 + 40)
    s.settle(T0 + 41, State.FINISHED)
    want = {
        "startup": 6.0,  # spawn → the first step (the start line at +5, step 1 at +6)
        "training": 6.0,  # +6 → +8, and step 4's +36 → +37, then +37 → +40 proven by the clean end
        "detection": 12.0,
        "dumps": 5.0,
        "kill": 2.0,
        "gpu_release": 1.0,
        "backoff": 2.0,
        "restart_startup": 5.0,  # +30 → step 2 at +35
        "redone": 1.0,  # step 3 again
        "other": 1.0,  # a clean end's teardown is no recovery
    }
    got = s.categories()
    assert {k: v for k, v in got.items() if v} == want
    record = json.loads((s.run_dir / GOODPUT_NAME).read_text())
    assert record["failures"] == 1 and record["wall_s"] == 41.0 and record["top_step"] == 4
    assert record["goodput_pct"] == round(100 * 6 / 41, 2)
    assert record["lost_s"] == 12 + 5 + 2 + 1 + 5 + 1 + 2
    assert c.readers(T0 + 41)["goodput"]()["categories"] == got


def test_a_failure_detected_while_stopping_is_not_lost_time(tmp_path):
    s = Script(tmp_path)
    s.concern.observe(Prepared(T0))
    s.start(1, T0)
    s.beat(T0 + 1, event="start", phase="train", step=0)
    s.beat(T0 + 2, event="step", step=1)
    s.settle(T0 + 2)
    s.state = State.STOPPING  # the graceful stop's way out exited non-zero: not a failure to account
    s.open_episode("crash", T0 + 10)
    snap = s.concern.readers(T0 + 10)["goodput"]()
    assert snap["failures"] == 0 and snap["categories"]["detection"] == 0
    assert snap["settled"]["training"] == 8.0  # proven at the episode


def test_a_worker_that_does_not_beat_proves_progress_by_its_output(tmp_path):
    s = Script(tmp_path)
    s.concern.observe(Prepared(T0))
    s.start(1, T0)
    s.settle(T0)
    s.state = State.RUNNING
    s.concern.observe(OutputProgress(s.attempt, T0 + 4))  # no start line: its output showed a step
    s.settle(T0 + 4)
    s.concern.observe(OutputProgress(s.attempt, T0 + 9))
    snap = s.concern.readers(T0 + 9)["goodput"]()
    assert snap["settled"]["startup"] == 4.0 and snap["settled"]["training"] == 5.0


def test_goodput_json_is_written_at_most_every_five_seconds_and_at_the_end(tmp_path):
    s = Script(tmp_path)
    s.concern.observe(Prepared(T0))
    s.start(1, T0)
    s.settle(T0)
    first = (s.run_dir / GOODPUT_NAME).read_text()
    s.settle(T0 + 3)
    assert (s.run_dir / GOODPUT_NAME).read_text() == first
    s.settle(T0 + 5)
    assert json.loads((s.run_dir / GOODPUT_NAME).read_text())["wall_s"] == 5.0
    s.settle(T0 + 6, State.STOPPED)  # final: written at once
    assert json.loads((s.run_dir / GOODPUT_NAME).read_text())["wall_s"] == 6.0


def test_a_new_supervisor_goes_on_from_goodput_json(tmp_path):
    s = Script(tmp_path)
    s.concern.observe(Prepared(T0))
    s.start(1, T0)
    s.settle(T0)
    s.beat(T0 + 3, event="start", phase="train", step=0)
    s.beat(T0 + 4, event="step", step=5)
    s.open_episode("stall", T0 + 10)
    s.settle(T0 + 10, State.FAILED)
    again = Script(tmp_path)
    again.concern.observe(Prepared(5000.0))  # another clock: only the totals carry over
    again.start(2, 5000.0)
    again.settle(5000.0)
    again.beat(5002.0, event="start", phase="train", step=0)
    again.beat(5003.0, event="step", step=5)  # reached before: redone
    snap = again.concern.readers(5003.0)["goodput"]()
    assert snap["failures"] == 1 and snap["settled"]["detection"] == 6.0
    assert snap["settled"]["startup"] == 4.0 + 3.0 and snap["settled"]["redone"] == 0.0
    assert snap["settled"]["training"] == 0.0 and again.concern.ledger.top_step == 5


@pytest.mark.parametrize("final", [False, True])
def test_a_refused_write_is_reported_not_raised(tmp_path, final):
    class FullDisk(FsOps):
        def write_json(self, path, data, durable=True):
            raise OSError(28, "No space left on device")

    s = Script(tmp_path, fs=FullDisk())
    s.concern.observe(Prepared(T0))
    s.settle(T0, State.FAILED if final else State.STARTING)
    assert s.failed == [s.run_dir / GOODPUT_NAME] and not (s.run_dir / GOODPUT_NAME).exists()
