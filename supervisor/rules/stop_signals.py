"""A stopping signal to `hangwatch run`, passed on to the command as the bare command would have received it.

In the foreground `hangwatch run -- CMD` stands in for CMD, so a signal means what it means to CMD:

    received   the command gets                          then, while it still runs
    SIGINT     SIGINT, its whole process group            SIGTERM after watchdog.term_grace_s, SIGKILL at the stop
               (a terminal's Ctrl-C: a KeyboardInterrupt  deadline; a second Ctrl-C: SIGKILL to the tree at once
               handler runs)
    SIGQUIT    SIGQUIT, its group (Ctrl-\\)                as for SIGINT
    SIGHUP     SIGHUP, its group (the terminal went away) as for SIGINT
    SIGTERM    SIGTERM, its main process (as `kill` sends) SIGKILL at the stop deadline

The run is then stopped, never restarted.  SIGHUP is a terminal's word only where there is a terminal
(`hangup_stops`: one of our standard streams is one, and SIGHUP was not ignored when we started — `nohup`): a
`hangwatch run` writing to files or pipes keeps the daemon convention, SIGHUP reopens its log files (logrotate's
postrotate).  As a service (systemd) and for the built-in worker's own config runs, a stop is SIGTERM to the worker as
always, and SIGHUP reopens the log files.  SIGUSR1 (a batch job's time
limit is near) is hangwatch's own: SIGTERM to the worker, and `run` exits 75 to be requeued.  Pure: a table.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Passing:
    """What the command gets for a signal hangwatch received."""

    received: int
    send: int
    group: bool  # to the command's process group (as a terminal sends) rather than its main process (as kill does)
    term_after_grace: bool  # SIGTERM follows after the grace while it still runs


GROUP_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1)  # stop the run whatever the mode


def stops(sig: int, transparent: bool, hangup_stops: bool = True) -> bool:
    """Whether `sig` stops the run (SIGHUP only in the foreground on a terminal: elsewhere it reopens the logs)."""
    return sig in STOPPING or (transparent and hangup_stops and sig == signal.SIGHUP)


def passing(sig: Optional[int], transparent: bool) -> Passing:
    """How the stop reaches the command (`sig`: the signal that stopped the run; None: a control request)."""
    if transparent and sig in GROUP_SIGNALS:
        return Passing(sig, sig, group=True, term_after_grace=True)
    return Passing(sig or signal.SIGTERM, signal.SIGTERM, group=False, term_after_grace=False)


def words(how: Passing, who: Optional[str], transparent: bool) -> str:
    """The screen's line for a stop passed on: who asked, what the command got, what a second one does."""
    line = f"{who or signal.Signals(how.received).name}: passed on to the command"
    if how.send != how.received:
        line += f" as {signal.Signals(how.send).name}"
    return line + ("; again to end it at once" if how.group and transparent else "")
