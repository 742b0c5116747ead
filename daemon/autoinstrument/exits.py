"""A rank's end in its own words: the last thing the interpreter does before it exits is a `stop` line.

    {"event": "stop", "reason": "exit", "code": 0}                          the script returned, or sys.exit(0)
    {"event": "stop", "reason": "exit", "code": 3}                          sys.exit(3)
    {"event": "stop", "reason": "exit", "code": 1, "exception": "KeyError"} an uncaught exception

Why: after the interpreter's own exit handlers the process still runs native teardown — C++ static destructors, a
library's threads — and that can crash a process whose work was done: torch's gloo backend aborts a rank now and
then at exit ("terminate called without an active exception", SIGABRT) after a run that completed.  torchrun then
exits 1 and, without this line, the supervisor could only read a failed run and start it again from the top.  With
it, a rank that died by a signal after saying `exit` with code 0 is known to have finished its work first
(`supervisor.rules.teardown`).

The line is written from an `atexit` handler registered when the rank is instrumented — before the script's first
line, so it runs after every handler the script and its libraries register (atexit runs them last in, first
out), when nothing more of the script can run.  Nothing is written when the script said `stop` through the
shared heartbeat (a HangwatchCallback of its own), when it drives a heartbeat of its own (`WRITERS.manual`: then
the script's lines are its own, its `stop` included), in a child forked from the rank (a child that returns runs
its parent's handlers), after `os._exit` (no handlers run), or when the heartbeat is closed.

The status: `sys.exit`'s argument, recorded by a thin wrapper around `sys.exit` (`raise SystemExit(n)` written
out is not seen: such an exit reports code 0, and the supervisor trusts a process's own exit code over this
line); an uncaught exception's type from `sys.last_exc`/`sys.last_value`, which the interpreter sets before it
prints the traceback.  Every error here is contained like any hook's (`Context.failed`).

Standard library only.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from typing import Any, Optional

from hangwatch.common.protocol import EXIT_STOP_REASON as EXIT_REASON
from hangwatch.daemon.autoinstrument.context import Context

_NOTHING = object()  # sys.exit was not called


def exit_status(requested: Any, last_exception: Optional[BaseException]) -> tuple[int, Optional[str]]:
    """(the exit code Python ends with, the uncaught exception's type name or None).  `requested`: what was last
    passed to `sys.exit` (`_NOTHING` when it was not called); `last_exception`: the uncaught exception, if any."""
    if last_exception is not None and not isinstance(last_exception, SystemExit):
        return 1, type(last_exception).__name__
    if requested is _NOTHING or requested is None:
        return 0, None
    if isinstance(requested, bool):
        return int(requested), None
    if isinstance(requested, int):
        return requested & 0xFF, None
    return 1, None  # sys.exit("message"): printed, status 1


class ExitLine:
    """Installs the `atexit` handler and the `sys.exit` wrapper for one rank process."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.hook = ctx.hook("exit")
        self.requested: Any = _NOTHING

    def install(self) -> None:
        original = sys.exit

        @functools.wraps(original)
        def exit(status: Any = None) -> None:  # noqa: A001 — it is sys.exit
            if self.hook.on and os.getpid() == self.ctx.pid:
                self.requested = status
            original(status)

        sys.exit = exit
        atexit.register(self.at_exit)

    def at_exit(self) -> None:
        """The interpreter is exiting normally: say how, once, from the rank process itself."""
        ctx = self.ctx
        if not self.hook.on or os.getpid() != ctx.pid or not ctx.usable() or ctx.manual():
            return
        try:
            last = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
            code, exception = exit_status(self.requested, last)
            extra = {"code": code}
            if exception is not None:
                extra["exception"] = exception
            ctx.hb.stop(EXIT_REASON, **extra)
        except Exception as exc:  # never an error of hangwatch's at the script's exit
            ctx.failed(self.hook, exc)


__all__ = ["ExitLine", "EXIT_REASON", "exit_status"]
