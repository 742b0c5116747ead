"""One failure (or end) of a worker, from detection until its process tree is gone.

A stall (a deadline fired, or `restart now`):
    incident "in progress" → at once, together: the process snapshot begins (CPU sampled over
    `cpu_sample_s` while the loop keeps running), SIGUSR1 to the announced pids, py-spy on each, a poke
    into each rank's NCCL flight-recorder pipe → in parallel, the snapshot is taken once its interval has
    passed and no py-spy holds a process stopped (the state letters are the processes' own; a busy
    loop's CPU may read lower by py-spy's pause), and the dumps come in (`StallDumps`: a whole
    faulthandler dump at once, one that is not whole once it stopped growing, py-spy when it ends) →
    when a rank waits on its DataLoader, its workers' stacks → the call it hung in
    (`incidents.landmarks`), the stuck frame and classification into the incident — with several
    ranks, each rank read on its own and the verdict (`incidents.verdict`): which rank is the culprit,
    which only wait for it → SIGTERM to the tree, SIGKILL after the grace: a worker a deadline found
    stuck gets `stuck_term_grace_s` (its main thread cannot run a graceful stop; children still get
    SIGTERM first), any other end the full `term_grace_s` (`TreeKiller`).
A worker exit (crash, signal, do-not-restart code, or the end of the run):
    classify the exit (last words, the fatal-signal dump, the log tail) → incident unless it was a
    clean end → `TreeKiller` for whatever is left of its tree.
Either way, once the tree is gone `finish` completes the incident (timings, the decision, the
heartbeat tails and the worker log tail) and writes it.

An episode never reaps: the loop observes exits in one place and records them on the `Worker`.
The incidents of an exit, of a worker that could not start and of a crash loop are at the end of this
module.  A worker's end is classified from the evidence in order of trust (`incidents.classify_exit`): its
last words (exit.json), its exit code or signal — a SIGKILL hangwatch did not send is put to the kernel's
records (`kernel_evidence.sigkill_cause`) — torchrun's root-cause report of the rank that failed first,
the log tail.  A fatal signal makes faulthandler write the stack into the rank's dump file: its frame is
the stuck frame, and the call it died in (`landmarks.read_stack`) is named in the summary.  With several
ranks the incident names the culprit rank (the one whose dump holds the
fatal error, else the one torchrun says failed first) and keeps every rank's dump; dumps the NCCL
flight recorder wrote by itself during the attempt (on its own timeout) are kept too.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Optional

import structlog

from hangwatch.common.config import RestartCfg, WatchdogCfg
from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import EXIT_NAME, rank_exit_name, read_json, tail_text
from hangwatch.supervisor.escalation import rank_evidence
from hangwatch.supervisor.escalation.dump_collector import StallDumps, WorkerDumps
from hangwatch.supervisor.escalation.flight_recorder import FlightDumps, into_incident
from hangwatch.supervisor.escalation.kernel_evidence import KernelEvidence, sigkill_cause, torchrun_root_cause
from hangwatch.supervisor.escalation.tree_killer import TreeKiller
from hangwatch.supervisor.incidents import (
    Incident,
    IncidentStore,
    classify_exit,
    classify_stall,
    fatal_error,
    frame_str,
    main_stack,
    signal_name,
    sleeping,
    stuck_frame,
)
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread
from hangwatch.supervisor.incidents.landmarks import Reading, is_own_code, read_stack, user_landmarks
from hangwatch.supervisor.incidents.loader_workers import judge
from hangwatch.supervisor.incidents.verdict import decide
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import ProcessTable, ProcRef
from hangwatch.supervisor.processes.snapshot import GpuCache
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.no_retry import NoRetry, no_retry_code
from hangwatch.supervisor.rules.policy import Decision, RestartPolicy
from hangwatch.supervisor.rules.teardown import exit_hang, teardown_crash
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired

log = structlog.get_logger("hangwatch")
MAX_DUMP_BYTES = 4 << 20


@dataclass(frozen=True)
class EscalationContext:
    """What an episode acts with; built once by the supervisor from its seams."""

    table: ProcessTable
    incidents: IncidentStore
    watchdog_cfg: WatchdogCfg
    snapshot: Callable[..., Any]  # (roots, extra) → an object whose take() returns the process records
    gpu: GpuCache
    gpu_pids: Callable[[], Optional[set]]
    cpu_sample_s: float
    subreaper: bool
    kernel: KernelEvidence = field(default_factory=KernelEvidence)  # what the kernel says of a SIGKILL
    fs: FsOps = field(default_factory=FsOps)  # the run's write seam (py-spy's output files)
    deadlines: Optional[Deadlines] = None  # the run's: each rank's step and phase for an episode's incident
    record: Callable[[], RunRecord] = RunRecord  # the run's record now (its last good checkpoint for an incident)


@dataclass
class Episode:
    kind: Optional[str]  # incident kind; None for a clean end (finished, graceful stop)
    incident: Optional[Incident]
    detected_at: float
    expired: Optional[Expired] = None
    reason: str = ""
    # What the loop proposes when the episode opens (the policy's on an exit, a peer's restart, a run that must
    # end); the deciders see it when the tree is gone, and `decision` is what was decided then (`settle`).
    proposed: Optional[Decision] = None
    decision: Optional[Decision] = None
    sample: Any = None  # the process snapshot being taken
    sampled_at: Optional[float] = None
    procs: list = field(default_factory=list)
    dumps: Optional[StallDumps] = None
    killer: Optional[TreeKiller] = None
    timings: dict = field(default_factory=dict)
    deadlines: Optional[Deadlines] = None  # the attempt's, for each rank's step and phase (a stall's verdict)
    landmarks: tuple = ()  # the user's (watchdog.landmarks), as `landmarks.Landmark` entries
    own_culprit: Optional[bool] = None  # multi-node: this node's ranks hold the culprit (`node_incident`)
    peer_notice: Optional[dict] = None  # multi-node: the peer's restart this episode follows
    # The `exit` deadline fired after every rank had said its work was done: why the run is finished (only the way out
    # hung).  Read when the deadline fires, before the kill's SIGTERM makes anyone say anything else.
    work_done: Optional[str] = None
    store: Optional[IncidentStore] = None  # where its incident is saved (the episode owns it)

    # ---- a stall ---------------------------------------------------------------------------

    @classmethod
    def stall(
        cls,
        tools: EscalationContext,
        attempt: Attempt,
        now: float,
        kind: str,
        expired: Optional[Expired],
    ) -> "Episode":
        deadlines, facts = tools.deadlines, tools.record()
        tr = deadlines.ranks.get(expired.rank if expired and expired.rank is not None else deadlines.main_rank())
        phase, step = (tr.phase, tr.step) if tr else (None, None)
        deadline = None
        if expired is not None:
            deadline = {
                "name": expired.name,
                "budget_s": round(expired.budget_s, 3),
                "elapsed_s": round(expired.elapsed_s, 3),
                "overdue_s": round(expired.overdue_s, 3),
                "source": expired.source,
                "rank": expired.rank,
                "phase": expired.phase,
                "progress_lines": expired.progress_lines,
                "last_progress_age_s": expired.last_progress_age_s,
            }
        on_rank = (
            f" on rank {expired.rank}" if expired and expired.rank is not None and len(deadlines.ranks) > 1 else ""
        )
        why = (
            f"{expired.name} deadline {expired.budget_s:.1f}s exceeded by {expired.overdue_s:.1f}s{on_rank}"
            f" in phase {phase!r} at step {step}"
            if expired
            else "restart now requested"
        )
        if expired is not None and expired.name == "output_silence":
            out = attempt.output
            last = f"; its last line: {out.last_line[:120]!r}" if out is not None and out.last_line else ""
            why = (
                f"no output for {expired.elapsed_s:.1f}s (output_silence_timeout_s {expired.budget_s:g}), "
                f"no heartbeat from any rank{last}"
            )
        inc = tools.incidents.open_for_run(
            kind,
            facts,
            note=False,  # noted when the episode finishes it
            attempt=attempt.number,
            phase=phase,
            step=step,
            deadline=deadline,
            summary=why,
            status="in progress",
            worker_pid=attempt.worker.pid,
            then=stragglers_field(attempt),
        )
        log.warning(
            "stall_detected" if kind != "manual" else "restart_now",
            kind=kind,
            incident=inc.id,
            deadline=expired.name if expired else None,
            budget_s=deadline and deadline["budget_s"],
            elapsed_s=deadline and deadline["elapsed_s"],
            overdue_s=deadline and deadline["overdue_s"],
            phase=phase,
            step=step,
            rank=expired.rank if expired else None,
            attempt=attempt.number,
        )
        done = exit_hang(expired.name, _stops(attempt, deadlines.ranks)) if expired is not None else None
        return cls(
            kind, inc, now, expired=expired, reason=why, deadlines=deadlines, work_done=done, store=tools.incidents
        )

    @classmethod
    def peer(
        cls,
        tools: EscalationContext,
        attempt: Attempt,
        now: float,
        notice: dict,
        gen: int,
    ) -> "Episode":
        """A peer node restarted (it bumped the generation): dump where the local ranks wait, then restart into
        generation `gen` with it (multi-node, `nodes.multi_node`)."""
        deadlines, facts = tools.deadlines, tools.record()
        tr = deadlines.ranks.get(deadlines.main_rank())
        phase, step = (tr.phase, tr.step) if tr else (None, None)
        why = (
            f"peer node {notice.get('node')} restarted (generation {gen}): "
            f"{notice.get('summary') or notice.get('kind')}"
        )
        inc = tools.incidents.open_for_run(
            "peer_restart",
            facts,
            note=False,  # noted when the episode finishes it
            attempt=attempt.number,
            phase=phase,
            step=step,
            summary=why,
            status="in progress",
            worker_pid=attempt.worker.pid,
            peer_notice=notice,
        )
        log.warning(
            "peer_restart",
            incident=inc.id,
            peer=notice.get("node"),
            generation=gen,
            attempt=attempt.number,
            peer_summary=notice.get("summary"),
        )
        return cls("peer_restart", inc, now, reason=why, deadlines=deadlines, peer_notice=notice, store=tools.incidents)

    def sample_then_dump(self, tools: EscalationContext, attempt: Attempt, now: float) -> bool:
        """At the first call begin the snapshot and the dumps together; True once the snapshot is taken (the
        dumps' gate, `_take_snapshot`), the dumps going on from there."""
        if self.dumps is None:
            w = attempt.worker
            extra = [ref.pid for ref in attempt.announced_refs().values()]
            self.sample = tools.snapshot([w.pid] if not w.exited else [], extra)
            self.sampled_at = now
            wd = tools.watchdog_cfg
            self.landmarks = user_landmarks(wd.landmarks)
            self.dumps = StallDumps(
                attempt.dump_targets(),
                grace_s=wd.dump_grace_s,
                table=tools.table,
                py_spy=wd.py_spy,
                py_spy_timeout_s=wd.py_spy_timeout_s,
                py_spy_path=wd.py_spy_path,
                out_dir=self.incident.dir,
                fs=tools.fs,
                flight=FlightDumps(attempt.flight, sorted(attempt.announced)),
                gate=lambda t: self._take_snapshot(tools, attempt, t),
                unannounced=unannounced_pythons(tools.table, attempt) if wd.py_spy else [],
            )
            self.dumps.begin(now)
            self.timings["dump_started_at_s"] = round(now - self.detected_at, 3)
        self.dumps.advance(now)
        return self.dumps.gate_at is not None

    def _take_snapshot(self, tools: EscalationContext, attempt: Attempt, now: float) -> bool:
        """The dumps' gate: once the CPU interval has passed, record the snapshot (no py-spy runs by then: a
        process py-spy holds stopped would read as state `t`) and from it the DataLoader workers' step."""
        if now - self.sampled_at < tools.cpu_sample_s:
            return False
        w = attempt.worker
        self.procs = self.sample.take()
        for p in self.procs:
            if p.get("create_time") and p["pid"] != w.pid:
                attempt.tree.setdefault(p["pid"], ProcRef(p["pid"], p["create_time"]))
        gpu = tools.gpu.fresh(now)
        self.incident.data.update(
            process_snapshot=self.procs, gpu=gpu, gpu_processes=gpu_processes(gpu, {p["pid"] for p in self.procs})
        )
        self.timings["snapshot_s"] = round(now - self.sampled_at, 3)
        self.dumps.loader_workers = WorkerDumps(self.procs, self.landmarks)
        return True

    def collect_dumps(self, attempt: Attempt, now: float) -> None:
        inc = self.incident
        texts = self.dumps.texts()
        spy = self.dumps.py_spy_texts()
        for rank, text in texts.items():
            inc.add_file(f"stack-rank{rank}.txt", text)
        for rank, text in spy.items():
            inc.add_file(f"py-spy-rank{rank}.txt", text)
        flight = self.dumps.flight.collect() if self.dumps.flight is not None else {}
        inc.data["flight_recorder"] = into_incident(inc, flight)
        rank = self.expired.rank if self.expired and self.expired.rank in texts else (min(texts) if texts else None)
        verdict = None
        if len(attempt.announced) > 1:
            # Each rank from its own process and stack: the deadline that fired first says nothing (they tie).
            evidence = rank_evidence.gather(attempt, self.deadlines, self.procs, texts, spy, flight, now)
            verdict = decide(evidence, self.landmarks)
            rank = verdict.culprit_rank if verdict.culprit_rank is not None else rank
            culprit_ev = next((e for e in evidence if e.rank == verdict.culprit_rank), None)
            want = ("livelock" if culprit_ev.livelock else "stall") if culprit_ev is not None else self.kind
            if self.kind in ("stall", "livelock") and want != self.kind:
                # Which rank's deadline fired first is a tie (a victim waiting in phase `wait` beats progress
                # too): the culprit's own state names the kind.
                self.kind = want
                inc.rekind(want)
        frame, stack, user = stuck_frame(texts.get(rank, "")) if rank is not None else (None, [], None)
        reading, read = self._reading(attempt, rank, texts, spy)
        if not stack and read:  # no faulthandler dump: py-spy's frames stand in
            frame, stack = read[0], read
        by_pid = self.dumps.pid_texts()
        for pid in by_pid:
            inc.data.setdefault("py_spy_pids", {})[pid] = f"py-spy-pid{pid}.txt"
        dump_pid = None
        if rank is None and by_pid:  # no rank announced itself: the stacks py-spy read of the tree's Python processes
            dump_pid, reading, read = self._unannounced_reading(attempt, by_pid)
            if read:
                frame, stack = read[0], read
                user = next((f for f in read if is_own_code(f.get("file"))), None)
        if verdict is None:
            announced = {ref.pid for ref in attempt.announced_refs().values()}
            own = (
                [p for p in self.procs if p["pid"] in announced]
                or [p for p in self.procs if p["pid"] == dump_pid]
                or [p for p in self.procs if p["pid"] == attempt.worker.pid]
            )
            line = None
            if stack and isinstance(stack[0].get("line"), int):
                line = rank_evidence.source_line(stack[0]["file"], stack[0]["line"], attempt.cwd)
            native = py_spy_main_thread(spy.get(rank, ""))[1] if rank is not None else []
            asleep = sleeping(line, native)
            classification = classify_stall(self.kind, inc.data.get("deadline"), own, frame, asleep)
            # The call it hung in first; without a landmark, what fired and what the process does lead.  The
            # reading names the innermost frame: the classification joins it without its own "at <frame>".
            condition = classify_stall(self.kind, inc.data.get("deadline"), own, None, asleep)
            summary = (
                f"{reading.summary()}; {self.reason}; {condition}"
                if reading.landmark
                else f"{self.reason}; {condition}; {reading.summary()}"
            )
        else:
            culprit = verdict.finding(verdict.culprit_rank)
            classification = culprit.classification if culprit else verdict.summary
            summary = f"{verdict.summary}; {self.reason}"  # the culprit's words name its landmark
            inc.data.update(
                culprit_rank=verdict.culprit_rank,
                verdict={"culprit_rank": verdict.culprit_rank, "reason": verdict.reason, "summary": verdict.summary},
                ranks=[
                    {**f.as_dict(), "dump": f"stack-rank{f.rank}.txt" if f.rank in texts else None}
                    for f in verdict.ranks
                ],
            )
        summary += self._loader_workers(inc, rank)
        inc.data.update(evidence=self.evidence(attempt, texts, spy, by_pid, now))
        if dump_pid is not None:
            inc.data["dump_pid"] = dump_pid
        inc.data.update(
            stuck_frame=frame,
            main_stack=stack,
            user_frame=user,
            dump_rank=rank,
            **reading.fields(),
            dumps={r: f"stack-rank{r}.txt" for r in texts},
            dump_signalled=dict(self.dumps.signalled),
            py_spy=self.dumps.py_spy_note or "not run",
            classification=classification,
            summary=summary,
        )
        self.timings["dump_s"] = round(now - self.dumps.started_at, 3)
        self.timings.update(self.dumps.timings())
        self.save()
        log.warning(
            "stack_dumped",
            incident=inc.id,
            stuck=frame_str(frame),
            classification=classification,
            ranks=sorted(texts),
            **({"culprit_rank": verdict.culprit_rank, "verdict": verdict.summary} if verdict else {}),
        )

    def _reading(self, attempt: Attempt, rank: Optional[int], texts: dict, spy: dict) -> tuple[Reading, list]:
        """The call the dump rank's main thread is in, and the stack it was read from: its faulthandler stack —
        py-spy's Python frames when there is none, or when faulthandler cut it at 100 frames — with py-spy's
        native frames and the source line of the innermost frame."""
        if rank is None:
            return read_stack([]), []
        stack, truncated = main_stack(texts.get(rank, ""))
        spy_stack, native = py_spy_main_thread(spy.get(rank, ""))
        if spy_stack and (not stack or truncated):
            stack, truncated = spy_stack, False
        line = None
        if stack and isinstance(stack[0].get("line"), int):
            line = rank_evidence.source_line(stack[0]["file"], stack[0]["line"], attempt.cwd)
        return read_stack(stack, native=native, source_line=line, extra=self.landmarks, truncated=truncated), stack

    def _unannounced_reading(self, attempt: Attempt, by_pid: dict[int, str]) -> tuple[Optional[int], Reading, list]:
        """The process whose stack stands for the worker when none announced itself: among the Python processes py-spy
        read, the busiest (CPU in the stall's snapshot), then the deepest in the tree — a launcher or a shell waits on
        the process that does the work."""
        cpu = {p["pid"]: p.get("cpu_percent") or 0.0 for p in self.procs}
        depth = {p["pid"]: i for i, p in enumerate(self.procs)}
        best = None
        for pid, text in by_pid.items():
            stack, native = py_spy_main_thread(text)
            if not stack:
                continue
            key = (cpu.get(pid, 0.0), depth.get(pid, -1))
            if best is None or key > best[0]:
                best = (key, pid, stack, native)
        if best is None:
            return None, read_stack([]), []
        _, pid, stack, native = best
        line = None
        if isinstance(stack[0].get("line"), int):
            line = rank_evidence.source_line(stack[0]["file"], stack[0]["line"], attempt.cwd)
        return pid, read_stack(stack, native=native, source_line=line, extra=self.landmarks), stack

    def evidence(self, attempt: Attempt, texts: dict, spy: dict, by_pid: dict, now: float) -> dict:
        """What this incident's verdict stood on, so that a reader knows what it could and could not see."""
        dumps = self.dumps
        gpu = self.incident.data.get("gpu") or {}
        ev = {
            "heartbeats": bool(self.deadlines and self.deadlines.ranks),
            "instrumentation": attempt.instrumentation,
            "stacks": {
                "faulthandler": sorted(r for r, t in texts.items() if t.strip()),
                "py_spy_ranks": sorted(r for r, t in spy.items() if t.strip()),
                "py_spy": sorted(by_pid),
                "py_spy_note": dumps.py_spy_note or "not run",
            },
            "gpu": "NVML, per process" if gpu.get("available") else f"none: {gpu.get('reason') or 'not read'}",
        }
        if attempt.output is not None:
            ev["output"] = attempt.output.evidence(now)
        return ev

    def _loader_workers(self, inc: Incident, rank: Optional[int]) -> str:
        """The DataLoader workers of the dump rank, when it waits on them: into the incident, and the
        summary's words."""
        w = self.dumps.loader_workers
        if w is None or not w.begun:
            return ""
        found = w.stacks()
        for workers in found.values():
            for ws, text in workers:
                if ws.dump and text:
                    inc.add_file(ws.dump, text)
        if rank not in found:
            return ""
        verdict = judge([ws for ws, _ in found[rank]])
        inc.data.update(verdict.fields(), dataloader_workers_dumped=w.note)
        return f"; {verdict.words()}"

    # ---- a worker exit ---------------------------------------------------------------------

    @classmethod
    def exited(
        cls,
        tools: EscalationContext,
        attempt: Attempt,
        now: float,
        *,
        decision: Optional[Decision] = None,
        stopping: Optional[str] = None,
    ) -> "Episode":
        """The worker exited by itself: after a stop request (`stopping` says which), or judged by `decision`."""
        w = attempt.worker
        if stopping is not None:
            # A stop hangwatch asked for is a stop, whatever exit code a launcher turns it into (torchrun
            # exits 1 after forwarding SIGTERM); only the worker's own last words make it a failure.
            if w.exit_code == 0 or w.exit_signal == signal.SIGTERM or own_failure(rank_last_words(attempt)) is None:
                how = (
                    ""
                    if w.exit_code == 0
                    else f" (exit {w.exit_code if w.exit_signal is None else signal_name(w.exit_signal)})"
                )
                return cls(None, None, now, reason=stopping + how)
            kind, classification, failed = classify(tools, attempt)
            summary = f"worker exited during a graceful stop: {classification}"
            return cls(
                kind,
                exit_incident(tools, attempt, kind, classification, summary, failed_rank=failed),
                now,
                reason=stopping,
                store=tools.incidents,
            )
        if decision.action == "finish":
            return cls(None, None, now, reason=decision.reason)
        kind, classification, failed = classify(tools, attempt)
        inc = exit_incident(tools, attempt, kind, classification, classification, decision, failed)
        return cls(kind, inc, now, reason=classification, store=tools.incidents)

    def save(self) -> None:
        """Save the incident (if any) through its store."""
        if self.incident is not None and self.store is not None:
            self.store.save(self.incident)

    def amend(self, fields: dict) -> None:
        """What others found about this failure (a concern, the peers): added to its incident and saved."""
        if self.incident is not None and fields:
            self.incident.data.update(fields)
            self.save()

    def note(self, fields: dict) -> None:
        """What a decider added to the incident, kept in its record (saved with it by `finish`)."""
        if self.incident is not None:
            self.incident.data.update(fields)

    def settle(self, decision: Optional[Decision], kind: Optional[str] = None) -> None:
        """The decision, asked once the tree is gone; the incident's directory renamed where the evidence made it
        another kind."""
        self.decision = decision
        inc = self.incident
        if inc is not None and kind is not None and kind != inc.kind:
            inc.rekind(kind)
            self.kind = kind

    def next_due_s(self, now: float, cpu_sample_s: float) -> Optional[float]:
        """Seconds from `now` until this episode has something to do on its own clock (the snapshot's interval
        ends, a dump's quiet period or grace ends, SIGKILL is due, …), or None: for the loop's wait, so that
        nothing waits for the next fixed-period pass.  Never negative."""
        due = []
        if self.killer is not None:
            due.append(self.killer.next_due())
        elif self.dumps is not None:
            due.append(self.dumps.next_due())
            if self.dumps.gate_at is None and self.sampled_at is not None:
                due.append(self.sampled_at + cpu_sample_s)
        due = [d for d in due if d is not None]
        return max(0.0, min(due) - now) if due else None

    def recovered(self, attempt: Attempt, facts: RunRecord, now: float) -> None:
        """The worker got out of the stall in its own process (a concern's doing, which amended the incident with
        how): nothing was killed, the attempt goes on; the incident is complete."""
        inc = self.incident
        if inc is None:
            return
        timings = {**self.timings, "detection_to_recovered_s": round(now - self.detected_at, 3)}
        inc.data.update(
            status="handled",
            timings=timings,
            decision=self.decision.as_dict()
            if self.decision
            else {"action": "recovered_in_process", "reason": "the stuck step was abandoned in the worker's process"},
            last_good_checkpoint=facts.last_good_checkpoint,
            last_good_step=facts.last_good_step,
            torn_lines=facts.torn_lines,
        )
        for rank in sorted(attempt.tail.recent):
            inc.add_file(f"heartbeat-tail-rank{rank}.jsonl", attempt.tail.tail_text(rank))
        inc.add_file("worker-log-tail.txt", tail_text(attempt.worker.log_path))
        self.save()
        facts.note_incident(inc)

    # ---- the tree ----------------------------------------------------------------------------

    @property
    def stuck(self) -> bool:
        """A deadline fired, or a peer node restarted (the local ranks wait for a peer that is gone): the worker
        is known to be stuck.  (`restart now`, an exit, a stop: not known.)"""
        return self.expired is not None or self.kind == "peer_restart"

    def term_grace_s(self, wd: WatchdogCfg) -> float:
        """SIGTERM → SIGKILL: a stuck worker's main thread cannot run its graceful stop, so it is not given the
        graceful grace — its children, which may still clean up, get SIGTERM first all the same."""
        return wd.stuck_term_grace_s if self.stuck else wd.term_grace_s

    def begin_kill(self, tools: EscalationContext, attempt: Attempt, now: float, send_term: bool = True) -> None:
        wd = tools.watchdog_cfg
        self.killer = TreeKiller(
            attempt.worker,
            attempt.known_refs(tools.table, tools.subreaper),
            table=tools.table,
            term_grace_s=self.term_grace_s(wd),
            gpu_release_timeout_s=wd.gpu_release_timeout_s,
            kill_wait_s=wd.kill_wait_s,
            gpu_pids=tools.gpu_pids,
            send_term=send_term,
        )
        self.timings["sigterm_at_s" if send_term else "sigkill_at_s"] = round(now - self.detected_at, 3)
        # Ranks a launcher (torchrun) started in sessions of their own are outside the group SIGTERM goes to:
        # each gets its own, so none depends on the launcher forwarding it (SIGKILL after the grace reaches them too).
        group = {r.pid for r in tools.table.group_members(attempt.worker.pgid)} | {attempt.worker.pid}
        outside = [ref for ref in attempt.announced_refs().values() if ref.pid not in group]
        self.killer.begin(now)
        if send_term:
            for ref in outside:
                tools.table.signal(ref, signal.SIGTERM)

    def finish(
        self, attempt: Optional[Attempt], facts: RunRecord, now: float, next_state: str, why: str, main_rank: int = 0
    ) -> None:
        """The tree is gone: complete and write the incident (if this episode has one)."""
        inc = self.incident
        if inc is None:
            return
        k = self.killer
        timings = {**self.timings, **(k.timings() if k else {})}
        gone_at = k.gone_at if k and k.gone_at is not None else now
        timings["detection_to_gone_s"] = round(gone_at - self.detected_at, 3)
        timings["total_s"] = round(now - self.detected_at, 3)
        w = attempt.worker if attempt else None
        inc.data.update(
            status="handled",
            timings=timings,
            gpu_release=k.gpu_release if k else None,
            decision=self.decision.as_dict() if self.decision else {"action": next_state, "reason": why},
            exit=inc.data.get("exit") or (exit_info(attempt, main_rank) if w and w.exited else None),
            last_good_checkpoint=facts.last_good_checkpoint,
            last_good_step=facts.last_good_step,
            torn_lines=facts.torn_lines,
        )
        if self.decision and self.decision.rollback:
            inc.data["rollback_to"] = facts.last_good_checkpoint
        if attempt is not None:
            for rank in sorted(attempt.tail.recent):
                inc.add_file(f"heartbeat-tail-rank{rank}.jsonl", attempt.tail.tail_text(rank))
            inc.add_file("worker-log-tail.txt", tail_text(attempt.worker.log_path))
        self.save()
        facts.note_incident(inc)


# ================================================================================ the incidents of an exit


def exit_info(attempt: Attempt, main_rank: int = 0) -> dict:
    w = attempt.worker
    return {
        "code": w.exit_code,
        "signal": w.exit_signal,
        "signal_name": signal_name(w.exit_signal),
        "last_words": read_json(attempt.dir / EXIT_NAME),
        "stop_reason": attempt.stop_reason(main_rank),
    }


def stragglers_field(attempt: Attempt) -> dict:
    """The straggler warnings of this attempt, for the incident record (nothing when there were none)."""
    recorded = attempt.stragglers.recorded
    return {"stragglers": [s.as_dict() for s in recorded]} if recorded else {}


_STEM, _EXT = EXIT_NAME.rsplit(".", 1)
RANK_EXIT_FILE = re.compile(
    rf"^{re.escape(_STEM)}-rank(\d+)\.{re.escape(_EXT)}$"
)  # as `rundir.rank_exit_name` names them


def rank_last_words(attempt: Attempt) -> dict[int, dict]:
    """Each rank's last words (exit.json for rank 0, exit-rank<R>.json for the others), where written — a rank
    that failed before it announced itself (a refused resume) included."""
    on_disk = set()
    try:
        for path in attempt.dir.iterdir():
            m = RANK_EXIT_FILE.match(path.name)
            if m:
                on_disk.add(int(m.group(1)))
    except OSError:  # no attempt directory: nothing was written
        pass
    out = {}
    for rank in sorted(set(attempt.announced) | {0} | on_disk):
        words = read_json(attempt.dir / rank_exit_name(rank))
        if words is not None:
            out[rank] = words
    return out


def own_failure(words: dict[int, dict]) -> Optional[int]:
    """The rank whose last words are its own failure — not a collective that broke because a peer died
    (`collective_error: true`, which makes a victim); the lowest such rank, or None."""
    return next((r for r, w in sorted(words.items()) if not w.get("collective_error")), None)


def no_retry(attempt: Attempt) -> Optional[NoRetry]:
    """A do-not-restart error (configuration, data, disk) of any rank of the ended worker: its last words, else
    torchrun's root-cause report in the log's tail (`rules.no_retry`); None when there is none."""
    w = attempt.worker
    code = w.exit_code if w.exit_signal is None else None
    return no_retry_code(code, rank_last_words(attempt), torchrun_root_cause(tail_text(w.log_path, 400)))


def teardown_crash_of(attempt: Attempt, ranks: Collection[int]) -> Optional[str]:
    """Why the ended worker counts as finished although a signal ended it (`rules.teardown`): every rank of `ranks`
    (those that spoke) had said it finished, then the worker or torchrun's failed rank died by a signal; else None."""
    w = attempt.worker
    stops = _stops(attempt, ranks)
    if not stops or not all(stops.values()) or (w.exit_code == 0 and w.exit_signal is None):
        return None  # no log read for a run that did not finish, or ended cleanly
    sig = signal_name(w.exit_signal) if w.exit_signal is not None else None
    code = w.exit_code if w.exit_signal is None else None
    root = None if sig is not None else torchrun_root_cause(tail_text(w.log_path, 400))
    return teardown_crash(code, sig, stops, root)


def _stops(attempt: Attempt, ranks: Collection[int]) -> dict:
    """{rank: its last `stop` line or None} for every rank that spoke (`ranks`) or announced itself."""
    return {r: attempt.stop_lines.get(r) for r in set(ranks) | set(attempt.announced)}


def classify(tools: EscalationContext, attempt: Attempt) -> tuple[str, str, Optional[int]]:
    """(kind, classification, the culprit rank or None).

    A rank's do-not-restart error that the launcher's exit code hides (torchrun exits 1) names the failure first:
    the run ends on it.  With several ranks the culprit comes first from its own evidence: the rank whose dump
    holds a fatal signal's stack (a segfault has no last words), else the rank whose last words are its own
    failure, else the rank torchrun reports as failing first; victims' collective errors never name the failure."""
    w = attempt.worker
    stop = no_retry(attempt)
    if stop is not None and stop.rank is not None and stop.code != w.exit_code:
        words = rank_last_words(attempt).get(stop.rank) or {}
        kind, text = classify_exit(stop.code, None, {**words, "message": stop.message}, "")
        several = len(attempt.announced) > 1  # then the incident's summary names the rank itself
        return kind, text if several else f"rank {stop.rank}: {text}", stop.rank
    if len(attempt.announced) > 1:
        found = _classify_ranks(tools, attempt)
        if found is not None:
            return found
    last_words = read_json(attempt.dir / EXIT_NAME)
    cause = launcher = None
    if w.exit_signal == signal.SIGKILL:
        pids = {w.pid} | {a.ref.pid for a in attempt.announced.values() if a.ref}
        cause = sigkill_cause(pids, attempt.oom_kills_at_start, tools.kernel.oom_kills(), tools.kernel.log())
    elif last_words is None:
        launcher = torchrun_root_cause(tail_text(w.log_path, 400))
        if launcher and launcher.get("signal") == "SIGKILL":
            rank_cause = sigkill_cause(
                {launcher["pid"]}, attempt.oom_kills_at_start, tools.kernel.oom_kills(), tools.kernel.log()
            )
            launcher = {**launcher, "signal": f"SIGKILL: {rank_cause}"}
    kind, text = classify_exit(
        w.exit_code, w.exit_signal, last_words, tail_text(w.log_path, 80), sigkill_cause=cause, launcher=launcher
    )
    return kind, text, launcher.get("rank") if launcher else None


def _classify_ranks(tools: EscalationContext, attempt: Attempt) -> Optional[tuple[str, str, Optional[int]]]:
    w = attempt.worker
    log_tail = tail_text(w.log_path, 400)
    launcher = torchrun_root_cause(log_tail)
    for rank, text in _rank_dumps(attempt).items():
        fatal = fatal_error(text)
        if fatal:
            sig = launcher.get("signal") if launcher and launcher.get("rank") == rank else None
            what = f"killed by {sig}" if sig else "died of a fatal signal"
            return "signal", f"{what} (Fatal Python error: {fatal})", rank
    words = rank_last_words(attempt)
    rank = own_failure(words)
    if rank is not None:
        lw = words[rank]
        kind, text = classify_exit(lw.get("exit_code"), None, lw, "")
        return kind, text, rank
    if launcher and launcher.get("rank") is not None:
        kind, text = classify_exit(w.exit_code, w.exit_signal, None, log_tail, launcher=launcher)
        return kind, text, launcher["rank"]
    return None


def raising_frame(traceback_text: str) -> Optional[dict]:
    """The innermost `File "…", line N, in F` of a traceback: where the exception was raised."""
    found = re.findall(r'^\s*File "(.+?)", line (\d+), in (.+?)\s*$', traceback_text or "", re.M)
    if not found:
        return None
    file, line, function = found[-1]
    return {"file": file, "line": int(line), "function": function}


def _rank_dumps(attempt: Attempt) -> dict[int, str]:
    """Each announced rank's dump file as it stands (a fatal signal's stack, earlier SIGUSR1 dumps)."""
    out = {}
    for rank, a in sorted(attempt.announced.items()):
        try:
            with open(a.dump_path, "rb") as f:
                text = f.read(MAX_DUMP_BYTES).decode("utf-8", "replace")
        except (OSError, TypeError):  # no file, or the rank announced none
            continue
        if text.strip():
            out[rank] = text
    return out


def exit_incident(
    tools: EscalationContext,
    attempt: Attempt,
    kind: str,
    classification: str,
    summary: str,
    decision: Optional[Decision] = None,
    failed_rank: Optional[int] = None,
) -> Incident:
    w = attempt.worker
    deadlines, facts = tools.deadlines, tools.record()
    tr = deadlines.ranks.get(deadlines.main_rank())
    info = exit_info(attempt, deadlines.main_rank())
    frame = stack = user = fatal_rank = reading = None
    dumps = _rank_dumps(attempt)
    for rank, text in dumps.items():  # a fatal signal makes faulthandler write the stack too
        if fatal_error(text):
            fatal = text[text.rfind("Fatal Python error") :]
            frame, stack, user = stuck_frame(fatal)
            reading = read_stack(
                stack, extra=user_landmarks(tools.watchdog_cfg.landmarks), truncated=main_stack(fatal)[1]
            )
            info["fatal_error"] = fatal_error(text)
            fatal_rank = rank
            break
    if reading is not None and reading.innermost_frame is not None:
        summary = f"{summary}; {reading.summary()}"
    several = len(attempt.announced) > 1
    culprit = (fatal_rank if fatal_rank is not None else failed_rank) if several else None
    words = rank_last_words(attempt)  # each rank's file is kept in the incident, announced or not
    if several and culprit is not None:
        # The culprit first, with its own frame: the fatal signal's stack, else where its exception was raised.
        where = frame or raising_frame((words.get(culprit) or {}).get("traceback") or "")
        if frame is None and where is not None:
            frame = where
        victims = sorted(r for r, lw in words.items() if r != culprit and lw.get("collective_error"))
        summary = (
            f"rank {culprit}: {classification}"
            + (f" at {frame_str(where)}" if where else "")
            + (f", {reading.words()}" if reading is not None and fatal_rank == culprit and reading.landmark else "")
            + "".join(f"; rank {r}: its collective broke when rank {culprit} failed (victim)" for r in victims)
        )
    inc = tools.incidents.open_for_run(
        kind,
        facts,
        note=False,  # noted when the episode finishes it
        attempt=attempt.number,
        phase=tr.phase if tr else None,
        step=tr.step if tr else None,
        deadline=None,
        exit=info,
        classification=classification,
        summary=summary,
        stuck_frame=frame,
        main_stack=stack or [],
        user_frame=user,
        **(reading.fields() if reading is not None else {}),
        status="in progress",
        worker_pid=w.pid,
        then={
            "decision": decision.as_dict() if decision else None,
            **stragglers_field(attempt),
            **({"culprit_rank": culprit} if several else {}),
        },
    )
    if info.get("last_words"):
        inc.add_file(EXIT_NAME, (attempt.dir / EXIT_NAME).read_text(errors="replace"))
    for rank in words:
        if rank != 0:
            name = rank_exit_name(rank)
            inc.add_file(name, (attempt.dir / name).read_text(errors="replace"))
    if several:
        inc.data["last_words_by_rank"] = {
            r: {k: lw.get(k) for k in ("kind", "message", "collective_error")} for r, lw in words.items()
        }
    if several:
        for rank, text in dumps.items():
            inc.add_file(f"stack-rank{rank}.txt", text)
        inc.data["dumps"] = {r: f"stack-rank{r}.txt" for r in dumps}
    flight = FlightDumps(attempt.flight, sorted(attempt.announced)).collect(since_wall=attempt.started_wall)
    if any(r["data"] is not None for r in flight.values()):  # written by the ranks themselves (dump on timeout)
        inc.data["flight_recorder"] = into_incident(inc, flight)
    log.warning(
        "worker_failed",
        kind=kind,
        incident=inc.id,
        classification=classification,
        attempt=attempt.number,
        step=inc.data.get("step"),
        code=w.exit_code,
        signal=signal_name(w.exit_signal),
        **({"culprit_rank": culprit} if several else {}),
    )
    return inc


def spawn_failed_incident(
    incidents: IncidentStore, attempt: int, argv: list[str], cwd: Optional[str], exc: OSError, facts: RunRecord
) -> Incident:
    """The worker command cannot be executed: a configuration error, recorded before the run fails."""
    inc = incidents.open_for_run(
        "config_error",
        facts,
        with_checkpoint=False,  # this record never named the last good checkpoint
        attempt=attempt,
        phase=None,
        step=None,
        classification=f"cannot start the worker: {exc}",
        summary=f"cannot start {argv[0]!r}: {exc.strerror or exc}",
        argv=argv,
        cwd=cwd,
    )
    log.error("spawn_failed", argv=argv, error=str(exc))
    return inc


def crash_loop_incident(
    incidents: IncidentStore,
    attempt: int,
    decision: Decision,
    policy: RestartPolicy,
    restart_cfg: RestartCfg,
    facts: RunRecord,
) -> Incident:
    """The final incident of a run the restart policy gave up on."""
    inc = incidents.open_for_run(
        "crash_loop",
        facts,
        with_last_incident=True,
        attempt=attempt,
        phase=None,
        step=policy.best_step,
        classification="crash loop",
        summary=decision.reason,
        status="final",
        restarts_in_window=len(policy.recent),
        window_s=restart_cfg.window_s,
        max_restarts=restart_cfg.max_restarts,
    )
    log.error("crash_loop", incident=inc.id, reason=decision.reason)
    return inc


def unannounced_pythons(table: ProcessTable, attempt: Attempt) -> list[ProcRef]:
    """The tree's Python processes that sent no `start` line (nor descend from one that did: a rank's DataLoader
    workers have their own step), the worker itself first: py-spy is the only way to their stacks."""
    w = attempt.worker
    announced = {ref.pid for ref in attempt.announced_refs().values()}
    below_ranks = {d.pid for pid in announced for d in table.descendants(pid)}
    refs = ([] if w.exited else [w.ref]) + table.descendants(w.pid)
    found, seen = [], set()
    for ref in refs:
        if ref.pid in seen or ref.pid in announced or ref.pid in below_ranks:
            continue
        seen.add(ref.pid)
        info = table.describe(ref)
        words = [info.get("name") or "", *(info.get("cmdline") or [])[:1]]
        if any(Path(word).name.startswith("python") for word in words if word):
            found.append(ref)
    return found


def gpu_processes(gpu: dict, pids: set) -> list[dict]:
    """The worker tree's processes on the GPUs (NVML): device, memory, and SM utilisation where the driver samples
    it per process; [] without a GPU or when none of them holds one."""
    out = []
    for dev in gpu.get("devices") or []:
        for p in dev.get("processes") or []:
            if p.get("pid") in pids:
                out.append(
                    {
                        "pid": p["pid"],
                        "device": dev.get("index"),
                        "used_memory_bytes": p.get("used_memory_bytes"),
                        "sm_util_percent": p.get("sm_util_percent"),
                        "device_utilization_percent": dev.get("utilization_percent"),
                    }
                )
    return out
