"""How the supervisor's loop sleeps and what wakes it: signals, file events, a timeout.

One self-pipe carries every wake-up: `signal.set_wakeup_fd` writes the signal number into it,
the heartbeat-file observer (`heartbeats.FileEvents`) writes a byte on every change, and the
selector waits on its read end with the loop's timeout (the earliest deadline, at most the loop
period), since a hang is exactly the absence of events.

The one signal recorder lives here: SIGTERM, SIGINT, SIGCHLD and SIGHUP are only *recorded* (in
a deque, which appends and pops atomically — safe from a handler); the loop drains them at the
start of its next pass and acts there (stop; reap; reopen the log).
"""
from __future__ import annotations

import os
import selectors
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

from hangwatch.supervisor.heartbeats import FileEvents

RECORDED = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP)
MIN_PASS_S = 0.05  # at most 20 loop passes a second, however many heartbeat lines arrive


class Wakeup:
    def __init__(self, *, install_signals: bool = True):
        self._install_signals = install_signals
        self._signals: deque[int] = deque()
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._selector: Optional[selectors.BaseSelector] = None
        self._events: Optional[FileEvents] = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: Optional[int] = None
        self._last_pass_end = float("-inf")

    def record(self, signum: int, frame: Any = None) -> None:
        """The signal handler: record, nothing else (the loop acts on it)."""
        self._signals.append(signum)

    def drain(self) -> list[int]:
        """The signals recorded since the last call, oldest first."""
        out = []
        while self._signals:
            out.append(self._signals.popleft())
        return out

    def open(self, watch_dir: Path) -> None:
        """Create the pipe, install the handlers (main thread only), watch `watch_dir` for heartbeat writes."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        if self._install_signals and threading.current_thread() is threading.main_thread():
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            for sig in RECORDED:
                self._old_handlers[sig] = signal.signal(sig, self.record)
        self._events = FileEvents(watch_dir, self._wake_w)
        self._events.start()

    def close(self) -> None:
        if self._events is not None:
            self._events.stop()
            self._events = None
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None
        if self._selector is not None:
            self._selector.close()
            self._selector = None
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None

    def wait(self, timeout: float) -> None:
        """Sleep until a wake-up or `timeout` seconds; returns at once when not opened."""
        if self._selector is None:
            return
        # Coalesce wake-ups: 8 ranks beating at 20 Hz are 160 file events a second, and one pass per
        # event would cost a core. Lines are still read within MIN_PASS_S; deadlines are unaffected.
        # (Real time on purpose: this is about CPU, not about deadlines.)
        since = time.monotonic() - self._last_pass_end
        if since < MIN_PASS_S:
            time.sleep(MIN_PASS_S - since)
            timeout = max(0.0, timeout - (MIN_PASS_S - since))
        try:
            self._selector.select(timeout)
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def pass_done(self) -> None:
        """The loop finished a pass: the coalescing interval starts now."""
        self._last_pass_end = time.monotonic()
