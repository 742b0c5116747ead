"""A process blocked reading its terminal: a prompt waiting for a person, not a call "blocked in C".

In the foreground the command's stdin is hangwatch's own (`processes.streams`), so a script may stop at `input()`,
a "continue? [y/N]" or a password prompt.  Its CPU is 0 % and its state S, which the stall classification alone
would call blocked in C; the kernel tells the difference.  `/proc/PID/syscall` names the system call the main
thread sleeps in and its arguments: a `read` (readv, pread) of a descriptor that is a terminal, or a `select`/`poll`
(their variants) whose descriptor set holds one — Python's `input()` on a terminal waits in select() through
readline — read from the process's memory at the set's address (`/proc/PID/mem`, which the parent of the tree may
read: the same permission as the syscall file).  Anything unreadable answers None: the evidence cannot tell.
"""

from __future__ import annotations

import os
import platform
import struct
from typing import Iterable, Optional

# the calls a terminal read sleeps in, by machine: name → number (asm/unistd.h)
SYSCALLS = {
    "x86_64": {"read": 0, "pread64": 17, "readv": 19, "poll": 7, "select": 23, "pselect6": 270, "ppoll": 271},
    "aarch64": {"read": 63, "pread64": 67, "readv": 65, "pselect6": 72, "ppoll": 73},
}
READS = ("read", "pread64", "readv")
SELECTS = ("select", "pselect6")
POLLS = ("poll", "ppoll")
MAX_SET_FDS = 1024  # FD_SETSIZE: a select set is at most this many bits
POLLFD = struct.Struct("ihh")  # struct pollfd {int fd; short events; short revents;}


def terminal_of(pid: int, fd: int, proc: str = "/proc") -> Optional[str]:
    """The terminal device `fd` of `pid` is (/dev/pts/3, /dev/tty1), or None."""
    try:
        target = os.readlink(f"{proc}/{pid}/fd/{fd}")
    except OSError:
        return None
    return target if target.startswith(("/dev/pts/", "/dev/tty", "/dev/console")) else None


def _syscall(pid: int, proc: str) -> Optional[tuple[int, list[int]]]:
    try:
        with open(f"{proc}/{pid}/syscall") as f:
            words = f.read().split()
    except OSError:
        return None
    if not words or words[0] in ("running", "-1"):
        return None
    try:
        return int(words[0]), [int(w, 16) for w in words[1:7]]
    except ValueError:
        return None


def _memory(pid: int, address: int, size: int, proc: str) -> Optional[bytes]:
    if address <= 0 or size <= 0:
        return None
    try:
        with open(f"{proc}/{pid}/mem", "rb", buffering=0) as f:
            f.seek(address)
            data = f.read(size)
    except (OSError, OverflowError, ValueError):
        return None
    return data if len(data) == size else None


def waited_fds(pid: int, proc: str = "/proc", machine: Optional[str] = None) -> Optional[list[int]]:
    """The descriptors `pid`'s main thread sleeps reading (a read's one, a select's or poll's set), or None."""
    numbers = SYSCALLS.get(machine or platform.machine())
    call = _syscall(pid, proc)
    if numbers is None or call is None:
        return None
    name = next((k for k, v in numbers.items() if v == call[0]), None)
    args = call[1]
    if name in READS and args:
        return [args[0]]
    if name in SELECTS and len(args) >= 2:
        nfds = min(args[0], MAX_SET_FDS)
        bits = _memory(pid, args[1], (nfds + 7) // 8, proc)
        if bits is None:
            return None
        return [fd for fd in range(nfds) if bits[fd // 8] >> (fd % 8) & 1]
    if name in POLLS and len(args) >= 2 and 0 < args[1] <= 64:
        raw = _memory(pid, args[0], POLLFD.size * args[1], proc)
        if raw is None:
            return None
        return [POLLFD.unpack_from(raw, i * POLLFD.size)[0] for i in range(args[1])]
    return None


def reading_terminal(pid: int, proc: str = "/proc", machine: Optional[str] = None) -> Optional[str]:
    """The terminal `pid` is blocked reading (its device), or None (not reading one, or it cannot be told)."""
    for fd in waited_fds(pid, proc, machine) or ():
        device = terminal_of(pid, fd, proc)
        if device is not None:
            return device
    return None


def first_reading(pids: Iterable[int], proc: str = "/proc") -> Optional[dict]:
    """The first of `pids` blocked reading its terminal: {"pid", "terminal"}, or None."""
    for pid in pids:
        device = reading_terminal(pid, proc)
        if device is not None:
            return {"pid": pid, "terminal": device}
    return None
