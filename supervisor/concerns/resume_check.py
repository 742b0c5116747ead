"""Whether your own script resumed from the checkpoint it was handed.

After a failure each attempt is handed the last good checkpoint (HANGWATCH_RESUME_FROM, its step in
HANGWATCH_RESUME_STEP).  The automatic instrumentation sees whether the script read any of it before its first
optimizer step (`daemon.autoinstrument.loads`); one that did not started again from its step 1, and says so in one
`warn` beat (`resume_ignored`).  Its steps and checkpoints are then its own (counted from 0, not from the
checkpoint's step), the goodput ledger counts the steps it does again as redone, the resume audit stops comparing
(`not_resumed`), and this concern writes the `resume_ignored` incident: what happened and what to change.
Registered for a command of your own (`worker.command`): the built-in worker always resumes.
"""

from __future__ import annotations

import structlog

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import Beat

log = structlog.get_logger("hangwatch")


class ResumeCheck(Concern):
    def __post_init__(self) -> None:
        self.name = "resume_check"
        self.reported: set[int] = set()  # attempts already reported

    def on_beat(self, ev: Beat) -> None:
        attempt, tr, rec = ev.attempt, ev.track, ev.rec
        if rec["event"] != "warn" or not rec.get("resume_ignored") or attempt.number in self.reported:
            return
        self.reported.add(attempt.number)
        handed, step = rec.get("resume_from") or attempt.resume_from, rec.get("resume_step")
        cfg, facts = self.run.cfg, self.run.facts
        set_args = cfg.worker.resume_args
        summary = (
            f"the script did not resume from the checkpoint it was given ({handed}, step {step}): it read nothing of "
            "it before its first optimizer step and started again from its step 1 — its steps and checkpoints are "
            "counted as its own, the steps it does again as redone. "
            + (
                f"worker.resume_args is set ({set_args!r}) but the script does not act on it: check the argument"
                if set_args
                else "Set worker.resume_args (e.g. ['--resume', '{checkpoint}']), or read HANGWATCH_RESUME_FROM in "
                "the script and load it"
            )
        )
        inc = self.run.incidents.open_for_run(
            "resume_ignored",
            facts,
            with_last_incident=True,
            attempt=attempt.number,
            phase="train",
            step=rec.get("step"),
            classification="resume ignored",
            summary=summary,
            status="final",
            rank=tr.rank,
            resume_from=handed,
            resume_step=step,
            resume_args=set_args,
        )
        log.warning("resume_ignored", incident=inc.id, attempt=attempt.number, resume_from=handed, resume_step=step)
