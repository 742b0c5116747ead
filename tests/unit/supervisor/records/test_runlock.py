"""One supervisor per run dir: the flock, its holder's pid, and its release on death."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

import pytest

from hangwatch.supervisor.records.runlock import (
    LOCK_NAME,
    RunDirBusy,
    RunLock,
    holder,
    holder_record,
    parse_record,
)


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


# ---- the holder's record: whom a refusal names --------------------------------------------------------------------


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_refusal_names_the_holders_pid_start_and_command(tmp_path):
    run = tmp_path / "run"
    with RunLock.acquire(run, command="hangwatch run configs/demo.yaml"):
        with pytest.raises(RunDirBusy) as err:
            RunLock.acquire(run)
    started = time.strftime("%Y-%m-%d %H:%M", time.localtime())  # to the minute: the second may have turned
    message = str(err.value)
    assert message.startswith(f"another hangwatch (pid {os.getpid()}) is supervising {run} (started {started}")
    assert message.endswith(
        f": hangwatch run configs/demo.yaml); stop it first (hangwatch stop --run-dir {run}) or use another run dir"
    )
    assert err.value.record["command"] == "hangwatch run configs/demo.yaml" and "\n" not in message


def test_the_record_is_in_the_lock_file_from_the_first_moment_and_gone_once_released(tmp_path):
    run = tmp_path / "run"
    lock = RunLock.acquire(run)
    record = parse_record((run / LOCK_NAME).read_bytes())
    assert record["pid"] == os.getpid() and abs(record["started"] - time.time()) < 60
    assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]  # the file it was made as is gone
    lock.release()
    assert (run / LOCK_NAME).read_bytes() == b""  # a lock let go names nobody
    assert holder(run) is None


def test_a_stale_lock_file_is_taken_over_and_rewritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    gone = dead_pid()
    (run / LOCK_NAME).write_text(json.dumps({"pid": gone, "started": 1.0, "command": "an old one, much longer " * 9}))
    with RunLock.acquire(run):
        assert parse_record((run / LOCK_NAME).read_bytes())["pid"] == os.getpid()
        assert holder(run) == os.getpid()
        assert (run / LOCK_NAME).read_bytes().count(b"\n") == 1  # the longer old record cut off


def test_a_newcomer_waits_out_the_instant_a_new_holder_has_not_written_its_record(tmp_path):
    """Taking over an existing file: locked first, written after.  Meanwhile the file names the previous holder,
    who is gone, or nobody; the refusal waits for the holder's own record rather than name either."""
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"pid": 111}))  # the previous holder's record
    written = iter([lambda: path.write_text(""), lambda: path.write_text(json.dumps({"pid": 222, "command": "x"}))])

    def sleep(_s):
        next(written)()

    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the new holder has it
    try:
        rec = holder_record(path, wait_s=60, alive=lambda pid: pid == 222, sleep=sleep)
    finally:
        os.close(fd)
    assert rec == {"pid": 222, "command": "x"}


def test_a_record_that_never_names_a_live_process_is_named_as_such(tmp_path):
    path = tmp_path / LOCK_NAME
    gone = dead_pid()
    path.write_text(f"{gone}\n")  # what earlier versions wrote: the pid alone
    fd = os.open(path, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # held by a process its holder started (it inherited the descriptor)
    try:
        rec = holder_record(path, wait_s=0.05)
    finally:
        os.close(fd)
    assert rec == {"pid": gone, "gone": True}
    assert f"(pid {gone}, which is gone: a process it started holds the lock)" in str(RunDirBusy(tmp_path, gone, rec))
    assert "(a supervisor whose lock file names no pid)" in str(RunDirBusy(tmp_path, None, {}))


@pytest.mark.parametrize(
    "data,record",
    [
        (b"", None),
        (b"4242\n", {"pid": 4242}),
        (b'{"pid": 7, "started": 1.5, "command": "hangwatch run a.yaml"}\n', None),
        (b'{"pid": 7, "star', None),  # half a write
        (b'{"pid": 0}\n', None),
        (b'{"pid": "7"}\n', None),
    ],
)
def test_parse_record(data, record):
    if data.startswith(b'{"pid": 7, "started"'):
        record = json.loads(data)
    assert parse_record(data) == record


def test_the_command_is_said_as_typed(tmp_path):
    (tmp_path / "tool.py").write_text(
        "from hangwatch.supervisor.records.runlock import command_line\nprint(command_line())\n"
    )

    def said(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.strip()

    assert said(sys.executable, str(tmp_path / "tool.py"), "run", "a b.yaml") == "tool.py run 'a b.yaml'"
    assert said(sys.executable, "-m", "tool", "run", "a.yaml") == "python -m tool run a.yaml"
