"""SIGTERM/SIGINT: finish the current optimizer step, checkpoint, stop — decided by the main loop.

The handler only records which signal came and restores the default disposition, so a second
SIGTERM (or SIGINT) kills the process at once, which is what an impatient operator wants.
SIGUSR1 (stack dump) belongs to faulthandler, installed by `Heartbeat.start`.

Lifecycle: `install()` → the loop polls `requested` → `uninstall()` restores what was there.
"""
from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, signals: tuple = STOP_SIGNALS):
        self._signals = signals
        self._previous: dict = {}
        self.requested: Optional[str] = None

    def install(self) -> "StopRequest":
        for sig in self._signals:
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()

    def _record(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name
        for sig in self._signals:
            signal.signal(sig, signal.SIG_DFL)

    def __bool__(self) -> bool:
        return self.requested is not None
