"""`FileEvents` on a real directory: which heartbeat files grew, read by the caller only when its selector
says so (no thread), through watchdog's inotify binding.  inotify queues an event inside the write(2)
that causes it, so "nothing was queued" is checked right after the write, without waiting; `select`'s
timeout below is a guard against a hang, never a measurement.  Behaviour only."""

from __future__ import annotations

import ctypes
import errno
import os
import select
import threading
from pathlib import Path

import pytest

from hangwatch.supervisor.watch import beat_files
from hangwatch.supervisor.watch.beat_files import FileEvents

GUARD_S = 30.0  # how long an event that must come may take before the test fails rather than hangs


@pytest.fixture
def events():
    ev, why = FileEvents.open()
    if ev is None:
        pytest.skip(f"no inotify here: {why}")
    yield ev
    ev.close()


def readable(ev: FileEvents, timeout: float = GUARD_S) -> bool:
    ready, _w, _x = select.select([ev.fileno()], [], [], timeout)
    return bool(ready)


def append(path: Path, data: bytes = b'{"v":1}\n') -> None:
    with open(path, "ab") as f:
        f.write(data)


def beat(directory: Path, rank: int) -> Path:
    return directory / f"heartbeat-rank{rank}.jsonl"


def test_a_write_to_a_watched_heartbeat_file_is_reported_once_the_descriptor_is_readable(events, tmp_path):
    for rank in (0, 1):
        beat(tmp_path, rank).touch()
    assert events.watch(tmp_path) and events.watching
    assert events.take() is None  # a new watch: everything is read once
    append(beat(tmp_path, 1))
    assert readable(events)
    assert events.take() == {"heartbeat-rank1.jsonl"}
    assert events.take() == set()


def test_a_new_heartbeat_file_is_reported_and_then_its_writes(events, tmp_path):
    events.watch(tmp_path)
    events.take()
    append(beat(tmp_path, 3))
    assert readable(events)
    assert events.drain()
    assert events.take() == {"heartbeat-rank3.jsonl"}
    append(beat(tmp_path, 3))  # watched by itself now
    assert readable(events)
    assert events.take() == {"heartbeat-rank3.jsonl"}


def test_a_file_renamed_into_place_is_reported(events, tmp_path):
    events.watch(tmp_path)
    events.take()
    tmp = tmp_path / "staging.tmp"
    append(tmp)
    os.rename(tmp, beat(tmp_path, 2))
    assert readable(events)
    assert events.take() == {"heartbeat-rank2.jsonl"}


def test_other_files_in_the_directory_report_nothing(events, tmp_path):
    events.watch(tmp_path)
    events.take()
    (tmp_path / "worker.log").write_text("chatty\n" * 10)
    append(tmp_path / "heartbeat-rankX.jsonl")
    assert not events.drain()
    assert events.take() == set()


def test_with_nothing_pending_drain_does_not_block_and_take_is_empty(events, tmp_path):
    assert not os.get_blocking(events.fileno())  # before any read: a blocking one would hang this test
    beat(tmp_path, 0).touch()
    events.watch(tmp_path)
    assert not readable(events, 0)
    out = []
    t = threading.Thread(target=lambda: out.append((events.take(), events.drain(), events.take())), daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive(), "drain() waited for an event"
    assert out == [(None, False, set())]


def test_switching_directories_drops_the_old_watch(events, tmp_path):
    old, new = tmp_path / "attempt-1", tmp_path / "attempt-2"
    old.mkdir()
    new.mkdir()
    beat(old, 0).touch()
    beat(new, 0).touch()
    events.watch(old)
    events.take()
    assert events.watch(new)
    assert not events.watch(new)  # the same directory again: no change
    assert events.directory == new
    assert events.take() is None  # the new watch: read everything once
    append(beat(old, 0))
    append(beat(old, 5))
    assert not events.drain()
    assert events.take() == set()
    append(beat(new, 0))
    assert readable(events)
    assert events.take() == {"heartbeat-rank0.jsonl"}
    assert events.watch(None) and not events.watching
    append(beat(new, 0))
    assert not events.drain()


def test_a_removed_directory_is_no_longer_watched(events, tmp_path):
    attempt = tmp_path / "attempt-1"
    attempt.mkdir()
    beat(attempt, 0).touch()
    events.watch(attempt)
    events.take()
    beat(attempt, 0).unlink()
    attempt.rmdir()
    for _ in range(10):  # IN_DELETE_SELF, then IN_IGNORED for each watch
        if not events.watching or not readable(events):
            break
        events.drain()
    assert not events.watching


def test_a_directory_that_cannot_be_watched_leaves_nothing_watched(events, tmp_path):
    assert events.watch(tmp_path / "missing")
    assert not events.watching


def test_lost_events_mean_read_everything(events, tmp_path):
    limit_file = Path("/proc/sys/fs/inotify/max_queued_events")
    try:
        limit = int(limit_file.read_text())
    except (OSError, ValueError):
        pytest.skip("the inotify queue length is not known")
    if limit > 100_000:
        pytest.skip(f"max_queued_events is {limit}: too many writes to overflow it here")
    events.watch(tmp_path)
    events.take()
    fds = [os.open(beat(tmp_path, r), os.O_WRONLY | os.O_CREAT | os.O_APPEND) for r in (0, 1)]
    try:
        events.drain()  # the two creations: both files are watched now
        for i in range(limit + 10):  # alternating files: the kernel cannot merge consecutive events
            os.write(fds[i % 2], b"x")
    finally:
        for fd in fds:
            os.close(fd)
    assert events.drain()
    assert events.take() is None
    assert events.take() == set()


def test_out_of_watches_for_files_the_directory_watch_reports_their_writes(events, tmp_path, monkeypatch):
    """inotify_add_watch fails with ENOSPC for a file: the directory watch reports writes, by name."""
    real = beat_files._inotify()

    class NoFileWatches:
        InotifyConstants = real.InotifyConstants
        inotify_rm_watch = staticmethod(real.inotify_rm_watch)

        @staticmethod
        def inotify_add_watch(fd, path, mask):
            if os.path.basename(path).startswith(b"heartbeat-rank"):
                ctypes.set_errno(errno.ENOSPC)
                return -1
            return real.inotify_add_watch(fd, path, mask)

    monkeypatch.setattr(beat_files, "_inotify_c", NoFileWatches)
    beat(tmp_path, 0).touch()
    events.watch(tmp_path)
    assert events.watching
    events.take()
    (tmp_path / "worker.log").write_text("chatty\n")
    append(beat(tmp_path, 0))
    assert readable(events)
    assert events.take() == {"heartbeat-rank0.jsonl"}


def test_without_inotify_open_says_why(monkeypatch):
    def missing():
        raise ImportError("watchdog: unsupported libc")

    monkeypatch.setattr(beat_files, "_inotify", missing)
    ev, why = FileEvents.open()
    assert ev is None and "no inotify" in why


def test_the_descriptor_is_not_inherited(events):
    assert not os.get_inheritable(events.fileno())


def test_close_releases_the_descriptor(tmp_path):
    ev, why = FileEvents.open()
    if ev is None:
        pytest.skip(f"no inotify here: {why}")
    ev.watch(tmp_path)
    fd = ev.fileno()
    os.fstat(fd)
    ev.close()
    assert ev.fileno() == -1 and not ev.watching and ev.directory is None
    with pytest.raises(OSError) as exc:
        os.fstat(fd)
    assert exc.value.errno == errno.EBADF
    ev.close()  # twice: nothing happens
