"""Reading the logs back: `hangwatch logs [-f] [--supervisor] [--attempt N]`.

Follows the newest attempt's worker log (switching when a new attempt starts), or the supervisor log,
across rotation (rename + create) and truncation; `sleep` is a seam so tests drive it without waiting.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from hangwatch.common.rundir import (
    ATTEMPTS,
    STATE_NAME,
    SUPERVISOR_LOG_NAME,
    WORKER_LOG_NAME,
    read_json,
    worker_log_path,
)
from hangwatch.supervisor.records.runlock import holder

ENDED_STATES = ("finished", "failed", "stopped")


def run_ended(run_dir: os.PathLike | str) -> bool:
    """True when the run is over: state.json says it ended and no supervisor holds the run dir.

    A supervisor that died (SIGKILL) leaves `running` behind: that run is not over (systemd may be
    about to restart it), so a follower keeps waiting.
    """
    state = read_json(Path(run_dir) / STATE_NAME) or {}
    return state.get("state") in ENDED_STATES and holder(run_dir) is None


class NoLogYet(Exception):
    pass


def latest_worker_log(run_dir: os.PathLike | str) -> Optional[Path]:
    """The worker log of the newest attempt that has one."""
    base = Path(run_dir) / ATTEMPTS
    if not base.is_dir():
        return None
    for attempt in sorted((p.name for p in base.iterdir() if p.name.isdigit()), key=int, reverse=True):
        candidate = base / attempt / WORKER_LOG_NAME
        if candidate.exists():
            return candidate
    return None


def follow_log(
    run_dir: os.PathLike | str,
    *,
    supervisor: bool = False,
    attempt: Optional[int] = None,
    follow: bool = False,
    last_lines: Optional[int] = None,
    poll_s: float = 0.25,
    sleep=time.sleep,
    ended: Optional[Callable[[], bool]] = None,
) -> Iterator[Union[Path, bytes]]:
    """Yield a `Path` each time a file is opened, then its bytes as they arrive.

    The worker log is that of the newest attempt; with `follow`, once the current file is drained
    and a newer attempt's worker.log exists, the follower moves on to it (the old worker is dead by
    then: the supervisor starts an attempt only after the previous tree is reaped).  The supervisor
    log is followed like `tail -F`: a rotated (moved) file is drained, then the new one opened; a
    truncated one is read again from its start.  `ended()` (default `run_ended(run_dir)`) says the
    run is over: once it is and the file is drained, following stops instead of waiting forever.
    """
    if ended is None:
        ended = lambda: run_ended(run_dir)  # noqa: E731
    run_dir = Path(run_dir)

    def target() -> Optional[Path]:
        if supervisor:
            p = run_dir / SUPERVISOR_LOG_NAME
            return p if p.exists() else None
        if attempt is not None:
            p = worker_log_path(run_dir, attempt)
            return p if p.exists() else None
        return latest_worker_log(run_dir)

    f = None
    path: Optional[Path] = None
    first = True
    try:
        while True:
            if f is None:
                path = target()
                if path is None:
                    if not follow or ended():
                        what = (
                            "supervisor log"
                            if supervisor
                            else (f"worker log for attempt {attempt}" if attempt else "worker log")
                        )
                        raise NoLogYet(f"no {what} yet in {run_dir}")
                    sleep(poll_s)
                    continue
                f = open(path, "rb")
                if first and last_lines is not None:
                    f.seek(_tail_offset(f, last_lines))
                first = False
                yield path
            chunk = f.read(65536)
            if chunk:
                yield chunk
                continue
            if not follow:
                return
            now_target = target()
            if now_target is not None and (now_target != path or _inode(now_target) != os.fstat(f.fileno()).st_ino):
                rest = f.read(65536)  # written between the read that found it drained and the new file appearing
                if rest:
                    yield rest
                    continue
                f.close()
                f = None  # drained: move on to the new attempt / the file that replaced a rotated one
                continue
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)  # truncated in place (copytruncate)
                continue
            if ended():
                rest = f.read()  # what was written between the last read and the end
                if rest:
                    yield rest
                return
            sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _tail_offset(f, lines: int) -> int:
    """Offset of the start of the last `lines` lines of the open binary file `f`."""
    end = f.seek(0, os.SEEK_END)
    if lines <= 0:
        return end
    pos, seen, block = end, 0, 65536
    # A file that ends with a newline: that newline terminates the last line, it does not start one.
    f.seek(max(end - 1, 0))
    skip_last = f.read(1) == b"\n"
    while pos > 0:
        start = max(pos - block, 0)
        f.seek(start)
        data = f.read(pos - start)
        if skip_last and pos == end:
            data = data[:-1]
        for i in range(len(data) - 1, -1, -1):
            if data[i] == 0x0A:
                seen += 1
                if seen == lines:
                    return start + i + 1
        pos = start
    return 0
