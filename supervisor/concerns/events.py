"""The moments a concern only observes, one small frozen event each, on one stream (`Concern.observe`).

The loop (and its intake) emits them through `concerns.tell`, to every registered concern in the order of
`registered`; a concern hears an event in the method its `hook` names (`on_beat(ev)`, …) if it has one.  An observer
answers nothing — what changes the flow is asked at the decision points of `base.Concern`
instead.  Each event carries `now`, the pass's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional, Union

if TYPE_CHECKING:  # annotations only
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.rules.outcome import Intent, Outcome
    from hangwatch.supervisor.rules.states import State
    from hangwatch.supervisor.watch.deadlines import Expired, RankTrack


@dataclass(frozen=True)
class PassState:
    """Where the pass settled, for the concerns that follow it (goodput, the standby)."""

    state: "State"
    intent: "Intent"
    attempt: Optional["Attempt"]
    episode: Optional["Episode"]
    expired: Optional["Expired"]
    main: Optional["RankTrack"]  # the main rank's tracker, when an attempt runs


@dataclass(frozen=True)
class Prepared:
    """The supervisor starts: a concern reads what it keeps in the run dir."""

    hook: ClassVar[str] = "on_prepared"  # the method of a concern that hears it
    now: float


@dataclass(frozen=True)
class AttemptStarted:
    """A new attempt's worker was spawned (`attempt.resume_from`: what it was handed; `resume_step`: its step)."""

    hook: ClassVar[str] = "on_attempt_started"  # the method of a concern that hears it
    attempt: "Attempt"
    resume_step: Optional[int]
    now: float


@dataclass(frozen=True)
class Beat:
    """One heartbeat line `rec` of rank `track.rank`, written at `at`; `left`: the phase the rank was in before it."""

    hook: ClassVar[str] = "on_beat"  # the method of a concern that hears it
    attempt: "Attempt"
    track: "RankTrack"
    rec: dict
    left: Optional[str]
    at: float
    now: float


@dataclass(frozen=True)
class OutputProgress:
    """A worker that does not beat showed progress in its output."""

    hook: ClassVar[str] = "on_output_progress"  # the method of a concern that hears it
    attempt: "Attempt"
    now: float


@dataclass(frozen=True)
class AttemptEnded:
    """The attempt's tree is gone (its decision is asked next)."""

    hook: ClassVar[str] = "on_attempt_ended"  # the method of a concern that hears it
    attempt: "Attempt"
    episode: "Episode"
    now: float


@dataclass(frozen=True)
class StopRequested:
    """The worker was asked to checkpoint and exit (a stop, a pause, a graceful restart: `intent`)."""

    hook: ClassVar[str] = "on_stop_requested"  # the method of a concern that hears it
    attempt: "Attempt"
    intent: "Intent"
    now: float


@dataclass(frozen=True)
class OutcomeReached:
    """What follows the episode was decided."""

    hook: ClassVar[str] = "on_outcome"  # the method of a concern that hears it
    outcome: "Outcome"
    now: float


@dataclass(frozen=True)
class PassBegins:
    """Before the current state's handler runs."""

    hook: ClassVar[str] = "on_pass_begins"  # the method of a concern that hears it
    now: float


@dataclass(frozen=True)
class PassSettled:
    """The pass's state settled (`where`)."""

    hook: ClassVar[str] = "on_pass_settled"  # the method of a concern that hears it
    where: "PassState"
    now: float


@dataclass(frozen=True)
class Closing:
    """The supervisor ends."""

    hook: ClassVar[str] = "on_closing"  # the method of a concern that hears it
    now: float


Event = Union[
    Prepared,
    AttemptStarted,
    Beat,
    OutputProgress,
    AttemptEnded,
    StopRequested,
    OutcomeReached,
    PassBegins,
    PassSettled,
    Closing,
]
