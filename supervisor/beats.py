"""What the supervisor makes of each heartbeat line, besides the deadlines (`Deadlines.observe`).

    start       the rank's process (by identity) and dump file are remembered: only announced
                processes ever get SIGUSR1; the first start moves STARTING → RUNNING
    step        the metrics `status` shows; a new highest step clears the crash-loop count; the rank's
                step time feeds the straggler watch (a `straggler` warning, never a kill)
    phase       systemd's status line follows the phase; leaving `train` pauses the straggler clock
    checkpoint  a *good* one becomes the run's last good checkpoint (state.json records it at once)
    warn        logged
    stop        its reason decides finished-or-not when the worker exits; once every rank said `stop`,
                the exit itself gets a deadline (a process that hangs on its way out is still caught)

Reading lines is part of draining events: nothing here signals or kills.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from hangwatch.supervisor.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.attempt import Attempt
    from hangwatch.supervisor.runner import Supervisor

log = structlog.get_logger("hangwatch")


def read(sup: "Supervisor", now: float) -> None:
    """Read the current attempt's new lines: feed the deadlines, record what they establish."""
    cur = sup.current
    if cur is None:
        return
    torn_before = cur.tail.torn
    for rec in cur.tail.read():
        tr = sup.deadlines.observe(rec, now)
        ev = rec["event"]
        if ev == "start":
            a = cur.announce(rec, sup.table)
            log.info("worker_started", attempt=cur.number, rank=a.rank, pid=rec.get("pid"),
                     resumed_from=rec.get("resumed_from"), skipped_checkpoints=rec.get("skipped_checkpoints") or None,
                     startup_s=round(now - cur.worker.started_at, 3))
            if sup.lifecycle.state is State.STARTING:
                sup.transition(State.RUNNING, f"start beat from rank {a.rank}", now)
            sup.write_state(now, force=True)
        elif ev == "step":
            sup.facts.last_step = rec
            sup.policy.observed_step(int(rec["step"]), now)
            _straggler(cur, tr.rank, int(rec["step"]), now, rec.get("step_time_s"))
        elif ev == "phase":
            if tr.phase != "train":
                cur.stragglers.left_train(tr.rank)
            log.debug("phase", rank=tr.rank, phase=tr.phase, budget_s=tr.phase_budget, step=tr.step)
            sup.status_note(now, force=True)
        elif ev == "checkpoint" and rec.get("good"):
            sup.facts.last_good_checkpoint, sup.facts.last_good_step = str(rec.get("path")), rec.get("step")
            log.info("good_checkpoint", path=sup.facts.last_good_checkpoint, step=sup.facts.last_good_step)
            sup.write_state(now, force=True)
        elif ev == "warn":
            log.warning("worker_warning", rank=tr.rank, message=rec.get("message"), step=tr.step)
        elif ev == "stop":
            cur.last_stop[tr.rank] = str(rec.get("reason"))
            log.info("worker_stop_line", rank=tr.rank, reason=rec.get("reason"), step=tr.step)
            if all(t.stopped for t in sup.deadlines.ranks.values()):
                # No per-rank deadline applies after `stop`; a process that then hangs on its way
                # out (a non-daemon thread, CUDA/NCCL teardown) is still caught.
                wd = sup.watchdog_cfg
                sup.deadlines.arm_extra("exit", now, wd.exit_after_stop_s + wd.term_grace_s, "exit after stop line")
    if cur.tail.torn != torn_before:
        sup.facts.torn_lines += cur.tail.torn - torn_before
        log.warning("torn_heartbeat_lines", count=cur.tail.torn - torn_before, total=sup.facts.torn_lines,
                    example=cur.tail.torn_examples[-1] if cur.tail.torn_examples else None)
    sup.save_calibration(only_if_changed=True)


def _straggler(cur: "Attempt", rank: int, step: int, now: float, reported) -> None:
    what, rec = cur.stragglers.step(rank, step, now, reported)
    if what == "straggler":
        log.warning("straggler", attempt=cur.number, **rec.as_dict())
    elif what == "recovered":
        log.info("straggler_recovered", attempt=cur.number, rank=rank, step=step, slow_since_step=rec.since_step)
