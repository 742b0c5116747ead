"""The one interface between the loop and what it watches for besides the deadlines: `Concern`.

A concern observes what the loop observes — an attempt's start, each heartbeat line, an overdue deadline, an
episode (a failure or an end, from detection until the tree is gone), the pass's settled state — and answers with
what it decides, or nothing: a deadline it handled without a stall, a reason to end the run, a replacement for the
episode's decision, a wait before the next attempt.  Every hook has a no-op default, so a concern implements only
the few it needs; the loop calls each hook for every registered concern in one `for`, and never asks which
concern it is.  A concern switched off in the config is not registered (`concerns.registered`): it is absent from
the pass, not an `if` in it.

What a concern may touch is in `RunContext` (built once by the loop; `facts` follows the loop's record): the
config, the run dir and its writes, the incident store, the deadlines and the run's record.  It never signals,
spawns or kills; an incident it owns it creates and amends through the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

if TYPE_CHECKING:  # annotations only
    from hangwatch.common.config import Config
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.incidents import IncidentStore
    from hangwatch.supervisor.processes.attempt import Attempt, Worker
    from hangwatch.supervisor.records.run_state import RunRecord
    from hangwatch.supervisor.rules.outcome import Intent, Outcome
    from hangwatch.supervisor.rules.policy import Decision
    from hangwatch.supervisor.rules.states import State
    from hangwatch.supervisor.watch.deadlines import Deadlines, Expired, RankTrack


@dataclass
class RunContext:
    """What every concern is handed once: the loop keeps `facts` current (it is replaced when a previous
    supervisor's record is read back); `changed()` tells the loop its read model is stale; `write_failed(exc,
    path)` reports a write the disk refused (the loop decides whether the run can go on)."""

    cfg: "Config"
    run_dir: Path
    fs: "FsOps"
    incidents: "IncidentStore"
    deadlines: "Deadlines"
    facts: "RunRecord"
    changed: Callable[[], None] = lambda: None
    write_failed: Callable[[OSError, Path], None] = lambda exc, path: None
    where: Callable[[], Optional["PassState"]] = lambda: None  # the loop's situation now


@dataclass(frozen=True)
class PassState:
    """Where the pass settled, for the concerns that follow it (goodput, the standby)."""

    state: "State"
    intent: "Intent"
    attempt: Optional["Attempt"]
    episode: Optional["Episode"]
    expired: Optional["Expired"]
    main: Optional["RankTrack"]  # the main rank's tracker, when an attempt runs


@dataclass
class Concern:
    """The no-op base of every concern: override the hooks you need."""

    run: RunContext
    name: str = field(default="concern", init=False)

    def __post_init__(self) -> None:
        """A concern's own state (its name, what it keeps between hooks): set here, never read from the run dir."""

    def prepare(self, now: float) -> None:
        """The supervisor starts: read what this concern keeps in the run dir."""

    # ---- an attempt

    def attempt_started(self, attempt: "Attempt", resume_step: Optional[int], now: float) -> None:
        """A new attempt's worker was spawned (`attempt.resume_from`: what it was handed)."""

    def take_worker(self, number: int, adir: Path, resume_from: str, now: float) -> Optional["Worker"]:
        """A worker already loaded for attempt `number` (a prewarmed standby), released now; None: spawn one."""
        return None

    def own_pids(self) -> set[int]:
        """Processes this concern started that are not part of any attempt's tree (never its orphans)."""
        return set()

    def beat(self, attempt: "Attempt", tr: "RankTrack", rec: dict, left: Optional[str], at: float, now: float) -> None:
        """One heartbeat line of rank `tr.rank`, written at `at`; `left`: the phase the rank was in before it."""

    def output_progress(self, attempt: "Attempt", now: float) -> None:
        """A worker that does not beat showed progress in its output."""

    def overdue(self, attempt: "Attempt", expired: "Expired", now: float) -> bool:
        """A deadline is overdue: True when this concern handled it without a stall (the deadlines re-armed)."""
        return False

    def while_running(self, attempt: "Attempt", now: float) -> Optional[str]:
        """Each pass while a worker runs: why the run must end now (the attempt is killed, the run fails), or None."""
        return None

    def hold_exit(self, attempt: "Attempt", now: float) -> bool:
        """The worker exited: True to read its exit in a later pass (what it last said is still on its way)."""
        return False

    def attempt_ended(self, attempt: "Attempt", episode: "Episode", now: float) -> None:
        """The attempt's tree is gone."""

    # ---- an episode

    def episode_opened(self, attempt: "Attempt", episode: "Episode", intent: "Intent", now: float) -> dict[str, Any]:
        """An episode began — a stall, a peer's restart, an exit (with its decision), the exit of a graceful stop —
        and `intent` is what was asked to follow the worker: fields for its incident."""
        return {}

    def decision(
        self, attempt: "Attempt", episode: "Episode", decision: Optional["Decision"], now: float
    ) -> Optional["Decision"]:
        """A replacement for the episode's decision (an OOM's remedy, a failure that cannot be survived), or None."""
        return None

    def before_kill(self, attempt: "Attempt", episode: "Episode", now: float) -> Optional[str]:
        """A stall's dumps are in and its tree is about to be killed: why the kill waits instead (this concern asked
        the worker to recover in its own process; `recovering` says how that went), or None."""
        return None

    def recovering(self, attempt: "Attempt", episode: "Episode", now: float) -> Optional[bool]:
        """While the kill waits on this concern: True, the worker recovered (the attempt goes on); False, it did not
        (the kill); None, still waiting, or not this concern's wait."""
        return None

    def stop_requested(self, attempt: "Attempt", intent: "Intent", now: float) -> None:
        """The worker was asked to checkpoint and exit (a stop, a pause, a graceful restart)."""

    def hold_teardown(self, attempt: "Attempt", episode: "Episode", intent: "Intent", now: float) -> bool:
        """The tree's teardown is over: True to keep the loop waiting before what follows (processes remain)."""
        return False

    def outcome(self, out: "Outcome", now: float) -> None:
        """What follows the episode was decided."""

    # ---- every pass

    def pass_begins(self, now: float) -> None:
        """Before the current state's handler runs."""

    def settled(self, where: PassState, now: float) -> None:
        """The pass's state settled."""

    def next_due_s(self, now: float) -> Optional[float]:
        """Seconds until this concern needs a pass (None: never on its account)."""
        return None

    def readers(self, now: float) -> dict[str, Callable[[], Any]]:
        """Fields of the read model this concern provides, read on first use."""
        return {}

    def close(self, now: float) -> None:
        """The supervisor ends."""
