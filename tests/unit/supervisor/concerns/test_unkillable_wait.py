"""A worker whose tree outlives SIGKILL (uninterruptible sleep), on the fake supervisor: an `unkillable` incident
naming each survivor, its state and kernel wait channel; no second attempt on top of it; `wait` restarts once the
survivors are gone, `fail` ends the run failed; an operator's stop does not wait for them.  And the wait channel
read from /proc."""

from __future__ import annotations

import signal

from fixtures.fakes.fake_supervisor import Harness

from hangwatch.supervisor.processes.process import kernel_wait

WD = {"kill_wait_s": 3, "step_timeout_s": 2}


def _stuck_in_d(h: Harness):
    """Attempt 1 steps, then stalls; its child (which left the group) cannot be killed."""
    w = h.running(steps=3)
    child = h.table.add(ppid=w.pid, term="ignore", survives_kill=True)
    h.table.describe = lambda ref: {"pid": ref.pid, "state": "disk-sleep", "wchan": "nfs_wait_bit_killable"}
    return w, child


def test_wait_mode_starts_nothing_on_top_of_a_survivor_and_restarts_once_it_is_gone(tmp_path):
    h = Harness(tmp_path, watchdog=WD, restart={"on_unkillable": "wait", "backoff_initial_s": 0})
    w, child = _stuck_in_d(h)
    h.until(lambda: "unkillable" in h.incident_kinds(), within_s=30)
    inc = next(h.sup.incidents.get(i["id"]) for i in h.sup.incidents.list() if i["kind"] == "unkillable")
    assert [s["pid"] for s in inc["survivors"]] == [child.pid]
    assert inc["survivors"][0]["state"] == "disk-sleep" and inc["survivors"][0]["wchan"] == "nfs_wait_bit_killable"
    assert "a reboot or a GPU reset may be needed" in inc["summary"] and inc["status"] == "waiting"
    assert inc["failure_kind"] == "stall"
    # an hour of fake time later the survivor is still there: still one attempt, still killing, no storm of passes
    passes = 0
    t0 = h.clock()
    while h.clock() - t0 < 3600:
        h.tick()
        passes += 1
    assert len(h.spawn.workers) == 1 and h.state == "killing"
    assert passes <= 3700  # once a second, not ten times
    assert h.table.sent.count((child.pid, signal.SIGKILL)) == 1
    # it goes: the run restarts
    h.table.end(child.pid, sig=signal.SIGKILL)
    h.until(lambda: len(h.spawn.workers) == 2, within_s=10)
    inc = h.sup.incidents.get(inc["id"])
    assert inc["status"] == "final" and inc["gone_after_s"] >= 3600


def test_fail_mode_ends_the_run_failed(tmp_path):
    h = Harness(tmp_path, watchdog=WD, restart={"on_unkillable": "fail"})
    _stuck_in_d(h)
    h.until(lambda: h.state == "failed", within_s=30)
    assert h.sup.exit_code == 1 and len(h.spawn.workers) == 1
    assert sorted(h.incident_kinds()) == ["stall", "unkillable"]


def test_an_operator_stop_does_not_wait_for_survivors(tmp_path):
    h = Harness(tmp_path, watchdog=WD, restart={"on_unkillable": "wait"})
    _, child = _stuck_in_d(h)
    h.until(lambda: "unkillable" in h.incident_kinds(), within_s=30)
    h.request(cmd="stop")
    h.until(lambda: h.state == "stopped", within_s=10)
    inc = next(h.sup.incidents.get(i["id"]) for i in h.sup.incidents.list() if i["kind"] == "unkillable")
    assert inc["still_there"] == [child.pid] and len(h.spawn.workers) == 1


def test_kernel_wait_reads_wchan_and_says_why_the_stack_is_not_there(tmp_path):
    d = tmp_path / "proc" / "42"
    d.mkdir(parents=True)
    (d / "wchan").write_text("nfs_wait_bit_killable")
    got = kernel_wait(42, proc=str(tmp_path / "proc"))
    assert got["wchan"] == "nfs_wait_bit_killable" and "kernel_stack_unreadable" in got
    (d / "wchan").write_text("0")  # a running process: no wait channel
    (d / "stack").write_text("[<0>] do_nanosleep+0x6d/0x100\n")
    got = kernel_wait(42, proc=str(tmp_path / "proc"))
    assert got["wchan"] is None and got["kernel_stack"].startswith("[<0>] do_nanosleep")
