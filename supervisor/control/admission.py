"""Who gets a place in the control server's connection table, and who gives one up: pure decisions.

The table is bounded: every connection costs a file descriptor and may buffer up to a few MiB of
replies.  One peer process (SO_PEERCRED uid and pid) may hold only a share of it, so that one leaking
script cannot crowd out everyone else.  A newcomer that would pass either bound is not turned away
while someone idles: the oldest *idle* connection gives up its place (the same peer's when that peer
is at its cap, anyone's when the table is full), so a new `status` is always answered.

A connection that has not yet asked anything is spared for YOUNG_S after its accept when only its own
process's share is at stake: a burst of clients from one process (a script asking 200 `status` at once)
is accepted faster than its threads write their lines, and evicting the newest arrivals before their
line comes would turn a burst into resets.  The process may then hold more than its share, within the
table's bound, until its young connections have either asked or aged; `over_share` names the ones to
close then (the server sweeps each pass).  A full table spares nobody: the bound is the bound.

Idle means nothing is owed either way: no deferred reply being waited for (a `dump`) and no reply
bytes unsent.  Among the idle, connections already let go (their replies out, being closed) leave
first, then the ones already answered, then the ones silent the longest, and a connection holding part
of a line leaves last: it is in the middle of asking.  Only when every candidate is owed something is
the newcomer refused.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from hangwatch.supervisor.control.peer import PeerCred

# Derived limits (docs/control-protocol.md, "Connection limits"): the table may use a quarter of the file
# descriptors the process may open (the rest are the worker's pipes, logs, heartbeats and the run dir),
# within a floor that keeps the socket usable and a ceiling that bounds the memory the buffers may take.
FD_SHARE = 4
TABLE_FLOOR = 16
TABLE_CEILING = 256
PEER_SHARE = 4  # one peer process may hold a quarter of the table
# How long a connection that has asked nothing yet is spared from its own process's share: far longer than
# a thread of a busy client takes between connect() and its first write, far shorter than IDLE_TIMEOUT_S.
YOUNG_S = 5.0


@dataclass(frozen=True)
class Limits:
    max_clients: int  # connections in the table, all peers together
    max_per_peer: int  # connections one peer process may hold

    def __post_init__(self) -> None:
        if not 1 <= self.max_per_peer <= self.max_clients:
            raise ValueError(
                f"control limits: need 1 <= max_per_peer ({self.max_per_peer}) <= max_clients ({self.max_clients})"
            )

    @classmethod
    def for_fd_limit(cls, nofile: int) -> "Limits":
        """The limits for a process that may open `nofile` file descriptors."""
        table = max(TABLE_FLOOR, min(TABLE_CEILING, nofile // FD_SHARE))
        return cls(max_clients=table, max_per_peer=max(1, table // PEER_SHARE))

    @classmethod
    def derived(cls) -> "Limits":
        """The limits for this process, from its soft RLIMIT_NOFILE."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        return cls.for_fd_limit(TABLE_CEILING * FD_SHARE if soft == resource.RLIM_INFINITY else soft)


class Slot(Protocol):
    """What admission looks at in a connection (the server's `_Client` has all of it)."""

    peer: PeerCred
    pending: object  # a deferred reply being waited for, or None
    outbuf: bytearray
    inbuf: bytearray
    hangup: bool
    replies: int  # replies queued so far
    last_active: float
    accepted: float  # when it was accepted (the same clock as last_active)
    seq: int  # accept order: ties in time go to the earlier connection


@dataclass(frozen=True)
class Admission:
    evict: tuple = ()  # connections to close first, in order
    refusal: Optional[str] = None  # set: refuse the newcomer, evict nobody
    over_share: bool = False  # admitted past its process's share (its others are young): sweep later


def same_peer(a: PeerCred, b: PeerCred) -> bool:
    return (a.uid, a.pid) == (b.uid, b.pid)


def eviction_key(slot: Slot) -> Optional[tuple]:
    """Sort key among the idle (lowest leaves first); None: owed something, never evicted."""
    if slot.pending is not None or slot.outbuf:
        return None
    if slot.hangup:
        standing = 0  # its replies are out and it is being let go anyway
    elif slot.inbuf:
        standing = 2  # part of a line: in the middle of asking
    else:
        standing = 1
    # A connection already answered leaves before one that has not asked yet, however long either was silent:
    # a burst of clients that connect and then write would otherwise lose the earliest of them to eviction
    # before their line arrives, while the ones served a moment ago wait only to be closed.
    return standing, 0 if slot.replies else 1, slot.last_active, slot.seq


def young(slot: Slot, now: float) -> bool:
    """Accepted less than YOUNG_S ago and asked nothing yet: its line is probably on its way."""
    return (
        not slot.replies
        and not slot.inbuf
        and not slot.hangup
        and slot.pending is None
        and now - slot.accepted < YOUNG_S
    )


def idle_in_order(slots: Sequence[Slot]) -> list[Slot]:
    """The idle among `slots`, the first to leave first."""
    idle = [(key, s) for s in slots if (key := eviction_key(s)) is not None]
    return [s for _, s in sorted(idle, key=lambda pair: pair[0])]


def oldest_idle(slots: Sequence[Slot]) -> Optional[Slot]:
    idle = idle_in_order(slots)
    return idle[0] if idle else None


def admit(peer: PeerCred, slots: Sequence[Slot], limits: Limits, now: float) -> Admission:
    """Whether a new connection from `peer` joins `slots`, and whom it displaces."""
    evict: list[Slot] = []
    over_share = False
    own = [s for s in slots if same_peer(s.peer, peer)]
    excess = len(own) + 1 - limits.max_per_peer  # more than one when it was let past its share before
    if excess > 0:
        evict.extend(idle_in_order([s for s in own if not young(s, now)])[:excess])
        if len(evict) < excess:
            if not evict and not any(young(s, now) for s in own):
                return Admission(
                    refusal=f"busy: process {peer.pid} already has {len(own)} control connections, "
                    f"all waiting for replies (at most {limits.max_per_peer} per process)"
                )
            over_share = True  # its others are still arriving (or owed replies): it gives back the excess later
    if len(slots) - len(evict) >= limits.max_clients:
        victim = oldest_idle([s for s in slots if s not in evict])
        if victim is None:
            return Admission(refusal=f"busy: all {len(slots)} control connections are waiting for replies")
        evict.append(victim)
    return Admission(evict=tuple(evict), over_share=over_share)


def over_share(slots: Sequence[Slot], limits: Limits, now: float) -> tuple[list[Slot], bool]:
    """The connections to close so that no process holds more than its share (oldest idle first, never a
    young one or one owed something), and whether a process stays over its share after that."""
    by_peer: dict[tuple[int, int], list[Slot]] = {}
    for s in slots:
        by_peer.setdefault((s.peer.uid, s.peer.pid), []).append(s)
    evict: list[Slot] = []
    still_over = False
    for own in by_peer.values():
        excess = len(own) - limits.max_per_peer
        if excess <= 0:
            continue
        candidates = idle_in_order([s for s in own if not young(s, now)])
        evict.extend(candidates[:excess])
        still_over = still_over or len(candidates) < excess
    return evict, still_over
