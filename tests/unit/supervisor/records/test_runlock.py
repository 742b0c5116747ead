"""One supervisor per run dir: the flock, its holder's pid, and its release on death."""

from __future__ import annotations

import fcntl
import os

import pytest

from hangwatch.supervisor.records.runlock import RunDirBusy, RunLock, holder


def test_a_second_lock_on_the_same_run_dir_is_refused_with_the_holders_pid(tmp_path):
    first = RunLock.acquire(tmp_path / "run")
    assert holder(tmp_path / "run") == os.getpid()
    with pytest.raises(RunDirBusy) as err:
        RunLock.acquire(tmp_path / "run")  # flock is per open file: a second open conflicts, same process or not
    assert err.value.holder == os.getpid()
    assert f"pid {os.getpid()}" in str(err.value) and "hangwatch stop --run-dir" in str(err.value)
    first.release()
    assert holder(tmp_path / "run") is None
    with RunLock.acquire(tmp_path / "run") as again:
        assert again.held
    assert not again.held


def test_workers_do_not_inherit_the_lock(tmp_path):
    lock = RunLock.acquire(tmp_path)
    assert fcntl.fcntl(lock._fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    lock.release()
