"""What has been asked of the run and not yet carried out: the record that signals, control requests and a disk that
refused a write fill in while the loop drains its events, and the loop's handlers act on in the same pass.

Recording never signals, spawns or kills; it logs what was asked.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import structlog

from hangwatch.common.durable import describe_write_error, disk_error
from hangwatch.supervisor.rules.outcome import STOPS, Intent
from hangwatch.supervisor.rules.states import State

log = structlog.get_logger("hangwatch")


@dataclass
class Intents:
    state: Callable[[], State] = lambda: State.STARTING  # the loop's state now
    after_teardown: Intent = Intent.NONE  # what an operator asked to follow the current worker
    force: bool = False  # a second stop: kill without waiting
    escalate_now: bool = False  # `restart now`: dump and kill
    stopped_by: Optional[str] = None  # who asked for the stop (a signal's sender, a control request)
    stop_signal: Optional[int] = None  # the signal that stopped the run (passed on to the command)
    fail_reason: Optional[str] = None  # why the run must end failed (the disk refused a write)
    abort: Optional[str] = None  # end the run at once (a concern said so: a diverged resume, say)

    def stop(self, why: str, intent: Intent, state: State, repeat_forces: bool = True, signum: int = 0) -> bool:
        """Ask the worker to checkpoint and stop (`Intent.REQUEUE`: to be run again); a second request forces the
        kill, unless `repeat_forces` is false (a batch job's signals: the scheduler's SIGKILL follows on its own
        clock).  True when this was the first request (systemd hears "stopping")."""
        if self.after_teardown in STOPS:
            if repeat_forces:
                self.force = True
                log.warning("stop_forced", why=why, say=f"{why} again: ending the command's tree now")
            else:
                log.info("stop_requested_again", why=why, state=state.value)
            return False
        self.after_teardown, self.stopped_by = intent, why
        self.stop_signal = signum or None
        log.info("stop_requested", why=why, intent=intent.value, state=state.value)
        return True

    def write_failed(self, exc: OSError, path: Path) -> None:
        """A write in the run dir failed.  Said on stderr first (the log file may be on the same disk);
        when it is the disk's fault (full, read-only, I/O error) the run cannot go on: the worker is
        stopped (it checkpoints if it still can; the last good checkpoint is never touched) and the run
        ends `failed`, exit 74, its reason naming the path.  Resuming is `hangwatch run` once there is room."""
        what = describe_write_error(exc, path)
        print(f"hangwatch: cannot write {path}: {exc}", file=sys.stderr, flush=True)
        log.error("write_failed", path=str(path), error=str(exc))
        if disk_error(exc) and self.fail_reason is None and not self.state().final:
            self.fail_reason = what
            self.after_teardown = Intent.FAIL
            log.error("run_cannot_go_on", why=what)

    def busy(self, state: State) -> Optional[str]:
        """Why a restart or pause cannot be taken now (None: it can)."""
        if state.final:
            return f"the run is over (state {state.value})"
        if self.after_teardown in STOPS:
            return "the supervisor is stopping"
        return None

    def new_attempt(self) -> None:
        """A new attempt starts: what was asked of the last one is done."""
        self.escalate_now, self.abort = False, None
