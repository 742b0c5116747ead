"""The relay (`processes/streams.py`) with real processes, real pipes and real pseudo-terminals: each of the
command's streams reaches hangwatch's stream of the same name byte for byte, both land in worker.log, a terminal
exactly where hangwatch has one, the window size passed on and followed, hangwatch's own lines never inside the
command's, a reader that went away felt by the command as it would be bare."""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import struct
import sys
import termios
import time
from pathlib import Path

import pytest

from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes.streams import Relay, hangup_is_the_terminals

CHILD = r"""
import os, sys, time
sys.stdout.write("OUT\rbar\x1b[1m"); sys.stdout.flush()
sys.stderr.write("ERR half"); sys.stderr.flush()
time.sleep(0.05)
sys.stdout.write(" line\n"); sys.stdout.flush()
sys.stderr.write(" done\n"); sys.stderr.flush()
size = os.get_terminal_size(1) if os.isatty(1) else None
# one write (print() writes its parts one by one where stdout is unbuffered): the line arrives whole in either order
sys.stdout.write(f"tty {os.isatty(0)} {os.isatty(1)} {os.isatty(2)} {size}\n"); sys.stdout.flush()
"""


def spawn(relay: Relay, tmp_path: Path, code: str, n: int = 1, stdin=None):
    log = tmp_path / "attempts" / f"{n:04d}" / "worker.log"
    w = process.spawn(
        [sys.executable, "-c", code], env=dict(os.environ), cwd=str(tmp_path), log_path=log, now=0.0, relay=relay
    )
    return w, log


def read_all(fd: int, until: float) -> bytes:
    os.set_blocking(fd, False)
    out = b""
    while time.monotonic() < until:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.02)
            continue
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_pipes_each_stream_to_its_own_byte_for_byte_and_both_in_the_log(tmp_path):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    relay = Relay(out_w, err_w)
    try:
        w, log = spawn(relay, tmp_path, CHILD)
        assert w.popen.wait(20) == 0
        relay.say("a line of hangwatch's own")
    finally:
        relay.close()
    os.close(out_w)
    os.close(err_w)
    out = read_all(out_r, time.monotonic() + 5)
    err = read_all(err_r, time.monotonic() + 5)
    assert out == b"OUT\rbar\x1b[1m line\ntty False False False None\n"
    # the command left its stderr line open when hangwatch spoke? No: it had ended it; hangwatch's line follows whole
    assert err == b"ERR half done\nhangwatch: a line of hangwatch's own\n"
    logged = log.read_bytes()
    assert sorted(logged.split(b"\n")) != []  # both streams, in the order they were read
    for part in (b"OUT\rbar\x1b[1m", b"ERR half", b" line\n", b" done\n", b"tty False False False None\n"):
        assert part in logged
    assert len(logged) == len(out) + len(err) - len(b"hangwatch: a line of hangwatch's own\n")


def test_an_own_line_never_lands_inside_an_open_line_of_the_command(tmp_path):
    err_r, err_w = os.pipe()
    out_r, out_w = os.pipe()
    relay = Relay(out_w, err_w)
    try:
        w, _ = spawn(
            relay,
            tmp_path,
            "import sys, time; sys.stderr.write('\\r 40%|####'); sys.stderr.flush(); "
            "time.sleep(1.0); sys.stderr.write('\\r100%|##########|\\n')",
        )
        time.sleep(0.5)
        relay.say("stall at step 5")
        assert w.popen.wait(20) == 0
    finally:
        relay.close()
    os.close(err_w)
    os.close(out_w)
    err = read_all(err_r, time.monotonic() + 5)
    assert err == b"\r 40%|####\nhangwatch: stall at step 5\n\r100%|##########|\n"


def test_a_terminal_exactly_where_hangwatch_has_one_with_its_size(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    err_r, err_w = os.pipe()  # stdout a terminal, stderr a pipe: `hangwatch run -- cmd 2>err.log` in a terminal
    relay = Relay(slave, err_w)
    try:
        w, log = spawn(relay, tmp_path, CHILD)
        assert w.popen.wait(20) == 0
    finally:
        relay.close()
    os.close(err_w)
    screen = read_all(master, time.monotonic() + 3)
    err = read_all(err_r, time.monotonic() + 3)
    assert b"tty False True False os.terminal_size(columns=101, lines=33)" in screen.replace(b"\r\n", b"\n")
    assert err == b"ERR half done\n"
    logged = log.read_bytes()
    assert b"OUT\rbar\x1b[1m" in logged and b" line\n" in logged
    assert b"\r\n" not in logged  # output processing off: the bytes as written, no newline translation
    os.close(master)
    os.close(slave)


def test_the_window_size_is_followed_on_sigwinch(tmp_path):
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGWINCH, lambda *a: print('winch', os.get_terminal_size(1), flush=True))\n"
        "print('ready', flush=True)\n"
        "time.sleep(3)\n"
    )
    relay = Relay(slave, slave)
    relay.follow_window()
    try:
        w, _ = spawn(relay, tmp_path, code)
        seen = b""
        end = time.monotonic() + 10
        while b"ready" not in seen and time.monotonic() < end:
            seen += read_all(master, time.monotonic() + 0.2)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 132, 0, 0))
        os.kill(os.getpid(), signal.SIGWINCH)  # what the terminal does for a resize
        end = time.monotonic() + 10
        while b"winch" not in seen and time.monotonic() < end:
            seen += read_all(master, time.monotonic() + 0.2)
        w.popen.wait(20)
    finally:
        relay.close()
    assert b"winch os.terminal_size(columns=132, lines=50)" in seen
    os.close(master)
    os.close(slave)


def test_a_reader_gone_is_felt_by_the_command_as_it_would_be_bare(tmp_path):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.close(out_r)  # `hangwatch run -- cmd | head -0`
    relay = Relay(out_w, err_w)
    code = "import time\nfor i in range(200):\n    print('line', i, flush=True)\n    time.sleep(0.01)\n"
    try:
        w, log = spawn(relay, tmp_path, code)
        rc = w.popen.wait(20)
    finally:
        relay.close()
    os.close(out_w)
    os.close(err_w)
    # bare, python dies of the broken pipe (BrokenPipeError → exit 1, or SIGPIPE): not after 200 lines
    assert rc != 0
    assert log.read_bytes().startswith(b"line")  # what was read before the reader was found gone is logged
    assert b"line 199" not in log.read_bytes()
    assert b"BrokenPipeError" in read_all(err_r, time.monotonic() + 3)


def test_a_second_attempt_is_announced_before_its_output(tmp_path):
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    relay = Relay(out_w, err_w)
    try:
        for n in (1, 2):
            w, _ = spawn(relay, tmp_path, f"print('attempt {n}')", n=n)
            w.popen.wait(20)
            time.sleep(0.2)
    finally:
        relay.close()
    os.close(out_w)
    os.close(err_w)
    assert read_all(out_r, time.monotonic() + 3) == b"attempt 1\nattempt 2\n"
    assert read_all(err_r, time.monotonic() + 3) == "hangwatch: ──── attempt 2 ────\n".encode()


def test_hidden_output_goes_to_the_log_only_and_the_command_sees_no_terminal(tmp_path):
    master, slave = pty.openpty()
    relay = Relay(slave, slave, show=False)
    try:
        w, log = spawn(relay, tmp_path, CHILD)
        assert w.popen.wait(20) == 0
    finally:
        relay.close()
    assert b"tty False False False None" in log.read_bytes()
    os.set_blocking(master, False)
    with pytest.raises(BlockingIOError):
        os.read(master, 100)
    os.close(master)
    os.close(slave)


def test_a_spawn_that_fails_leaves_no_descriptor_behind(tmp_path):
    out_r, out_w = os.pipe()
    relay = Relay(out_w, out_w)
    before = open_fds()
    for _ in range(3):
        with pytest.raises(FileNotFoundError):
            process.spawn(["/nonexistent/cmd"], env={}, cwd=None, log_path=tmp_path / "w.log", now=0.0, relay=relay)
    assert open_fds() == before
    relay.close()


def open_fds() -> set[str]:
    out = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{name}:{os.readlink(f'/proc/self/fd/{name}')}")
        except OSError:  # the listing's own descriptor, gone by now
            pass
    return out


def test_a_hangup_is_the_terminals_only_with_one_and_not_under_nohup():
    master, slave = pty.openpty()
    r, w = os.pipe()
    try:
        assert hangup_is_the_terminals((r, w, slave), disposition=signal.SIG_DFL)
        assert not hangup_is_the_terminals((r, w), disposition=signal.SIG_DFL)  # a pipe, a file: the daemon's SIGHUP
        assert not hangup_is_the_terminals((r, w, slave), disposition=signal.SIG_IGN)  # nohup
    finally:
        for fd in (master, slave, r, w):
            os.close(fd)
