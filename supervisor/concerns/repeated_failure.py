"""The same failure twice in a row ends the run: a restart cannot help what happens identically each time.

A worker that ends with the same exception (kind and message) at the same step as the attempt before it — a
deterministic error: a typo'd path at start-up, a bad argument, a shape that never fits — would only do it again:
the restart policy would spend its whole crash-loop budget on identical attempts.  So at the second identical
failure the episode's decision becomes `fail`, and the incident says what repeated and where to look.  Failures
without an exception (a signal, a bare exit code) and stalls (a hang is often transient) are left to the restart
policy; so is an out-of-memory failure the OOM remediation answers with another micro-batch or batch (its next attempt
runs with another setting, so an OOM there is no repetition).

An out-of-memory failure is the same when its exception and the size it tried to allocate are: the rest of torch's
message (what is free, what other processes hold) moves a little from one attempt to the next.  Its words say what
to change — the batch size, by the framework argument `framework_oom` recorded when a framework trained — and the
message's figures ("Tried to allocate 2.0 GiB; 3.6 GiB allowed").
"""

from __future__ import annotations

import re
from typing import Optional

import structlog

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.oom_evidence import gib, parse_oom_message
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")

KINDS = ("crash", "oom")  # exits whose classification names an exception
TRIED = re.compile(r"Tried to allocate \d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB)")


def signature(kind: Optional[str], data: dict) -> Optional[tuple]:
    """What makes two failures the same: the kind, the exception in the classification, the step (None: an exit
    without an exception to compare)."""
    words = str(data.get("classification") or "")
    if kind not in KINDS or not any(m in words for m in ("crash with ", "out of memory: ")):
        return None
    tried = TRIED.search(words) if kind == "oom" else None
    if tried is not None:  # the figures after it (free, in use) differ a little between two attempts of one failure
        words = words[: tried.end()]
    return kind, words, data.get("step")


def oom_advice(data: dict) -> str:
    """What to change after the same out-of-memory failure twice: the batch (the framework's argument when one
    trained), with the figures of torch's message."""
    fr = data.get("framework_remediation") if isinstance(data.get("framework_remediation"), dict) else {}
    said = fr.get("oom_words")
    if not said:
        figures = parse_oom_message(str(data.get("classification") or ""))
        if figures:
            said = f"Tried to allocate {gib(figures['tried_mb'])}" + (
                f"; {gib(figures['allowed_mb'])} allowed"
                if figures.get("allowed_mb") is not None
                else f"; {gib(figures['free_mb'])} free of {gib(figures['total_mb'])}"
            )
    argument = fr.get("argument") or "the batch size of your training loop (its DataLoader's batch_size)"
    why = f"; hangwatch did not change the batch: {fr['why']}" if fr.get("why") else ""
    return (
        f"the same batch ran out of memory at the same step{f' ({said})' if said else ''}: lower {argument} and raise "
        f"the gradient accumulation by the same factor (the same examples per optimizer step), or shorten the "
        f"sequences{why}"
    )


class RepeatedFailure(Concern):
    def __post_init__(self) -> None:
        self.name = "repeated_failure"
        self.previous: Optional[tuple] = None  # the last failure's signature (None: it had none, or none failed yet)
        self.previous_incident: Optional[str] = None
        self.seen: set[str] = set()

    def decision(self, attempt, episode, decision, now: float) -> Optional[Decision]:
        inc = episode.incident
        if inc is None or inc.id in self.seen or decision is None:
            return None
        self.seen.add(inc.id)
        sig = signature(episode.kind, inc.data)
        before, before_id = self.previous, self.previous_incident
        self.previous, self.previous_incident = sig, inc.id
        if sig is None or sig != before or decision.action != "restart" or decision.rollback:
            return None  # rollback: the OOM remediation's restart with another setting
        kind, words, step = sig
        where = f"after step {step}" if step else "before the first step"  # its last step beat (0: none yet)
        advice = (
            oom_advice(inc.data)
            if kind == "oom"
            else "fix the cause (the worker log of each attempt has the whole traceback) and run again"
        )
        reason = (
            f"the same failure twice in a row {where} (incidents {before_id} and {inc.id}): {words} — a restart "
            f"would only repeat it: {advice}"
        )
        self.run.incidents.amend(inc, repeated=before_id)
        log.error("repeated_failure", incident=inc.id, previous=before_id, step=step, text=words)
        return Decision("fail", reason)
