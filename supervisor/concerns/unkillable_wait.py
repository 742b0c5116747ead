"""Processes SIGKILL could not end (`restart.on_unkillable`).

A process of the tree still there `watchdog.kill_wait_s` after SIGKILL sleeps uninterruptibly in the kernel (NFS, a
GPU driver): no new attempt may start on top of it.  The `unkillable` incident says which processes and where in
the kernel they wait; then, under `wait`, the loop stays in KILLING until they are gone (an operator's stop, or a
failure that ends the run, does not wait for them), or, under `fail`, the run ends failed.
"""

from __future__ import annotations

from typing import Optional

import structlog

from hangwatch.common.exitcodes import EXIT_FAILED
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.rules.answer import Answer
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")

ENDS_RUN = (Intent.EXIT, Intent.REQUEUE, Intent.FAIL, Intent.PEER_FAILED)  # intents that do not wait for the survivors


class UnkillableWait(Concern):
    priority = 100  # `decision`: the highest: its failure overrides any other concern's decision

    def __post_init__(self) -> None:
        self.name = "unkillable_wait"
        self.waiting = None  # the `unkillable` incident while the run waits for the survivors to go
        self.looked_at: set[int] = set()  # the killers whose survivors were already reported (asked once each)

    def hold_teardown(self, attempt, episode, intent: Intent, now: float) -> bool:
        killer = episode.killer
        if self.waiting is None:
            if not killer.survivors or id(killer) in self.looked_at:
                return False
            self.looked_at.add(id(killer))
            return self._survivors(attempt, episode, intent, now)
        left = killer.survivors_left(now)
        if left and intent not in ENDS_RUN:
            return True
        self._stop_waiting(killer, now, gone=not left)
        return False

    def decision(self, attempt, episode, decision, now: float) -> Optional[Answer]:
        """`restart.on_unkillable: fail` and processes of the tree outlived SIGKILL: the machine cannot go on (exit 1),
        not the command — whatever was decided before."""
        killer = episode.killer
        if self.run.cfg.restart.on_unkillable != "fail" or killer is None or not killer.survivors:
            return None
        pids = [s.get("pid") for s in killer.survivors]
        why = f"processes {pids} outlived SIGKILL (unkillable; a reboot or a GPU reset may be needed)"
        return Answer(Decision("fail", why, exit_code=EXIT_FAILED))

    def next_due_s(self, now: float) -> Optional[float]:
        return 1.0 if self.waiting is not None else None  # survivors are looked at once a second

    def _survivors(self, attempt, episode, intent: Intent, now: float) -> bool:
        """The incident and its alert; then wait (True) or let the episode end (False): failed under `fail`, as asked
        when the run is ending anyway (a stop, a failure that ends the run)."""
        killer, cfg, facts = episode.killer, self.run.cfg, self.run.facts
        mode = cfg.restart.on_unkillable
        pids = [s.get("pid") for s in killer.survivors]
        states = ", ".join(
            f"{s.get('pid')} ({s.get('state')}, waiting in {s.get('wchan') or 'an unknown kernel function'})"
            for s in killer.survivors
        )
        ending = mode == "wait" and intent in ENDS_RUN
        if ending:
            then = f"the run ends with them still there ({intent.value} was asked; nothing will start on top of them)"
        elif mode == "wait":
            then = "no new attempt starts until they are gone (restart.on_unkillable: wait)"
        else:
            then = "the run ends failed (restart.on_unkillable: fail)"
        summary = (
            f"{len(pids)} process(es) of attempt {attempt.number}'s tree outlived SIGKILL by "
            f"{cfg.watchdog.kill_wait_s:g} s: {states} — uninterruptible sleep in the kernel (NFS, a GPU "
            f"driver); a reboot or a GPU reset may be needed; {then}"
        )
        inc = self.run.incidents.open_for_run(
            "unkillable",
            facts,
            attempt=attempt.number,
            phase=None,
            step=facts.last_step.get("step"),
            classification="unkillable process",
            summary=summary,
            status="waiting" if mode == "wait" and not ending else "final",
            survivors=killer.survivors,
            on_unkillable=mode,
            failure=episode.incident.id if episode.incident is not None else None,
            failure_kind=episode.kind,
            kill_wait_s=cfg.watchdog.kill_wait_s,
        )
        log.error("unkillable", incident=inc.id, attempt=attempt.number, pids=pids, on_unkillable=mode, text=summary)
        if ending:
            self.run.incidents.amend(inc, still_there=pids, waited_s=0.0)
            return False
        if mode == "fail":
            return False  # the episode's decision says so (`decision`)
        self.waiting = inc
        return True

    def _stop_waiting(self, killer, now: float, gone: bool) -> None:
        """The survivors are gone (the run goes on), or the run ends while they are still there."""
        inc, self.waiting = self.waiting, None
        waited = round(now - (killer.done_at or now), 3)
        if gone:
            self.run.incidents.amend(inc, status="final", gone_after_s=waited)
            log.info(
                "unkillable_gone", incident=inc.id, waited_s=waited, note="the survivors are gone: the run goes on"
            )
        else:
            still = [r.pid for r in killer.survivor_refs]
            self.run.incidents.amend(inc, status="final", still_there=still, waited_s=waited)
            log.warning(
                "unkillable_left",
                incident=inc.id,
                pids=still,
                waited_s=waited,
                note="the run ends with them still there",
            )
