"""One supervisor per run dir: an exclusive `flock` on `<run_dir>/hangwatch.lock`, held for life.

Taken before the supervisor writes anything in the run dir (log, socket-path record, state.json), so
a second supervisor — whatever its socket, however close in time it starts — is refused with the
holder's pid and changes nothing.  The kernel drops the lock when the holder dies (even by SIGKILL),
so a stale lock file never blocks a restart; the file itself is left in place (removing it would
race with a newcomer that already opened it).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import Optional

LOCK_NAME = "hangwatch.lock"


class RunDirBusy(RuntimeError):
    """Another live supervisor holds the run dir."""

    def __init__(self, run_dir: Path, holder: Optional[int]):
        self.run_dir, self.holder = run_dir, holder
        who = f"pid {holder}" if holder else "a supervisor that is starting"
        super().__init__(
            f"another hangwatch ({who}) is supervising {run_dir}; "
            f"stop it first (hangwatch stop --run-dir {run_dir}) or use another run dir"
        )


class RunLock:
    def __init__(self, fd: int, path: Path):
        self._fd: Optional[int] = fd
        self.path = path

    @classmethod
    def acquire(cls, run_dir: os.PathLike | str) -> "RunLock":
        """Lock `run_dir` (created when missing) or raise RunDirBusy naming the holder."""
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        # O_CLOEXEC: a worker must not inherit the lock, or it would outlive its supervisor.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _read_pid(fd)
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunDirBusy(run_dir, holder) from None
            raise
        # Only the holder writes the pid, so a reader never sees two pids mixed.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(fd, path)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(fd: int) -> Optional[int]:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def holder(run_dir: os.PathLike | str) -> Optional[int]:
    """The pid of the supervisor holding `run_dir`, or None when nobody holds it."""
    path = Path(run_dir) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _read_pid(fd) or -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
