"""What the supervisor makes of each heartbeat line, besides the deadlines (`Deadlines.observe`).

    start       the rank's process (by identity) and dump file are remembered: only announced
                processes ever get SIGUSR1; the first start moves STARTING → RUNNING; a `resumed_from`
                other than the checkpoint handed in HANGWATCH_RESUME_FROM is logged (a warning when
                the ledger holds it bad)
    step        the metrics `status` shows; a new highest step clears the crash-loop count; the rank's
                step time feeds the straggler watch (a `straggler` warning, never a kill); its loss
                confirms or spoils the checkpoints that wait for confirmation (`checkpoint_ledger`)
    phase       systemd's status line follows the phase; leaving `train` pauses the straggler clock
    checkpoint  recorded in the checkpoint ledger (`checkpoint_ledger`: pending until confirmed, good at
                once when the worker says so); state.json records the last good one at once
    warn        logged; a non-finite loss in it spoils waiting checkpoints, like a step's
    stop        its reason decides finished-or-not when the worker exits; once every rank said `stop`,
                the exit itself gets a deadline (a process that hangs on its way out is still caught)

Each line counts from when it was written, not when it was read (reads are coalesced): its file's
modification time (`heartbeats.written_at`) when the supervisor runs on the real clock, its file
system keeps local times and this pass saw no suspension (`Supervisor.file_times`); else the pass's
`now`.

Reading lines is part of draining events: nothing here signals or kills.  It is also the loop's
busiest work (64 ranks at 10 Hz are 640 lines a second), so a line costs a decode and a few dict
updates: nothing is logged or formatted per step line, state.json is written once per read however
many lines asked for it, and new calibration samples are saved at most every CALIBRATION_SAVE_S.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Collection, Optional

import structlog

from hangwatch.supervisor.records.checkpoint_ledger import BAD, CheckpointLedger, resolve
from hangwatch.supervisor.watch.beat_files import written_at
from hangwatch.supervisor.loop.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.loop.supervisor import Supervisor

log = structlog.get_logger("hangwatch")


def read(sup: "Supervisor", now: float, names: Optional[Collection[str]] = None) -> None:
    """Read the current attempt's new lines (in the files named in `names` only, when given): feed the
    deadlines, record what they establish."""
    cur = sup.current
    if cur is None:
        return
    torn_before = cur.tail.torn
    state_changed = False  # state.json is written once, after the lines (64 ranks start in one pass)
    lines = cur.tail.read_timed(names)
    exact = bool(lines) and sup.file_times_now and cur.tail.local_times()
    wall_now = time.time() if exact else 0.0
    lo = cur.tail.read_at if cur.tail.read_at is not None else cur.worker.started_at
    cur.tail.read_at = now
    for mtime, rec in lines:
        at = written_at(mtime, wall_now, now, lo) if exact else now
        tr = sup.deadlines.observe(rec, at)
        ev = rec["event"]
        if ev == "start":
            a = cur.announce(rec, sup.table)
            log.info("worker_started", attempt=cur.number, rank=a.rank, pid=rec.get("pid"),
                     resumed_from=rec.get("resumed_from"), skipped_checkpoints=rec.get("skipped_checkpoints") or None,
                     startup_s=round(at - cur.worker.started_at, 3))
            if sup.nodes is not None:
                note = sup.nodes.rank_started(rec, now, cur.number)
                if note:
                    log.info("torchrun_round", attempt=cur.number, rank=a.rank, pid=rec.get("pid"), note=note)
            if not cur.resume_checked:
                cur.resume_checked = True
                _resumed(cur, rec, sup.ledger.ledger)
            if sup.lifecycle.state is State.STARTING:
                sup.transition(State.RUNNING, f"start beat from rank {a.rank}", now)
            state_changed = True
        if ev in ("step", "checkpoint", "warn") and sup.ledger.observe(rec, cur.number):
            state_changed = True  # a checkpoint announced, confirmed or spoiled: state.json says so at once
        if ev == "step":
            sup.facts.last_step = rec
            sup.policy.observed_step(int(rec["step"]), now)
            _straggler(cur, tr.rank, int(rec["step"]), at, rec.get("step_time_s"))
        elif ev == "phase":
            if tr.phase != "train":
                cur.stragglers.left_train(tr.rank)
            log.debug("phase", rank=tr.rank, phase=tr.phase, budget_s=tr.phase_budget, step=tr.step)
            sup.status_note(now, force=True)
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
    if state_changed:
        sup.write_state(now, force=True)
    sup.save_calibration(only_if_changed=True, now=now)


def _resumed(cur: "Attempt", rec: dict, ledger: "CheckpointLedger") -> None:
    """Compare the worker's `resumed_from` (its first `start` beat) with what it was handed.  Resuming
    from a checkpoint the ledger holds bad is a warning; another choice (the built-in worker resumes
    from its own provisional checkpoint after a graceful stop) is only noted."""
    reported, handed = rec.get("resumed_from"), cur.resume_from
    if not reported:
        if handed:
            log.info("resume_not_reported", attempt=cur.number, handed=handed,
                     note="the start beat names no checkpoint; Heartbeat.start(resumed_from=...) lets it be checked")
        return
    where = resolve(str(reported), cur.cwd)
    if handed and where == resolve(handed, cur.cwd):
        return
    known = next((e for e in ledger.entries.values() if resolve(e.path, cur.cwd) == where), None)
    status = known.status if known else "unknown to the supervisor"
    (log.warning if status == BAD else log.info)(
        "resumed_from_differs", attempt=cur.number, handed=handed or None, reported=str(reported), status=status,
        why=known.why if known else None)


def _straggler(cur: "Attempt", rank: int, step: int, now: float, reported) -> None:
    what, rec = cur.stragglers.step(rank, step, now, reported)
    if what == "straggler":
        log.warning("straggler", attempt=cur.number, **rec.as_dict())
    elif what == "recovered":
        log.info("straggler_recovered", attempt=cur.number, rank=rank, step=step, slow_since_step=rec.since_step)
