"""UnkillableWait alone (no Supervisor): a real TreeKiller over the fake process table ends a tree whose child
survives SIGKILL (uninterruptible sleep), a real IncidentStore, a fake clock.  Survivors → the `unkillable`
incident and a hold under `wait`, a `fail` decision under `fail` (asked once the tree is gone, through the decision's
one owner, `concerns.decide`); the wait ends when they go (the incident final,
`gone_after_s`), or at once when the run ends anyway (an operator's stop)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from fixtures.deciding import RecordingFs, decided
from fixtures.fakes.fake_supervisor import FakeProcessTable

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.exitcodes import EXIT_FAILED
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.unkillable_wait import UnkillableWait
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.escalation.tree_killer import TreeKiller
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

T0 = 1000.0
KILL_WAIT_S = 5.0


def make_run(tmp_path: Path, mode: str) -> RunContext:
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": "train.jsonl"},
            "watchdog": {"kill_wait_s": KILL_WAIT_S, "term_grace_s": 1},
            "restart": {"on_unkillable": mode},
        }
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    facts = RunRecord(last_step={"event": "step", "step": 7})
    return RunContext(
        cfg, run_dir, FsOps(), IncidentStore(run_dir), Deadlines(cfg.watchdog, Calibration(cfg.watchdog)), facts
    )


class Tree:
    """Attempt 1's worker and a child that left its group and sleeps in the kernel (SIGKILL cannot end it)."""

    def __init__(self, run: RunContext, survivor: bool = True):
        self.table = FakeProcessTable()
        self.table.describe = lambda ref: {"pid": ref.pid, "state": "disk-sleep", "wchan": "nfs_wait_bit_killable"}
        w = self.table.add(term="ignore")
        self.child = self.table.add(ppid=w.pid, term="ignore", survives_kill=survivor)
        d = attempt_dir(run.run_dir, 1)
        d.mkdir(parents=True)
        self.worker = Worker(w.pid, w.create_time, ["python"], d / WORKER_LOG_NAME, T0)
        self.attempt = Attempt(1, d, self.worker, HeartbeatTail(d))

    def killed(self, now: float) -> TreeKiller:
        """SIGTERM at `now`, SIGKILL after the grace, then `kill_wait_s`: the killer done, survivors recorded."""
        k = TreeKiller(
            self.worker, [], self.table, term_grace_s=1.0, gpu_release_timeout_s=2.0, kill_wait_s=KILL_WAIT_S
        )
        k.begin(now)
        t = now
        while not k.advance(t):
            t += 0.5
        return k


def stalled(run: RunContext, tree: Tree, now: float) -> Episode:
    inc = run.incidents.create("stall", attempt=1, step=7, summary="step deadline exceeded")
    ep = Episode("stall", inc, now)
    ep.killer = tree.killed(now)
    return ep


def unkillable(run: RunContext) -> dict:
    (one,) = [i for i in run.incidents.list() if i["kind"] == "unkillable"]
    return run.incidents.get(one["id"])


def test_a_tree_that_went_holds_nothing_and_writes_nothing(tmp_path):
    run = make_run(tmp_path, "wait")
    tree = Tree(run, survivor=False)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    assert ep.killer.survivors == []
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, T0 + 10) is False
    assert concern.decision(tree.attempt, ep, None, T0 + 10) is None and concern.next_due_s(T0 + 10) is None
    restart, fs = Decision("restart", "stall"), RecordingFs()
    assert decided([concern], tree.attempt, ep, restart, T0 + 10, fs=fs) is restart and fs.written == []
    assert [i["kind"] for i in run.incidents.list()] == ["stall"]


def test_wait_holds_the_teardown_until_the_survivors_are_gone_then_the_incident_is_final(tmp_path):
    run = make_run(tmp_path, "wait")
    tree = Tree(run)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    done = ep.killer.done_at
    assert ep.killer.survivors and done is not None
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done) is True
    inc = unkillable(run)
    assert inc["status"] == "waiting" and inc["on_unkillable"] == "wait" and inc["attempt"] == 1
    assert [s["pid"] for s in inc["survivors"]] == [tree.child.pid]
    assert inc["survivors"][0]["wchan"] == "nfs_wait_bit_killable"
    assert inc["failure"] == ep.incident.id and inc["failure_kind"] == "stall" and inc["step"] == 7
    assert inc["kill_wait_s"] == KILL_WAIT_S
    assert f"outlived SIGKILL by {KILL_WAIT_S:g} s" in inc["summary"] and "no new attempt starts" in inc["summary"]
    assert run.facts.last_incident["id"] == inc["id"]
    assert concern.next_due_s(done) == 1.0  # looked at once a second while it waits
    assert concern.decision(tree.attempt, ep, None, done) is None  # waiting is no decision
    # an hour later it is still there: still held, one incident, one SIGKILL to it
    for t in range(1, 3600, 97):
        assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done + t) is True
    assert len([i for i in run.incidents.list() if i["kind"] == "unkillable"]) == 1
    assert tree.table.sent.count((tree.child.pid, signal.SIGKILL)) == 1
    # it goes: the hold ends, the incident says after how long
    tree.table.end(tree.child.pid, sig=signal.SIGKILL)
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done + 3700) is False
    inc = unkillable(run)
    assert inc["status"] == "final" and inc["gone_after_s"] == 3700.0 and "still_there" not in inc
    assert concern.next_due_s(done + 3700) is None and concern.waiting is None


def test_fail_ends_the_run_with_a_fail_decision_once(tmp_path):
    run = make_run(tmp_path, "fail")
    tree = Tree(run)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    done = ep.killer.done_at
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done) is False
    inc = unkillable(run)
    assert inc["status"] == "final" and inc["on_unkillable"] == "fail" and "the run ends failed" in inc["summary"]
    fs = RecordingFs()
    got = decided([concern], tree.attempt, ep, Decision("restart", "stall"), done, fs=fs, store=run.incidents)
    assert got is not None and got.action == "fail" and str(tree.child.pid) in got.reason
    assert "unkillable" in got.reason and got.exit_code == EXIT_FAILED
    assert ep.decision is got and fs.written == []  # settled on the episode by the owner; nothing to write
    assert len([i for i in run.incidents.list() if i["kind"] == "unkillable"]) == 1  # one incident
    # the answer is the episode's own: the next episode, its tree gone whole, keeps its decision
    tree.table.end(tree.child.pid, sig=signal.SIGKILL)
    nxt = Episode("crash", run.incidents.create("crash", attempt=1, step=7), done + 10)
    nxt.killer = tree.killed(done + 10)
    assert nxt.killer.survivors == []
    restart = Decision("restart", "crash")
    assert decided([concern], tree.attempt, nxt, restart, done + 20) is restart and nxt.decision is restart
    assert concern.next_due_s(done) is None


@pytest.mark.parametrize("intent", [Intent.EXIT, Intent.FAIL, Intent.PEER_FAILED])
def test_a_run_that_ends_anyway_stops_waiting_and_says_who_is_still_there(tmp_path, intent):
    run = make_run(tmp_path, "wait")
    tree = Tree(run)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    done = ep.killer.done_at
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done) is True
    assert concern.hold_teardown(tree.attempt, ep, intent, done + 30) is False  # an operator's stop, say
    inc = unkillable(run)
    assert inc["status"] == "final" and inc["still_there"] == [tree.child.pid] and inc["waited_s"] == 30.0
    assert "gone_after_s" not in inc and concern.waiting is None and concern.next_due_s(done + 30) is None


def test_a_restart_requested_while_waiting_still_waits(tmp_path):
    run = make_run(tmp_path, "wait")
    tree = Tree(run)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    done = ep.killer.done_at
    assert concern.hold_teardown(tree.attempt, ep, Intent.NONE, done) is True
    assert concern.hold_teardown(tree.attempt, ep, Intent.RESTART, done + 5) is True
    assert concern.hold_teardown(tree.attempt, ep, Intent.PAUSE, done + 6) is True


def test_an_exit_already_asked_for_does_not_wait_even_on_the_first_look(tmp_path):
    run = make_run(tmp_path, "wait")
    tree = Tree(run)
    ep = stalled(run, tree, T0)
    concern = UnkillableWait(run)
    assert concern.hold_teardown(tree.attempt, ep, Intent.EXIT, ep.killer.done_at) is False
    (inc,) = [i for i in run.incidents.list() if i["kind"] == "unkillable"]
    record = run.incidents.get(inc["id"])
    assert (
        record["status"] == "final"
        and record["still_there"]
        and "the run ends with them still there" in (record["summary"])
    )
    # asked again for the same teardown: no second incident
    assert concern.hold_teardown(tree.attempt, ep, Intent.EXIT, ep.killer.done_at + 1) is False
    assert len([i for i in run.incidents.list() if i["kind"] == "unkillable"]) == 1
