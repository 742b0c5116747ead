"""When the supervisor's loop wakes and what one pass reads: the selector's timeout is the time to the
earliest deadline (long when nothing is due), heartbeat writes wake it through inotify (a burst is one
wake-up and one read of every new line), other files wake nothing, and lines count from when they were
written.  Behaviour only: no assertion on how long anything took."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from fixtures.fakes.fake_supervisor import Harness

from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import encode
from hangwatch.common.rundir import heartbeat_path
from hangwatch.supervisor.loop import supervisor as runner
from hangwatch.supervisor.loop.wakeup import Wakeup
from hangwatch.supervisor.watch.beat_files import FILE_TIME_TICK_S, HeartbeatTail, local_file_times, written_at


def line(rank: int = 0, event: str = "step", step: int = 1, phase: str = "train", **kw) -> bytes:
    return encode(
        {
            "v": 1,
            "t": time.time(),
            "pid": 4242,
            "rank": rank,
            "attempt": 1,
            "event": event,
            "step": step,
            "phase": phase,
            **kw,
        }
    )


def append(directory: Path, rank: int, *lines: bytes) -> Path:
    path = heartbeat_path(directory, rank)
    with open(path, "ab") as f:
        f.write(b"".join(lines))
    return path


# ------------------------------------------------------------------------------------------ the wake-up


@pytest.fixture
def woken(tmp_path):
    w = Wakeup(install_signals=False, min_read_s=0.05)
    w.open()
    if not w.hears_beats and w.events_problem:
        w.close()
        pytest.skip(w.events_problem)
    yield w
    w.close()


def test_a_heartbeat_write_wakes_the_loop_and_a_worker_log_write_does_not(woken, tmp_path):
    assert woken.watch(tmp_path) and woken.hears_beats
    assert woken.grown() is None  # a new watch: read every file once
    (tmp_path / "worker.log").write_text("chatty\n" * 10)
    assert woken.wait(0.2) == "timeout"
    assert woken.grown() == set()
    append(tmp_path, 0, line())
    assert woken.wait(30.0) == "beats"
    assert woken.grown() == {"heartbeat-rank0.jsonl"}


def test_a_burst_of_writes_is_one_wake_up_naming_every_file_that_grew(woken, tmp_path):
    for r in range(4):
        append(tmp_path, r, line(r))
    woken.watch(tmp_path)
    woken.grown()
    woken.pass_done()  # just read: what comes next waits out min_read_s
    for i in range(50):
        for r in range(4):
            append(tmp_path, r, line(r, step=i))
    assert woken.wait(30.0) == "beats"
    assert woken.grown() == {f"heartbeat-rank{r}.jsonl" for r in range(4)}
    assert woken.wait(0.1) == "timeout"  # every event of the burst was taken by that one wake-up


def test_a_new_rank_file_wakes_the_loop_and_is_watched_from_then_on(woken, tmp_path):
    woken.watch(tmp_path)
    woken.grown()
    append(tmp_path, 3, line(3))
    assert woken.wait(30.0) == "beats" and woken.grown() == {"heartbeat-rank3.jsonl"}
    append(tmp_path, 3, line(3, step=2))
    assert woken.wait(30.0) == "beats" and woken.grown() == {"heartbeat-rank3.jsonl"}


def test_signals_and_the_control_socket_wake_the_loop_even_while_reads_are_held_back(tmp_path):
    r, w = os.pipe()
    wake = Wakeup(install_signals=False, min_read_s=30.0)
    wake.open(extra=[r])
    try:
        wake.watch(tmp_path)
        wake.pass_done()
        append(tmp_path, 0, line())
        wake.poke()
        assert wake.wait(60.0) == "signal"
        os.write(w, b"x")
        assert wake.wait(60.0) == "extra"
    finally:
        wake.close()
        os.close(r)
        os.close(w)


def test_watching_the_same_directory_again_changes_nothing_and_none_stops_watching(woken, tmp_path):
    assert woken.watch(tmp_path) is True
    assert woken.watch(tmp_path) is False
    assert woken.watch(None) is True and not woken.hears_beats and woken.grown() is None


# ------------------------------------------------------------------------------------------ the tail


def test_every_new_line_of_every_rank_is_read_in_one_call(tmp_path):
    tail = HeartbeatTail(tmp_path)
    for r in range(8):
        append(tmp_path, r, *(line(r, step=s) for s in range(25)))
    recs = tail.read()
    assert len(recs) == 200 and {(x["rank"], x["step"]) for x in recs} == {(r, s) for r in range(8) for s in range(25)}
    assert tail.read() == []
    half = line(2, step=99)
    append(tmp_path, 2, half[:20])
    assert tail.read() == []  # not a line until its newline comes
    append(tmp_path, 2, half[20:])
    assert [x["step"] for x in tail.read()] == [99]
    assert '"step":99' in tail.tail_text(2)


def test_a_read_limited_to_named_files_leaves_the_others_for_later(tmp_path):
    tail = HeartbeatTail(tmp_path)
    for r in range(3):
        append(tmp_path, r, line(r))
    assert [x["rank"] for x in tail.read({"heartbeat-rank1.jsonl"})] == [1]
    assert sorted(x["rank"] for x in tail.read()) == [0, 2]


def test_a_rank_file_created_later_is_found(tmp_path):
    tail = HeartbeatTail(tmp_path)
    append(tmp_path, 0, line(0))
    assert len(tail.read()) == 1
    append(tmp_path, 5, line(5))
    assert [x["rank"] for x in tail.read()] == [5]
    assert [x["rank"] for x in tail.read({"heartbeat-rank7.jsonl"})] == []  # named but not there yet
    append(tmp_path, 7, line(7))
    assert [x["rank"] for x in tail.read({"heartbeat-rank7.jsonl"})] == [7]


def test_each_line_comes_with_its_files_modification_time(tmp_path):
    tail = HeartbeatTail(tmp_path)
    path = append(tmp_path, 0, line(0), line(0, step=2))
    got = tail.read_timed()
    assert [m for m, _ in got] == [os.stat(path).st_mtime_ns] * 2


@pytest.mark.parametrize(
    "mtime_s, expect",
    [
        (None, 100.0),  # no file time: when it was read
        (995.0, 100.0 - 5.0 + FILE_TIME_TICK_S),  # written 5 s before the read (wall 1000 ↔ reader 100)
        (999.999, 100.0),  # within a tick of the read: never after it
        (2000.0, 100.0),  # a file time in the future: the read
        (900.0, 90.0),  # before the previous read (lo): it was not there then
    ],
)
def test_a_line_counts_from_its_file_time_within_the_reads_that_bound_it(mtime_s, expect):
    mtime_ns = None if mtime_s is None else int(mtime_s * 1e9)
    assert written_at(mtime_ns, wall_now=1000.0, now=100.0, lo=90.0) == pytest.approx(expect)


@pytest.mark.parametrize(
    "fstype, local",
    [("ext4", True), ("tmpfs", True), ("xfs", True), ("nfs4", False), ("fuse.sshfs", False), ("cifs", False)],
)
def test_only_local_file_systems_date_lines_by_their_file_times(tmp_path, fstype, local):
    data = tmp_path / "data"
    data.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        f"22 1 0:21 / / rw - ext4 /dev/vda rw\n"
        f"23 22 0:22 / {tmp_path} rw shared:1 - {fstype} server:/x rw\n"
        f"24 22 0:23 / {tmp_path}x rw - nfs server:/y rw\n"
    )  # a longer name, not a parent
    assert local_file_times(data, str(mountinfo)) is local


# ------------------------------------------------------------------------------------------ the loop


class HeardWakeup:
    """The runner's wake-up with inotify at work: `named` is what the file events said grew."""

    hears_beats = True
    signals_installed = True
    events_problem = None

    def __init__(self):
        self.signals: list[int] = []
        self.named = None

    def record(self, sig: int) -> None:
        self.signals.append(sig)

    def drain(self) -> list[int]:
        out, self.signals = self.signals, []
        return out

    def grown(self):
        return self.named


def harness(tmp_path, **kw) -> Harness:
    h = Harness(tmp_path, **kw)
    h.control.fileno = lambda: 7  # a control server the loop can sleep on
    return h


def sleep(h: Harness, dt: float) -> None:
    """What the loop does between passes: plan its sleep (`next_wait`), then wake `dt` later."""
    h.sup.next_wait(h.clock())
    h.clock.t += dt


def earliest_remaining(h: Harness) -> float:
    return min(d["remaining_s"] for d in h.sup.deadlines.active(h.clock()))


def test_the_loop_sleeps_until_the_earliest_deadline(tmp_path):
    h = harness(tmp_path)
    h.running()
    h.sup.wakeup = HeardWakeup()
    h.sup.run_once(h.clock())
    assert h.sup.next_wait(h.clock()) == pytest.approx(earliest_remaining(h), abs=1e-3)  # the step deadline
    h.clock.t += 0.7
    assert h.sup.next_wait(h.clock()) == pytest.approx(earliest_remaining(h), abs=1e-3)
    assert h.sup.next_wait(h.clock()) < h.sup.watchdog_cfg.step_timeout_s


def test_a_loop_with_nothing_due_sleeps_long(tmp_path):
    h = harness(tmp_path, watchdog={"startup_timeout_s": 3600})
    h.until(lambda: h.spawn.workers)
    h.sup.wakeup = HeardWakeup()
    assert h.sup.next_wait(h.clock()) == runner.IDLE_WAIT_S  # the startup deadline is an hour away
    h.request(cmd="pause")
    h.until(lambda: h.state == "paused")
    assert h.sup.next_wait(h.clock()) == runner.IDLE_WAIT_S


def test_a_notifier_that_wants_calling_shortens_the_sleep(tmp_path):
    h = harness(tmp_path, watchdog={"startup_timeout_s": 3600})
    h.until(lambda: h.spawn.workers)
    h.sup.wakeup = HeardWakeup()
    h.sup.outward.notifier = type(
        "Pinger", (), {"next_due_s": lambda self, now: 1.5, "watchdog": lambda self, now=None: None}
    )()
    assert h.sup.next_wait(h.clock()) == 1.5


def test_without_file_events_or_a_control_descriptor_the_loop_polls(tmp_path):
    h = harness(tmp_path, watchdog={"startup_timeout_s": 3600})
    h.until(lambda: h.spawn.workers)
    deaf = HeardWakeup()
    deaf.hears_beats = False
    h.sup.wakeup = deaf
    assert h.sup.next_wait(h.clock()) == h.sup.watchdog_cfg.poll_interval_s  # heartbeat files read on a timer
    plain = Harness(tmp_path / "plain", watchdog={"startup_timeout_s": 3600})  # its control has no descriptor
    plain.until(lambda: plain.spawn.workers)
    plain.sup.wakeup = HeardWakeup()
    assert plain.sup.next_wait(plain.clock()) == plain.sup.watchdog_cfg.poll_interval_s


def test_a_burst_of_lines_from_every_rank_is_read_in_one_pass(tmp_path):
    h = harness(tmp_path)
    w = h.running()
    h.sup.wakeup = HeardWakeup()
    for r in range(1, 8):
        append(w.dir, r, line(r, "start", 0, dump_signal=None, dump_path=None))
    for r in range(8):
        append(w.dir, r, *(line(r, step=s) for s in range(3, 13)))
    h.sup.run_once(h.clock())
    assert {r: t.step for r, t in h.sup.deadlines.ranks.items()} == {r: 12 for r in range(8)}


def test_a_deadline_is_believed_only_after_every_file_was_read(tmp_path):
    h = harness(tmp_path)
    w = h.running()
    heard = h.sup.wakeup = HeardWakeup()
    heard.named = set()  # the events have told of nothing (yet)
    sleep(h, h.sup.watchdog_cfg.step_timeout_s + 0.5)
    assert h.sup.deadlines.check(h.clock()) is not None
    w.step()  # written, but not among the files the events named
    h.sup.run_once(h.clock())
    assert h.state == "running" and h.incident_kinds() == []
    assert h.sup.deadlines.ranks[0].step == w.step_no


def test_a_child_exit_is_noticed_when_sigchld_says_so(tmp_path):
    h = harness(tmp_path)
    w = h.running()
    heard = h.sup.wakeup = HeardWakeup()
    h.sup.run_once(h.clock())
    first = h.sup.current.worker
    h.table.end(w.pid, code=1)
    sleep(h, 0.1)
    h.sup.run_once(h.clock())
    assert not first.exited  # no SIGCHLD yet, and reaped a moment ago
    heard.record(signal.SIGCHLD)
    sleep(h, 0.1)
    h.sup.run_once(h.clock())
    assert first.exit_code == 1


def test_lines_count_from_their_file_times_within_the_reads_that_bound_them(tmp_path):
    h = harness(tmp_path)
    w = h.running()
    h.sup.wakeup = HeardWakeup()
    h.sup.seams.file_times = True  # the fake clock is not the wall clock: dates are pinned to the bounds below
    h.sup.run_once(h.clock())
    before = h.clock()
    sleep(h, 1.0)
    w.step()
    path = heartbeat_path(w.dir, 0)
    os.utime(path, (time.time() - 1000, time.time() - 1000))  # long before the previous read
    h.sup.run_once(h.clock())
    assert h.sup.deadlines.ranks[0].last_line_at == before  # not before the previous read
    sleep(h, 1.0)
    w.step()
    os.utime(path, (time.time() + 1000, time.time() + 1000))  # "in the future"
    h.sup.run_once(h.clock())
    assert h.sup.deadlines.ranks[0].last_line_at == h.clock()  # not after this read


def test_a_suspension_dates_its_lines_by_the_read(tmp_path):
    h = harness(tmp_path)
    w = h.running()
    h.sup.wakeup = HeardWakeup()
    h.sup.seams.file_times = True
    h.sup.run_once(h.clock())
    h.clock.t += 30.0  # the supervisor was stopped
    w.step()
    os.utime(heartbeat_path(w.dir, 0), (time.time() - 1000, time.time() - 1000))
    h.sup.run_once(h.clock())
    assert h.sup.deadlines.ranks[0].last_line_at == h.clock() and h.state == "running"


def test_calibration_samples_are_saved_now_and_then_not_every_pass(tmp_path):
    writes = []

    class CountingFs(FsOps):
        def write_json(self, path, data, durable=True):
            writes.append(Path(path).name)
            super().write_json(path, data, durable)

    h = Harness(tmp_path, fs=CountingFs())
    w = h.running()
    for _ in range(1400):
        w.step()
        h.tick(0.05)  # 70 s of steps, a pass after each
    assert 0 < writes.count("calibration.json") <= 70 // runner.CALIBRATION_SAVE_S + 1
