"""Supervisor lifecycle on real processes: signals to the supervisor, its death, leftovers of a
previous instance, pid reuse, its own suspension, and the control-request contract."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil
import pytest
from fixtures.fakes.sup_harness import (
    HBWORKER,
    PY,
    attempts,
    run_supervisor,
    start_supervisor,
    state,
    strays,
    wait_for,
    wait_no_strays,
    write_config,
)

from hangwatch.common.config import load_config
from hangwatch.supervisor.loop.seams import Seams
from hangwatch.supervisor.loop.supervisor import Supervisor

pytestmark = pytest.mark.slow

LONG = ("--steps", "100000", "--step-s", "0.05")


def beats(run_dir, attempt=1):
    p = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def stop_reason(run_dir, attempt):
    return next((b["reason"] for b in beats(run_dir, attempt) if b["event"] == "stop"), None)


def running_with_steps(run_dir, attempt=1):
    return lambda: any(b["event"] == "step" for b in beats(run_dir, attempt))


def test_sigterm_asks_the_worker_to_checkpoint_and_stop_then_exits_0(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "ok", *LONG)
    sup = start_supervisor(cfg_path)
    wait_for(running_with_steps(run_dir), 20, "steps")
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=30)
    assert sup.returncode == 0, out[-3000:]
    st = state(run_dir)
    assert st["state"] == "stopped" and st["incidents"] == 0 and st["worker"] is None
    events = [(b["event"], b.get("reason")) for b in beats(run_dir) if b["event"] in ("checkpoint", "stop")]
    assert events[-2:] == [("checkpoint", None), ("stop", "terminated")]
    assert not wait_no_strays(str(run_dir))


def test_a_requeue_asked_after_the_work_finished_ends_the_run_finished_not_requeued(tmp_path):
    """SIGUSR1 (a batch job's time limit is near) reaches the supervisor after the worker said `stop finished` but
    before it exited: requeueing would run a finished training again.  The run is finished and exits 0, not 75."""
    cfg_path, run_dir = write_config(tmp_path, "ok", "--steps", "4", "--linger-s", "30")
    sup = start_supervisor(cfg_path)
    wait_for(lambda: stop_reason(run_dir, 1) == "finished", 30, "stop finished")
    sup.send_signal(signal.SIGUSR1)
    out, _ = sup.communicate(timeout=30)
    assert sup.returncode == 0, out[-3000:]
    st = state(run_dir)
    assert st["state"] == "finished" and st["incidents"] == 0, st
    assert "stop_requested" in out  # the request was taken, then the finished work outranked it
    assert len(attempts(run_dir)) == 1
    assert not wait_no_strays(str(run_dir))


def test_a_second_sigterm_kills_a_worker_that_does_not_stop(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "block_c", watchdog={"step_timeout_s": 120, "silence_timeout_s": 120})
    sup = start_supervisor(cfg_path)
    wait_for(lambda: (run_dir / "attempts" / "0001" / "pids.txt").exists() and len(beats(run_dir)) >= 3, 20, "start")
    time.sleep(0.3)
    sup.send_signal(signal.SIGTERM)
    wait_for(lambda: state(run_dir)["state"] == "stopping", 10, "stopping")
    time.sleep(0.5)
    assert state(run_dir)["state"] == "stopping"  # blocked in C: it cannot honour SIGTERM
    sup.send_signal(signal.SIGTERM)
    out, _ = sup.communicate(timeout=30)
    # the command did not answer the SIGTERM it was passed and was killed: `run` dies of SIGTERM, as it would have
    assert sup.returncode == -signal.SIGTERM, out[-3000:]
    assert state(run_dir)["state"] == "stopped"
    assert "stop_forced" in out
    assert not wait_no_strays(str(run_dir))


def test_worker_dies_with_a_sigkilled_supervisor_and_the_next_one_ends_the_leftovers(tmp_path):
    # attempt 1 spawns a grandchild in its group and blocks; deadlines are far away
    cfg_path, run_dir = write_config(
        tmp_path, "grandchild", "--bad-attempts", "99", watchdog={"step_timeout_s": 120, "silence_timeout_s": 120}
    )
    sup = start_supervisor(cfg_path)
    wait_for(
        lambda: len(state(run_dir).get("descendants") or []) == 1 if (run_dir / "state.json").exists() else False,
        20,
        "the grandchild recorded in state.json",
    )
    st = state(run_dir)
    worker = psutil.Process(st["worker"]["pid"])
    grandchild = psutil.Process(st["descendants"][0]["pid"])
    sup.kill()
    sup.communicate()
    # PR_SET_PDEATHSIG: the direct child goes with the supervisor
    wait_for(lambda: not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE, 10, "worker death")
    assert grandchild.is_running() and grandchild.status() != psutil.STATUS_ZOMBIE  # orphaned, still in the group
    # the next supervisor on that run dir (named: another config continues it there) finds it through state.json and
    # ends it before starting its own worker
    cfg2, _ = write_config(tmp_path, "ok")
    nxt = start_supervisor(cfg2, "--run-dir", str(run_dir), echo=True)
    out, _ = nxt.communicate(timeout=90)
    rc = nxt.returncode
    assert rc == 0, out[-3000:]
    assert "leftovers_found" in out
    wait_for(lambda: not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE, 10, "grandchild death")
    assert state(run_dir)["state"] == "finished"
    assert not wait_no_strays(str(run_dir))


def dead_process_ref():
    p = subprocess.Popen(["true"])
    ct = psutil.Process(p.pid).create_time()
    p.wait()
    return {"pid": p.pid, "create_time": ct}


def test_a_previous_supervisors_worker_that_still_runs_is_ended(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "ok")
    run_dir.mkdir()
    (tmp_path / "old").mkdir()
    old = subprocess.Popen(
        [PY, str(HBWORKER), "grandchild", "--tag", str(run_dir)],
        start_new_session=True,
        env={
            **os.environ,
            "HANGWATCH_RUN_DIR": str(tmp_path / "old"),
            "HANGWATCH_ATTEMPT": "1",
            "HANGWATCH_HEARTBEAT_DIR": str(tmp_path / "old"),
            "PYTHONPATH": str(HBWORKER.parents[2]),
        },
    )
    wait_for(
        lambda: (
            (tmp_path / "old" / "pids.txt").exists() and len((tmp_path / "old" / "pids.txt").read_text().split()) == 2
        ),
        20,
        "old worker and its grandchild",
    )
    gc_pid = int((tmp_path / "old" / "pids.txt").read_text().split()[1])
    ct = psutil.Process(old.pid).create_time()
    (run_dir / "state.json").write_text(
        json.dumps(
            {
                "state": "running",
                "updated_wall": time.time(),
                "supervisor": dead_process_ref(),
                "worker": {"pid": old.pid, "pgid": old.pid, "sid": old.pid, "create_time": ct},
                "pids": {},
                "descendants": [],
            }
        )
    )
    rc, out = run_supervisor(cfg_path)
    assert rc == 0, out[-3000:]
    assert old.wait(timeout=10) is not None  # ended (it was our child here only because the test started it)
    assert not psutil.pid_exists(gc_pid) or psutil.Process(gc_pid).status() == psutil.STATUS_ZOMBIE
    assert state(run_dir)["state"] == "finished"


def test_a_reused_pid_is_not_killed(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "ok")
    run_dir.mkdir()
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        real_ct = psutil.Process(bystander.pid).create_time()
        fake = {"pid": bystander.pid, "create_time": real_ct - 1000.0}  # the old worker had this pid long ago
        (run_dir / "state.json").write_text(
            json.dumps(
                {
                    "state": "running",
                    "updated_wall": real_ct - 900.0,
                    "supervisor": dead_process_ref(),
                    "worker": {**fake, "pgid": bystander.pid, "sid": bystander.pid},
                    "pids": {"0": fake},
                    "descendants": [fake],
                }
            )
        )
        rc, out = run_supervisor(cfg_path)
        assert rc == 0, out[-3000:]
        assert bystander.poll() is None, "an unrelated process with a reused pid was killed"
        assert "now belongs to another process" in out
    finally:
        bystander.kill()
        bystander.wait()


def test_refuses_to_run_beside_a_live_supervisor(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "ok")
    run_dir.mkdir()
    me = psutil.Process(os.getpid())
    (run_dir / "state.json").write_text(
        json.dumps({"state": "running", "supervisor": {"pid": me.pid, "create_time": me.create_time()}})
    )
    rc, out = run_supervisor(cfg_path)
    assert rc == 1 and "another supervisor" in out and f"pid {me.pid}" in out
    assert not (run_dir / "attempts").exists()


def test_a_suspended_machine_does_not_fire_deadlines(tmp_path):
    # supervisor and worker both frozen (what a laptop's sleep looks like) for longer than every deadline
    cfg_path, run_dir = write_config(
        tmp_path, "ok", "--steps", "40", "--step-s", "0.1", watchdog={"silence_timeout_s": 3, "step_timeout_s": 2}
    )
    sup = start_supervisor(cfg_path)
    wait_for(running_with_steps(run_dir), 20, "steps")
    worker_pgid = state(run_dir)["worker"]["pgid"]
    os.kill(sup.pid, signal.SIGSTOP)
    os.killpg(worker_pgid, signal.SIGSTOP)
    time.sleep(5)
    os.kill(sup.pid, signal.SIGCONT)
    time.sleep(0.5)  # the supervisor wakes first and sees no new line: only the gap saves the worker
    os.killpg(worker_pgid, signal.SIGCONT)
    out, _ = sup.communicate(timeout=60)
    assert sup.returncode == 0, out[-3000:]
    assert "supervisor_suspended" in out
    st = state(run_dir)
    assert st["state"] == "finished" and st["incidents"] == 0 and len(attempts(run_dir)) == 1


# ------------------------------------------------------------------------------------------ control contract


class Recorder:
    def __init__(self):
        self.calls = []

    def ready(self):
        self.calls.append(("ready",))

    def status(self, text):
        self.calls.append(("status", text))

    def watchdog(self, now=None):
        self.calls.append(("watchdog",))

    def stopping(self):
        self.calls.append(("stopping",))


class ScriptedControl:
    """Sends each request once its condition holds; records the replies.  Like the control server, it
    holds a pending reply (a `dump`) and asks it on every poll, sending nothing else meanwhile."""

    def __init__(self, script):
        self.script = list(script)
        self.replies = []
        self.pending = None
        self.closed = False

    def poll(self, handler):
        if self.pending is not None:
            req, pending = self.pending
            if not pending.ready(time.monotonic()):
                return
            self.replies.append((req, pending.reply()))
            self.pending = None
        while self.script and self.script[0][0]():
            _, req = self.script.pop(0)
            reply = handler(req)
            if not isinstance(reply, dict):
                self.pending = (req, reply)
                return
            self.replies.append((req, reply))

    def close(self):
        self.closed = True


def test_control_requests_drive_the_lifecycle(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "ok", *LONG)
    cfg = load_config(cfg_path)
    box = {}

    def at(attempt, state="running", min_step=3):  # step 2 is followed by a good checkpoint
        def cond():
            s = box["sup"]
            tr = s.deadlines.ranks.get(0)
            return (
                s.attempt == attempt and s.lifecycle.state.value == state and (tr is not None and tr.step >= min_step)
            )

        return cond

    paused = lambda: box["sup"].lifecycle.state.value == "paused"  # noqa: E731
    control = ScriptedControl(
        [
            (at(1), {"cmd": "bogus"}),
            (at(1), {"cmd": "status"}),
            (at(1), {"cmd": "dump"}),
            (at(1), {"cmd": "resume"}),
            (at(1), {"cmd": "restart", "mode": "sideways"}),
            (at(1), {"cmd": "restart", "mode": "graceful"}),
            (at(2), {"cmd": "restart", "mode": "now"}),
            (at(3), {"cmd": "incidents"}),
            (at(3), {"cmd": "incidents", "id": "0001"}),
            (at(3), {"cmd": "incidents", "id": "0042"}),
            (at(3), {"cmd": "pause"}),
            (paused, {"cmd": "status"}),
            (paused, {"cmd": "resume"}),
            (at(4), {"cmd": "stop"}),
        ]
    )
    notifier = Recorder()
    # NVML's reading is a seam: status reports what it says, on a machine with GPUs or without
    no_gpu = {"available": False, "reason": "no GPU: NVML unavailable (faked)"}
    sup = box["sup"] = Supervisor(cfg, Seams(control=control, notifier=notifier, gpu=lambda: no_gpu))
    assert sup.run() == 0
    assert not control.script, f"requests never sent: {control.script}"
    get = lambda **r: next(rep for q, rep in control.replies if q == r)  # noqa: E731  (the first reply)

    bogus = get(cmd="bogus")
    assert bogus["ok"] is False and "unknown command 'bogus'" in bogus["error"] and "status" in bogus["error"]
    st = get(cmd="status")["result"]
    assert st["state"] == "running" and st["attempt"] == 1 and st["step"] >= 3 and st["phase"] == "train"
    assert st["pid"] and st["pids"] == {"0": st["pid"]} and st["max_steps"] == 100000 and st["loss"] is not None
    assert {d["name"] for d in st["deadlines"]} == {"silence", "step"}
    assert st["gpu"]["available"] is False and st["gpu"]["reason"] == no_gpu["reason"]
    assert st["last_good_checkpoint"].startswith("ckpt-")
    for key in (
        "phase_age_s",
        "phase_budget_s",
        "tokens_per_s",
        "lr",
        "last_beat_age_s",
        "restarts",
        "incidents",
        "last_incident",
        "run_dir",
        "config",
        "supervisor_pid",
        "uptime_s",
        "torn_lines",
    ):
        assert key in st
    dump = get(cmd="dump")["result"]["dumps"]["0"]
    assert "most recent call first" in dump and "in main" in dump and dump.count("Current thread") == 1
    assert get(cmd="resume")["ok"] is False and "not paused" in get(cmd="resume")["error"]
    assert get(cmd="restart", mode="sideways")["ok"] is False
    assert get(cmd="restart", mode="graceful")["result"]["accepted"] == "restart"
    # graceful: the worker checkpointed and stopped by itself, no incident, no backoff
    assert stop_reason(run_dir, 1) == "terminated"
    assert get(cmd="restart", mode="now")["ok"] is True
    listing = get(cmd="incidents")["result"]
    assert [(i["id"], i["kind"], i["attempt"]) for i in listing] == [("0001", "manual", 2)]
    full = get(cmd="incidents", id="0001")["result"]
    assert full["kind"] == "manual" and full["deadline"] is None and full["attempt"] == 2
    assert full["stuck_frame"]["file"].endswith("hbworker.py") and full["main_stack"][-1]["function"] == "<module>"
    assert "no incident '0042'" in get(cmd="incidents", id="0042")["error"]
    assert get(cmd="pause")["result"]["accepted"] == "pause"
    assert [r for q, r in control.replies if q == {"cmd": "status"}][1]["result"]["state"] == "paused"
    assert stop_reason(run_dir, 3) == "terminated"
    assert get(cmd="stop")["result"]["accepted"] == "stop"
    assert sup.lifecycle.state.value == "stopped" and sup.attempt == 4 and sup.context.facts.restarts == 3
    assert control.closed
    kinds = [c[0] for c in notifier.calls]
    assert kinds.count("ready") == 1 and kinds.count("stopping") >= 1 and kinds.count("watchdog") > 10
    assert any(c[0] == "status" and "attempt 2" in c[1] for c in notifier.calls)
    assert not wait_no_strays(str(run_dir))
    assert strays(str(run_dir)) == []


def _cli(*args):
    return subprocess.run([PY, "-m", "hangwatch.supervisor", *args], capture_output=True, text=True, timeout=60)


def test_a_pause_survives_a_sigkilled_supervisor(tmp_path):
    """Paused, the supervisor is SIGKILLed and started again: it stays paused (no worker) until `resume`."""
    cfg_path, run_dir = write_config(tmp_path, "ok", *LONG)
    first = start_supervisor(cfg_path)
    try:
        wait_for(running_with_steps(run_dir), 20, "steps")
        assert _cli("pause", "--run-dir", str(run_dir)).returncode == 0
        wait_for(lambda: state(run_dir)["state"] == "paused", 30, "paused")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    second = start_supervisor(cfg_path)
    try:
        wait_for(lambda: _cli("status", "--run-dir", str(run_dir), "--json").returncode == 0, 20, "the new supervisor")
        time.sleep(1.0)  # a supervisor that ignored the pause would have spawned attempt 2 by now
        st = json.loads(_cli("status", "--run-dir", str(run_dir), "--json").stdout)
        assert st["state"] == "paused" and [p.name for p in attempts(run_dir)] == ["0001"]
        assert _cli("resume", "--run-dir", str(run_dir)).returncode == 0
        wait_for(running_with_steps(run_dir, 2), 20, "attempt 2 stepping after resume")
        assert _cli("stop", "--run-dir", str(run_dir)).returncode == 0
        assert second.wait(timeout=30) == 0
    finally:
        if second.poll() is None:
            second.kill()
            second.wait()
