"""Every resume audited against the steps before it (`watchdog.resume_audit`).

An attempt after an earlier one replays the steps the earlier attempts beat after its resume point (step 0 when it
starts from scratch; no audit when the resume point's step is unknown): each replayed step's loss, learning rate and
gradient norm are compared with the earlier beat of the same rank and step (`watch.replay_check.ReplayAudit`, pure).
The records go to `resume-audit.json` ({"audits": [...]}, one per resumed attempt, each naming its attempt and the
incident it recovered from): a later finding about that incident is an addition linked to it, never a rewrite of its
file; readers join the two (`incidents.store.with_findings`).  A divergence is a `resume_diverged` incident of the
new attempt; under `on_divergence: stop` the run ends there.
"""

from __future__ import annotations

from typing import Optional

import structlog

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import AttemptEnded, AttemptStarted, Beat
from hangwatch.supervisor.records import run_state
from hangwatch.supervisor.records.healing import file_summary
from hangwatch.supervisor.watch.replay_check import (
    AUDITS_NAME,
    REBATCHED_RTOL,
    ReplayAudit,
    default_rtol,
    earlier_beats,
)

log = structlog.get_logger("hangwatch")


class ResumeAudit(Concern):
    def __post_init__(self) -> None:
        self.name = "resume_audit"
        self.audit: Optional[ReplayAudit] = None  # the current attempt's, while it replays
        self.audits: Optional[list[dict]] = None  # resume-audit.json's records (read on first use)
        self.failure = None  # the incident of the failure the next attempt recovers from
        self.settings: dict[int, object] = {}  # attempt → the micro-batch setting it started with (None: the config's)
        self.abort: Optional[str] = None

    def _records(self) -> list[dict]:
        if self.audits is None:
            data = run_state.read(self.run.run_dir / AUDITS_NAME)[0] or {}
            self.audits = [a for a in data.get("audits") or [] if isinstance(a, dict)]
        return self.audits

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        attempt, resume_step = ev.attempt, ev.resume_step
        self.audit, self.abort = None, None
        number = attempt.number
        self.settings[number] = file_summary(self.run.run_dir)  # the micro-batch this attempt runs with
        cfg = self.run.cfg
        ra = cfg.watchdog.resume_audit
        if number <= 1 or (attempt.resume_from and resume_step is None):
            return
        resumed = int(resume_step or 0)
        before = earlier_beats(self.run.run_dir, number, resumed)
        if not before:
            return
        rtol, note = default_rtol(ra.rtol, cfg.worker.command is not None), ""
        setting = self.settings[number]
        if setting != self.settings.get(number - 1, setting) and rtol < REBATCHED_RTOL:
            rtol, note = REBATCHED_RTOL, "the micro-batch changed after an OOM: the same sums in another order"
        inc = self.failure
        self.audit = ReplayAudit(number, resumed, before, rtol, incident=inc.id if inc is not None else None, note=note)
        self._records().append(self.audit.record())
        self._save()

    def on_beat(self, ev: Beat) -> None:
        attempt, tr, rec = ev.attempt, ev.track, ev.rec
        a = self.audit
        if a is not None and a.open and rec["event"] == "warn" and rec.get("resume_ignored"):
            a.not_resumed(
                "resume not audited: the script did not resume from the checkpoint it was given — it started again "
                "from its step 1 (the `resume_ignored` incident)"
            )
            self._save()
            return
        if rec["event"] != "step" or a is None or not a.open:
            return
        step = int(rec["step"])
        verdict = a.observe(tr.rank, step, rec)
        if verdict is None:
            return
        self._save()
        if verdict != "diverged":
            log.info("resume_verified", attempt=attempt.number, step=step, text=a.text, incident=a.incident)
            return
        self._diverged(attempt, step)

    def _diverged(self, attempt, step: int) -> None:
        ra, a, facts = self.run.cfg.watchdog.resume_audit, self.audit, self.run.facts
        stop = ra.on_divergence == "stop"
        then = (
            "the run ends here (watchdog.resume_audit.on_divergence: stop)"
            if stop
            else "training goes on (watchdog.resume_audit.on_divergence: warn)"
        )
        inc = self.run.incidents.open_for_run(
            "resume_diverged",
            facts,
            with_last_incident=True,
            attempt=attempt.number,
            phase="train",
            step=step,
            classification="resume diverged",
            summary=f"{a.text}; {then}",
            status="final",
            resume_audit=a.record(),
            on_divergence=ra.on_divergence,
            resumed_from=attempt.resume_from,
        )
        self._records()[-1]["diverged_incident"] = inc.id
        self._save()
        d = a.difference or {}
        log.error(
            "resume_diverged",
            incident=inc.id,
            attempt=attempt.number,
            step=step,
            figure=d.get("figure"),
            now=d.get("now"),
            before=d.get("before"),
            text=a.text,
            on_divergence=ra.on_divergence,
        )
        if stop and self.abort is None:
            self.abort = f"resume diverged — {a.text}"

    def while_running(self, attempt, now: float) -> Optional[str]:
        return self.abort

    def on_attempt_ended(self, ev: AttemptEnded) -> None:
        """An audit still open says what it did compare; the failure (if any) is what the next attempt recovers from."""
        episode = ev.episode
        if self.audit is not None and self.audit.ended() is not None:
            self._save()
        self.audit, self.abort = None, None
        self.failure = episode.incident if episode is not None else None

    def _save(self) -> None:
        a = self.audit
        if a is None:
            return
        records = self._records()
        rec = a.record()
        extra = {k: v for k, v in records[-1].items() if k not in rec}
        records[-1] = {**rec, **extra}
        path = self.run.run_dir / AUDITS_NAME
        try:
            self.run.fs.write_json(path, {"audits": records})
        except OSError as exc:
            self.run.write_failed(exc, path)
