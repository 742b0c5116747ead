"""The one interface between the loop and the run's other machines: `Nodes`, and `SingleNode`, its null object.

On one box (`worker.nnodes` 1) the loop holds a `SingleNode`: no peer link, no generation, every question
answered the way one machine answers it, so the loop has no multi-node branch of its own.  On several
(`nodes.multi_node.MultiNode`) each method is where the peers are heard and told.  Every method takes
what it needs (the attempt, the episode, `now`) and returns a decision or amends the episode it is
handed; none reaches into the loop.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: a node never needs more of them than what it is handed
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.rules.answer import Answer
    from hangwatch.supervisor.rules.policy import Decision
    from hangwatch.supervisor.watch.deadlines import Expired


class Nodes(abc.ABC):
    name: str = ""

    # ---- life

    @property
    @abc.abstractmethod
    def helper_pid(self) -> Optional[int]:
        """The peer-link helper's pid (our child, never part of a worker's tree), if one runs."""

    @abc.abstractmethod
    def start(self, now: float) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def poll(self, now: float) -> list[str]:
        """Take in what the peer link heard (the generation, peers' notices and records)."""

    @abc.abstractmethod
    def next_due_s(self, now: float) -> Optional[float]:
        """When the loop must pass again for the peers' sake (None: never on their account)."""

    @abc.abstractmethod
    def status(self) -> Optional[dict]:
        """The `nodes` field of status and state.json (None on one node)."""

    @abc.abstractmethod
    def offer(self, path: Optional[str], step: Optional[int]) -> None:
        """This node's newest good checkpoint, for the peers' choice of a resume point."""

    @abc.abstractmethod
    def ended(self, state: str, why: str) -> None:
        """This supervisor reached a final state."""

    # ---- an attempt

    @abc.abstractmethod
    def ready_for_attempt(self, now: float) -> bool:
        """An attempt may be spawned now (several nodes: the store is reached and the generation is new)."""

    @abc.abstractmethod
    def resume_point(self, own: Optional[dict], now: float) -> tuple[bool, str]:
        """(settled, the checkpoint to resume from) given this node's own choice `own` ({"path", "step"} or None)."""

    @abc.abstractmethod
    def rdzv_id(self) -> Optional[str]:
        """torchrun's rendezvous id for the attempt about to start (None: no rendezvous of ours)."""

    @abc.abstractmethod
    def spawned(self, attempt: int, now: float) -> None: ...

    @abc.abstractmethod
    def rank_started(self, rec: dict, now: float, attempt: int) -> Optional[str]:
        """A `start` beat; returns a note for the log when it is torchrun's own restart of a rank."""

    # The moments a concern meets too are met in the same shapes (`concerns.base.Concern`): `overdue`,
    # `while_running` and `decision` take and answer what the concerns' do.

    @abc.abstractmethod
    def overdue(self, attempt: "Attempt", expired: "Expired", now: float) -> bool:
        """A deadline fired but the evidence says it is no stall (torchrun between rounds, peers still missing at the
        rendezvous): the deadlines are re-armed and True is returned; False: the loop escalates."""

    @abc.abstractmethod
    def while_running(self, attempt: Optional["Attempt"], now: float) -> Optional[str]:
        """Each pass while starting or running: why a peer's failure ends the run, or None (a lost peer's incident
        is written on the way)."""

    @abc.abstractmethod
    def peer_restart(self) -> Optional[tuple[int, dict]]:
        """A peer restarted into a newer generation: (generation, its notice)."""

    # ---- an episode

    @abc.abstractmethod
    def stall_read(self, ep: "Episode", attempt: "Attempt", now: float) -> None:
        """A stall's dumps are read, nothing is killed yet: amend the incident, tell the peers."""

    @abc.abstractmethod
    def exit_cause(self, attempt: "Attempt", code: Optional[int], stop_reason: Optional[str]) -> Optional["Decision"]:
        """A worker exit that is not this node's failure: the decision (a free restart); None: the policy decides."""

    @abc.abstractmethod
    def exit_read(self, ep: "Episode", decision: "Decision", attempt: "Attempt", now: float) -> None:
        """An exit's incident is written: amend it, tell the peers."""

    @abc.abstractmethod
    def decision(
        self, attempt: Optional["Attempt"], ep: "Episode", decision: Optional["Decision"], now: float
    ) -> Optional["Answer"]:
        """The episode's tree is gone and nothing decided (`decision` None) on a stall: the answer — a decision when
        the culprit is elsewhere (None: the restart policy decides), what the peers said for the incident, the kind
        the evidence made it — applied by `concerns.decide`.  It writes nothing."""


class SingleNode(Nodes):
    """One box: nothing to hear, nothing to tell, every attempt may start, every failure is this node's."""

    helper_pid = None

    def start(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass

    def poll(self, now: float) -> list[str]:
        return []

    def next_due_s(self, now: float) -> Optional[float]:
        return None

    def status(self) -> Optional[dict]:
        return None

    def offer(self, path: Optional[str], step: Optional[int]) -> None:
        pass

    def ended(self, state: str, why: str) -> None:
        pass

    def ready_for_attempt(self, now: float) -> bool:
        return True

    def resume_point(self, own: Optional[dict], now: float) -> tuple[bool, str]:
        return True, (own or {}).get("path") or ""

    def rdzv_id(self) -> Optional[str]:
        return None

    def spawned(self, attempt: int, now: float) -> None:
        pass

    def rank_started(self, rec: dict, now: float, attempt: int) -> Optional[str]:
        return None

    def overdue(self, attempt, expired, now) -> bool:
        return False

    def while_running(self, attempt, now) -> Optional[str]:
        return None

    def peer_restart(self) -> Optional[tuple[int, dict]]:
        return None

    def stall_read(self, ep, attempt, now) -> None:
        pass

    def exit_cause(self, attempt, code, stop_reason):
        return None

    def exit_read(self, ep, decision, attempt, now) -> None:
        pass

    def decision(self, attempt, ep, decision, now) -> None:
        return None
