"""A worker that crashed on its way out after its work was done: finished, not failed.

A process can die after its program ended: in native teardown (C++ static destructors, a library's threads at
exit).  torch's gloo backend does so now and then — a rank aborts with "terminate called without an active
exception" (SIGABRT) after a run that completed — and torchrun then reports a failed job.  Restarting would
redo a finished run from its last checkpoint (a script without checkpoints: from the top).

The evidence that the work was done is each rank's own `stop` line, written before the end: the built-in
worker's and the callbacks' `finished` / `idle`, and the automatic instrumentation's `exit` with code 0 (its
interpreter's last act, `daemon.autoinstrument.exits`).  The evidence that the end was a teardown crash and not
an exit status the program chose is a signal: the worker itself died by one, or torchrun's root-cause report
says its failed rank did.  A program that chose a nonzero status exits with it, never by a signal — so an exit
code without a signal is judged by the policy as before, whatever the lines said.

Pure: the caller passes what it read.
"""

from __future__ import annotations

from typing import Mapping, Optional

from hangwatch.common.protocol import EXIT_STOP_REASON
from hangwatch.supervisor.rules.policy import FINISH_REASONS


def finished_stop(stop: Optional[Mapping]) -> bool:
    """Whether a rank's last `stop` line ({"reason", "code"}) says its work was done."""
    if not stop:
        return False
    reason = stop.get("reason")
    if reason in FINISH_REASONS:
        return True
    code = stop.get("code")
    return reason == EXIT_STOP_REASON and type(code) is int and code == 0


def teardown_crash(
    exit_code: Optional[int],
    exit_signal: Optional[str],
    stops: Mapping[int, Optional[Mapping]],
    root_cause: Optional[Mapping],
) -> Optional[str]:
    """Why the run is finished although the worker's exit was not clean, or None (judge the exit as usual).

    `exit_code`: the worker's exit code (None when a signal ended it); `exit_signal`: that signal's name;
    `stops`: {rank: its last `stop` line or None} for every rank of the attempt; `root_cause`: torchrun's report
    ({rank, exitcode, signal}) or None."""
    said = _all_done(stops)
    if (exit_code == 0 and exit_signal is None) or said is None:
        return None
    if exit_signal is not None:
        who, how = "the worker", exit_signal
    elif root_cause and root_cause.get("signal"):
        rank = root_cause.get("rank")
        who = f"rank {rank}" if rank is not None else "a rank"
        how = str(root_cause["signal"])
    else:
        return None
    return (
        f"{who} died by {how} while exiting, after every rank had finished its work ({said}): a crash in the "
        f"process's teardown, not in the run; not restarting"
    )


def exit_hang(deadline: Optional[str], stops: Mapping[int, Optional[Mapping]]) -> Optional[str]:
    """Why a worker killed for not exiting after its `stop` lines ends a finished run, or None.  `deadline`: the name
    of the deadline that fired (`exit`: armed once every rank said `stop`); `stops` as for `teardown_crash`.  Every
    rank had said its work was done: what hung was the way out (a non-daemon thread, a library's teardown, a
    launcher waiting for its peers) — the run is finished once the tree is gone, not started again from the top."""
    said = _all_done(stops)
    if deadline != "exit" or said is None:
        return None
    return (
        f"the worker did not exit after every rank had finished its work ({said}); its tree was killed: a hang on "
        f"the way out, not in the run; not restarting"
    )


def _all_done(stops: Mapping[int, Optional[Mapping]]) -> Optional[str]:
    """What each rank said, when every one said its work was done (at least one rank); else None."""
    if not stops or not all(finished_stop(s) for s in stops.values()):
        return None
    return "; ".join(
        f"rank {r}: "
        + ("the interpreter exited with status 0" if s["reason"] == EXIT_STOP_REASON else f"stop {s['reason']!r}")
        for r, s in sorted(stops.items())
    )


__all__ = ["teardown_crash", "exit_hang", "finished_stop"]
