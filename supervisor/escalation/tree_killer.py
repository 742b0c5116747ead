"""Bringing a worker's whole tree down, as steps the main loop advances without blocking it.

SIGTERM to the process group → the grace it was given (`term_grace_s` for a graceful stop,
`stuck_term_grace_s` for a worker a deadline found stuck: its main thread cannot run the handler) →
SIGKILL to the group and to every descendant that left it → the tree gone (or, after `kill_wait_s`,
its survivors recorded) → wait (bounded) until NVML no longer lists the dead pids as holding GPU memory.

Survivors of SIGKILL (uninterruptible sleep: NFS, a GPU driver) are what `restart.on_unkillable` is about:
`survivors_left(now)` looks again, at most every SURVIVOR_POLL_S, for as long as the loop waits for them to go.

`advance(now) -> bool` (True when finished).  Processes are seen only through the injected
`ProcessTable`; it never reaps: the supervisor's loop reaps children in one place each pass and records
the worker's exit on `Worker`, which is what `TreeKiller` reads.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Callable, Optional

import structlog

from hangwatch.supervisor.processes.process import ProcessTable, ProcRef, Worker

log = structlog.get_logger("hangwatch")

SURVIVOR_POLL_S = 1.0  # how often survivors of SIGKILL are looked at while the run waits for them


@dataclass
class TreeKiller:
    """Brings a worker's whole tree down; `refs` are extra processes known to belong to it."""

    worker: Worker
    refs: list[ProcRef]
    table: ProcessTable
    term_grace_s: float
    gpu_release_timeout_s: float
    kill_wait_s: float = 30.0  # after SIGKILL, how long to wait for the tree to go before recording survivors
    gpu_pids: Callable[[], Optional[set[int]]] = lambda: None
    send_term: bool = True
    term_at: Optional[float] = None
    kill_at: Optional[float] = None
    gone_at: Optional[float] = None
    done_at: Optional[float] = None
    killed: list[int] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)
    gpu_release: dict = field(default_factory=dict)
    survivor_refs: list[ProcRef] = field(default_factory=list)
    survivors_checked_at: Optional[float] = None
    survivors_gone_at: Optional[float] = None
    _dead: set[int] = field(default_factory=set)

    def _tree(self) -> list[ProcRef]:
        members = {r.pid: r for r in self.table.group_members(self.worker.pgid)}
        for r in self.refs:
            members.setdefault(r.pid, r)
        if not self.worker.exited:
            members.setdefault(self.worker.pid, self.worker.ref)
        return self.table.alive(members.values())

    def begin(self, now: float) -> None:
        self.term_at = now
        self.refs = list({r.pid: r for r in self.refs + self.table.descendants(self.worker.pid)}.values())
        self._dead = {r.pid for r in self.refs} | {self.worker.pid}
        if self.send_term:
            self.table.signal_group(self.worker.pgid, signal.SIGTERM)
        else:
            self.kill_now(now)

    def kill_now(self, now: float) -> None:
        self.kill_at = now
        # the group first, then whoever left it (setsid, double fork), each checked by start time
        self.table.signal_group(self.worker.pgid, signal.SIGKILL)
        for r in self._tree():
            self._dead.add(r.pid)
            if self.table.signal(r, signal.SIGKILL):
                self.killed.append(r.pid)

    def advance(self, now: float) -> bool:
        if self.done_at is not None:
            return True
        if self.gone_at is None:
            # new descendants may still appear until the parent dies: keep collecting them
            if not self.worker.exited:
                for r in self.table.descendants(self.worker.pid):
                    if r.pid not in {x.pid for x in self.refs}:
                        self.refs.append(r)
                        self._dead.add(r.pid)
            left = self._tree()
            if not left and self.worker.exited:
                self.gone_at = now
            elif self.kill_at is None and self.term_at is not None and now - self.term_at >= self.term_grace_s:
                log.info("sigkill", pids=[r.pid for r in left], grace_s=self.term_grace_s)
                self.kill_now(now)
                return False
            elif self.kill_at is not None and now - self.kill_at >= self.kill_wait_s:
                # SIGKILL cannot end a process in uninterruptible sleep (state D): record it and go on,
                # rather than leave the run stuck in `killing` for ever.
                self.survivors = [self.table.describe(r) for r in left]
                self.survivor_refs = list(left)
                self.survivors_checked_at = now
                log.error("sigkill_survivors", survivors=self.survivors, waited_s=round(now - self.kill_at, 3))
                self.gone_at = now
            else:
                return False
        holding = self.gpu_pids()
        if holding is None:
            self.gpu_release = {"checked": False, "reason": "no GPU"}
            self.done_at = now
            return True
        still = sorted(holding & self._dead)
        if not still or now - self.gone_at >= self.gpu_release_timeout_s:
            self.gpu_release = {
                "checked": True,
                "released": not still,
                "waited_s": round(now - self.gone_at, 3),
                "pids_still_holding": still,
            }
            self.done_at = now
            return True
        return False

    def survivors_left(self, now: float) -> bool:
        """Whether a survivor of SIGKILL is still there (looked at again at most every SURVIVOR_POLL_S)."""
        if not self.survivor_refs or self.survivors_gone_at is not None:
            return False
        if self.survivors_checked_at is not None and now - self.survivors_checked_at < SURVIVOR_POLL_S:
            return True
        self.survivors_checked_at = now
        self.survivor_refs = self.table.alive(self.survivor_refs)
        if self.survivor_refs:
            return True
        self.survivors_gone_at = now
        return False

    def next_due(self) -> Optional[float]:
        """The earliest time this killer acts on its own clock — SIGKILL when the grace runs out, the survivors
        recorded, the GPU wait ended — or None.  (Exits are events: SIGCHLD wakes the loop.)"""
        if self.done_at is not None and self.survivor_refs and self.survivors_gone_at is None:
            return (self.survivors_checked_at or self.done_at) + SURVIVOR_POLL_S
        if self.done_at is not None or self.term_at is None:
            return None
        if self.gone_at is None:
            return self.term_at + self.term_grace_s if self.kill_at is None else self.kill_at + self.kill_wait_s
        return self.gone_at + self.gpu_release_timeout_s

    def timings(self) -> dict:
        t0 = self.term_at
        rel = lambda x: None if x is None or t0 is None else round(x - t0, 3)  # noqa: E731
        return {
            "term_grace_s": self.term_grace_s if self.send_term else None,
            "sigkill_after_s": rel(self.kill_at),
            "tree_gone_after_s": rel(self.gone_at),
            "done_after_s": rel(self.done_at),
            "sigterm_sent": self.send_term,
            "sigkilled_pids": self.killed,
            "survivors": self.survivors,
        }
