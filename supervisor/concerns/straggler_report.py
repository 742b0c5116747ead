"""Stragglers: a rank whose steps take markedly longer than its peers' (`watch.stragglers.StragglerWatch`, one per
attempt, fed each rank's step times); said in the log when a rank becomes one and when it recovers, and shown in
`status` and in the incidents of the attempt."""

from __future__ import annotations

import structlog

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import Beat

log = structlog.get_logger("hangwatch")


class StragglerReport(Concern):
    def __post_init__(self) -> None:
        self.name = "straggler_report"

    def on_beat(self, ev: Beat) -> None:
        attempt, tr, rec, at = ev.attempt, ev.track, ev.rec, ev.at
        ev = rec["event"]
        if ev == "phase" and tr.phase != "train":
            attempt.stragglers.left_train(tr.rank)
        if ev != "step":
            return
        step = int(rec["step"])
        what, r = attempt.stragglers.step(tr.rank, step, at, rec.get("step_time_s"))
        if what == "straggler":
            log.warning("straggler", attempt=attempt.number, **r.as_dict())
        elif what == "recovered":
            log.info(
                "straggler_recovered", attempt=attempt.number, rank=tr.rank, step=step, slow_since_step=r.since_step
            )
