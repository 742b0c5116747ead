"""The loop's read model (`read_model.view.View`), built from the parts the loop holds.

`Viewer.build(now, at)` makes a new view from `at` (the loop's situation at that moment, `Situation`) and the parts
it was handed once; nothing is cached between builds, so nothing needs invalidating.  The loop builds one per pass,
at its end (state.json, systemd's status line and the listeners share it); a `status` request gets its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from hangwatch.common.inbox_layout import queue_status
from hangwatch.supervisor.control.paths import socket_path_for
from hangwatch.supervisor.processes.terminal_wait import first_reading
from hangwatch.supervisor.read_model import view as views
from hangwatch.supervisor.read_model.view import View
from hangwatch.supervisor.records.healing import state_fields
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State

if TYPE_CHECKING:
    from hangwatch.common.config import Config
    from hangwatch.supervisor.concerns import Concern, RunContext
    from hangwatch.supervisor.nodes.interface import Nodes
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.processes.snapshot import GpuCache
    from hangwatch.supervisor.watch.calibration import Calibration


@dataclass(frozen=True)
class Situation:
    """The loop's own fields a view shows."""

    state: State
    intent: Intent
    attempt: int
    current: Optional["Attempt"]
    exit_code: int
    backoff_until: Optional[float]
    started_at: float


class Healing:
    """The self-healing fields (`remediation.json`, `quarantine.jsonl`), re-read only when one of those files changed
    (size or modification time): the worker writes the quarantine, a concern the remediation."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._stamp: Optional[tuple] = None
        self._fields: dict = {}

    def fields(self) -> dict:
        stamp = tuple(_stamp(self.run_dir / name) for name in ("remediation.json", "quarantine.jsonl"))
        if stamp != self._stamp:
            self._stamp, self._fields = stamp, state_fields(self.run_dir)
        return dict(self._fields)


def _stamp(path: Path) -> Optional[tuple]:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


class Viewer:
    def __init__(
        self,
        cfg: "Config",
        run: "RunContext",
        calibration: "Calibration",
        gpu: "GpuCache",
        nodes: "Nodes",
        concerns: list["Concern"],
        socket: Callable[[], Optional[str]],
        config_path: Path,
    ):
        self.cfg, self.run, self.calibration, self.gpu, self.nodes, self.concerns = (
            cfg,
            run,
            calibration,
            gpu,
            nodes,
            concerns,
        )
        self.healing = Healing(run.run_dir)
        self._socket = socket
        self.config_path = config_path

    def build(self, now: float, at: Situation) -> View:
        st, cur, dl, facts = at.state, at.current, self.run.deadlines, self.run.facts
        watching = st.watched and cur is not None and not cur.worker.exited
        last = dict(facts.last_step)
        extra: dict[str, Any] = {}
        for c in self.concerns:  # the goodput ledger, the standby
            extra.update(c.readers(now))
        return View(
            now=now,
            state=st,
            intent=at.intent,
            attempt=at.attempt,
            exit_code=at.exit_code,
            worker=cur.worker if cur else None,
            watching=watching,
            main=dl.ranks.get(dl.main_rank()),
            restarts=facts.restarts,
            last_step=last,
            last_good_checkpoint=facts.last_good_checkpoint,
            last_good_step=facts.last_good_step,
            last_incident=facts.last_incident,
            torn_lines=facts.torn_lines,
            max_steps=views.max_steps(last, self.cfg.train.max_steps if self.cfg.worker.command is None else None),
            backoff_remaining_s=round(max(0.0, at.backoff_until - now), 3)
            if at.backoff_until is not None and st is State.BACKOFF
            else None,
            step_budget=dl.step_budget(),
            calibration_samples=len(self.calibration.step_samples),
            uptime_s=now - at.started_at,
            run_dir=str(self.run.run_dir),
            config=str(self.cfg._source or self.config_path),
            socket=self._socket(),
            readers=self._readers(now, cur, watching, extra),
            healing=self.healing.fields(),
            nodes=self.nodes.status(),
        )

    def _readers(self, now: float, cur: Optional["Attempt"], watching: bool, extra: dict) -> views.Readers:
        dl = self.run.deadlines
        return views.Readers(
            ranks=lambda: tuple(t for _, t in sorted(dl.ranks.items())) if cur else (),
            deadlines=lambda: tuple(dl.active(now)) if watching else (),
            announced=lambda: cur.announced_refs() if cur else {},
            descendants=lambda: tuple(cur.tree.values()) if cur else (),
            stragglers=lambda: cur.stragglers.status() if cur else {},
            incidents=self.run.incidents.count,
            gpu=lambda: self.gpu.summary(now),
            queue=lambda: queue_status(self.run.run_dir) if self.cfg.data.inbox else None,
            output=lambda: cur.output.evidence(now) if cur is not None and cur.output is not None else None,
            budgets=dl.phase_budgets,
            waiting_for_input=lambda: first_reading([cur.worker.pid, *cur.tree]) if watching else None,
            **extra,
        )


def socket_of(cfg: "Config", run_dir: Path, control: Any) -> str:
    """Where the control socket is (fixed for a supervisor's life)."""
    return str(getattr(control, "path", None) or socket_path_for(cfg, run_dir))
