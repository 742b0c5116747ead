"""The supervisor's loop: launch the worker, watch its heartbeats, escalate stalls, restart, stop cleanly.

    hangwatch run CONFIG [--run-dir DIR]      (wired by `hangwatch.supervisor.app`)

`Supervisor` holds the state machine and nothing else: the pass, the handler of each state, the wiring.
Everything it acts with is handed in (seams) or built here, and nothing outside this module reads or writes
its fields: readers get the read model (`view`), listeners get it once a pass, and the parts it uses — an
episode, the attempt, the deadlines, the nodes, the concerns — receive what they need and return decisions.

Lifecycle: see `rules.states`.  One pass (`run_once(now)`), always in this order (docs/design.md, "The loop"):
    1. drain events — recorded signals, child exits (reaped here and nowhere else), heartbeat lines,
       the peer link, control requests.  Draining records facts and intents; it never signals, spawns,
       kills or writes an incident.  Exits are reaped before lines are read, so a dead worker's last
       lines (`stop`, a final step) are read in the pass that sees it dead;
    2. check deadlines on the supervisor's own monotonic clock (a gap in the loop's own clock — this
       process was suspended — extends every deadline instead of firing it);
    3. reconcile: the handler of the current state (`HANDLERS`) acts — spawn, snapshot and dump,
       signal, kill, write the incident, back off — until the state settles; then in-flight `dump`
       requests advance and the pass settles, once (tree scan, one read model: sd_notify, state.json when it
       changed, the listeners).
Every time comes from the `now` the pass was given; only `run()` reads the clock, so a fake clock,
a fake process table and a fake spawn drive the whole lifecycle without a process.

A stall, top-down: `_overdue` records the expired deadline (a concern may handle it in the worker's process:
`concerns.generate_overrun`) → `on_running` → `_escalated` opens `Episode.stall` (snapshot, SIGUSR1 dumps,
py-spy; `_open` lets the concerns add to it) → STALLED → `on_evidence` (the snapshot) → DUMPING → `on_evidence`
(the dumps read, the verdict) → `begin_kill` → KILLING → `on_killing` (SIGKILL at the grace; a concern may hold the
teardown) → `finish_episode` (`decide`, the decision; `rules.outcome.next_outcome`; the incident completed) →
`follow` → BACKOFF or `start_attempt`; the pass settles (`_settle`: one read model, state.json, systemd).

What the loop watches for besides the deadlines — a runaway generate, the resume audit, OOM recovery, the wait for
processes SIGKILL cannot end, goodput, the prewarmed standby, stragglers — are concerns (`concerns.base.Concern`),
registered in one place (`concerns.registered`): told what the loop observes as typed events (`concerns.tell`),
asked at a few decision points whose conflicting answers their `priority` resolves; one box or several is the
nodes interface (`nodes.interface.Nodes`).

Between passes the loop sleeps (`wakeup.Wakeup.wait`) until something needs a pass: a signal, a
heartbeat write (coalesced: one pass reads every new line of every rank), a control request, or the
earliest deadline (`next_wait`, `wakeup.pace`).  A supervisor with nothing due sleeps up to IDLE_WAIT_S; only while
escalating does it pass on a short period (FAST_PASS_S), and only where a heartbeat write or a request
cannot wake it (no inotify, a control server without a descriptor) does it fall back to
`watchdog.poll_interval_s`.

Heartbeat lines and output are read by `intake`; control requests are answered by `control_requests.Desk`; the read
model is built by `view_builder`; state.json, systemd and the listeners hear of each pass once, at its end
(`outward`, `state_file`).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import structlog

from hangwatch.common.config import Config, dump_config
from hangwatch.common.durable import describe_write_error, disk_error
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_FAILED, EXIT_IOERR, EXIT_NO_RETRY, EXIT_OK
from hangwatch.common.rundir import CALIBRATION_NAME, CONFIG_NAME, STATE_NAME, attempt_dir, next_attempt
from hangwatch.supervisor.concerns import (
    Answer,
    Concern,
    PassState,
    RunContext,
    decide,
    highest,
    merged,
    registered,
    tell,
)
from hangwatch.supervisor.concerns.events import (
    AttemptEnded,
    AttemptStarted,
    Closing,
    OutcomeReached,
    PassBegins,
    PassSettled,
    Prepared,
    StopRequested,
)
from hangwatch.supervisor.escalation.episode import (
    Episode,
    EscalationContext,
    crash_loop_incident,
    no_retry,
    spawn_failed_incident,
    teardown_crash_of,
)
from hangwatch.supervisor.incidents import IncidentStore, signal_name
from hangwatch.supervisor.nodes.interface import Nodes, SingleNode
from hangwatch.supervisor.nodes.multi_node import MultiNode
from hangwatch.supervisor.nodes.peers import spawn_helper
from hangwatch.supervisor.ops import logsetup
from hangwatch.supervisor.ops.notify import NullNotifier
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes import leftovers, process
from hangwatch.supervisor.processes import snapshot as snapshots
from hangwatch.supervisor.processes.attempt import alive
from hangwatch.supervisor.processes.interpreter import note_for
from hangwatch.supervisor.read_model.view import View
from hangwatch.supervisor.records import run_state
from hangwatch.supervisor.records.checkpoint_ledger import PersistedLedger, resume_choice, set_aside_bad
from hangwatch.supervisor.rules import stop_signals
from hangwatch.supervisor.rules.outcome import (
    Intent,
    Outcome,
    done_before_stop,
    next_outcome,
    run_exit_status,
)
from hangwatch.supervisor.rules.policy import Decision, RestartPolicy
from hangwatch.supervisor.rules.states import State, StateMachine
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired, SuspensionDetector

from .control_requests import Desk
from .intake import Intake
from .intents import Intents
from .outward import Outward
from .seams import Seams
from .state_file import StateFile
from .view_builder import Situation, Viewer, socket_of
from .wakeup import FAST_PASS_S, IDLE_WAIT_S, pace  # noqa: F401  (FAST_PASS_S, IDLE_WAIT_S: the pacing's figures)

log = structlog.get_logger("hangwatch")
_UNASKED = object()

TREE_SCAN_S = (
    5.0  # how often descendants are re-listed (to find those that leave the group); in passes, never a wake-up
)
REAP_EVERY_S = 1.0  # a running worker is waited for at least this often even without a SIGCHLD
CALIBRATION_SAVE_S = 30.0  # new step samples reach calibration.json at most this often (and at every attempt end)


# The handler of each state (final states have none): it acts, and moves the state at most one step.
HANDLERS = {
    State.STARTING: "on_running",
    State.RUNNING: "on_running",
    State.STOPPING: "on_stopping",
    State.STALLED: "on_evidence",
    State.DUMPING: "on_evidence",
    State.RECOVERING: "on_recovering",
    State.KILLING: "on_killing",
    State.BACKOFF: "on_idle",
    State.PAUSED: "on_idle",
}


class Supervisor:
    def __init__(self, cfg: Config, seams: Optional[Seams] = None):
        """Seams only (`loop.seams.Seams`, built by `app.run`); no I/O (that is `prepare`)."""
        self.cfg, self.seams = cfg, s = cfg, (seams if seams is not None else Seams())
        self.watchdog_cfg = wd = cfg.watchdog
        self.run_dir = Path(cfg.run_dir)
        self.config_path, self.state_path = self.run_dir / CONFIG_NAME, self.run_dir / STATE_NAME
        self.clock, self.table, self.fs, self.wakeup, self.control = s.clock, s.table, s.fs, s.wakeup, s.control
        self.control_fd: Any = _UNASKED  # asked once (`_fileno`): the server's descriptor lives as long as the server
        self.file_times_now = s.file_times  # lines are dated by their files' times in this pass (no suspension)
        self.lifecycle = StateMachine(State.STARTING)
        self.intents = Intents(state=lambda: self.lifecycle.state)
        self.calibration = Calibration(wd, self.run_dir / CALIBRATION_NAME, fs=self.fs)
        self.deadlines = Deadlines(wd, self.calibration)
        self.policy = s.policy if s.policy is not None else RestartPolicy(cfg.restart)
        self.incidents = IncidentStore(self.run_dir, fs=self.fs, on_write_error=self.intents.write_failed)
        self.suspension = SuspensionDetector(wd.poll_interval_s)
        self.gpu = snapshots.GpuCache(s.gpu)
        self.tools = EscalationContext(self.table, self.incidents, wd, s.snapshot, self.gpu, s.gpu_pids,
                                       s.cpu_sample_s, s.subreaper, fs=self.fs, deadlines=self.deadlines,
                                       record=lambda: self.context.facts)  # fmt: skip
        self.ledger = PersistedLedger(self.run_dir, cfg.checkpoint.confirm_steps, fs=self.fs)  # announced checkpoints
        # What the concerns are handed; its `facts` is the run's record (replaced in `prepare` by the one read back).
        self.context = RunContext(cfg, self.run_dir, self.fs, self.incidents, self.deadlines,
            run_state.RunRecord(checkpoints=self.ledger.ledger), write_failed=self.intents.write_failed,
            where=self._where)  # fmt: skip
        self.concerns: list[Concern] = registered(self.context, table=self.table, config_path=self.config_path,
                                                  spawn_standby=s.spawn_standby)  # fmt: skip
        # Several nodes: the peer link and this node's part in the run; one node: a null object.  The loop
        # talks to either through the same interface and has no multi-node branch of its own.
        multi = cfg.worker.nnodes > 1
        self.nodes: Nodes = MultiNode(cfg, self.run_dir, incidents=self.incidents, facts=lambda: self.context.facts,
            deadlines=self.deadlines, table=self.table, spawn=s.peer_spawn or spawn_helper, poke=self.wakeup.poke) \
            if multi else SingleNode()  # fmt: skip
        files = lambda: self.file_times_now  # noqa: E731
        self.intake = Intake(self.context, wd, self.table, self.ledger, self.policy, self.nodes, self.concerns, files)
        state = StateFile(self.state_path, self.fs, self.table, self.nodes, self.intents.write_failed)
        self.outward = Outward(s.notifier if s.notifier is not None else NullNotifier(), s.listeners, state)
        socket = socket_of(cfg, self.run_dir, self.control)
        self.viewer = Viewer(cfg, self.context, self.calibration, self.gpu, self.nodes, self.concerns, lambda: socket,
                             self.config_path)  # fmt: skip
        persist = lambda now: state.keep(self.view(now), self.lifecycle.reason or None, now, force=True)  # noqa: E731
        self.desk = Desk(self.intents, self.table, self.incidents, wd.dump_grace_s, where=self._where, view=self.view,
                         persist=persist, attempt=lambda: self.attempt, ask_stop=self.request_stop)  # fmt: skip
        self.attempt = 0  # the number of the current (or last) attempt
        self.current: Optional[attempts.Attempt] = None
        self.episode: Optional[Episode] = None  # the failure (or end) being handled until the tree is gone
        self.awaiting_rendezvous = False  # multi-node: the next attempt waits for the store / a new generation
        self.expired: Optional[Expired] = None  # this pass's overdue deadline
        self.backoff_until: Optional[float] = None
        self.exit_code = EXIT_OK
        self.holding = False  # a concern keeps the loop in KILLING after the tree's teardown (unkillable processes)
        self.started_at = 0.0
        self.no_progress_recorded = False
        self._last_reap = float("-inf")
        self.instrumentation = ""  # what instrumentation the worker gets, in words (the start line; `prepare`)
        self.term_at: Optional[float] = None  # a stop passed on as SIGINT/SIGHUP/SIGQUIT: when SIGTERM follows
        self.by_itself = False  # the current attempt's worker ended on its own (not killed after a stall)
        self.stop_answered = False  # …and it was while stopping: its status is its answer to the stop

    def concern(self, name: str) -> Optional[Concern]:
        """The registered concern of that name (None: not registered for this run)."""
        return next((c for c in self.concerns if c.name == name), None)

    def _where(self) -> PassState:
        dl, cur = self.deadlines, self.current
        main = dl.ranks.get(dl.main_rank()) if cur is not None else None
        return PassState(self.lifecycle.state, self.intents.after_teardown, cur, self.episode, self.expired, main)

    # ================================================================================ set-up and loop

    def prepare(self, now: float) -> Optional[str]:
        """The set-up's I/O: the run dir, a previous supervisor's state and leftovers, calibration,
        config.yaml.  Returns why the supervisor must not run, or None."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = now
        previous, self.context.facts = read_back(self.state_path, self.ledger)
        problem = leftovers.clear(previous or {}, self.table, state_path=self.state_path,
            grace_s=self.watchdog_cfg.term_grace_s, end_leftovers=self.seams.end_leftovers)  # fmt: skip
        if problem:
            return problem
        problem = self.calibration.reload()
        if problem:
            log.warning("calibration_ignored", problem=problem)
        self.attempt = next_attempt(self.run_dir) - 1
        tell(self.concerns, Prepared(now))
        try:
            self.fs.write_file(self.config_path, dump_config(self.cfg).encode())
        except OSError as exc:
            self.exit_code = EXIT_IOERR if disk_error(exc) else EXIT_FAILED
            return f"cannot write {self.config_path}: {describe_write_error(exc, self.config_path)}"
        if run_state.paused_before(previous):
            # A pause outlives the supervisor: start paused; `resume` starts a worker.
            self.transition(State.PAUSED, "paused before this supervisor started (state.json)", now)
        if self.seams.subreaper:
            process.set_child_subreaper()
        self.nodes.start(now)
        self.instrumentation = note_for(self.cfg, self.seams.probe)  # asked once, before the loop
        return None

    def run(self) -> int:
        """Run until finished, stopped or failed; returns the process exit code."""
        problem = self.prepare(self.clock())
        if problem:
            print(f"hangwatch: {problem}", file=sys.stderr)
            log.error("refused", problem=problem)
            _close(self.control)  # the socket file must not outlive a supervisor that never ran
            return self.exit_code if self.exit_code != EXIT_OK else EXIT_FAILED
        self.control_fd = _fileno(self.control) if self.control_fd is _UNASKED else self.control_fd
        self.wakeup.open(extra=[fd for fd in (self.control_fd,) if fd is not None])
        if self.wakeup.events_problem:
            note = f"heartbeat files are read every {self.watchdog_cfg.poll_interval_s:g} s instead"
            log.warning("heartbeat_events_unavailable", problem=self.wakeup.events_problem, note=note)
        log.info("supervisor_started", run_dir=str(self.run_dir), pid=os.getpid(), config=str(self.config_path))
        try:
            while not self.lifecycle.state.final:
                wait = self.next_wait(self.clock())
                # A new attempt's files made no event before the watch existed: read them at once.
                if self.wakeup.watch(self.current.dir if alive(self.current) else None):
                    wait = 0.0
                self.wakeup.wait(wait)
                self.run_once(self.clock())
                self.suspension.touch(self.clock())  # the pass's own work (fsynced writes) is not a suspension
                self.wakeup.pass_done()
        except BaseException:  # the supervisor itself is failing: leave no worker tree behind
            if alive(self.current):
                self.current.kill_all(self.table)
            raise
        finally:
            if self.ledger.dirty:
                self.ledger.save()
            now = self.clock()
            self._settle(now, final=True)
            tell(self.concerns, Closing(now))
            self.wakeup.close()
            self.nodes.close()
            self.calibration.persist(False, None, CALIBRATION_SAVE_S)
            _close(self.control)
        log.info("supervisor_exit", state=self.lifecycle.state.value, exit_code=self.exit_code)
        return self.exit_code

    def run_once(self, now: float) -> None:
        """One pass at `now`: drain events, check deadlines, reconcile."""
        signals = self.wakeup.drain()
        # SIGCONT: this process was stopped since the last pass (SIGSTOP, a frozen unit); for how long
        # it cannot tell, so the whole time since then counts as suspended (deadlines move, never fire).
        gap = self.suspension.observe(now, continued=signal.SIGCONT in signals)
        self.file_times_now = self.seams.file_times and gap <= 0  # lines written in a gap count from now
        if gap > 0:
            self.deadlines.shift(gap)
            if self.backoff_until is not None:
                self.backoff_until += gap
            log.warning("supervisor_suspended", gap_s=round(gap, 3), note="deadlines extended by the gap")
        self._drain_events(now, signals)
        self.expired = self._overdue(now)  # 2. deadlines: only recorded here; the reconcile step opens the episode
        self._reconcile(now)

    def next_wait(self, now: float) -> float:
        """How long the loop may sleep from `now` (`wakeup.pace`); the planned wake-up is handed to the suspension
        detector (a pass much later than planned means this process was not running)."""
        st, cur, ep = self.lifecycle.state, self.current, self.episode
        if self.control_fd is _UNASKED:
            self.control_fd = _fileno(self.control)
        watched = st.watched and alive(cur)
        blind = (watched and not self.wakeup.hears_beats) or (self.control is not None and self.control_fd is None)
        backoff = self.backoff_until - now if st is State.BACKOFF and self.backoff_until is not None else None
        wait = pace(
            now_due=(st is State.STARTING and cur is None and not self.awaiting_rendezvous)
            or (cur is not None and cur.tail.backlog and not st.escalating),
            escalating=st.escalating or st is State.STOPPING or bool(self.desk.dumps),
            episode_due=ep.next_due_s(now, self.tools.cpu_sample_s) if ep is not None else None,
            held=self.holding,
            dues=[self.outward.next_due_s(now), self.nodes.next_due_s(now), backoff,
                  self.deadlines.next_due_s(now) if st.watched else None, *(c.next_due_s(now) for c in self.concerns)],
            timer_s=self.watchdog_cfg.poll_interval_s if blind else None,
        )  # fmt: skip
        self.suspension.expect(now + wait)
        return wait

    # ================================================================================ 1. events

    def _drain_events(self, now: float, signals: list[int]) -> None:
        s = self.seams
        for sig in signals:  # SIGCHLD only woke the loop: children are reaped below
            if stop_signals.stops(sig, s.transparent, s.hangup_stops):  # SIGUSR1: a batch job's time limit is near
                intent = Intent.REQUEUE if sig == signal.SIGUSR1 else Intent.EXIT
                why, batch = s.signal_source.describe(sig), s.signal_source.batch
                self.request_stop(why, intent, repeat_forces=not batch, signum=sig)
            elif sig == signal.SIGHUP:
                logsetup.reopen()
                log.info("log_reopened", why="SIGHUP")
        heard = signal.SIGCHLD in signals or not self.wakeup.signals_installed
        st, cur = self.lifecycle.state, self.current
        busy = st not in (State.STARTING, State.RUNNING)  # stopping, escalating: every pass
        if cur is not None and (heard or now - self._last_reap >= REAP_EVERY_S or busy):
            # The one place exits are observed; orphans only when a child's exit was heard (or cannot be): one waitpid
            # per known pid would be the bulk of a pass with many ranks.
            self._last_reap = now
            killing = self.episode.killer.refs if self.episode is not None and self.episode.killer else ()
            if cur.reap(self.table, now, heard or busy, also=[r.pid for r in killing]):
                w = cur.worker
                log.info("worker_exited", attempt=cur.number, pid=w.pid, code=w.exit_code,
                         signal=signal_name(w.exit_signal), state=st.value)  # fmt: skip
        self.nodes.poll(now)  # what the peer link heard: the generation, peers' notices and records
        if cur is not None and self.nodes.helper_pid:
            cur.foreign.add(self.nodes.helper_pid)  # our child, never an orphan of the worker's tree
        grown = self.wakeup.grown()  # the heartbeat files the file events said grew (None: read them all)
        if cur is not None and cur.worker.exited:
            grown = None  # an ended worker's last lines (its last step, its stop) decide what its end means
        self._heard(self.intake.beats(cur, now, grown), now)
        self._heard(self.intake.output(cur, now), now)
        if self.control is not None:
            try:
                self.control.poll(lambda req: self.desk.handle(req, now))
            except Exception:  # a broken control channel must not take the training run down with it
                log.exception("control_poll_failed")

    def _heard(self, running: Optional[str], now: float) -> None:
        """What a read of the worker's lines or output moves: STARTING → RUNNING (`running`: why)."""
        if running and self.lifecycle.state is State.STARTING and self.current is not None:
            self.transition(State.RUNNING, running, now)
        self.calibration.persist(True, now, CALIBRATION_SAVE_S)

    def request_stop(
        self, why: str = "requested", intent: Intent = Intent.EXIT, repeat_forces: bool = True, signum: int = 0
    ) -> None:
        """Ask the worker to checkpoint and stop, then exit 0 (`Intent.REQUEUE`: 75, to be run again; in the
        foreground after signal `signum`: the command's status); a second request kills at once, unless
        `repeat_forces` is false (a batch job's signals: the scheduler's SIGKILL follows on its own clock)."""
        if self.intents.stop(why, intent, self.lifecycle.state, repeat_forces, signum):
            self.outward.notify("stopping")

    # ================================================================================ 2. deadlines

    def _overdue(self, now: float) -> Optional[Expired]:
        """The deadline that is overdue at `now`, if any.  When this pass read only the files whose
        writes were heard, every file is read before a deadline is believed: a line the events have
        not told of yet must not make a worker look stuck."""
        if not self.lifecycle.state.watched or not alive(self.current):
            return None
        expired = self.deadlines.check(now)
        if expired is not None and not self.intake.read_all:
            self._heard(self.intake.beats(self.current, now), now)
            expired = self.deadlines.check(now)
        if expired is not None and self.current.output is not None and self.current.output_read_at < now:
            self._heard(self.intake.output(self.current, now, force=True), now)  # output since the last read
            expired = self.deadlines.check(now)
        if expired is not None and self.nodes.overdue(self.current, expired, now):
            return None  # torchrun between rounds, or peers still missing at the rendezvous (`nodes`)
        if expired is not None and not self.intents.escalate_now:
            for c in self.concerns:
                if c.overdue(self.current, expired, now):
                    return None  # handled in the worker's process (a runaway generate ended): no stall
        return expired

    # ================================================================================ 3. reconcile

    def _reconcile(self, now: float) -> None:
        """Run the current state's handler until the state settles (each handler moves at most one step),
        then the bookkeeping, once: the pass's read model, systemd, state.json, the listeners."""
        tell(self.concerns, PassBegins(now))
        for _ in range(len(State)):
            st = self.lifecycle.state
            handler = HANDLERS.get(st)  # final states have none
            if handler is None:
                break
            getattr(self, handler)(now)
            if self.lifecycle.state is st:
                break
        self.desk.advance(now, self.episode)
        if record_no_progress(self.policy, self.incidents, self.attempt, self.context.facts, self.no_progress_recorded):
            self.no_progress_recorded = True
        if self.current is not None and self.lifecycle.state.watched:
            self.current.rescan(self.table, self.seams.subreaper, now, TREE_SCAN_S)
        self._settle(now)

    def _settle(self, now: float, final: bool = False) -> None:
        """The pass settled: the concerns that follow it, then the outside hears of it, from one read model."""
        where = self._where()
        tell(self.concerns, PassSettled(where, now))
        self.outward.pass_settled(self.view(now), self.lifecycle.reason or None, now, final=final)

    def on_running(self, now: float) -> None:  # STARTING, RUNNING
        failed = self.nodes.while_running(self.current, now)
        it = self.intents
        if failed and it.after_teardown is Intent.NONE:
            log.error("peer_failed", why=failed)
            it.after_teardown, it.fail_reason = Intent.PEER_FAILED, failed
        if self.current is None or self.awaiting_rendezvous:
            out = next_outcome(it.after_teardown, None, during="the wait for the rendezvous", reason=it.fail_reason)
            if out is not None and self.awaiting_rendezvous:
                if out.state is not State.STARTING:
                    self.follow(out, now)  # no worker to stop: a stop, a pause, a failed peer end the wait at once
                    return
                it.after_teardown = Intent.NONE  # a restart while waiting to start: it is starting
            self.start_attempt(now)
        elif not self._escalated(now) and it.after_teardown is not Intent.NONE:
            self.graceful_stop(now)

    def on_stopping(self, now: float) -> None:
        if self.term_at is not None and now >= self.term_at and alive(self.current):
            self.term_at = None  # a SIGINT (SIGHUP, SIGQUIT) the command did not end on: SIGTERM, as a person would
            sent = self.table.signal_group(self.current.worker.pgid, signal.SIGTERM)
            log.info("stop_escalated", signal="SIGTERM", sent=sent, say="the command is still running: SIGTERM")
        if not self._escalated(now) and self.intents.force:
            self.intents.force = False
            self.begin_kill(Episode(None, None, now, reason="forced stop"), now, send_term=False)

    def _escalated(self, now: float) -> bool:
        """A worker exit, `restart now`, a peer's restart, a concern's reason to end the run or an overdue deadline
        starts an episode (True when one did)."""
        cur, it = self.current, self.intents
        # each pass while a worker runs, every concern asked: a concern may end the run (a diverged resume)
        why = highest(self.concerns, lambda c: c.while_running(cur, now), every=True)
        if why and it.abort is None:
            it.abort = why
        peer = self.nodes.peer_restart()
        if cur.worker.exited:
            self.worker_exited(now)
        elif peer is not None and not it.escalate_now and self.expired is None:
            # A peer node restarted: its ranks are gone from the collective ours wait in.  Dump ours (where they
            # waited), kill, and join the new generation at once.
            gen, notice = peer
            if not cur.announced:  # still at the rendezvous: nothing ran, nothing to dump or report
                node = notice.get("node")
                why = f"peer node {node} restarted into generation {gen} before this attempt's ranks started"
                log.info("rendezvous_moved", node=self.nodes.name, generation=gen, attempt=self.attempt, why=why)
                ep = Episode(None, None, now, reason=why, proposed=Decision("restart", f"{why}; joining it"))
                self.begin_kill(ep, now, why=why)
                return True
            self._open(Episode.peer(self.tools, cur, now, notice, gen), now)
        elif it.abort is not None and not it.escalate_now:
            # a concern's reason to end the run (a diverged resume): running it again would do the same
            ep = Episode(None, None, now, reason=it.abort, proposed=Decision("fail", it.abort, exit_code=EXIT_NO_RETRY))
            self.begin_kill(ep, now, send_term=False, why=f"ending the run: {it.abort}")
        elif it.escalate_now or self.expired is not None:
            ex = None if it.escalate_now else self.expired
            it.escalate_now = False
            kind = ex.incident_kind if ex else "manual"
            self._open(Episode.stall(self.tools, cur, now, kind, ex), now)
        else:
            return False
        return True

    def _open(self, ep: Episode, now: float, exited: bool = False) -> None:
        """An episode begins: the concerns hear of it and add what they know to its incident.  A stall or a peer's
        restart then gathers its evidence (STALLED); an exit goes to the teardown of what is left of its tree."""
        self.episode = ep
        ep.amend(merged(self.concerns, lambda c: c.episode_opened(self.current, ep, self.intents.after_teardown, now)))
        if exited:
            self.begin_kill(ep, now, why="worker exited; ending what is left of its tree")
        else:
            self.deadlines.disarm_extra("stop")
            self.transition(State.STALLED, ep.reason, now)

    def on_evidence(self, now: float) -> None:  # STALLED, DUMPING
        ep, cur = self.episode, self.current
        if self.lifecycle.state is State.STALLED:
            if ep.sample_then_dump(self.tools, cur, now):
                pids = [t.ref.pid for t in ep.dumps.targets]
                self.transition(
                    State.DUMPING, f"snapshot taken; dumps of {pids} under way (signalled at detection)", now
                )
            return
        if ep.dumps.advance(now):
            ep.collect_dumps(cur, now)
            # Several nodes: local evidence first, then the peers hear of it — before anything is killed.
            self.nodes.stall_read(ep, cur, now)
            # A concern may ask the worker to get out of it in its own process first (`restart.in_process`).
            why = highest(self.concerns, lambda c: c.before_kill(cur, ep, now))
            if why:
                self.transition(State.RECOVERING, why, now)
            else:
                self.begin_kill(ep, now)

    def on_recovering(self, now: float) -> None:
        """The worker was asked to recover in its process: it did (back to RUNNING, nothing killed), or it did not
        (the kill, as for any stall)."""
        ep, cur = self.episode, self.current
        answers = [c.recovering(cur, ep, now) for c in self.concerns]
        if cur.worker.exited:
            self.begin_kill(ep, now, why="the worker exited while asked to abandon its step; ending its tree")
        elif any(a is False for a in answers):
            self.begin_kill(ep, now)
        elif any(a is True for a in answers):
            ep.recovered(cur, self.context.facts, now)
            inc = ep.incident
            log.warning("recovered_in_process", attempt=cur.number, incident=inc.id if inc else None, kind=ep.kind,
                        text=(inc.data.get("summary") if inc else None))  # fmt: skip
            self.episode = self.expired = None
            self.transition(State.RUNNING, "recovered in the worker's process: the stuck step abandoned", now)

    def on_killing(self, now: float) -> None:
        killer = self.episode.killer
        if self.intents.force and killer.kill_at is None:
            self.intents.force = False
            killer.kill_now(now)
        if not killer.advance(now):
            return
        # Every concern is asked (none may miss the tree's end); one that holds keeps the next attempt from starting
        # on top of what is left (restart.on_unkillable: wait), or waits for its last output (`output_settle`).
        held = [c.hold_teardown(self.current, self.episode, self.intents.after_teardown, now) for c in self.concerns]
        self.holding = any(held)
        if not self.holding:
            self.finish_episode(now)

    def on_idle(self, now: float) -> None:  # BACKOFF, PAUSED
        it, st = self.intents, self.lifecycle.state
        out = next_outcome(it.after_teardown, None, during=st.value, reason=it.fail_reason)
        if out is not None and out.state is not st:
            self.follow(out, now)
        elif st is State.BACKOFF and (self.backoff_until is None or now >= self.backoff_until):
            self.start_attempt(now)

    def start_attempt(self, now: float) -> None:
        number = self.attempt + 1
        resume = self._resume_point(number, now)
        if resume is None:
            return  # several nodes: waiting for the rendezvous (the peer link wakes the loop)
        resume, resume_step = resume
        self.awaiting_rendezvous = False
        if self.current is not None:
            self.context.facts.restarts += 1
        self.attempt = number
        if self.lifecycle.state is not State.STARTING:
            self.transition(State.STARTING, f"attempt {number}", now)
        self.episode = self.backoff_until = self.expired = self.term_at = None
        self.holding = self.by_itself = False
        self.intents.new_attempt()
        take = lambda n, adir, rf, t: highest(self.concerns, lambda c: c.take_worker(n, adir, rf, t))  # noqa: E731
        try:
            rdzv = self.nodes.rdzv_id()
            self.current = cur = attempts.start(self.cfg, number, self.config_path, self.seams.spawn, now, fs=self.fs,
                resume_from=resume, take_standby=take, rdzv_id=rdzv, resume_step=resume_step)  # fmt: skip
            for c in self.concerns:
                cur.foreign |= c.own_pids()  # a concern's processes (standbys) are not the tree's orphans
            if self.nodes.helper_pid:
                cur.foreign.add(self.nodes.helper_pid)  # the peer-link helper: ours, not the tree's
            cur.oom_kills_at_start = self.tools.kernel.oom_kills()
            tell(self.concerns, AttemptStarted(cur, resume_step, now))
        except OSError as exc:
            self.current = None
            self.follow(
                refusal(exc, number, self.cfg, self.config_path, self.intents, self.incidents, self.context.facts), now
            )
            return
        self.deadlines.arm_startup(now)
        self.policy.attempt_started(now, last_good_step=self.context.facts.last_good_step)
        self.nodes.spawned(number, now)
        w = cur.worker
        log.info("worker_spawned", attempt=number, pid=w.pid, argv=w.argv, log=str(w.log_path),
                 prewarmed=cur.prewarmed, instrumentation=self.instrumentation)  # fmt: skip
        self.outward.ready()
        self.desk.persist(now)  # state.json records the new tree at once

    def _resume_point(self, number: int, now: float) -> Optional[tuple[str, Optional[int]]]:
        """What attempt `number` resumes from (path, step), once the nodes agree; None: not yet (STARTING)."""
        found, why = resume_point(self.nodes, self.ledger, self.cfg, number, now)
        if found is None:
            if self.lifecycle.state is not State.STARTING:
                self.transition(State.STARTING, why, now)
            self.awaiting_rendezvous = True
        return found

    def graceful_stop(self, now: float) -> None:
        intent = self.intents.after_teardown
        self.transition(State.STOPPING, f"{intent.value} requested", now)
        w, s = self.current.worker, self.seams
        how = stop_signals.passing(self.intents.stop_signal, s.transparent)
        sent = self.table.signal_group(w.pgid, how.send) if how.group else self.table.signal(w.ref, how.send)
        budget, source = self.deadlines.step_budget()
        grace = self.watchdog_cfg.term_grace_s
        self.term_at = now + grace if how.term_after_grace else None
        bound = grace * (2 if how.term_after_grace else 1) + budget
        self.deadlines.arm_extra("stop", now, bound, f"term_grace + {source} step budget")
        say = stop_signals.words(how, self.intents.stopped_by, s.transparent) if self.intents.stop_signal else None
        log.info("graceful_stop", intent=intent.value, pid=w.pid, signal=signal.Signals(how.send).name, sent=sent,
                 bound_s=round(bound, 3), say=say)  # fmt: skip
        tell(self.concerns, StopRequested(self.current, intent, now))

    def worker_exited(self, now: float) -> None:
        """The worker's exit, read once what it last said is in (`Concern.hold_exit`): an episode whose decision —
        the policy's, or a finished worker's over a stop — the concerns may replace once the tree is gone."""
        cur, w = self.current, self.current.worker
        if any([c.hold_exit(cur, now) for c in self.concerns]):
            return
        self.by_itself = True
        stop_reason = cur.stop_reason(self.deadlines.main_rank())
        if self.lifecycle.state is State.STOPPING:
            self.stop_answered = True  # its answer to the stop it was passed
            stopping = f"graceful stop ({self.intents.after_teardown.value})"
            ep = Episode.exited(self.tools, cur, now, stopping=stopping)
            # the stop came as the last step was done: the work is complete, the run finished (not to be run again)
            ep.proposed = done_before_stop(w.exit_code, stop_reason)
            self._open(ep, now, exited=True)
            return
        code = w.exit_code if w.exit_signal is None else None
        free = self.nodes.exit_cause(cur, code, stop_reason)  # several nodes: a peer's doing, not this node's
        # A signal after every rank said it had finished: a crash in the process's teardown, not a failed run
        done = None if free is not None else teardown_crash_of(cur, self.deadlines.ranks)
        if done is not None:
            log.warning("worker_teardown_crash", attempt=cur.number, why=done)
        # torchrun exits 1 for a rank's configuration, data or disk error: the ranks' last words and torchrun's
        # root-cause report keep the run from restarting it for ever
        decision = free or self.policy.on_exit(now, code, stop_reason, own_command=self.cfg.worker.command is not None,
            no_retry=no_retry(cur) if done is None else None, teardown=done)  # fmt: skip
        if free is not None and code == 0:  # a clean stop a peer's stop caused: nothing failed here
            ep = Episode(None, None, now, reason=decision.reason)
        else:
            ep = Episode.exited(self.tools, cur, now, decision=decision)
        ep.proposed = decision  # the concerns may replace it once the tree is gone (an OOM's remedy)
        if ep.incident is not None:
            self.nodes.exit_read(ep, decision, cur, now)
        self._open(ep, now, exited=True)

    def begin_kill(self, ep: Episode, now: float, send_term: bool = True, why: Optional[str] = None) -> None:
        self.episode = ep
        ep.begin_kill(self.tools, self.current, now, send_term)
        self.deadlines.disarm_extra("stop")
        self.transition(
            State.KILLING, why or ("SIGTERM to the process group" if send_term else "SIGKILL to the tree"), now
        )

    def finish_episode(self, now: float) -> None:
        """The tree is gone: the decision is asked, once — the episode's own (the policy's on an exit, the loop's),
        then each concern's replacement (an OOM's remedy, a failure that cannot be survived); with neither decision
        nor request, the nodes (a peer's doing), then the policy on a failure — the incident completed, and the loop
        goes where the outcome says."""
        ep, cur, it = self.episode, self.current, self.intents
        cur.tail.finish()
        if cur.output is not None:
            self.intake.output(cur, now, force=True)  # its last words: where its own output says it ended
            cur.output.close()
        self.ledger.attempt_ended(cur.number)  # what it left unconfirmed stays unconfirmed
        tell(self.concerns, AttemptEnded(cur, ep, now))
        self.calibration.persist(False, None, CALIBRATION_SAVE_S)

        def undecided() -> Optional[Answer]:  # nothing decided, nothing asked: the nodes, the way out, the policy
            if it.after_teardown is not Intent.NONE:
                return None
            answer = self.nodes.decision(cur, ep, None, now) or Answer()  # several nodes: the culprit elsewhere
            if answer.decision is not None:
                return answer
            done = ep.work_done  # every rank had finished: the way out hung
            decision = Decision("finish", done) if done is not None else self.policy.on_failure(now, ep.reason)
            return replace(answer, decision=decision)

        decision = decide(self.concerns, cur, ep, now, fs=self.fs, write_failed=it.write_failed, undecided=undecided)
        out = next_outcome(it.after_teardown, decision, cur.worker.exit_code, reason=it.fail_reason)
        ep.finish(cur, self.context.facts, now, out.state.value, out.why, self.deadlines.main_rank())
        gone = ep.killer.timings()["tree_gone_after_s"]
        log.info("tree_gone", attempt=self.attempt, next=out.state.value, why=out.why, gone_after_s=gone)
        self.episode = None
        if out.state is State.FAILED and decision is not None and decision.crash_loop:
            crash_loop_incident(
                self.incidents, self.attempt, decision, self.policy, self.cfg.restart, self.context.facts
            )
        self.follow(out, now, decision)

    def follow(self, out: Outcome, now: float, decision: Optional[Decision] = None) -> None:
        """Go where the outcome says: a new attempt now or after a backoff, paused, or a final state (`decision`: the
        episode's that led there, which the run's exit status follows)."""
        tell(self.concerns, OutcomeReached(out, now))
        it = self.intents
        if out.state in (State.STARTING, State.PAUSED):
            it.after_teardown = Intent.NONE
        if out.state is State.STARTING:
            self.start_attempt(now)
            return
        if out.state is State.BACKOFF:
            self.backoff_until = now + out.delay_s
        if out.state.final:
            w = self.current.worker if self.current is not None else None
            code = w.exit_code if w and (out.state is not State.STOPPED or self.stop_answered) else None
            self.exit_code = run_exit_status(out, decision, code=code, signum=w.exit_signal if w else None,
                by_itself=self.by_itself, stop_signal=it.stop_signal, transparent=self.seams.transparent)  # fmt: skip
            if out.state is not State.FAILED:
                self.outward.notify("stopping")
        stopped_by = f" ({it.stopped_by})" if out.state is State.STOPPED and it.stopped_by else ""
        self.transition(out.state, out.why + stopped_by, now)

    def view(self, now: float) -> View:
        """The read model at `now`, built anew (`view_builder`)."""
        at = Situation(self.lifecycle.state, self.intents.after_teardown, self.attempt, self.current, self.exit_code,
                       self.backoff_until, self.started_at)  # fmt: skip
        return self.viewer.build(now, at)

    def transition(self, dst: State, why: str, now: float) -> None:
        src = self.lifecycle.state
        self.lifecycle.transition(dst, why)
        if dst.final:
            self.nodes.ended(dst.value, why)
        log.info("state", frm=src.value, to=dst.value, why=why, attempt=self.attempt)


def resume_point(
    nodes: Nodes, ledger: PersistedLedger, cfg: Config, number: int, now: float
) -> tuple[Optional[tuple[str, Optional[int]]], str]:
    """((path, step), "") for attempt `number`, or (None, why it must wait): several nodes start no torchrun before
    the store is reached and — after a failure — a new generation exists (the old one's rendezvous may be closed),
    and agree on the resume point; the peer link wakes the loop when they did."""
    if not nodes.ready_for_attempt(now):
        return None, f"attempt {number}: waiting for the rendezvous store and a new generation"
    if cfg.worker.command is not None and set_aside_bad(ledger.ledger, cfg.worker.cwd):
        ledger.save()  # where they went, on record (the built-in worker skips bad ones itself: left in place)
    chosen, step = resume_choice(ledger.ledger, cfg.worker.cwd, number)
    settled, resume = nodes.resume_point({"path": chosen, "step": step} if chosen else None, now)
    if not settled:
        return None, f"attempt {number}: agreeing on the resume point"
    return (resume, step if resume == chosen else None), ""  # the peers agreed on another: its step is theirs


def read_back(state_path: Path, ledger: PersistedLedger) -> tuple[Optional[dict], run_state.RunRecord]:
    """A previous supervisor's state.json and checkpoint ledger: its record, and the run's record from them."""
    previous, problem = run_state.read(state_path)
    if problem:
        log.warning("state_unreadable", problem=problem)
    problem = ledger.load()
    if problem:  # the run goes on without its record: every checkpoint must earn its place again
        print(f"hangwatch: warning: {problem}", file=sys.stderr, flush=True)
        log.warning("checkpoint_ledger_unreadable", problem=problem)
    known = bool(ledger.ledger.entries)
    facts = run_state.RunRecord.from_previous(previous, ledger.ledger)
    if ledger.ledger.entries and not known:  # seeded from an older supervisor's state.json
        ledger.save()
    return previous, facts


def refusal(exc: OSError, number: int, cfg: Config, config_path: Path, intents: Intents,
            incidents: IncidentStore, facts: run_state.RunRecord) -> Outcome:  # fmt: skip
    """Attempt `number` could not be started: failed — for the disk (74) when its directory or log cannot be made,
    else for the configuration (78), with an incident naming the command."""
    if disk_error(exc):
        intents.write_failed(exc, Path(exc.filename or attempt_dir(Path(cfg.run_dir), number)))
        return Outcome(State.FAILED, intents.fail_reason, EXIT_IOERR)
    argv = attempts.worker_argv(cfg, config_path)
    spawn_failed_incident(incidents, number, argv, cfg.worker.cwd, exc, facts)
    return Outcome(State.FAILED, f"cannot start the worker: {exc}", EXIT_CONFIG)


def record_no_progress(policy, incidents: IncidentStore, attempt: int, facts: run_state.RunRecord, done: bool) -> bool:
    """The policy gave up for lack of progress: the run's final incident (after the failure's own).  True when it
    was recorded now."""
    gave_up = getattr(policy, "gave_up", None)
    if gave_up is None or done:
        return False
    inc = incidents.open_for_run(
        "no_progress",
        facts,
        with_last_incident=True,
        then=gave_up,
        attempt=attempt,
        phase=None,
        step=gave_up["attempt_top_step"],
        classification="no progress",
        summary=gave_up["reason"],
        status="final",
    )
    log.error("no_progress", incident=inc.id, reason=gave_up["reason"])
    return True


def _fileno(control) -> Optional[int]:
    """A descriptor that is readable when the control server has something to do, if it offers one."""
    fileno = getattr(control, "fileno", None)
    try:
        return fileno() if callable(fileno) else None
    except (OSError, ValueError):
        return None


def _close(control) -> None:
    if control is not None:
        try:
            control.close()
        except Exception as exc:  # a broken control server must not hide the run's result
            log.warning("control_close_failed", error=str(exc))
