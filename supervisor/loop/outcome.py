"""What follows once no worker process is left: the one decision, pure and table-tested.

Two things can decide it.  An explicit request (`after_teardown`: stop → STOPPED, pause → PAUSED,
restart/resume → STARTING at once) always wins.  Without one, the restart policy's `Decision` on
how the worker ended does: finish → FINISHED, fail → FAILED (with the worker's own do-not-restart
code as the exit code, else 1), restart → BACKOFF for its delay.  With neither (a backoff or a
pause that is still running) nothing changes.

The same function serves the three places that ask: the end of a failure episode (the tree is
gone), a request during BACKOFF, and a request while PAUSED.

The no-progress stop (`NoProgress`, pure; `ProgressPolicy` puts it into the restart policy's decision):
restarts that fail `restart.no_progress_restarts` times in a row without stepping past the last good
step — the step the attempt resumed from — end the run `failed` before the restart budget is spent on
hopeless attempts (a resume that never steps, a crash at the same place after every resume).  Unlike
the crash loop it does not depend on how fast the attempts fail.  The supervisor's ops layer records
the `no_progress` incident and alerts (`supervisor.app.Ops`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional

from hangwatch.common.config import RestartCfg
from hangwatch.common.exitcodes import EXIT_FAILED, EXIT_IOERR, EXIT_OK, NO_RESTART_CODES
from hangwatch.supervisor.loop.policy import Decision, RestartPolicy
from hangwatch.supervisor.loop.states import State


class Intent(enum.Enum):
    """What an operator asked to follow the current worker (`none`: let the restart policy decide)."""

    NONE = None
    EXIT = "exit"  # SIGTERM/SIGINT to the supervisor, `stop`
    PAUSE = "pause"
    RESTART = "restart"  # `restart`, `resume`
    FAIL = "fail"  # the supervisor cannot go on (the disk refused its writes): stop the worker, end failed
    PEER_FAILED = "peer_failed"  # several nodes: a peer's supervisor ended failed (its crash loop): the run cannot go on


@dataclass(frozen=True)
class Outcome:
    state: State
    why: str
    exit_code: int = EXIT_OK
    delay_s: float = 0.0  # BACKOFF only: how long before the next attempt


REQUESTED = {
    Intent.EXIT: (State.STOPPED, "stop requested", EXIT_OK),
    Intent.PAUSE: (State.PAUSED, "pause requested", EXIT_OK),
    Intent.RESTART: (State.STARTING, "restart requested", EXIT_OK),
    Intent.FAIL: (State.FAILED, "the run cannot go on", EXIT_IOERR),
    Intent.PEER_FAILED: (State.FAILED, "a peer node failed", EXIT_FAILED),
}


def resolve(intent: Intent, decision: Optional[Decision], exit_code: Optional[int] = None,
            during: Optional[str] = None, reason: Optional[str] = None) -> Optional[Outcome]:
    """(request, policy decision, the worker's exit code) → what comes next; None: stay as it is.

    `during` names the state a request arrived in ("backoff", "paused"), for the reason given;
    `reason` replaces the request's generic words (why a FAIL: "no space left on device at PATH").
    """
    if intent is not Intent.NONE:
        state, why, code = REQUESTED[intent]
        why = reason or why
        return Outcome(state, f"{why} during {during}" if during else why, code)
    if decision is None:
        return None
    if decision.action == "finish":
        return Outcome(State.FINISHED, decision.reason)
    if decision.action == "fail":
        return Outcome(State.FAILED, decision.reason, exit_code if exit_code in NO_RESTART_CODES else EXIT_FAILED)
    when = f"next attempt in {decision.delay_s:g}s" if decision.delay_s > 0 else "restarting at once"
    return Outcome(State.BACKOFF, f"{decision.reason}; {when}", delay_s=decision.delay_s)


@dataclass
class NoProgress:
    """Counts the restarts in a row that ended without a step past their reference step.  `limit` 0: off."""

    limit: int
    streak: int = 0

    def attempt_ended(self, restart: bool, reference: Optional[int], top: Optional[int]) -> bool:
        """An attempt failed; `restart`: it was started by a restart (not the run's first); `reference`: the last
        good step when it started (None: no good checkpoint, step 0); `top`: its highest step (None: none).
        True when the limit is reached."""
        if not restart:
            return False
        if top is not None and top > (reference if reference is not None else 0):
            self.streak = 0
            return False
        self.streak += 1
        return self.limit > 0 and self.streak >= self.limit

    def words(self, reference: Optional[int]) -> str:
        past = f"step {reference}, the last good checkpoint" if reference is not None else "step 0 (no good checkpoint yet)"
        return f"no progress: {self.streak} restart(s) in a row ended without stepping past {past}"


class ProgressPolicy(RestartPolicy):
    """The restart policy with the no-progress stop: a failure that reaches the limit is a `fail` decision,
    and `gave_up` says why (the ops layer turns it into the `no_progress` incident and alert).

    `last_good_step` is read when an attempt starts: the step it resumes from."""

    def __init__(self, cfg: RestartCfg, limit: int, last_good_step: Callable[[], Optional[int]] = lambda: None):
        super().__init__(cfg)
        self.no_progress = NoProgress(limit)
        self.last_good_step = last_good_step
        self.started = 0
        self.reference: Optional[int] = None
        self.attempt_top: Optional[int] = None
        self.gave_up: Optional[dict] = None

    def attempt_started(self, now: float) -> None:
        super().attempt_started(now)
        self.started += 1
        self.reference = self.last_good_step()
        self.attempt_top = None

    def observed_step(self, step: int, now: float) -> bool:
        self.attempt_top = step if self.attempt_top is None else max(self.attempt_top, step)
        return super().observed_step(step, now)

    def on_failure(self, now: float, reason: str, *, rollback: bool = False) -> Decision:
        decision = super().on_failure(now, reason, rollback=rollback)
        hopeless = self.no_progress.attempt_ended(self.started > 1, self.reference, self.attempt_top)
        if decision.action != "restart" or not hopeless:
            return decision
        why = f"{self.no_progress.words(self.reference)} (restart.no_progress_restarts {self.no_progress.limit}); " \
              f"last failure: {reason}"
        self.gave_up = {"reason": why, "restarts": self.no_progress.streak, "last_good_step": self.reference,
                        "attempt_top_step": self.attempt_top, "last_failure": reason}
        return Decision("fail", why)
