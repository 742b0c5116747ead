"""Self-healing on an attempt that ended by itself: an out-of-memory failure of the built-in worker restarts with a
smaller micro-batch (`oom_remediation`: the remedy, decided from the memory evidence the failing rank left, or the
ladder) or, with every remedy tried, ends the run; a non-finite streak's incident lists the examples the worker
quarantined.  Registered for the built-in worker with `restart.oom_remediation` on.
"""

from __future__ import annotations

from typing import Optional

from hangwatch.supervisor.concerns import oom_evidence
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.oom_remediation import OOM_KIND, OomRemediation, after_exit, quarantine_fields


class OomRecovery(Concern):
    def __post_init__(self) -> None:
        self.name = "oom_recovery"
        self.remediation = OomRemediation(self.run.cfg, self.run.run_dir)
        self.seen: set[str] = set()  # incidents already remedied (the decision is asked at the exit and at the end)

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
