"""The supervisor's whole lifecycle on fakes: fake clock, fake process table, fake spawn, heartbeat
lines written by the test, scripted control requests.  No process is started; every case is
(state, event) → (state reached, signals sent in order, incidents written).

Signals read "SIGUSR1" (to one announced pid), "-SIGTERM" (to the worker's process group), …
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass, field
from typing import Callable, Optional

import pytest
from fixtures.fakes.fake_supervisor import Harness

from hangwatch.supervisor.ops import logsetup


def stop_stepping(h):  # a stall: running, then silent in train — the step deadline (2 s) fires
    h.running()


def ignore_term(h):
    h.running()


def never_start(h):
    h.until(lambda: h.spawn.workers)


def silent_in_eval(h):  # no step deadline in eval without a budget: only silence (3 s) applies
    h.running().phase("eval")


def livelocked(h):
    w = h.running()
    h.until(lambda: h.state == "stalled", each=lambda: w.beat("progress"))


def eval_over_budget(h):
    h.running().phase("eval", budget_s=1)


def exits(code=None, sig=None):
    def script(h):
        h.running().exit(code, sig)

    return script


def finishes(h):
    w = h.running()
    w.stop("finished")
    w.exit(0)


def restart_now(h):
    h.running()
    h.request(cmd="restart", mode="now")


def restart_now_while_killing(h):
    h.running()
    h.until(lambda: h.state == "killing", within_s=10)
    h.request(cmd="restart", mode="now")


def graceful_restart(h):
    h.running()
    h.request(cmd="restart")


def stop(h):
    h.running()
    h.request(cmd="stop")


def stop_twice(h):
    h.running()
    h.request(cmd="stop")
    h.until(lambda: h.state == "stopping")
    h.tick()
    h.request(cmd="stop")


def crash_twice(h):  # the first restart is immediate; the second failure in a row backs off
    h.running().exit(1)
    h.until(lambda: h.sup.attempt == 2)
    h.worker.start()
    h.worker.exit(1)


def during_backoff(cmd):  # two crashes in a row, and the request while the supervisor waits to restart
    def script(h):
        crash_twice(h)
        h.until(lambda: h.state == "backoff")
        h.request(cmd=cmd)

    return script


def while_paused(cmd):
    def script(h):
        h.running()
        h.request(cmd="pause")
        h.until(lambda: h.state == "paused")
        h.request(cmd=cmd)

    return script


def crash_loop(h):
    for n in (1, 2, 3):
        h.until(lambda: len(h.spawn.workers) == n and h.state == "starting")
        h.worker.start()
        h.worker.exit(1)


def exits_while_stopping(code, last_words=None):
    def script(h):
        h.running()
        h.request(cmd="stop")
        h.until(lambda: h.state == "stopping")
        h.worker.exit(code, last_words=last_words)

    return script


CRASH_WORDS = {
    "kind": "crash",
    "message": "boom",
    "traceback": "Traceback (most recent call last):\nValueError: boom\n",
}


def hangs_after_stop_line(h):  # `stop finished`, then never exits: the exit deadline (exit_after_stop 4 + term 1)
    h.running().stop("finished")


def hangs_after_stop_line_unfinished(h):  # a `stop` that does not say the work is done: the run goes on
    h.running().stop("terminated")


def ignores_stop(h):  # the stop bound (term_grace 1 + step budget 2) fires while STOPPING
    h.running()
    h.request(cmd="stop")


def setsid_child(h):  # a child that left the group: SIGTERM to the group misses it, it gets its own SIGKILL
    w = h.running()
    h.table.add(ppid=w.pid, pgid=None, term="ignore")  # its own group and session
    h.tick(1.1)  # found by the kill (the worker's descendants), not only by the periodic tree scan


def spawn_fails(h):
    h.spawn.fail = FileNotFoundError(2, "No such file or directory", "fake-worker")


def supervisor_signal(sig):
    def script(h):
        h.running()
        h.sup.wakeup.record(sig)

    return script


@dataclass
class Case:
    name: str
    script: Callable  # (harness): bring the supervisor to the state and cause the event
    reach: Callable  # (harness) -> bool: the scenario is over
    path: str  # every state entered, in order; the last is where it ends
    signals: list
    incidents: list = field(default_factory=list)  # (kind, deadline that fired or None)
    harness: dict = field(default_factory=dict)
    exit_code: Optional[int] = None


def attempt(n, state="starting"):
    return lambda h: h.sup.attempt == n and h.state == state


def in_state(state):
    return lambda h: h.state == state


IGNORE = {"proc": {"term": "ignore"}}
DIE = {"proc": {"term": "die"}}
STALL = "starting running stalled dumping killing"
RESTARTED = "backoff starting"
STOPPED = "starting running stopping killing"
CASES = [
    Case(
        "stall: dumps, TERM, backoff, restart",
        stop_stepping,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM"],
        [("stall", "step")],
    ),
    Case(
        "stall: TERM ignored, KILL after grace",
        ignore_term,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM", "-SIGKILL"],
        [("stall", "step")],
        IGNORE,
    ),
    Case(
        "a second failure in a row backs off before the restart",
        crash_twice,
        in_state("backoff"),
        f"starting running killing {RESTARTED} running killing backoff",
        ["-SIGTERM"] * 2,
        [("crash", None)] * 2,
    ),
    Case(
        "startup timeout: no SIGUSR1 to a worker that never announced",
        never_start,
        attempt(2),
        f"starting stalled dumping killing {RESTARTED}",
        ["-SIGTERM"],
        [("startup_timeout", "startup")],
        DIE,
    ),
    Case(
        "silence", silent_in_eval, attempt(2), f"{STALL} {RESTARTED}", ["SIGUSR1", "-SIGTERM"], [("stall", "silence")]
    ),
    Case(
        "livelock: progress beats without a step",
        livelocked,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM"],
        [("livelock", "step")],
    ),
    Case(
        "phase budget from the line",
        eval_over_budget,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM"],
        [("stall", "phase")],
    ),
    Case(
        "crash exit → restart",
        exits(1),
        attempt(2),
        f"starting running killing {RESTARTED}",
        ["-SIGTERM"],
        [("crash", None)],
    ),
    Case(
        "killed by a signal → restart",
        exits(sig=signal.SIGKILL),
        attempt(2),
        f"starting running killing {RESTARTED}",
        ["-SIGTERM"],
        [("signal", None)],
    ),
    Case(
        "exit 75 → restart (rollback)",
        exits(75),
        attempt(2),
        f"starting running killing {RESTARTED}",
        ["-SIGTERM"],
        [("nan", None)],
    ),
    Case(
        "exit 78 → failed, no restart",
        exits(78),
        in_state("failed"),
        "starting running killing failed",
        ["-SIGTERM"],
        [("config_error", None)],
        exit_code=78,
    ),
    Case(
        "exit 65 → failed, no restart",
        exits(65),
        in_state("failed"),
        "starting running killing failed",
        ["-SIGTERM"],
        [("data_error", None)],
        exit_code=65,
    ),
    Case("finished", finishes, in_state("finished"), "starting running killing finished", ["-SIGTERM"], exit_code=0),
    Case(
        "restart now: dump, kill, restart without backoff",
        restart_now,
        attempt(2),
        f"{STALL} starting",
        ["SIGUSR1", "-SIGTERM"],
        [("manual", None)],
    ),
    Case(
        "restart now while killing: restart without backoff",
        restart_now_while_killing,
        attempt(2),
        f"{STALL} starting",
        ["SIGUSR1", "-SIGTERM", "-SIGKILL"],
        [("stall", "step")],
        IGNORE,
    ),
    Case(
        "graceful restart: SIGTERM to the worker, no incident",
        graceful_restart,
        attempt(2),
        f"{STOPPED} starting",
        ["SIGTERM", "-SIGTERM"],
    ),
    Case(
        "stop: checkpoint, exit 0, stopped",
        stop,
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        exit_code=0,
    ),
    Case(
        "a second stop forces the kill",
        stop_twice,
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGKILL"],
        harness=IGNORE,
        exit_code=0,
    ),
    Case(
        "pause during backoff",
        during_backoff("pause"),
        in_state("paused"),
        f"starting running killing {RESTARTED} running killing backoff paused",
        ["-SIGTERM"] * 2,
        [("crash", None)] * 2,
    ),
    Case(
        "pause, then resume", while_paused("resume"), attempt(2), f"{STOPPED} paused starting", ["SIGTERM", "-SIGTERM"]
    ),
    Case(
        "stop during backoff",
        during_backoff("stop"),
        in_state("stopped"),
        f"starting running killing {RESTARTED} running killing backoff stopped",
        ["-SIGTERM"] * 2,
        [("crash", None)] * 2,
        exit_code=0,
    ),
    Case(
        "stop while paused",
        while_paused("stop"),
        in_state("stopped"),
        f"{STOPPED} paused stopped",
        ["SIGTERM", "-SIGTERM"],
        exit_code=0,
    ),
    Case(
        "crash loop → failed",
        crash_loop,
        in_state("failed"),
        f"starting running killing {RESTARTED} running killing {RESTARTED} running killing failed",
        ["-SIGTERM"] * 3,
        [("crash", None)] * 3 + [("crash_loop", None)],
        {"restart": {"max_restarts": 2, "backoff_initial_s": 0}},
        exit_code=1,
    ),
    Case(
        "worker crashes while stopping",
        exits_while_stopping(1, CRASH_WORDS),
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        [("crash", None)],
        IGNORE,
        exit_code=0,
    ),
    # torchrun exits 1 after forwarding our SIGTERM: a stop hangwatch asked for is a stop, not a crash.
    Case(
        "a launcher exits 1 on the stop it was asked for",
        exits_while_stopping(1),
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        [],
        IGNORE,
        exit_code=0,
    ),
    Case(
        "worker exits cleanly while stopping",
        exits_while_stopping(0),
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        [],
        IGNORE,
        exit_code=0,
    ),
    # every rank had said `finished`: the work is done, the tree that would not go is killed and the run is finished
    Case(
        "hangs on its way out after `stop finished`",
        hangs_after_stop_line,
        in_state("finished"),
        f"{STALL} finished",
        ["SIGUSR1", "-SIGTERM", "-SIGKILL"],
        [("stall", "exit")],
        IGNORE,
        exit_code=0,
    ),
    Case(
        "hangs on its way out after `stop terminated`",
        hangs_after_stop_line_unfinished,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM", "-SIGKILL"],
        [("stall", "exit")],
        IGNORE,
    ),
    Case(
        "a deadline while stopping escalates",
        ignores_stop,
        in_state("stopped"),
        "starting running stopping stalled dumping killing stopped",
        ["SIGTERM", "SIGUSR1", "-SIGTERM", "-SIGKILL"],
        [("stall", "step")],
        IGNORE,
        exit_code=0,
    ),
    Case(
        "a child that left the group gets its own SIGKILL",
        setsid_child,
        attempt(2),
        f"{STALL} {RESTARTED}",
        ["SIGUSR1", "-SIGTERM", "-SIGKILL", "SIGKILL"],
        [("stall", "step")],
    ),
    Case(
        "the worker cannot be spawned",
        spawn_fails,
        in_state("failed"),
        "starting failed",
        [],
        [("config_error", None)],
        exit_code=78,
    ),
    Case(
        "SIGTERM to the supervisor: graceful stop",
        supervisor_signal(signal.SIGTERM),
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        exit_code=0,
    ),
    Case(
        "SIGINT to the supervisor: graceful stop",
        supervisor_signal(signal.SIGINT),
        in_state("stopped"),
        f"{STOPPED} stopped",
        ["SIGTERM", "-SIGTERM"],
        exit_code=0,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lifecycle(tmp_path, case):
    h = Harness(tmp_path, **case.harness)
    case.script(h)
    h.until(lambda: case.reach(h), within_s=60)
    assert " ".join(h.visited) == case.path
    assert h.table.signals() == case.signals
    incidents = [h.sup.incidents.get(i["id"]) for i in h.sup.incidents.list()]
    assert [(i["kind"], (i.get("deadline") or {}).get("name")) for i in incidents] == case.incidents
    assert all(i.get("status") != "in progress" for i in incidents)  # every episode completed its incident
    if case.exit_code is not None:
        assert h.sup.exit_code == case.exit_code


def test_sigusr1_goes_to_announced_pids_only(tmp_path):
    h = Harness(tmp_path)
    w = h.running()
    launcher_child = h.table.add(ppid=w.pid, pgid=w.pid)  # in the group, never announced (a torchrun-like child)
    h.until(lambda: h.state == "killing")
    usr1 = [pid for pid, sig in h.table.sent if sig == signal.SIGUSR1]
    assert usr1 == [w.pid] and launcher_child.pid not in usr1
    inc = h.incident()
    assert inc["stuck_frame"]["function"] == "block_in_c" and inc["dump_signalled"] == {"0": True}


def test_stall_incident_and_timings(tmp_path):
    h = Harness(tmp_path, proc={"term": "ignore"})
    h.running()
    took = h.until(lambda: h.sup.attempt == 2)
    inc = h.incident()
    assert inc["deadline"]["name"] == "step" and inc["deadline"]["budget_s"] == 2 and inc["step"] == 2
    assert inc["last_good_checkpoint"] == "ckpt-2" and inc["decision"] == {
        "action": "restart",
        "reason": inc["decision"]["reason"],
        "delay_s": 0,
        "crash_loop": False,
        "rollback": False,
    }
    t = inc["timings"]
    assert t["snapshot_s"] == pytest.approx(0.5, abs=0.06)  # the CPU sample spans loop passes, no blocking
    assert (
        t["dump_started_at_s"] == 0 and t["dump_files_s"] == 0
    )  # signalled at detection; the whole dump is in at once
    grace = h.sup.watchdog_cfg.stuck_term_grace_s
    assert t["term_grace_s"] == grace and t["sigkill_after_s"] == pytest.approx(
        grace, abs=0.11
    )  # stuck: stuck_term_grace_s
    # the step deadline, the snapshot (the dumps within it), the stuck grace; no backoff before the first restart
    assert 2 + 0.5 + 0.5 <= took <= 2 + 0.5 + 0.5 + 0.4
    assert {"heartbeat-tail-rank0.jsonl", "worker-log-tail.txt", "stack-rank0.txt"} <= set(inc["files"])


def test_exit_75_records_the_rollback_target(tmp_path):
    h = Harness(tmp_path)
    h.running().exit(75)
    h.until(lambda: h.sup.attempt == 2)
    inc = h.incident()
    assert inc["decision"]["rollback"] is True and inc["rollback_to"] == "ckpt-2"


def test_a_dump_request_is_answered_after_the_dumps_settle(tmp_path):
    h = Harness(tmp_path)
    w = h.running()
    h.request(cmd="dump")
    h.tick()
    assert h.reply(cmd="dump") is None and len(h.control.pending) == 1  # in flight, the loop goes on
    took = h.until(lambda: h.reply(cmd="dump") is not None)
    rep = h.reply(cmd="dump")
    assert rep["ok"] and "in block_in_c" in rep["result"]["dumps"]["0"] and rep["result"]["signalled"] == {"0": True}
    assert [(pid, sig) for pid, sig in h.table.sent] == [(w.pid, signal.SIGUSR1)]
    assert took <= 0.3  # the dump is whole: answered at the next pass, without waiting for it to stop growing
    assert h.state == "running"


def test_a_dump_request_during_a_stall_shares_the_stalls_dumps(tmp_path):
    h = Harness(tmp_path, proc={"term": "ignore"})
    h.running()
    h.until(lambda: h.state == "stalled")
    h.request(cmd="dump")
    h.until(lambda: h.reply(cmd="dump") is not None)
    assert h.state == "killing"  # answered once the stall's dumps settled, before the tree is down
    assert h.reply(cmd="dump")["ok"] and "block_in_c" in h.reply(cmd="dump")["result"]["dumps"]["0"]
    assert h.table.signals().count("SIGUSR1") == 1  # one SIGUSR1 serves both


def test_a_dump_request_without_an_announced_worker_is_refused_at_once(tmp_path):
    h = Harness(tmp_path)
    h.until(lambda: h.spawn.workers)
    h.request(cmd="dump")
    h.tick()
    assert "no running worker process announced" in h.reply(cmd="dump")["error"]


def test_a_suspended_supervisor_extends_deadlines_instead_of_firing(tmp_path, caplog):
    h = Harness(tmp_path)
    w = h.running()
    h.tick(30.0)  # the whole machine slept: 30 s gap, no line (every deadline is shorter)
    w.step()
    h.until(lambda: h.sup.context.facts.last_step.get("step") == 3)
    assert h.state == "running" and h.incident_kinds() == [] and h.table.sent == []
    assert h.sup.suspension.total_s > 25


def test_a_recorded_sighup_reopens_the_log(tmp_path):
    logsetup.configure(tmp_path / "logs", "info")
    try:
        handler = next(x for x in logsetup._handlers if isinstance(x, logging.FileHandler))
        before = handler.stream
        h = Harness(tmp_path)
        h.sup.wakeup.record(signal.SIGHUP)
        h.tick()
        assert handler.stream is not before and before.closed and not handler.stream.closed  # reopened
        assert "log_reopened" in (tmp_path / "logs" / logsetup.LOG_NAME).read_text()
    finally:
        logging.getLogger(logsetup.ROOT_LOGGER).handlers.clear()
        logsetup._handlers.clear()


def test_control_commands(tmp_path):
    h = Harness(tmp_path)
    h.running()
    for req in (
        {"cmd": "bogus"},
        {"cmd": "status"},
        {"cmd": "resume"},
        {"cmd": "restart", "mode": "sideways"},
        {"cmd": "incidents"},
        {"cmd": "incidents", "id": "7"},
        ["not", "an", "object"],
    ):
        h.control.queue.append(req)
    h.tick()
    assert "unknown command 'bogus'" in h.reply(cmd="bogus")["error"]
    st = h.reply(cmd="status")["result"]
    assert (st["state"], st["attempt"], st["step"], st["phase"], st["intent"]) == ("running", 1, 2, "train", None)
    assert st["pid"] == h.worker.pid and st["pids"] == {"0": h.worker.pid} and st["last_good_checkpoint"] == "ckpt-2"
    assert {d["name"] for d in st["deadlines"]} == {"silence", "step"} and st["gpu"]["available"] is False
    assert "not paused" in h.reply(cmd="resume")["error"]
    assert "must be 'graceful' or 'now'" in h.reply(cmd="restart", mode="sideways")["error"]
    assert h.reply(cmd="incidents")["result"] == [] and "no incident '7'" in h.reply(cmd="incidents", id="7")["error"]
    assert "must be a JSON object" in h.control.replies[-1][1]["error"]


def test_requests_after_the_run_is_over_are_refused(tmp_path):
    h = Harness(tmp_path)
    finishes(h)
    h.until(lambda: h.state == "finished")
    h.request(cmd="restart")
    h.request(cmd="stop")
    h.request(cmd="pause")
    h.sup.run_once(h.clock())
    for cmd in ("restart", "stop", "pause"):
        assert "the run is over" in h.reply(cmd=cmd)["error"]


def test_state_file_and_notifications(tmp_path):
    h = Harness(tmp_path)
    w = h.running()
    st = h.sup.state_path.read_text()
    assert f'"pid": {w.pid}' in st and '"state": "running"' in st and '"last_good_checkpoint": "ckpt-2"' in st
    h.request(cmd="stop")
    h.until(lambda: h.state == "stopped")
    import json

    final = json.loads(h.sup.state_path.read_text())
    assert final["worker"] is None and final["pids"] == {} and final["exit_code"] == 0
    kinds = [c[0] for c in h.notifier.calls]
    assert kinds.count("ready") == 1 and "stopping" in kinds and kinds.count("watchdog") >= 4  # every pass


@pytest.mark.parametrize("when", ["while pausing", "once paused"])
def test_a_pause_outlives_the_supervisor(tmp_path, when):
    first = Harness(tmp_path)
    first.running()
    first.request(cmd="pause")
    if when == "while pausing":
        first.until(lambda: first.state == "stopping")  # the supervisor dies before the worker is gone
    else:
        first.until(lambda: first.state == "stopping")
        first.worker.graceful_exit()
        first.until(lambda: first.state == "paused")
    assert json.loads((tmp_path / "run" / "state.json").read_text())["intent"] == "pause"
    second = Harness(tmp_path)  # a new supervisor on the same run dir (systemd restarted it, say)
    for _ in range(20):
        second.tick()
    assert second.state == "paused" and second.spawn.workers == []
    second.request(cmd="resume")
    second.until(lambda: second.spawn.workers)
    second.worker.start()
    second.until(lambda: second.state == "running")
    assert json.loads((tmp_path / "run" / "state.json").read_text())["intent"] is None


def test_the_next_attempt_resumes_from_the_last_good_checkpoint_and_a_new_supervisor_keeps_the_record(tmp_path):
    """Attempt 1 announces two checkpoints; the newer one is spoiled by a NaN before its confirmation.
    Attempt 2 is handed the older one, as is the first attempt of a supervisor restarted on the run dir."""
    from structlog.testing import capture_logs

    from hangwatch.common.protocol import ENV_RESUME_FROM

    good, spoiled = tmp_path / "ck" / "step-2", tmp_path / "ck" / "step-4"
    good.mkdir(parents=True)
    spoiled.mkdir()
    h = Harness(tmp_path)
    w = h.running(steps=2, checkpoint=False)
    w.beat("checkpoint", path=str(good), good=False)
    w.step(2)  # steps 3 and 4, loss 1.0: confirmed
    w.beat("checkpoint", path=str(spoiled), good=False)
    w.step_no = 5
    w.beat("step", loss=float("nan"))
    w.exit(1)
    h.until(lambda: h.sup.attempt == 2)
    assert h.spawn.envs[0][ENV_RESUME_FROM] == "" and h.spawn.envs[1][ENV_RESUME_FROM] == str(good)
    st = json.loads(h.sup.state_path.read_text())
    assert (st["last_good_checkpoint"], st["last_good_step"]) == (str(good), 2)
    record = {c["path"]: c for c in json.loads((tmp_path / "run" / "checkpoints.json").read_text())["checkpoints"]}
    assert record[str(spoiled)]["status"] == "bad" and record[str(spoiled)]["why"] == "loss nan at step 5"
    with capture_logs() as logs:  # the worker says it resumed from another one than it was handed
        h.worker.beat("start", resumed_from=str(spoiled), dump_signal=None, dump_path=None)
        h.until(lambda: h.state == "running")
    assert [(r["log_level"], r["status"], r["why"]) for r in logs if r["event"] == "resumed_from_differs"] == [
        ("warning", "bad", "loss nan at step 5")
    ]

    second = Harness(tmp_path)  # a new supervisor on the same run dir keeps the record
    assert second.sup.context.facts.last_good_checkpoint == str(good)
    import shutil

    shutil.rmtree(good)  # ... and skips a good checkpoint deleted meanwhile
    with capture_logs() as logs:
        second.until(lambda: second.spawn.workers)
    assert second.spawn.envs[0][ENV_RESUME_FROM] == ""
    assert any(r["event"] == "good_checkpoint_missing" and r["path"] == str(good) for r in logs)
