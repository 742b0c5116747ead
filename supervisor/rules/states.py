"""Supervisor lifecycle: an Enum of states and the only transitions allowed between them.

    STARTING ──start beat──▶ RUNNING ──stop finished, exit 0──▶ (KILLING: reap stragglers) ─▶ FINISHED
       │  ▲                    │
       │  │                    ├─deadline fired / restart now──▶ STALLED ─▶ DUMPING ─▶ KILLING
       │  │                    │                          ▲               │             ▲
       │  │                    │                          └── RUNNING ◀─ RECOVERING ───┘
       │  │                    │                                                       │
       │  │                    └─worker exited (crash, nan, signal, …)──▶ KILLING ─────┤
       │  │                                                                            ▼
       │  └────────────── BACKOFF ◀── restart with backoff ───── (decision after the tree is gone)
       │                    │                                      ├─▶ STARTING   restart now, no backoff
       └─startup timeout────┘                                      ├─▶ FAILED     do-not-restart code, crash loop
                                                                   ├─▶ STOPPED    stop requested
                                                                   └─▶ PAUSED     pause requested
    SIGTERM/SIGINT, `stop`, `pause`, `restart graceful`: RUNNING/STARTING ─▶ STOPPING (SIGTERM to the
    worker, which checkpoints and exits 0) ─▶ KILLING (stragglers) ─▶ STOPPED / PAUSED / STARTING.
    A deadline that fires while STOPPING escalates like any stall (STALLED → DUMPING → KILLING).
    DUMPING ─▶ RECOVERING: the dumps are in and a concern asked the worker to abandon its stuck step in its own
    process (`restart.in_process`); it answered (RUNNING, nothing killed) or did not within the grace (KILLING).
    PAUSED ─resume─▶ STARTING.  STOPPED, FINISHED and FAILED are final.
    STARTING ─▶ PAUSED before any worker is spawned: the run was paused when the previous supervisor
    ended (state.json `intent: pause`), and a pause outlives its supervisor.
    Several nodes: STARTING holds no worker while the next attempt waits for the rendezvous store, a new
    generation or the resume point (`nodes`); a request then ends it at once: STARTING ─▶ STOPPED / PAUSED /
    FAILED (a peer node failed, `Intent.PEER_FAILED`).

Every change goes through `StateMachine.transition`, which raises `IllegalTransition` (the project's
one, from `hangwatch.common.transitions`) for a move the table does not allow, so a logic error shows
up as an exception instead of a wedged supervisor.
"""

from __future__ import annotations

import enum
from typing import Callable, Optional

from hangwatch.common.transitions import IllegalTransition

__all__ = ["ESCALATING", "FINAL", "TRANSITIONS", "WATCHED", "IllegalTransition", "State", "StateMachine"]


class State(enum.Enum):
    STARTING = "starting"  # worker spawned (or about to be), waiting for its first `start` beat
    RUNNING = "running"  # start beat seen; deadlines armed
    STALLED = "stalled"  # a deadline fired; taking the process snapshot
    DUMPING = "dumping"  # SIGUSR1 sent, waiting for the stack dumps to stop growing
    RECOVERING = "recovering"  # the worker was asked to abandon its stuck step in its own process; waiting
    KILLING = "killing"  # SIGTERM → grace → SIGKILL to the tree, reaping, waiting for GPU memory
    BACKOFF = "backoff"  # tree gone, waiting before the next attempt
    STOPPING = "stopping"  # worker asked to checkpoint and exit (SIGTERM), waiting for it
    PAUSED = "paused"  # no worker, by request; `resume` starts one
    STOPPED = "stopped"  # stopped by request; the supervisor exits 0
    FINISHED = "finished"  # the worker finished the run; the supervisor exits 0
    FAILED = "failed"  # do-not-restart exit or crash loop; the supervisor exits non-zero

    @property
    def final(self) -> bool:
        return self in FINAL

    @property
    def watched(self) -> bool:
        """A worker runs (or is about to) and its deadlines apply."""
        return self in WATCHED

    @property
    def escalating(self) -> bool:
        """An episode is under way: snapshot, dumps, the kill."""
        return self in ESCALATING


FINAL = frozenset({State.STOPPED, State.FINISHED, State.FAILED})
WATCHED = frozenset({State.STARTING, State.RUNNING, State.STOPPING})
ESCALATING = frozenset({State.STALLED, State.DUMPING, State.RECOVERING, State.KILLING})

S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    S.STARTING: frozenset({S.RUNNING, S.STALLED, S.KILLING, S.STOPPING, S.FAILED, S.PAUSED, S.STOPPED}),
    S.RUNNING: frozenset({S.STALLED, S.KILLING, S.STOPPING}),
    S.STALLED: frozenset({S.DUMPING}),
    S.DUMPING: frozenset({S.KILLING, S.RECOVERING}),
    S.RECOVERING: frozenset({S.RUNNING, S.KILLING}),
    S.KILLING: frozenset({S.BACKOFF, S.STARTING, S.FAILED, S.STOPPED, S.PAUSED, S.FINISHED}),
    S.BACKOFF: frozenset({S.STARTING, S.STOPPED, S.PAUSED, S.FAILED}),
    S.STOPPING: frozenset({S.STALLED, S.KILLING}),
    S.PAUSED: frozenset({S.STARTING, S.STOPPED, S.FAILED}),
    S.STOPPED: frozenset(),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
}


class StateMachine:
    """The current state; a listener hears every accepted transition."""

    def __init__(
        self, initial: State = State.STARTING, *, on_change: Optional[Callable[[State, State, str], None]] = None
    ):
        self.state = initial
        self.reason = ""  # why the last accepted transition happened (a final state's is the run's end)
        self._on_change = on_change

    def transition(self, dst: State, reason: str = "") -> None:
        src = self.state
        if dst not in TRANSITIONS[src]:
            allowed = ", ".join(sorted(s.value for s in TRANSITIONS[src])) or "none (final state)"
            raise IllegalTransition(
                f"illegal transition {src.value} → {dst.value}"
                + (f" ({reason})" if reason else "")
                + f"; allowed from {src.value}: {allowed}"
            )
        self.state, self.reason = dst, reason
        if self._on_change is not None:
            self._on_change(src, dst, reason)
