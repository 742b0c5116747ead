"""Restart policy: what follows a worker's end, and how long to wait before the next attempt.

* exit 0 after a `stop` line with reason `finished` (or `idle`): the run is done;
* exit 65 (EX_DATAERR), 74 (EX_IOERR) or 78 (EX_CONFIG): restarting cannot help — the run fails with that code;
  so does such an error of one rank under torchrun, which exits 1 for it (`no_retry`: the rank's last words or
  torchrun's root-cause report, read by the caller);
* exit 75 (EX_TEMPFAIL, non-finite loss streak): restart; the worker rolls back to the newest
  *good* checkpoint by itself;
* anything else — another code, a signal, a stall the supervisor killed: restart.

The first restart after a healthy stretch starts at once: a run that failed once gains nothing by
waiting, and its whole recovery is then the worker's cold start.  Only repeated failure backs off:
the second consecutive failure waits `backoff_initial_s`, each further one twice as long, capped at
`backoff_max_s`.  An attempt that ran `healthy_after_s` and made steps ends the streak (the run's
first attempt starts with none).  The crash-loop guard does not depend on the delays: more than
`max_restarts` restarts within `window_s` without a new step (a step beyond the highest ever
reached, so replaying the same steps after each resume does not count) fail the run.
Pure logic: every method takes `now`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

from hangwatch.common.config import RestartCfg
from hangwatch.common.exitcodes import (
    EXIT_CONFIG,
    EXIT_DATAERR,
    EXIT_IOERR,
    EXIT_NO_RETRY,
    EXIT_TEMPFAIL,
    NO_RESTART_CODES,
)
from hangwatch.common.protocol import EXIT_STOP_REASON
from hangwatch.supervisor.rules.no_retry import NoRetry

FINISH_REASONS = frozenset({"finished", "idle"})
NO_RESTART_WORDS = {
    EXIT_CONFIG: "configuration error (EX_CONFIG)",
    EXIT_DATAERR: "unusable data (EX_DATAERR)",
    EXIT_IOERR: "the disk refused a write (EX_IOERR): make room, then `hangwatch run` resumes from the last good "
    "checkpoint",
}


@dataclass(frozen=True)
class Decision:
    action: str  # "restart", "finish" or "fail"
    reason: str
    delay_s: float = 0.0
    crash_loop: bool = False
    rollback: bool = False  # the worker is expected to roll back to the last good checkpoint
    # The do-not-restart code the run ends with when it is not the worker's own (a rank's, which torchrun's
    # exit 1 hides); None: the worker's exit code is the one
    exit_code: Optional[int] = None

    def as_dict(self) -> dict:
        out = {
            "action": self.action,
            "reason": self.reason,
            "delay_s": round(self.delay_s, 3),
            "crash_loop": self.crash_loop,
            "rollback": self.rollback,
        }
        if self.exit_code is not None:
            out["exit_code"] = self.exit_code
        return out


class RestartPolicy:
    def __init__(self, cfg: RestartCfg):
        self.cfg = cfg
        self.consecutive = 0  # failures since the last healthy stretch
        self.recent: deque[float] = deque()  # restart times since the last new step
        self.best_step = -1
        self.attempt_started_at: Optional[float] = None
        self.attempt_stepped = False
        self.total_restarts = 0

    def attempt_started(self, now: float, last_good_step: Optional[int] = None) -> None:
        """An attempt was spawned; `last_good_step`: the step it resumes from (what `ProgressPolicy` judges by)."""
        self.attempt_started_at = now
        self.attempt_stepped = False

    def observed_step(self, step: int, now: float) -> bool:
        """A step line; True when it is a new high (which clears the crash-loop count)."""
        self.attempt_stepped = True
        if step > self.best_step:
            self.best_step = step
            self.recent.clear()
            return True
        return False

    def backoff_s(self, failures: int) -> float:
        """The delay before the restart that follows `failures` consecutive failures: none after the first."""
        if failures <= 1:
            return 0.0
        delay = self.cfg.backoff_initial_s * (2 ** (failures - 2))
        return float(min(delay, self.cfg.backoff_max_s))

    def on_exit(
        self,
        now: float,
        code: Optional[int],
        stop_reason: Optional[str] = None,
        own_command: bool = False,
        no_retry: Optional[NoRetry] = None,
        teardown: Optional[str] = None,
    ) -> Decision:
        """The worker exited by itself with `code` (None: killed by a signal).  `own_command`: the worker is the
        user's command (`worker.command`), which owes hangwatch no `stop` line: exit 0 without one is a command
        that completed, as it would be in a shell (the built-in worker always says why it stops).  `no_retry`: a
        rank's do-not-restart error (`no_retry.no_retry_code`), which fails the run with the rank's code.
        `teardown`: why the exit, unclean as it is, came after every rank had finished (`rules.teardown`): a finish."""
        if teardown is not None:
            return Decision("finish", teardown)
        if code == 0 and stop_reason in FINISH_REASONS:
            return Decision("finish", f"worker exited 0 after stop {stop_reason!r}")
        if code == 0 and stop_reason in (None, EXIT_STOP_REASON) and own_command:
            return Decision("finish", "worker exited 0: the command completed")
        if code in NO_RESTART_CODES:
            return Decision("fail", f"worker exited {code}: {NO_RESTART_WORDS[code]}; not restarting")
        if no_retry is not None and no_retry.code in NO_RESTART_CODES:
            said = no_retry.message.strip().splitlines()[0][:300] if no_retry.message.strip() else ""
            how = f"exited with code {code}" if code is not None else "ended by a signal"
            what, _, advice = NO_RESTART_WORDS[no_retry.code].partition(": ")
            who = f"rank {no_retry.rank}" if no_retry.rank is not None else "a rank"
            return Decision(
                "fail",
                f"{who} exited {no_retry.code}: {what}"
                + (f": {said}" if said else "")
                + f"; not restarting (the worker {how})"
                + (f"; {advice}" if advice else ""),
                exit_code=no_retry.code,
            )
        if code == EXIT_TEMPFAIL:
            return self.on_failure(
                now,
                f"worker exited {code}: non-finite loss streak; restart from the last good checkpoint",
                rollback=True,
            )
        return self.on_failure(now, "worker exited" + (f" with code {code}" if code is not None else " by a signal"))

    def on_failure(self, now: float, reason: str, *, rollback: bool = False) -> Decision:
        """A failed attempt (crash or stall): restart after a backoff, or stop a crash loop."""
        started = self.attempt_started_at
        if started is not None and self.attempt_stepped and now - started >= self.cfg.healthy_after_s:
            self.consecutive = 0
        while self.recent and now - self.recent[0] > self.cfg.window_s:
            self.recent.popleft()
        if len(self.recent) >= self.cfg.max_restarts:
            return Decision(
                "fail",
                f"crash loop: {len(self.recent)} restart(s) within {self.cfg.window_s:g}s without a new step "
                f"(max_restarts {self.cfg.max_restarts}); last failure: {reason}",
                crash_loop=True,
            )
        self.recent.append(now)
        self.consecutive += 1
        self.total_restarts += 1
        return Decision("restart", reason, delay_s=self.backoff_s(self.consecutive), rollback=rollback)


# ---- the no-progress stop: restarts that fail `restart.no_progress_restarts` times in a row without stepping past
# the last good step — the step the attempt resumed from — end the run `failed` before the restart budget is spent
# on hopeless attempts (a resume that never steps, a crash at the same place after every resume).  Unlike the crash
# loop it does not depend on how fast the attempts fail.  The loop records the `no_progress` incident.


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
        past = (
            f"step {reference}, the last good checkpoint"
            if reference is not None
            else "step 0 (no good checkpoint yet)"
        )
        return f"no progress: {self.streak} restart(s) in a row ended without stepping past {past}"


class ProgressPolicy(RestartPolicy):
    """The restart policy with the no-progress stop: a failure that reaches the limit is a `fail` decision,
    and `gave_up` says why (the loop turns it into the `no_progress` incident; the alert follows from it).

    The loop hands each attempt's reference step to `attempt_started`: the last good step it resumes from."""

    def __init__(self, cfg: RestartCfg, limit: int):
        super().__init__(cfg)
        self.no_progress = NoProgress(limit)
        self.started = 0
        self.reference: Optional[int] = None
        self.attempt_top: Optional[int] = None
        self.gave_up: Optional[dict] = None

    def attempt_started(self, now: float, last_good_step: Optional[int] = None) -> None:
        super().attempt_started(now, last_good_step)
        self.started += 1
        self.reference = last_good_step
        self.attempt_top = None

    def observed_step(self, step: int, now: float) -> bool:
        self.attempt_top = step if self.attempt_top is None else max(self.attempt_top, step)
        return super().observed_step(step, now)

    def on_failure(self, now: float, reason: str, *, rollback: bool = False) -> Decision:
        decision = super().on_failure(now, reason, rollback=rollback)
        hopeless = self.no_progress.attempt_ended(self.started > 1, self.reference, self.attempt_top)
        if decision.action != "restart" or not hopeless:
            return decision
        why = (
            f"{self.no_progress.words(self.reference)} (restart.no_progress_restarts {self.no_progress.limit}); "
            f"last failure: {reason}"
        )
        self.gave_up = {
            "reason": why,
            "restarts": self.no_progress.streak,
            "last_good_step": self.reference,
            "attempt_top_step": self.attempt_top,
            "last_failure": reason,
        }
        return Decision("fail", why, exit_code=EXIT_NO_RETRY)  # a run that cannot get past a point: do not retry
