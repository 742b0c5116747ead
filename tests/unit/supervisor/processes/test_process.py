"""The process-table seam, a dead supervisor's leftovers (on a fake table), the wake-up and the state record."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fixtures.fakes.fake_supervisor import FakeClock, FakeProcessTable

from hangwatch.supervisor.loop.wakeup import Wakeup
from hangwatch.supervisor.processes import leftovers
from hangwatch.supervisor.processes.process import ProcRef, PsutilProcessTable, decode_status
from hangwatch.supervisor.records import run_state


def test_the_real_table_checks_identity_by_start_time():
    sent = []
    table = PsutilProcessTable(kill=lambda pid, sig: sent.append((pid, sig)))
    me = table.ref_of(os.getpid())
    assert me is not None and table.matches(me) and not table.is_gone(me)
    assert table.session_id(os.getpid()) == os.getsid(0) and table.describe(me)["pid"] == os.getpid()
    impostor = ProcRef(me.pid, me.create_time - 100)  # the pid, reused by someone else long after
    assert table.is_gone(impostor) and not table.signal(impostor, signal.SIGTERM)
    assert table.signal(me, 0) and table.signal_group(12345, 0) and sent == [(me.pid, 0), (-12345, 0)]
    assert table.reap(os.getpid()) is None  # not our child: nothing to reap, never an error


@pytest.mark.parametrize(
    "status, decoded", [(3 << 8, (3, None)), (0, (0, None)), (signal.SIGKILL, (None, signal.SIGKILL))]
)
def test_decode_status(status, decoded):
    assert tuple(decode_status(status)) == decoded


def _state(worker, pids=(), descendants=(), updated=2.0e9):
    return {
        "worker": {"pid": worker.pid, "pgid": worker.pgid, "sid": worker.sid, "create_time": worker.create_time},
        "pids": {str(i): {"pid": p.pid, "create_time": p.create_time} for i, p in enumerate(pids)},
        "descendants": [{"pid": p.pid, "create_time": p.create_time} for p in descendants],
        "updated_wall": updated,
    }


def test_leftovers_of_a_live_tree_are_the_group_and_the_recorded_pids():
    t = FakeProcessTable()
    w = t.add(ppid=1)
    member = t.add(ppid=w.pid, pgid=w.pid, sid=w.pid)
    escaped = t.add(ppid=1)  # left the group; recorded as a descendant
    refs, group, notes = leftovers.find(_state(w, descendants=[escaped]), t)
    assert {r.pid for r in refs} == {w.pid, member.pid, escaped.pid} and group == w.pid and notes == []


def test_leftovers_after_the_leader_died_are_members_of_its_session_and_time_only():
    t = FakeProcessTable()
    w = t.add(ppid=1)
    w.status = (None, 9)
    w.reaped = True  # gone
    old = t.add(ppid=1, pgid=w.pid, sid=w.pid)
    late = t.add(ppid=1, pgid=w.pid, sid=w.pid)
    late.create_time = 2.0e9 + 100  # started after the dead supervisor's last state update
    refs, group, notes = leftovers.find(_state(w), t)
    assert [r.pid for r in refs] == [old.pid] and group is None
    assert notes == [f"pid {late.pid} in process group {w.pid} started after the old tree: left alone"]


def test_a_reused_pid_is_left_alone():
    t = FakeProcessTable()
    w = t.add(ppid=1)
    st = _state(w)
    st["worker"]["create_time"] -= 1000
    st["worker"]["pgid"] = st["worker"]["sid"] = 99999
    refs, group, notes = leftovers.find(st, t)
    assert refs == [] and group is None and "now belongs to another process" in notes[0]


def test_ending_leftovers_sigkills_what_sigterm_did_not_end():
    t = FakeProcessTable()
    polite, stubborn = t.add(ppid=1, term="die"), t.add(ppid=1, term="ignore")
    clock = FakeClock(0.0)
    refs = [ProcRef(p.pid, p.create_time) for p in (polite, stubborn)]
    survivors = leftovers.end(refs, None, t, grace_s=2, clock=clock, sleep=lambda s: setattr(clock, "t", clock.t + s))
    assert survivors == [] and t.signals() == ["SIGTERM", "SIGTERM", "SIGKILL"] and t.sent[-1][0] == stubborn.pid
    assert clock.t == pytest.approx(2.0, abs=0.06)  # waited the grace for the stubborn one, not longer


def test_a_live_supervisor_on_the_run_dir_refuses_the_second(tmp_path):
    t = FakeProcessTable()
    other = t.add(ppid=1)
    why = leftovers.clear(
        {"supervisor": {"pid": other.pid, "create_time": other.create_time}},
        t,
        state_path=tmp_path / "state.json",
        grace_s=1,
    )
    assert f"another supervisor (pid {other.pid}) is running" in why
    assert (
        leftovers.clear({"supervisor": {"pid": other.pid, "create_time": 1.0}}, t, state_path=tmp_path / "s", grace_s=1)
        is None
    )


def test_signals_are_recorded_in_order_and_wake_the_wait(tmp_path):
    w = Wakeup(install_signals=False)
    w.record(signal.SIGHUP)
    w.record(signal.SIGTERM)
    assert w.drain() == [signal.SIGHUP, signal.SIGTERM] and w.drain() == []
    w.wait(10.0)  # not opened: returns at once
    w.open(tmp_path)
    try:
        threading.Timer(0.1, lambda: (tmp_path / "heartbeat-rank0.jsonl").write_text("x\n")).start()
        t0 = time.monotonic()
        w.wait(5.0)  # woken by the file event, long before the timeout
        assert time.monotonic() - t0 < 3.0
    finally:
        w.close()


def test_the_state_record_drops_pids_once_the_tree_is_gone():
    facts = run_state.RunRecord(restarts=2, last_good_checkpoint="ckpt-4", last_good_step=4)
    common = dict(
        state="backoff",
        final=False,
        supervisor=None,
        worker=None,
        announced={0: ProcRef(5, 1.0)},
        descendants=[ProcRef(6, 2.0)],
        attempt=3,
        incidents=1,
        socket="/s",
        run_dir="/r",
        exit_code=0,
        wall=7.0,
        restarts=facts.restarts,
        last_good_checkpoint=facts.last_good_checkpoint,
        last_good_step=facts.last_good_step,
        last_incident=None,
        torn_lines=0,
    )
    gone = run_state.record(tree_gone=True, **common)
    assert gone["pids"] == {} and gone["descendants"] == [] and gone["exit_code"] is None and gone["restarts"] == 2
    live = run_state.record(tree_gone=False, **common)
    assert live["pids"] == {"0": {"pid": 5, "create_time": 1.0}} and live["supervisor"] == {"pid": os.getpid()}
    assert run_state.RunRecord.from_previous(gone).last_good_checkpoint == "ckpt-4"


def test_py_spy_is_found_next_to_the_interpreter_before_path(tmp_path):
    from hangwatch.supervisor.escalation.dump_collector import find_py_spy

    venv_bin, other = tmp_path / "venv" / "bin", tmp_path / "elsewhere"
    venv_bin.mkdir(parents=True)
    other.mkdir()
    for d in (venv_bin, other):
        exe = d / "py-spy"
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    assert find_py_spy(str(venv_bin / "python"), path=str(other)) == str(venv_bin / "py-spy")
    (venv_bin / "py-spy").unlink()
    assert find_py_spy(str(venv_bin / "python"), path=str(other)) == str(other / "py-spy")
    assert find_py_spy(str(venv_bin / "python"), path=str(tmp_path)) is None


def test_the_built_in_worker_runs_under_torchrun_with_more_than_one_rank(tmp_path):
    import sys as _sys

    from hangwatch.common.config import Config
    from hangwatch.supervisor.processes.attempt import worker_argv

    base = {"run_dir": str(tmp_path / "run"), "data": {"train": str(tmp_path / "t.jsonl")}}
    one = worker_argv(Config.model_validate(base), tmp_path / "run" / "config.yaml")
    assert one[:3] == [_sys.executable, "-m", "hangwatch.daemon"]
    two = worker_argv(
        Config.model_validate({**base, "worker": {"nproc_per_node": 2}}), tmp_path / "run" / "config.yaml"
    )
    assert two[:7] == [_sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    assert two[7:] == one[2:]


def test_descendants_and_own_children_come_from_one_listing_of_every_parent():
    listings = []

    def parents():
        listings.append(1)
        me = os.getpid()
        return {10: me, 11: 10, 12: 11, 13: 10, 20: me, 21: 20, 30: 1, 31: 30}

    clock = FakeClock(5.0)
    table = PsutilProcessTable(clock=clock, parents=parents)
    table.create_time = lambda pid: 1000.0 + pid  # the fake pids have no /proc entry
    assert sorted(r.pid for r in table.descendants(10)) == [11, 12, 13]
    assert sorted(r.pid for r in table.own_children(exclude={20})) == [10]
    assert table.descendants(31) == [] and len(listings) == 1  # one scan, one listing
    clock.t += 1.0
    assert sorted(r.pid for r in table.descendants(30)) == [31] and len(listings) == 2  # a later pass lists again
