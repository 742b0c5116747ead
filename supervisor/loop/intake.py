"""What the worker says: its heartbeat lines and its output, read for the loop once a pass.

Heartbeat lines (`Intake.beats`), besides the deadlines (`Deadlines.observe`) and the concerns (`events.Beat`):
    start       the rank's process and dump file are remembered (only announced processes ever get
                SIGUSR1); the first start moves STARTING → RUNNING (the loop's move: what `beats` returns); a
                `resumed_from` other than the checkpoint handed in HANGWATCH_RESUME_FROM is logged (a warning
                when the ledger holds it bad)
    step        the metrics `status` shows; a new highest step clears the crash-loop count; its loss confirms
                or spoils waiting checkpoints
    phase       systemd's status line follows the phase (at the pass's end)
    checkpoint  recorded in the checkpoint ledger (state.json records the last good one at the pass's end)
    warn        logged; a non-finite loss in it spoils waiting checkpoints, like a step's
    stop        its reason decides finished-or-not when the worker exits; once every rank said `stop`,
                the exit itself gets a deadline (a process that hangs on its way out is still caught)
Each line counts from when it was written, not when it was read (reads are coalesced): its file's
modification time when the supervisor runs on the real clock, its file system keeps local times and this
pass saw no suspension; else the pass's `now`.  A step line costs a decode and a few dict updates.

The output (`Intake.output`, at most every OUTPUT_READ_S unless forced: a chatty log is not read on every
heartbeat): when it grew, and its progress lines, go into the deadlines; a worker that never beat but shows
progress there is running.  Intake records what the lines establish; the moves they cause are the loop's.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Collection, Optional

import structlog

from hangwatch.supervisor.concerns import tell
from hangwatch.supervisor.concerns.events import Beat, OutputProgress
from hangwatch.supervisor.records.checkpoint_ledger import BAD, PersistedLedger, resolved_path
from hangwatch.supervisor.watch.beat_files import written_at

if TYPE_CHECKING:
    from hangwatch.common.config import WatchdogConfig
    from hangwatch.supervisor.concerns import Concern, RunContext
    from hangwatch.supervisor.nodes.interface import Nodes
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.processes.process import ProcessTable
    from hangwatch.supervisor.rules.policy import RestartPolicy

log = structlog.get_logger("hangwatch")

OUTPUT_READ_S = 1.0  # the worker's output is read at most this often (and always before a deadline is believed)


class Intake:
    def __init__(
        self,
        run: "RunContext",
        wd: "WatchdogConfig",
        table: "ProcessTable",
        ledger: PersistedLedger,
        policy: "RestartPolicy",
        nodes: "Nodes",
        concerns: list["Concern"],
        file_times: Callable[[], bool],
    ):
        self.run, self.wd, self.table, self.ledger, self.policy = run, wd, table, ledger, policy
        self.nodes, self.concerns, self.file_times = nodes, concerns, file_times
        self.read_all = True  # the last read took every heartbeat file (not only those the file events named)

    def beats(self, cur: Optional["Attempt"], now: float, names: Optional[Collection[str]] = None) -> Optional[str]:
        """Read the attempt's new lines (in the files named in `names` only, when given).  Returns why the worker is
        running when a line said so (a start line), else None."""
        running = None
        self.read_all = names is None
        if cur is None:
            return None
        torn_before = cur.tail.torn
        lines = cur.tail.read_timed(names)
        exact = bool(lines) and self.file_times() and cur.tail.local_times()
        wall_now = time.time() if exact else 0.0
        lo = cur.tail.read_at if cur.tail.read_at is not None else cur.worker.started_at
        cur.tail.read_at = now
        for mtime, rec in lines:
            said = self._line(cur, rec, written_at(mtime, wall_now, now, lo) if exact else now, now)
            running = running or said
        if cur.tail.torn != torn_before:
            facts = self.run.facts
            facts.torn_lines += cur.tail.torn - torn_before
            log.warning(
                "torn_heartbeat_lines",
                count=cur.tail.torn - torn_before,
                total=facts.torn_lines,
                example=cur.tail.torn_examples[-1] if cur.tail.torn_examples else None,
            )
        return running

    def _line(self, cur: "Attempt", rec: dict, at: float, now: float) -> Optional[str]:
        dl = self.run.deadlines
        before = dl.ranks.get(rec.get("rank") if isinstance(rec.get("rank"), int) else 0)
        left = before.phase if before is not None else None
        tr = dl.observe(rec, at)
        ev = rec["event"]
        running = None
        if ev == "start":
            running = f"start beat from rank {self._start(cur, rec, at, now)}"
        elif ev != "stop" and cur.announced:
            back = cur.follow(rec, self.table)
            if back is not None:
                log.info(
                    "rank_process_changed",
                    attempt=cur.number,
                    rank=back.rank,
                    pid=rec.get("pid"),
                    note="the process that announced the rank last is gone; this one, which announced it before, "
                    "goes on",
                )
        if ev in ("step", "checkpoint", "warn"):
            self.ledger.observe(rec, cur.number)  # a checkpoint announced, confirmed or spoiled
        if ev == "step":
            self.run.facts.last_step = rec
            self.policy.observed_step(int(rec["step"]), now)
        elif ev == "phase":
            log.debug("phase", rank=tr.rank, phase=tr.phase, budget_s=tr.phase_budget, step=tr.step)
        elif ev == "warn":
            log.warning("worker_warning", rank=tr.rank, message=rec.get("message"), step=tr.step)
        elif ev == "stop":
            self._stop(cur, tr, rec, now)
        tell(self.concerns, Beat(cur, tr, rec, left, at, now))
        return running

    def _start(self, cur: "Attempt", rec: dict, at: float, now: float) -> int:
        a = cur.announce(rec, self.table)
        if (a.rank, rec.get("pid")) not in cur.started:
            cur.started.add((a.rank, rec.get("pid")))
            log.info(
                "worker_started",
                attempt=cur.number,
                rank=a.rank,
                pid=rec.get("pid"),
                resumed_from=rec.get("resumed_from"),
                skipped_checkpoints=rec.get("skipped_checkpoints") or None,
                startup_s=round(at - cur.worker.started_at, 3),
            )
        elif rec.get("resumed_from"):
            log.info("worker_resumed_from", attempt=cur.number, rank=a.rank, resumed_from=rec["resumed_from"])
        note = self.nodes.rank_started(rec, now, cur.number)
        if note:
            log.info("torchrun_round", attempt=cur.number, rank=a.rank, pid=rec.get("pid"), note=note)
        # The bootstrap's own start (instrumented: auto) comes before the script has chosen what to resume from;
        # the start line of the script's callback or heartbeat, which says so, is the one compared.
        if not cur.resume_checked and (rec.get("instrumented") != "auto" or rec.get("resumed_from")):
            cur.resume_checked = True
            self._resumed(cur, rec)
        return a.rank

    def _stop(self, cur: "Attempt", tr, rec: dict, now: float) -> None:
        cur.stop_lines[tr.rank] = {"reason": rec.get("reason"), "code": rec.get("code")}
        log.info(
            "worker_stop_line",
            rank=tr.rank,
            reason=rec.get("reason"),
            step=tr.step,
            **({"code": rec["code"]} if "code" in rec else {}),
        )
        dl = self.run.deadlines
        if all(t.stopped for t in dl.ranks.values()):
            # No per-rank deadline applies after `stop`; a process that then hangs on its way
            # out (a non-daemon thread, CUDA/NCCL teardown) is still caught.
            dl.arm_extra("exit", now, self.wd.exit_after_stop_s + self.wd.term_grace_s, "exit after stop line")

    def _resumed(self, cur: "Attempt", rec: dict) -> None:
        """Compare the worker's `resumed_from` (its first `start` beat) with what it was handed.  Resuming
        from a checkpoint the ledger holds bad is a warning; another choice (the built-in worker resumes
        from its own provisional checkpoint after a graceful stop) is only noted."""
        reported, handed = rec.get("resumed_from"), cur.resume_from
        if not reported:
            if handed:
                log.info(
                    "resume_not_reported",
                    attempt=cur.number,
                    handed=handed,
                    note="the start beat names no checkpoint; Heartbeat.start(resumed_from=...) lets it be checked",
                )
            return
        where = resolved_path(str(reported), cur.cwd)
        if handed and where == resolved_path(handed, cur.cwd):
            return
        known = next((e for e in self.ledger.ledger.entries.values() if resolved_path(e.path, cur.cwd) == where), None)
        status = known.status if known else "unknown to the supervisor"
        (log.warning if status == BAD else log.info)(
            "resumed_from_differs",
            attempt=cur.number,
            handed=handed or None,
            reported=str(reported),
            status=status,
            why=known.why if known else None,
        )

    def output(self, cur: Optional["Attempt"], now: float, force: bool = False) -> Optional[str]:
        """The attempt's new output (at most every OUTPUT_READ_S unless `force`d).  Returns why the worker is running
        when its output shows progress before any beat did, else None."""
        if cur is None or cur.output is None or (not force and now - cur.output_read_at < OUTPUT_READ_S):
            return None
        cur.output_read_at = now
        grew, progressed = cur.output.read(now, time.time() if self.file_times() else None)
        if not grew:
            return None
        dl = self.run.deadlines
        dl.output_seen(cur.output.last_output_at, progressed, cur.output.steps_read)
        if progressed:
            tell(self.concerns, OutputProgress(cur, now))
            if not dl.started:
                return f"progress in its output: {cur.output.last_progress_line[:80]!r}"
        return None
