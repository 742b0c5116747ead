"""The one interface between the loop and what it watches for besides the deadlines: `Concern`.

A concern observes what the loop observes — an attempt's start, each heartbeat line, the end of its tree, the pass's
settled state — on one stream of small typed events (`events`, to `Concern.observe`), and answers nothing there.  It
decides only at a few decision points, methods that return an answer or nothing: a deadline it handled without a
stall, a reason to end the run, a replacement for the episode's decision, a wait before the kill or the next
attempt.  Every method has a no-op default, so a concern implements only what it needs; the loop tells each event to
every registered concern in one call (`concerns.tell`), resolves conflicting answers by the concerns' `priority`,
and never asks which concern it is.  A concern switched off in the config is not registered
(`concerns.registered`): it is absent from the pass, not an `if` in it.

What a concern may touch is in `RunContext` (built once by the loop; `facts` follows the loop's record): the
config, the run dir and its writes, the incident store, the deadlines and the run's record.  It never signals,
spawns or kills; an incident it owns it creates and amends through the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

from hangwatch.supervisor.concerns.events import Event, PassState

if TYPE_CHECKING:  # annotations only
    from hangwatch.common.config import Config
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.incidents import IncidentStore
    from hangwatch.supervisor.processes.attempt import Attempt, Worker
    from hangwatch.supervisor.records.run_state import RunRecord
    from hangwatch.supervisor.rules.answer import Answer
    from hangwatch.supervisor.rules.outcome import Intent
    from hangwatch.supervisor.rules.policy import Decision
    from hangwatch.supervisor.watch.deadlines import Deadlines, Expired


@dataclass
class RunContext:
    """What every concern is handed once: the loop keeps `facts` current (it is replaced when a previous
    supervisor's record is read back); `write_failed(exc, path)` reports a write the disk refused (the loop decides
    whether the run can go on)."""

    cfg: "Config"
    run_dir: Path
    fs: "FsOps"
    incidents: "IncidentStore"
    deadlines: "Deadlines"
    facts: "RunRecord"
    write_failed: Callable[[OSError, Path], None] = lambda exc, path: None
    where: Callable[[], Optional["PassState"]] = lambda: None  # the loop's situation now


@dataclass
class Concern:
    """The no-op base of every concern: add the `on_<event>` methods and override the decision points you need.

    Observers cannot decide; deciders return answers.  Everything the loop only tells a concern comes on one stream
    of small typed events (`events`), to `observe`, which hands each to the method its `hook` names (`on_beat(ev)`,
    `on_attempt_started(ev)`, …) where the concern has one; those answer nothing.  The few moments where a concern
    changes the flow are the decision points below, each a method that returns its answer (a no-op default answers
    nothing).  Where several concerns can answer one point and the
    answers conflict, `priority` resolves it — the higher wins — never their order in `registered`:

    - `decision`: asked in ascending priority, each concern handed the decision so far; the last replacement (the
      highest priority's) is the episode's;
    - `while_running`, `before_kill`, `take_worker`: the answer of the highest priority that answers;
    - `episode_opened`: the fields merged in ascending priority (a higher one's field wins).

    The other points combine every answer whatever the order: `overdue`, `hold_exit`, `hold_teardown` (any True),
    `recovering` (any False, then any True), `next_due_s` (the soonest), `readers` and `own_pids` (all of them).
    """

    run: RunContext
    name: str = field(default="concern", init=False)
    # Which answer wins where answers conflict (the higher); see above for the decision points that use it.
    priority: ClassVar[int] = 0

    def __post_init__(self) -> None:
        """A concern's own state (its name, what it keeps between events): set here, never read from the run dir."""

    # ---- the one observer

    def observe(self, event: "Event") -> None:
        """What the loop only tells (`events`: `Prepared`, `AttemptStarted`, `Beat`, `OutputProgress`,
        `AttemptEnded`, `StopRequested`, `OutcomeReached`, `PassBegins`, `PassSettled`, `Closing`), handed to the
        method the event's `hook` names (`on_beat(ev)`, …) where the concern has one.  Answers nothing; an exception
        raised there propagates to the loop."""
        heard = getattr(self, event.hook, None)
        if heard is not None:
            heard(event)

    # ---- decision points: an attempt

    def take_worker(self, number: int, adir: Path, resume_from: str, now: float) -> Optional["Worker"]:
        """Decision point: a worker already loaded for attempt `number` (a prewarmed standby), released now; None:
        spawn one.  Several answers: the highest priority's."""
        return None

    def own_pids(self) -> set[int]:
        """Decision point: processes this concern started that are not part of any attempt's tree (never its
        orphans).  Every concern's are joined."""
        return set()

    def overdue(self, attempt: "Attempt", expired: "Expired", now: float) -> bool:
        """Decision point: a deadline is overdue: True when this concern handled it without a stall (the deadlines
        re-armed).  Any True handles it."""
        return False

    def while_running(self, attempt: "Attempt", now: float) -> Optional[str]:
        """Decision point, each pass while a worker runs: why the run must end now (the attempt is killed, the run
        fails), or None.  Several answers: the highest priority's."""
        return None

    def hold_exit(self, attempt: "Attempt", now: float) -> bool:
        """Decision point: the worker exited: True to read its exit in a later pass (what it last said is still on
        its way).  Every concern is asked; any True holds."""
        return False

    # ---- decision points: an episode

    def episode_opened(self, attempt: "Attempt", episode: "Episode", intent: "Intent", now: float) -> dict[str, Any]:
        """Decision point: an episode began — a stall, a peer's restart, an exit (with its decision), the exit of a
        graceful stop — and `intent` is what was asked to follow the worker: fields for its incident.  Merged in
        ascending priority (a higher one's field wins)."""
        return {}

    def decision(
        self, attempt: "Attempt", episode: "Episode", decision: Optional["Decision"], now: float
    ) -> Optional["Answer"]:
        """Decision point, asked once, when the episode's tree is gone: an `Answer` — a replacement for the
        decision so far (an OOM's remedy, a failure that cannot be survived), the incident's fields, the files it
        wants written — or None.  It writes nothing: `concerns.decide` makes the writes and amends the incident.
        Asked in ascending priority, each concern handed the decision so far: the highest priority's replacement
        wins."""
        return None

    def before_kill(self, attempt: "Attempt", episode: "Episode", now: float) -> Optional[str]:
        """Decision point: a stall's dumps are in and its tree is about to be killed: why the kill waits instead
        (this concern asked the worker to recover in its own process; `recovering` says how that went), or None.
        Several answers: the highest priority's."""
        return None

    def recovering(self, attempt: "Attempt", episode: "Episode", now: float) -> Optional[bool]:
        """Decision point, while the kill waits on this concern: True, the worker recovered (the attempt goes on);
        False, it did not (the kill); None, still waiting, or not this concern's wait.  Any False kills."""
        return None

    def hold_teardown(self, attempt: "Attempt", episode: "Episode", intent: "Intent", now: float) -> bool:
        """Decision point: the tree's teardown is over: True to keep the loop waiting before what follows (processes
        remain).  Every concern is asked (none may miss the tree's end); any True holds."""
        return False

    # ---- decision points: every pass

    def next_due_s(self, now: float) -> Optional[float]:
        """Decision point: seconds until this concern needs a pass (None: never on its account).  The soonest wins."""
        return None

    def readers(self, now: float) -> dict[str, Callable[[], Any]]:
        """Decision point: fields of the read model this concern provides, read on first use."""
        return {}
