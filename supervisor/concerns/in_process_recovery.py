"""Recovery inside the built-in worker's process (`restart.in_process`): the supervisor's half.

* A stall (a deadline overdue in `train`, `eval` or `generate`) of a worker on one process: once the stack dumps are
  in, the kill waits while the worker is ordered to abandon the stuck step (`protocol.ABANDON_NAME`; the worker raises
  an exception in its training thread at that thread's next bytecode and puts back the last good checkpoint's state,
  held in memory — `daemon.trainer.recovery`).  Its answer (a `warn` line with `recovered`) completes the incident
  and the attempt goes on; a refusal, or no answer within `watchdog.abandon_grace_s` (a thread blocked in C, a CUDA
  kernel, a collective), and the tree is killed and restarted as before.  A second stall at the same step of the same
  attempt is not asked again: the restart.  The incident says which path was taken and why (`recovery`).
* What the worker recovered from by itself, told in its `warn` lines: an out-of-memory step adapted in the process
  (`oom_adapted`: an incident of that kind with the memory figures, and `remediation.json` updated so that later
  attempts start at the adapted size) and a non-finite streak rolled back in the process (a `nan` incident with the
  quarantined examples, nothing restarted).

Registered for the built-in worker with `restart.in_process` on (`concerns.registered`); a stall of several ranks is
not asked (they would have to agree inside the collective one of them may be stuck in), and its incident says so.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import structlog

from hangwatch.common.oom_ladder import Rung
from hangwatch.common.protocol import ABANDON_NAME, ABANDON_REFUSED_FIELD, RECOVERED_FIELD
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat
from hangwatch.supervisor.records import healing
from hangwatch.supervisor.rules import oom_evidence, oom_remediation
from hangwatch.supervisor.rules.outcome import Intent

log = structlog.get_logger("hangwatch")

STALL_KINDS = frozenset({"stall", "livelock"})
RECOVERABLE_PHASES = frozenset({"train", "eval", "generate"})  # where the worker's training thread runs its loop
OOM_ADAPTED_FIELD = "oom_adapted"


@dataclass
class Order:
    """One abandon order, from when it is written until it is answered or its grace is over."""

    attempt: int
    order: int
    issued_at: float
    grace_s: float
    rank: int
    step: Optional[int]
    phase: Optional[str]
    answer: Optional[dict] = None  # the worker's `recovered` record
    refused: Optional[str] = None
    extra: dict = field(default_factory=dict)


def eligible(cfg) -> Optional[str]:
    """Why a stall of this run cannot be recovered in the worker's process (None: it can be asked)."""
    w = cfg.worker
    if w.command is not None:
        return "a script of your own: hangwatch cannot put its state back"
    if int(w.nproc_per_node) > 1 or (isinstance(w.nnodes, int) and w.nnodes > 1):
        return "several ranks: they would have to agree inside the collective one of them may be stuck in"
    if cfg.data.inbox:
        return "continuous mode: its inbox files are handed out once"
    return None


class InProcessRecovery(Concern):
    def __post_init__(self) -> None:
        self.name = "in_process_recovery"
        self.pending: Optional[Order] = None
        self.orders = 0
        self.tried: set[tuple[int, Optional[int]]] = set()  # (attempt, step) already asked once
        self.recovered = {"stall": 0, "nonfinite": 0, "oom": 0}
        self.last: Optional[dict] = None

    # ---- a stall: the order and its answer

    def before_kill(self, attempt, episode, now: float) -> Optional[str]:
        ex = episode.expired
        if ex is None or episode.kind not in STALL_KINDS or episode.incident is None:
            return None
        where = self.run.where()
        if where is not None and where.intent is not Intent.NONE:
            return None  # a stop, a pause, a restart was asked for: the kill is what follows anyway
        why_not = eligible(self.run.cfg)
        deadlines = self.run.deadlines
        rank = ex.rank if ex.rank is not None else deadlines.main_rank()
        tr = deadlines.ranks.get(rank)
        step = tr.step if tr is not None else None
        if why_not is None and (tr is None or tr.phase not in RECOVERABLE_PHASES):
            why_not = f"stuck in phase {tr.phase if tr else None!r}, outside the training loop"
        if why_not is None and (attempt.number, step) in self.tried:
            why_not = f"a stall at step {step} was recovered in the process once already: this time a restart"
        if why_not is not None:
            self.run.incidents.amend(episode.incident, recovery={"path": "restart", "why": why_not})
            return None
        self.orders += 1
        order = {"order": self.orders, "issued_unix": round(time.time(), 3), "step": step}
        try:
            self.run.fs.write_json(attempt.dir / ABANDON_NAME, order, durable=False)
        except OSError as exc:
            why = f"the order to abandon the step could not be written: {exc}"
            self.run.incidents.amend(episode.incident, recovery={"path": "restart", "why": why})
            return None
        self.tried.add((attempt.number, step))
        grace = float(self.run.cfg.watchdog.abandon_grace_s)
        self.pending = Order(attempt.number, self.orders, now, grace, rank, step, tr.phase if tr else None)
        deadlines.abandon(rank)
        log.warning(
            "abandon_ordered",
            attempt=attempt.number,
            order=self.orders,
            step=step,
            phase=self.pending.phase,
            grace_s=grace,
            note="asking the worker to abandon its stuck step in its own process before killing it",
        )
        return f"dumps in; asked the worker to abandon its stuck step in its own process (order {self.orders})"

    def recovering(self, attempt, episode, now: float) -> Optional[bool]:
        p = self.pending
        if p is None or p.attempt != attempt.number:
            return None
        inc = episode.incident
        waited = round(now - p.issued_at, 3)
        if p.answer is not None:
            self.pending = None
            a = p.answer
            restored = f"checkpoint step {a.get('restored_step')}" if a.get("restored_from") else "the start"
            text = (
                f"recovered in the worker's process: {abandoned_words(a)} abandoned (stuck at {a.get('landed_at')}), "
                f"the state of {restored} put back from memory; nothing restarted"
            )
            if inc is not None:
                self.run.incidents.amend(
                    inc,
                    summary=f"{inc.data.get('summary', '')} — {text}",
                    recovery={"path": "in_process", "order": p.order, "answered_after_s": waited, **a},
                )
            self._note("stall", a)
            return True
        if p.refused is not None or now - p.issued_at >= p.grace_s:
            self.pending = None
            why = (
                f"the worker refused: {p.refused}"
                if p.refused is not None
                else f"no answer within {p.grace_s:g} s: the stuck thread ran no Python bytecode (blocked in C, a "
                "CUDA kernel or a collective)"
            )
            if inc is not None:
                self.run.incidents.amend(
                    inc, recovery={"path": "restart", "asked": True, "order": p.order, "waited_s": waited, "why": why}
                )
            log.warning("abandon_unanswered", attempt=attempt.number, order=p.order, why=why)
            return False
        return None

    def next_due_s(self, now: float) -> Optional[float]:
        p = self.pending
        return None if p is None else max(0.0, p.issued_at + p.grace_s - now)

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.pending = None

    # ---- what the worker says

    def on_beat(self, ev: Beat) -> None:
        attempt, rec = ev.attempt, ev.rec
        if rec.get("event") != "warn":
            return
        rec_recovered = rec.get(RECOVERED_FIELD)
        p = self.pending
        if isinstance(rec_recovered, dict):
            kind = rec_recovered.get("kind")
            if kind == "stall" and p is not None and rec_recovered.get("order") == p.order:
                p.answer = rec_recovered
            elif kind == "nonfinite":
                self._nonfinite(attempt, rec_recovered)
        refused = rec.get(ABANDON_REFUSED_FIELD)
        if isinstance(refused, dict) and p is not None and refused.get("order") == p.order:
            p.refused = str(refused.get("why") or "no reason given")
        adapted = rec.get(OOM_ADAPTED_FIELD)
        if isinstance(adapted, dict):
            self._oom_adapted(attempt, adapted)

    def _nonfinite(self, attempt, r: dict) -> None:
        restored = f"checkpoint step {r.get('restored_step')}" if r.get("restored_from") else "the start"
        named = [str(i) for i in r.get("quarantined") or []]
        mine = {q["id"]: q for q in healing.read_quarantine(self.run.run_dir) if q.get("id") in set(named)}
        rows = [{k: mine[i].get(k) for k in ("id", "reason", "step")} for i in named if i in mine]
        quarantined = {"quarantined": rows}
        summary = (
            f"{r.get('streak')} non-finite steps in a row at step {r.get('failed_step')}: rolled back in the worker's "
            f"process to {restored} (its state held in memory)"
            + (f"; quarantined {', '.join(named)}" if named else "; no example quarantined (no culprit named)")
            + "; nothing restarted"
        )
        self._handled(
            "nan",
            attempt,
            r,
            step=r.get("failed_step"),
            classification="non-finite loss",
            summary=summary,
            reason="rolled back to the last good state in memory",
            event="nonfinite_rolled_back",
            recovery={"path": "in_process", **r},
            **(quarantined if named else {}),
        )

    def _handled(
        self, kind: str, attempt, r: dict, *, step, classification: str, summary: str, reason: str, event: str, **fields
    ):
        """An incident the worker handled in its own process (nothing for the loop to do): created complete, noted in
        the run's record, counted for `status`, logged (the alert desk hears of it by `event`)."""
        inc = self.run.incidents.open_for_run(
            kind,
            self.run.facts,
            attempt=attempt.number,
            phase="train",
            step=step,
            classification=classification,
            summary=summary,
            status="handled",
            decision={"action": "recovered_in_process", "reason": reason},
            then=fields,
        )
        self._note("nonfinite" if kind == "nan" else "oom", r)
        log.warning(event, incident=inc.id, kind=kind, attempt=attempt.number, step=step, text=summary)
        return inc

    def _oom_adapted(self, attempt, r: dict) -> None:
        """An out-of-memory step adapted in the worker's process: the incident, and remediation.json so that the next
        attempts start at this size."""
        try:
            before = Rung(**r["from"])
            after = Rung(**r["to"])
        except (KeyError, TypeError):
            log.warning("oom_adapted_unreadable", record=r)
            return
        message = r.get("message") if isinstance(r.get("message"), str) else None
        figures = oom_evidence.parse_oom_message(message)
        said = _message_words(figures)
        what = (
            "gradient checkpointing turned on"
            if after.gradient_checkpointing and not before.gradient_checkpointing
            else f"micro_batch_size {before.micro_batch_size} → {after.micro_batch_size}, grad_accum "
            f"{before.grad_accum} → {after.grad_accum} (effective batch {after.effective} unchanged)"
        )
        summary = (
            f"out of memory in step {r.get('step')} at {before.words()}{said}: adapted in the worker's process — "
            f"{what}; the step's work dropped and the same step taken again on the same examples; nothing restarted"
        )
        remedy = oom_remediation.Remedy(before, after, summary, basis="in_process")
        inc = self._handled(
            "oom_adapted",
            attempt,
            r,
            step=r.get("step"),
            classification="out of memory",
            summary=summary,
            reason=what,
            event="oom_adapted",
            remediation=remedy.fields() | {"action": "adapted_in_process"},
            memory={"message": figures, "worker": r.get("memory")},
            message=message,
        )
        path = healing.path_for(self.run.run_dir)
        try:
            record = oom_remediation.applied(
                healing.load(self.run.run_dir),
                self.run.cfg,
                remedy,
                attempt=attempt.number,
                step=r.get("step"),
                incident=inc.id,
            )
            # Through the run's write seam, byte for byte what `oom_remediation.save` writes (indented by 2, durably).
            self.run.fs.write_file(path, (json.dumps(record, indent=2, default=str) + "\n").encode())
        except OSError as exc:
            self.run.write_failed(exc, path)

    def _note(self, kind: str, r: dict) -> None:
        self.recovered[kind] += 1
        self.last = {"kind": kind, **{k: r.get(k) for k in ("step", "failed_step", "restored_step") if k in r}}

    def readers(self, now: float) -> dict[str, Any]:
        return {
            "in_process": lambda: {
                "recovered": dict(self.recovered),
                "last": self.last,
                "waiting": None
                if self.pending is None
                else {
                    "order": self.pending.order,
                    "step": self.pending.step,
                    "since_s": round(now - self.pending.issued_at, 3),
                },
            }
        }


def abandoned_words(a: dict) -> str:
    """What was abandoned: "step 41", or "the eval at step 40" (an eval runs after its step, before the next)."""
    failed = a.get("failed_step")
    phase = a.get("phase")
    if phase in ("eval", "generate") and isinstance(failed, int):
        return f"the {phase} at step {failed - 1}"
    return f"step {failed}"


def _message_words(figures: Optional[dict]) -> str:
    """What torch's OOM message says, in a few words: what was asked for, the cap, what PyTorch held."""
    if not figures:
        return ""
    gib = oom_evidence.gib
    parts = [f"tried to allocate {gib(figures['tried_mb'])}"]
    if "allowed_mb" in figures:
        parts.append(f"{gib(figures['allowed_mb'])} allowed")
    if "allocated_mb" in figures:
        parts.append(f"{gib(figures['allocated_mb'])} allocated by PyTorch")
    return " (" + "; ".join(parts) + ")"
