"""One supervisor per run dir: an exclusive `flock` on `<run_dir>/hangwatch.lock`, held for life.

Taken before the supervisor writes anything in the run dir (log, socket-path record, state.json), so
a second supervisor — whatever its socket, however close in time it starts — is refused and changes nothing.
The refusal names the holder: its pid, when it started and its command, read from the lock file.  The kernel
drops the lock when the holder dies (even by SIGKILL), so a stale lock file never blocks a restart; the file
itself is left in place (removing it would race with a newcomer that already opened it).

The holder's record is in the file from the first moment anyone can find it locked, so that a refusal never has
to say "some supervisor that is starting": a run dir without a lock file gets one made whole beside it (written,
locked, then linked into place, which fails if another got there first).  An existing file can only be taken
over as it is — locked first, then rewritten — so there a refused newcomer may meet the previous holder's record
or none for an instant: a record whose process is gone, or an empty file (a holder empties it as it lets go), is
read again until the new holder has written its own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Callable, Optional

LOCK_NAME = "hangwatch.lock"
RECORD_WAIT_S = 2.0  # how long a refused newcomer waits for the holder's record (a holder writes it at once)
COMMAND_SHOWN = 200  # characters of the holder's command kept in the record


class RunDirBusy(RuntimeError):
    """Another live supervisor holds the run dir: `holder` its pid (None only when no record of it could be read),
    `record` what its lock file says ({"pid", "started", "command"})."""

    def __init__(self, run_dir: Path, holder: Optional[int], record: Optional[dict] = None):
        self.run_dir, self.holder = run_dir, holder
        self.record = record if record is not None else ({"pid": holder} if holder else {})
        super().__init__(
            f"another hangwatch ({holder_words(self.record)}) is supervising {run_dir}{_since(self.record)}; "
            f"stop it first (hangwatch stop --run-dir {run_dir}) or use another run dir"
        )


def holder_words(record: dict) -> str:
    """ "pid 4242"; what is said when the lock file does not name a live process."""
    pid = record.get("pid")
    if not pid:
        return "a supervisor whose lock file names no pid"
    return f"pid {pid}, which is gone: a process it started holds the lock" if record.get("gone") else f"pid {pid}"


def _since(record: dict) -> str:
    """ " (started 2024-05-01 03:12:44: hangwatch run a.yaml)": what the holder's record says besides its pid."""
    parts = []
    started = record.get("started")
    if isinstance(started, (int, float)):
        parts.append("started " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)))
    if record.get("command"):
        parts.append(str(record["command"]))
    return f" ({': '.join(parts)})" if parts else ""


class RunLock:
    def __init__(self, fd: int, path: Path):
        self._fd: Optional[int] = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: os.PathLike | str, *, command: Optional[str] = None) -> "RunLock":
        """Lock `run_dir` (created when missing) or raise RunDirBusy naming the holder.  `command`: what the record
        says this holder runs (default: this process's command line)."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        record = own_record(command)
        fd = _create_locked(path, record)
        if fd is not None:
            return cls(fd, path)
        # O_CLOEXEC: a worker must not inherit the lock, or it would outlive its supervisor.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                found = holder_record(path)
                raise RunDirBusy(run_dir, found.get("pid"), found) from None
            raise
        # Only the holder writes the record: written over the old one, then cut to its length, so the file is
        # never empty while held (a reader meets the old record, this one, or a mix it cannot parse, and reads again).
        os.pwrite(fd, record, 0)
        os.ftruncate(fd, len(record))
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, 0)  # a lock let go names nobody: the next holder's newcomers wait for its record
            except OSError:
                pass
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def own_record(command: Optional[str] = None) -> bytes:
    """This process's record: one JSON line, pid first."""
    rec = {"pid": os.getpid(), "started": round(time.time(), 3), "command": (command or command_line())[:COMMAND_SHOWN]}
    return (json.dumps(rec) + "\n").encode()


def command_line() -> str:
    """How this process was started, as a person would type it: `hangwatch run a.yaml`, `python -m pkg …`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        head = "python -m " + name.removesuffix(".__main__")
    else:
        head = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
    return " ".join([head, *(shlex.quote(a) for a in sys.argv[1:])])


def _create_locked(path: Path, record: bytes) -> Optional[int]:
    """A lock file made whole under another name — the record written, the flock taken — then linked into place:
    its descriptor, or None when a lock file is already there (or this file system cannot link)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    except OSError:
        return None
    try:
        os.pwrite(fd, record, 0)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.link(tmp, path)
    except OSError:
        os.close(fd)
        return None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass
    return fd


def parse_record(data: bytes) -> Optional[dict]:
    """The record in a lock file's bytes: a JSON object with a pid, or a bare pid (what earlier versions wrote);
    None when there is none (an empty file, half a write)."""
    text = data.decode("ascii", "replace").strip()
    if not text:
        return None
    if text.isdigit():
        return {"pid": int(text)}
    try:
        rec = json.loads(text.splitlines()[0])
    except ValueError:
        return None
    if isinstance(rec, dict) and isinstance(rec.get("pid"), int) and rec["pid"] > 0:
        return rec
    return None


def holder_record(
    path: Path, wait_s: float = RECORD_WAIT_S, *, alive: Optional[Callable[[int], bool]] = None, sleep=time.sleep
) -> dict:
    """The record of the process holding the lock at `path`, read until it names a live process (the holder writes
    it at once; until then the file is empty or names the previous holder, who is gone).  After `wait_s` without
    one: what the file says, marked `gone` when it names a process that is no longer there; {} when it says nothing."""
    alive = alive or pid_alive
    deadline = time.monotonic() + wait_s
    while True:
        rec = _read_record(path)
        if rec is not None and alive(rec["pid"]):
            return rec
        if time.monotonic() >= deadline or not locked(path):
            return {**rec, "gone": True} if rec is not None else {}
        sleep(0.005)


def _read_record(path: Path) -> Optional[dict]:
    try:
        with open(path, "rb") as f:
            return parse_record(f.read(4096))
    except OSError:
        return None


def locked(path: Path) -> bool:
    """Whether some process holds the flock on `path` (a shared lock cannot be had while one does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock, had it been taken
    return False


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, dead but not yet reaped, holds no lock: not alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[:1] != [b"Z"]
    except OSError:
        return True  # no /proc to ask: os.kill's answer stands


def holder(run_dir: os.PathLike | str) -> Optional[int]:
    """The pid of the supervisor holding `run_dir`, or None when nobody holds it (-1: held, its pid not known)."""
    path = Path(run_dir) / LOCK_NAME
    if not path.exists() or not locked(path):
        return None
    rec = _read_record(path)
    return rec["pid"] if rec is not None else -1
