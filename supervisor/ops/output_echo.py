"""The worker's output on `hangwatch run`'s own stdout, as the command would have shown it.

The worker writes its stdout and stderr into the attempt's `worker.log` (the file stays the record: it survives the
supervisor, `hangwatch logs` reads it).  In the foreground, `hangwatch run` also shows it: a thread of its own
follows the current attempt's log and copies each new byte to stdout as it lands — progress bars' carriage returns
and all — and, when a new attempt starts, says so on a line of its own before that attempt's output, so a person
sees where attempt 2 began.  A listener of the loop (`pass_done(view, now)`): on the loop it only notes which
attempt's log to follow; reading and writing happen on the thread, so a slow terminal never delays the loop.
`close` copies what is left of the last log before the run's summary is printed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import BinaryIO, Optional

import structlog

log = structlog.get_logger("hangwatch")

POLL_S = 0.05  # how often the log is looked at while nothing new came (a line shows within this)
CHUNK = 1 << 16


class OutputEcho:
    def __init__(self, out: BinaryIO, poll_s: float = POLL_S):
        self.out = out
        self.poll_s = poll_s
        self._want: Optional[tuple[int, Path]] = None  # (attempt, its log) the loop last saw
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.failed: Optional[str] = None  # why echoing stopped (the terminal went away): the run goes on

    # ---- the loop's side

    def pass_done(self, view, now: float) -> None:
        w = view.worker
        if w is None or w.log_path is None:
            return
        want = (view.attempt, Path(w.log_path))
        if want != self._want:
            with self._lock:
                self._want = want
            if self._thread is None:
                self._thread = threading.Thread(target=self._follow, name="hangwatch-output", daemon=True)
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Copy what is left of the current log, then stop."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    # ---- the thread

    def _follow(self) -> None:
        following: Optional[tuple[int, Path]] = None
        fd: Optional[int] = None
        try:
            while True:
                with self._lock:
                    want = self._want
                if want != following:
                    if fd is not None:
                        self._drain(fd)  # the old attempt's last words first
                        os.close(fd)
                        fd = None
                    if following is not None or want[0] > 1:  # a run that goes on says where it picks up, too
                        self._write(f"hangwatch: ──── attempt {want[0]} ────\n".encode())
                    following = want
                if fd is None and following is not None:
                    try:
                        fd = os.open(following[1], os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        fd = None
                copied = self._drain(fd) if fd is not None else 0
                if self._stop.is_set():
                    if fd is not None:
                        self._drain(fd)
                    return
                if not copied:
                    self._stop.wait(self.poll_s)
        except OSError as exc:  # stdout closed (a terminal that went away, a pipe nobody reads): stop echoing
            self.failed = str(exc)
            log.warning("output_echo_stopped", error=str(exc), note="the worker's output is still in worker.log")
        finally:
            if fd is not None:
                os.close(fd)

    def _drain(self, fd: int) -> int:
        copied = 0
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                return copied
            self._write(chunk)
            copied += len(chunk)

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()
