"""state.json as the loop keeps it: written once a pass, at its end, when the record changed (or every
STATE_WRITE_S, for the step it shows), and at once only where a write must precede what follows (a new tree's pids,
an accepted pause).  What changes every step (the step, the wall time) does not count as a change: a training run
at ten steps a second would otherwise fsync state.json ten times a second."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from hangwatch.supervisor.read_model import view as views
from hangwatch.supervisor.records import run_state

if TYPE_CHECKING:
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.nodes.interface import Nodes
    from hangwatch.supervisor.processes.process import ProcessTable
    from hangwatch.supervisor.read_model.view import View

STATE_WRITE_S = 5.0  # the longest a changing step goes unrecorded
VOLATILE = ("step", "updated_wall")  # fields that change without the run's state changing


class StateFile:
    def __init__(
        self,
        path: Path,
        fs: "FsOps",
        table: "ProcessTable",
        nodes: "Nodes",
        write_failed: Callable[[OSError, Path], None],
    ):
        self.path, self.fs, self.table, self.nodes, self.write_failed = path, fs, table, nodes, write_failed
        self._last: Optional[dict] = None
        self._last_at = float("-inf")

    def keep(self, v: "View", why: Optional[str], now: float, force: bool = False) -> None:
        """Record `v` when it differs from what was last written (or it is time, or `force`)."""
        data = views.state_record(v, self.table.ref_of(os.getpid()), why=why)
        key = stable(data)
        if not force and key == self._last and now - self._last_at < STATE_WRITE_S:
            return
        self._last, self._last_at = key, now
        self.nodes.offer(v.last_good_checkpoint, v.last_good_step)  # for the peers' resume choice
        try:
            run_state.write(self.path, data, fs=self.fs)
        except OSError as exc:
            self.write_failed(exc, self.path)


def stable(data: dict) -> dict:
    """The record without what changes while nothing happens (the step, the time, a peer's age)."""
    key = {k: val for k, val in data.items() if k not in VOLATILE}
    nodes = key.get("nodes")
    if isinstance(nodes, dict) and isinstance(nodes.get("peers"), dict):
        peers = {n: {k: v for k, v in p.items() if k != "age_s"} for n, p in nodes["peers"].items()}
        key["nodes"] = {**nodes, "peers": peers}
    return key
