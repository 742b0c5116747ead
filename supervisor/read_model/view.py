"""The one read model of the supervisor: a `View`, built by the loop from its own state, once per pass
(again only when the state moved within the pass), and the three renderings that read it — the
`status` reply, the `state.json` record and the one-line status systemd shows.  Prometheus' snapshot
(`ops.metrics.Metrics.take`) reads the same view.  Nothing here reads the supervisor: the loop hands
the facts over (`Supervisor.view`), so a reader can never reach into the loop's state.

A view is built every pass (the ops side reads its state, attempt and main rank), so what costs more
than a lookup — every rank's row and deadlines, the process tree, the incident count, the GPUs, the
inbox — is read through the loop's `Readers` on first use only, once per view: a pass that nobody asks
for a status, a state.json or a metrics snapshot pays for none of it.  A view is read in the pass that
built it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hangwatch.supervisor.processes.process import ProcRef, Worker
from hangwatch.supervisor.records.run_state import record
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State
from hangwatch.supervisor.watch.deadlines import RankTrack


@dataclass(frozen=True)
class Readers:
    """Where a view's costlier fields come from, each read on first use (`_Read`)."""

    ranks: Callable[[], tuple]  # every rank's tracker, by rank
    deadlines: Callable[[], tuple]  # the armed deadlines (dicts: name, rank, budget, elapsed, remaining, source)
    announced: Callable[[], dict]  # rank → ProcRef of each rank that announced itself
    descendants: Callable[[], tuple]  # ProcRefs of the tree seen so far
    stragglers: Callable[[], dict]  # rank → straggler record
    incidents: Callable[[], int]  # how many incidents the run has
    gpu: Callable[[], dict]
    queue: Callable[[], Optional[dict]]  # continuous mode: the inbox
    output: Callable[[], Optional[dict]] = lambda: None  # the worker's output as evidence (`output_tail.evidence`)
    goodput: Callable[[], Optional[dict]] = lambda: None  # the goodput ledger's snapshot (`records.goodput`)
    standby: Callable[[], Optional[dict]] = lambda: None  # restart.prewarm's standby (`processes.standby.describe`)
    budgets: Callable[[], dict] = dict  # every timed phase's budget and where it came from (`Deadlines.phase_budgets`)
    in_process: Callable[[], Optional[dict]] = lambda: None  # recoveries in the worker's process (`restart.in_process`)
    # a script's framework batch after OOMs (`concerns.framework_oom.summary`)
    framework_remediation: Callable[[], Optional[dict]] = lambda: None
    # a process of the tree blocked reading its terminal, a prompt (`processes.terminal_wait.first_reading`)
    waiting_for_input: Callable[[], Optional[dict]] = lambda: None


class _Read:
    """A view field read through its `Readers` entry on first use, then kept on the view."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, view: Any, owner: Optional[type] = None) -> Any:
        if view is None:
            return self
        value = getattr(view.readers, self.name)()
        view.__dict__[self.name] = value  # a frozen dataclass still has its __dict__: the next read is a lookup
        return value


@dataclass(frozen=True)
class View:
    now: float  # the pass's monotonic time: every age below is relative to it
    state: State
    intent: Intent
    attempt: int
    exit_code: int
    worker: Optional[Worker]  # the current (or last) attempt's worker
    watching: bool  # a worker runs and its deadlines apply
    main: Optional[RankTrack]  # the main rank's tracker (phase, step, beat times)
    restarts: int
    last_step: dict  # the last `step` line
    last_good_checkpoint: Optional[str]
    last_good_step: Optional[int]
    last_incident: Optional[dict]
    torn_lines: int
    max_steps: Optional[int]
    backoff_remaining_s: Optional[float]
    step_budget: tuple  # (seconds, source)
    calibration_samples: int
    uptime_s: float
    run_dir: str
    config: str
    socket: str
    readers: Readers = field(repr=False, compare=False)
    healing: dict = field(default_factory=dict)  # self-healing's record (remediation, quarantine)
    nodes: Optional[dict] = None  # several machines: generation, peers, torchrun rounds

    ranks = _Read()
    deadlines = _Read()
    announced = _Read()
    descendants = _Read()
    stragglers = _Read()
    incidents = _Read()
    gpu = _Read()
    queue = _Read()
    output = _Read()
    goodput = _Read()
    standby = _Read()
    budgets = _Read()
    in_process = _Read()
    framework_remediation = _Read()
    waiting_for_input = _Read()

    @property
    def worker_alive(self) -> bool:
        return self.worker is not None and not self.worker.exited

    @property
    def paused(self) -> bool:
        """Paused, or on the way to a pause: the next supervisor on this run dir must start paused."""
        return self.state is State.PAUSED or self.intent is Intent.PAUSE


def status_reply(v: View) -> dict:
    """The `status` command's result (`hangwatch status`, `top`, the report's live view)."""
    tr = v.main
    last_line = max((t.last_line_at for t in v.ranks), default=None)
    return {
        "state": v.state.value,
        "attempt": v.attempt,
        "pid": v.worker.pid if v.worker_alive else None,
        "pids": {str(r): ref.pid for r, ref in v.announced.items()},
        "phase": tr.phase if tr else None,
        "phase_age_s": round(v.now - tr.phase_since, 3) if tr else None,
        "phase_budget_s": tr.phase_budget if tr else None,
        "step": tr.step if tr else None,
        "max_steps": v.max_steps,
        "loss": v.last_step.get("loss"),
        "tokens_per_s": v.last_step.get("tokens_per_s"),
        "lr": v.last_step.get("lr"),
        "last_beat_age_s": round(v.now - last_line, 3) if last_line is not None else None,
        "last_good_checkpoint": v.last_good_checkpoint,
        "last_good_step": v.last_good_step,
        "restarts": v.restarts,
        "incidents": v.incidents,
        "last_incident": v.last_incident,
        "deadlines": list(v.deadlines),
        "ranks": rank_rows(v),
        "stragglers": {str(r): rec for r, rec in v.stragglers.items()},
        "backoff_remaining_s": v.backoff_remaining_s,
        "intent": v.intent.value,
        "gpu": v.gpu,
        "run_dir": v.run_dir,
        "config": v.config,
        "supervisor_pid": os.getpid(),
        "uptime_s": round(v.uptime_s, 3),
        "torn_lines": v.torn_lines,
        "calibration": {
            "step_budget_s": v.step_budget[0],
            "source": v.step_budget[1],
            "samples": v.calibration_samples,
        },
        "phase_budgets": v.budgets,  # phase → {budget_s, source: config, learned: …, default, line}
        "queue": v.queue,
        "output": v.output,  # what the worker's output shows: its last line, progress line and step, and their ages
        "goodput": v.goodput,  # where the run's time went, by category (`records.goodput`)
        "standby": v.standby,  # restart.prewarm: the next attempt's process, loading or ready, and its RAM
        "in_process": v.in_process,  # recoveries in the worker's process: counts by kind, the last, an order waiting
        **v.healing,  # self-healing: the micro-batch after OOMs, quarantined examples
        "framework_remediation": v.framework_remediation,  # a script's HF / Lightning batch after OOMs
        "nodes": v.nodes,  # multi-node: generation, peers, torchrun rounds
        "waiting_for_input": v.waiting_for_input,  # {pid, terminal}: the command waits at a prompt
    }


def rank_rows(v: View) -> list[dict]:
    """Every rank that spoke in this attempt: its pid, phase, step, last beat age, deadlines, straggling."""
    return [
        {
            "rank": t.rank,
            "pid": v.announced[t.rank].pid if t.rank in v.announced else t.pid,
            "phase": t.phase,
            "phase_age_s": round(v.now - t.phase_since, 3),
            "phase_budget_s": t.phase_budget,
            "step": t.step,
            "last_beat_age_s": round(v.now - t.last_line_at, 3),
            "stopped": t.stopped,
            "deadlines": [d for d in v.deadlines if d["rank"] == t.rank],
            "straggler": v.stragglers.get(t.rank),
        }
        for t in v.ranks
    ]


def status_line(v: View) -> str:
    """The one-line status systemd shows (`systemctl status`)."""
    parts = [f"{v.state.value} attempt {v.attempt}"]
    if v.main is not None:
        parts += [f"step {v.main.step}" + (f"/{v.max_steps}" if v.max_steps else ""), f"phase {v.main.phase}"]
    if v.last_incident:
        parts.append(f"incidents {v.incidents}")
    return ", ".join(parts)


def state_record(
    v: View, supervisor: Optional[ProcRef], wall: Optional[float] = None, why: Optional[str] = None
) -> dict:
    """state.json's record (`records.run_state`): enough for the next supervisor to find what this one
    leaves behind; the worker's tree is forgotten once it is gone (backoff, paused, the end).  `why`: the
    reason of the last transition, recorded once the state is final."""
    data = record(
        state=v.state.value,
        final=v.state.final,
        tree_gone=v.state.final or v.state in (State.BACKOFF, State.PAUSED),
        supervisor=supervisor,
        worker=v.worker,
        announced=v.announced,
        descendants=v.descendants,
        attempt=v.attempt,
        restarts=v.restarts,
        last_good_checkpoint=v.last_good_checkpoint,
        last_good_step=v.last_good_step,
        last_incident=v.last_incident,
        torn_lines=v.torn_lines,
        incidents=v.incidents,
        socket=v.socket,
        run_dir=v.run_dir,
        exit_code=v.exit_code,
        paused=v.paused,
        wall=wall,
        why=why,
    )
    data.update(v.healing)
    if v.framework_remediation is not None:
        data["framework_remediation"] = v.framework_remediation
    # The last step any beat reported — where the run ended, once it ended; a worker that does not beat: the step its
    # own output last said
    step = v.last_step.get("step")
    data["step"] = step if step is not None else (v.output or {}).get("step")
    if v.nodes is not None:
        data["nodes"] = v.nodes
    return data


def max_steps(last_step: dict, configured: Optional[int]) -> Optional[int]:
    """The run's length: what the worker's step lines say, else the built-in worker's config (`configured`)."""
    if isinstance(last_step.get("max_steps"), int):
        return last_step["max_steps"]
    return configured
