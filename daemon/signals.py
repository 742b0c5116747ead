"""SIGTERM/SIGINT: finish the current optimizer step, checkpoint, stop — decided by the main loop.

The handler only records which signal came and restores the default disposition, so a second
SIGTERM (or SIGINT) kills the process at once, which is what an impatient operator wants.

A rank under torchrun, or any worker in a Slurm job, is the exception (`repeat_kills=False`): it is asked to
stop twice as a matter of course — torchrun forwards the SIGTERM it gets to every rank, Slurm signals every
process of a job step (and srun passes its own SIGTERM on), and a supervisor may signal the ranks directly
too — so there a repeated signal is only recorded again; SIGKILL, after the grace, is the backstop.
SIGUSR1 (stack dump) belongs to faulthandler, installed by `Heartbeat.start`.

Lifecycle: `install()` → the loop polls `requested` → `uninstall()` restores what was there.
"""

from __future__ import annotations

import signal
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self, signals: tuple = STOP_SIGNALS, *, repeat_kills: bool = True):
        self._signals = signals
        self.repeat_kills = repeat_kills
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
        self.requested = self.requested or signal.Signals(signum).name
        if self.repeat_kills:
            for sig in self._signals:
                signal.signal(sig, signal.SIG_DFL)

    def __bool__(self) -> bool:
        return self.requested is not None
