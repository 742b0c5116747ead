"""Self-healing on an attempt that ended by itself: an out-of-memory failure of the built-in worker restarts with a
smaller micro-batch (`rules.oom_remediation`: the ladder's next rung at most, and the new process measures before
training how far down it must go) or, with every remedy tried, ends the run; a non-finite streak's incident lists the
examples the worker quarantined.  The new process's measure (its `warn` line with `remediation_probe`) is recorded in
remediation.json (`records.healing`, written through the run's `FsOps`) and the OOM's incident.  Registered for the
built-in worker with `restart.oom_remediation` on.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional

import structlog

from hangwatch.common.durable import FsOps
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import Beat
from hangwatch.supervisor.records import healing, memory_evidence
from hangwatch.supervisor.rules import oom_evidence, oom_remediation
from hangwatch.supervisor.rules.answer import Answer, Write
from hangwatch.supervisor.rules.oom_remediation import OOM_KIND, Remedy
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")
PROBE_FIELD = "remediation_probe"


class OomRecovery(Concern):
    priority = 10  # `decision`: first of the deciders: the built-in worker's OOM remedy

    def __post_init__(self) -> None:
        self.name = "oom_recovery"
        self.remediation = OomRemediation(self.run.cfg, self.run.run_dir, self.run.fs)

    def on_beat(self, ev: Beat) -> None:
        attempt, tr, rec = ev.attempt, ev.track, ev.rec
        result = rec.get(PROBE_FIELD) if rec.get("event") == "warn" else None
        if not isinstance(result, dict) or tr.rank != 0:
            return
        run_dir = self.run.run_dir
        record = healing.load(run_dir)
        if not isinstance(record, dict) or not isinstance(record.get("probe"), dict):
            return
        try:
            healing.save(
                # the history's times are wall clock (the beat's own `t`), as the entries written at the OOM are
                run_dir,
                oom_remediation.measured(
                    record, self.run.cfg, result, attempt=attempt.number, now=wall_time(rec.get("t"))
                ),
                self.run.fs,
            )
        except OSError as exc:
            self.run.write_failed(exc, healing.path_for(run_dir))
            return
        # the finding is this attempt's, in remediation.json's history naming the incident (joined on read,
        # `incidents.store.with_findings`): the earlier attempt's incident.json is never rewritten for it
        log.info("oom_measured", attempt=attempt.number, picked=result.get("picked"), why=result.get("why"))

    def decision(self, attempt, episode, decision, now: float) -> Optional[Answer]:
        inc = episode.incident
        if inc is None or decision is None:
            return None
        run_dir = self.run.run_dir
        quarantined = healing.quarantine_fields(run_dir, attempt.number) if episode.kind == "nan" else {}
        evidence: Optional[oom_evidence.Evidence] = None
        if episode.kind == OOM_KIND and decision.action == "restart":  # the evidence only picks a restart's size
            rank = inc.data.get("culprit_rank")
            evidence = memory_evidence.gather(run_dir, attempt.number, rank if isinstance(rank, int) else 0)
        answer = after_exit(
            self.remediation,
            episode.kind,
            inc.id,
            decision,
            attempt=attempt.number,
            step=inc.data.get("step"),
            evidence=evidence,
        )
        if not quarantined:
            return answer
        return replace(answer, fields={**quarantined, **answer.fields})


def wall_time(t) -> Optional[float]:
    """A heartbeat line's unix time, or None (then the record takes the clock's)."""
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


class OomRemediation:
    """The supervisor's handle: decides (`rules.oom_remediation`) and persists (`records.healing`, through `fs`) the
    remedy of each OOM failure of the built-in worker."""

    def __init__(self, cfg, run_dir: os.PathLike | str, fs: Optional[FsOps] = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.fs = fs
        # A user's own script has no micro-batch we could change; `restart.oom_remediation: false` turns it off.
        self.enabled = cfg.worker.command is None and cfg.restart.oom_remediation

    def remedy(
        self,
        kind: str,
        *,
        attempt: int,
        step: Optional[int],
        incident: Optional[str],
        now: Optional[float] = None,
        evidence: Optional[oom_evidence.Evidence] = None,
    ) -> tuple[Optional[Remedy], Optional[Write]]:
        """For an attempt that failed with `kind`: the remedy and the record to write for it (None when it is no new
        setting: every remedy tried), or (None, None) — not an OOM, or not the built-in worker.  Writes nothing.
        `evidence`: what the failed attempt left about memory."""
        if not self.enabled or kind != OOM_KIND:
            return None, None
        record = healing.load(self.run_dir)
        remedy = oom_remediation.decide(record, self.cfg, evidence)
        if remedy.exhausted:
            return remedy, None
        new = oom_remediation.applied(record, self.cfg, remedy, attempt=attempt, step=step, incident=incident, now=now)
        return remedy, healing.write(self.run_dir, new)

    def on_failure(self, kind: str, **how) -> Optional[Remedy]:
        """`remedy`, its record written at once through `fs` (a supervisor's restart after it reads it back)."""
        remedy, write = self.remedy(kind, **how)
        if write is not None:
            (self.fs or FsOps()).write_file(write.path, write.data)
        return remedy

    def summary(self) -> Optional[dict]:
        return oom_remediation.summary(healing.load(self.run_dir), self.cfg) if self.enabled else None


def after_exit(
    handle: OomRemediation,
    kind: Optional[str],
    incident_id: Optional[str],
    decision: Optional[Decision],
    *,
    attempt: int,
    step: Optional[int],
    now: Optional[float] = None,
    evidence: Optional[oom_evidence.Evidence] = None,
) -> Answer:
    """The answer to the restart policy's `decision` on an ended attempt, with OOM remediation applied: for an
    out-of-memory failure the policy restarts, the remedy — its record to write, named in the decision's reason and in
    the incident (`remediation`) — or, with every remedy tried, the run fails, the message saying what was tried.  A
    refused write fails the run: without the record the next attempt would run out of memory again.  Anything else:
    no change."""
    if decision is None or decision.action != "restart" or kind is None:
        return Answer()
    remedy, write = handle.remedy(kind, attempt=attempt, step=step, incident=incident_id, now=now, evidence=evidence)
    if remedy is None:
        return Answer()
    fields = {"remediation": remedy.fields()}
    if remedy.exhausted:
        return Answer(Decision("fail", remedy.message), fields)
    return Answer(
        Decision("restart", f"{decision.reason}; {remedy.message}", delay_s=decision.delay_s, rollback=True),
        fields,
        writes=(write,),
        refused=lambda exc: Answer(
            Decision("fail", f"out of memory, and the smaller micro-batch could not be recorded: {exc}")
        ),
    )
