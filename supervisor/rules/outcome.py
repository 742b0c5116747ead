"""What follows once no worker process is left: the one decision, pure and table-tested.

Two things can decide it.  An explicit request (`after_teardown`: stop → STOPPED, pause → PAUSED,
restart/resume → STARTING at once) always wins.  Without one, the restart policy's `Decision` on
how the worker ended does: finish → FINISHED, fail → FAILED (with the worker's own do-not-restart
code as the exit code — a rank's when the decision carries one, which torchrun's own exit 1 hides — else 1),
restart → BACKOFF for its delay.  With neither (a backoff or a
pause that is still running) nothing changes.

The same function serves the three places that ask: the end of a failure episode (the tree is
gone), a request during BACKOFF, and a request while PAUSED.

The no-progress stop is the restart policy's (`rules.policy.ProgressPolicy`).

`run_exit_status` is what `hangwatch run` then exits with: the command's own status where the command's own exit
ended the run, hangwatch's codes only where hangwatch ended it (`common.exitcodes`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from hangwatch.common.exitcodes import (
    EXIT_FAILED,
    EXIT_IOERR,
    EXIT_NO_RETRY,
    EXIT_OK,
    EXIT_TEMPFAIL,
    NO_RESTART_CODES,
)
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.rules.states import State


class Intent(enum.Enum):
    """What an operator asked to follow the current worker (`none`: let the restart policy decide)."""

    NONE = None
    EXIT = "exit"  # SIGTERM/SIGINT to the supervisor, `stop`
    REQUEUE = "requeue"  # SIGUSR1 to the supervisor (a batch job's time limit is near): stop, to be run again
    PAUSE = "pause"
    RESTART = "restart"  # `restart`, `resume`
    FAIL = "fail"  # the supervisor cannot go on (the disk refused its writes): stop the worker, end failed
    PEER_FAILED = (
        "peer_failed"  # several nodes: a peer's supervisor ended failed (its crash loop): the run cannot go on
    )


STOPS = frozenset({Intent.EXIT, Intent.REQUEUE})  # the intents that end the run STOPPED


@dataclass(frozen=True)
class Outcome:
    state: State
    why: str
    exit_code: int = EXIT_OK
    delay_s: float = 0.0  # BACKOFF only: how long before the next attempt


REQUESTED = {
    Intent.EXIT: (State.STOPPED, "stop requested", EXIT_OK),
    # exit 75 (sysexits' "try again later"): the job script requeues the job, which resumes from the checkpoint
    Intent.REQUEUE: (State.STOPPED, "stopped to be run again (requeue)", EXIT_TEMPFAIL),
    Intent.PAUSE: (State.PAUSED, "pause requested", EXIT_OK),
    Intent.RESTART: (State.STARTING, "restart requested", EXIT_OK),
    Intent.FAIL: (State.FAILED, "the run cannot go on", EXIT_IOERR),
    Intent.PEER_FAILED: (State.FAILED, "a peer node failed", EXIT_FAILED),
}


def next_outcome(
    intent: Intent,
    decision: Optional[Decision],
    exit_code: Optional[int] = None,
    during: Optional[str] = None,
    reason: Optional[str] = None,
) -> Optional[Outcome]:
    """(request, policy decision, the worker's exit code) → what comes next; None: stay as it is.

    `during` names the state a request arrived in ("backoff", "paused"), for the reason given;
    `reason` replaces the request's generic words (why a FAIL: "no space left on device at PATH").
    """
    if intent in STOPS and decision is not None and decision.action == "finish":
        return Outcome(State.FINISHED, decision.reason)  # the work was done before the stop: nothing to run again
    if intent is not Intent.NONE:
        state, why, code = REQUESTED[intent]
        why = reason or why
        return Outcome(state, f"{why} during {during}" if during else why, code)
    if decision is None:
        return None
    if decision.action == "finish":
        return Outcome(State.FINISHED, decision.reason)
    if decision.action == "fail":
        code = decision.exit_code if decision.exit_code is not None else exit_code
        return Outcome(State.FAILED, decision.reason, code if code in NO_RESTART_CODES else EXIT_FAILED)
    when = f"next attempt in {decision.delay_s:g}s" if decision.delay_s > 0 else "restarting at once"
    return Outcome(State.BACKOFF, f"{decision.reason}; {when}", delay_s=decision.delay_s)


def done_before_stop(code: Optional[int], stop_reason: Optional[str]) -> Optional[Decision]:
    """A worker that exits 0 saying its work is finished, while a stop was on its way, finished the run: a requeue
    would run a finished training again.  None: the exit answered the stop."""
    if code == 0 and stop_reason == "finished":
        return Decision("finish", "worker finished its work as the stop was requested")
    return None


SIGNALLED = 128  # a shell's status for death by signal N is 128+N


def shell_status(code: Optional[int], signum: Optional[int]) -> Optional[int]:
    """How a shell reports a process's end: its code, or 128+N for signal N; None when it has not ended."""
    if code is not None:
        return code
    return SIGNALLED + signum if signum else None


def run_exit_status(
    out: Outcome,
    decision: Optional[Decision],
    *,
    code: Optional[int],
    signum: Optional[int],
    by_itself: bool,
    stop_signal: Optional[int],
    transparent: bool,
) -> int:
    """`hangwatch run`'s exit status at a final outcome (pure).

    `code`/`signum`: how the last attempt's worker ended; `by_itself`: it ended on its own (not killed by hangwatch
    after a stall); `stop_signal`: the signal that stopped the run (SIGINT, SIGTERM, SIGHUP, SIGQUIT), passed on to
    the command; `transparent`: `hangwatch run` in the foreground, standing in for the command (a service keeps its
    own codes: 0 for a stop, 1 for a failure)."""
    if not transparent:
        return out.exit_code
    if out.state is State.STOPPED and stop_signal is not None and out.exit_code == EXIT_OK:
        # the command's answer to the signal it was passed: its own code (a KeyboardInterrupt handler that saved and
        # exited), else the signal's status as a shell reports the bare command's (130 after Ctrl-C)
        return code if code is not None else SIGNALLED + stop_signal
    if out.state is not State.FAILED:
        return out.exit_code
    if decision is not None and decision.exit_code is not None:
        return decision.exit_code  # a rank's do-not-restart code, or hangwatch's own do-not-retry
    if out.exit_code != EXIT_FAILED:
        return out.exit_code  # the worker's own do-not-restart code, or hangwatch's (a full disk, a spawn that failed)
    if by_itself:
        status = shell_status(code, signum)
        if status:
            return status
    return EXIT_NO_RETRY  # hangwatch ended it (stalls it killed, again and again): another run would do the same
