"""The same failure twice in a row ends the run: a restart cannot help what happens identically each time.

A worker that ends with the same exception (kind and message) at the same step as the attempt before it — a
deterministic error: a typo'd path at start-up, a bad argument, a shape that never fits — would only do it again:
the restart policy would spend its whole crash-loop budget on identical attempts.  So at the second identical
failure the episode's decision becomes `fail`, and the incident says what repeated and where to look.  Failures
without an exception (a signal, a bare exit code) and stalls (a hang is often transient) are left to the restart
policy; so is an out-of-memory failure the OOM remediation answers with another micro-batch (its next attempt runs
with another setting, so an OOM there is no repetition).
"""

from __future__ import annotations

from typing import Optional

import structlog

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")

KINDS = ("crash", "oom")  # exits whose classification names an exception


def signature(kind: Optional[str], data: dict) -> Optional[tuple]:
    """What makes two failures the same: the kind, the exception in the classification, the step (None: an exit
    without an exception to compare)."""
    words = str(data.get("classification") or "")
    if kind not in KINDS or not any(m in words for m in ("crash with ", "out of memory: ")):
        return None
    return kind, words, data.get("step")


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
        where = f"after step {step}" if step is not None else "before the first step"  # its last step beat
        reason = (
            f"the same failure twice in a row {where} (incidents {before_id} and {inc.id}): {words} — a restart "
            "would only repeat it; fix the cause (the worker log of each attempt has the whole traceback) and run "
            "again"
        )
        self.run.incidents.amend(inc, repeated=before_id)
        log.error("repeated_failure", incident=inc.id, previous=before_id, step=step, text=words)
        return Decision("fail", reason)
