"""Self-healing on an attempt that ended by itself: an out-of-memory failure of the built-in worker restarts with a
smaller micro-batch (`oom_remediation`: the ladder's next rung at most, and the new process measures before training
how far down it must go) or, with every remedy tried, ends the run; a non-finite streak's incident lists the examples
the worker quarantined.  The new process's measure (its `warn` line with `remediation_probe`) is recorded in
remediation.json and the OOM's incident.  Registered for the built-in worker with `restart.oom_remediation` on.
"""

from __future__ import annotations

from typing import Optional

import structlog

from hangwatch.supervisor.concerns import oom_evidence, oom_remediation
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.oom_remediation import OOM_KIND, OomRemediation, after_exit, quarantine_fields

log = structlog.get_logger("hangwatch")
PROBE_FIELD = "remediation_probe"


class OomRecovery(Concern):
    def __post_init__(self) -> None:
        self.name = "oom_recovery"
        self.remediation = OomRemediation(self.run.cfg, self.run.run_dir)
        self.seen: set[str] = set()  # incidents already remedied (the decision is asked at the exit and at the end)

    def beat(self, attempt, tr, rec: dict, left, at: float, now: float) -> None:
        result = rec.get(PROBE_FIELD) if rec.get("event") == "warn" else None
        if not isinstance(result, dict) or tr.rank != 0:
            return
        run_dir = self.run.run_dir
        record = oom_remediation.load(run_dir)
        if not isinstance(record, dict) or not isinstance(record.get("probe"), dict):
            return
        try:
            oom_remediation.save(
                # the history's times are wall clock (the beat's own `t`), as the entries written at the OOM are
                run_dir,
                oom_remediation.measured(
                    record, self.run.cfg, result, attempt=attempt.number, now=wall_time(rec.get("t"))
                ),
            )
        except OSError as exc:
            self.run.write_failed(exc, oom_remediation.path_for(run_dir))
            return
        ident = record["probe"].get("incident")
        inc = self.run.incidents.open(ident) if isinstance(ident, str) else None
        if inc is not None:
            self.run.incidents.amend(inc, measured={**result, "attempt": attempt.number})
        self.run.changed()
        log.info("oom_measured", attempt=attempt.number, picked=result.get("picked"), why=result.get("why"))

    def decision(self, attempt, episode, decision, now: float):
        inc = episode.incident
        if inc is None or inc.id in self.seen or decision is None:
            return None
        self.seen.add(inc.id)
        run_dir = self.run.run_dir
        if episode.kind == "nan":
            fields = quarantine_fields(run_dir, attempt.number)
            if fields:
                self.run.incidents.amend(inc, **fields)
        step = inc.data.get("step")
        evidence: Optional[oom_evidence.Evidence] = None
        if episode.kind == OOM_KIND and decision.action == "restart":  # the evidence only picks a restart's size
            rank = inc.data.get("culprit_rank")
            evidence = oom_evidence.gather(run_dir, attempt.number, rank if isinstance(rank, int) else 0)
        remedied, fields = after_exit(
            self.remediation, episode.kind, inc.id, decision, attempt=attempt.number, step=step, evidence=evidence
        )
        if fields:
            self.run.incidents.amend(inc, **fields)
        return None if remedied is decision else remedied


def wall_time(t) -> Optional[float]:
    """A heartbeat line's unix time, or None (then the record takes the clock's)."""
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None
