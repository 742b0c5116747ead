"""A process blocked reading its terminal (`processes/terminal_wait.py`), told from the kernel's word on real
processes: input() on a pty (select through readline), a raw read of a pty, a read of a pipe and a sleep (not a
terminal), and /proc files that cannot be read (the evidence cannot tell: None)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time

import pytest

from hangwatch.supervisor.processes.terminal_wait import first_reading, reading_terminal, waited_fds


def settled(p: subprocess.Popen, probe, want_none: bool = False, timeout: float = 10.0):
    """The probe's answer once the child has reached its blocking call."""
    end = time.monotonic() + timeout
    got = probe(p.pid)
    while (got is None) != want_none and time.monotonic() < end:
        time.sleep(0.05)
        got = probe(p.pid)
    return got


@pytest.mark.parametrize(
    "code",
    [
        "input('name? ')",  # Python's input() on a terminal waits in select() (readline)
        "import os; os.read(0, 10)",  # a plain read(2) of stdin
        "import sys; sys.stdin.readline()",
    ],
)
def test_a_process_blocked_reading_its_terminal_is_seen(code):
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    try:
        device = settled(p, reading_terminal)
        assert device == os.ttyname(slave)
        assert first_reading([os.getpid(), p.pid]) == {"pid": p.pid, "terminal": device}
    finally:
        p.kill()
        p.wait()
        os.close(master)
        os.close(slave)


def test_a_pipe_read_and_a_sleep_are_not_a_prompt():
    r, w = os.pipe()
    reader = subprocess.Popen([sys.executable, "-c", "import os; os.read(0, 10)"], stdin=r)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.DEVNULL)
    try:
        assert settled(reader, waited_fds) == [0]  # it does wait on fd 0 …
        assert reading_terminal(reader.pid) is None  # … which is a pipe
        time.sleep(0.3)
        assert reading_terminal(sleeper.pid) is None
    finally:
        for p in (reader, sleeper):
            p.kill()
            p.wait()
        os.close(r)
        os.close(w)


def test_what_cannot_be_read_answers_none(tmp_path):
    fake = tmp_path / "proc" / "123"
    fake.mkdir(parents=True)
    (fake / "syscall").write_text("running\n")
    assert reading_terminal(123, proc=str(tmp_path / "proc")) is None
    (fake / "syscall").write_text("0 0x0 0x7f 0x1 0x0 0x0 0x0 0x7ff 0x7fe\n")  # read(0, …), fd 0 not listed
    assert reading_terminal(123, proc=str(tmp_path / "proc"), machine="x86_64") is None
    (fake / "fd").mkdir()
    os.symlink("/dev/pts/9", fake / "fd" / "0")
    assert reading_terminal(123, proc=str(tmp_path / "proc"), machine="x86_64") == "/dev/pts/9"
    assert reading_terminal(123, proc=str(tmp_path / "proc"), machine="riscv64") is None  # a machine not in the table
    assert reading_terminal(999, proc=str(tmp_path / "proc")) is None
