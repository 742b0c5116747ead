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
    3. reconcile: the handler of the current state (`self.handlers`) acts — spawn, snapshot and dump,
       signal, kill, write the incident, back off — until the state settles; then in-flight `dump`
       requests advance and the bookkeeping runs (tree scan, sd_notify, state.json, the listeners).
Every time comes from the `now` the pass was given; only `run()` reads the clock, so a fake clock,
a fake process table and a fake spawn drive the whole lifecycle without a process.

A stall, top-down: `_overdue` records the expired deadline (a concern may handle it in the worker's process:
`concerns.generate_overrun`) → `on_running` → `_escalated` opens `Episode.stall` (snapshot, SIGUSR1 dumps,
py-spy; `_open` lets the concerns add to it) → STALLED → `on_stalled` (the snapshot) → DUMPING → `on_dumping` (the
dumps read, the verdict) → `begin_kill` → KILLING → `on_killing` (SIGKILL at the grace; a concern may hold the
teardown) → `finish_episode` (`_decide`, the one writer of the decision; `rules.outcome.next_outcome`; the
incident completed) → `follow` → BACKOFF or `start_attempt`.

What the loop watches for besides the deadlines — a runaway generate, the resume audit, OOM recovery, the wait for
processes SIGKILL cannot end, goodput, the prewarmed standby, stragglers — are concerns (`concerns.base.Concern`),
registered in one place (`concerns.registered`) and asked in one `for` at each hook; one box or several is the
nodes interface (`nodes.interface.Nodes`).

Between passes the loop sleeps (`wakeup.Wakeup.wait`) until something needs a pass: a signal, a
heartbeat write (coalesced: one pass reads every new line of every rank), a control request, or the
earliest deadline (`next_wait`).  A supervisor with nothing due sleeps up to IDLE_WAIT_S; only while
escalating does it pass on a short period (FAST_PASS_S), and only where a heartbeat write or a request
cannot wake it (no inotify, a control server without a descriptor) does it fall back to
`watchdog.poll_interval_s`.

Heartbeat lines (`_read_beats`), besides the deadlines (`Deadlines.observe`) and the concerns (`Concern.beat`):
    start       the rank's process and dump file are remembered (only announced processes ever get
                SIGUSR1); the first start moves STARTING → RUNNING; a `resumed_from` other than the
                checkpoint handed in HANGWATCH_RESUME_FROM is logged (a warning when the ledger holds it bad)
    step        the metrics `status` shows; a new highest step clears the crash-loop count; its loss confirms
                or spoils waiting checkpoints
    phase       systemd's status line follows the phase
    checkpoint  recorded in the checkpoint ledger; state.json records the last good one at once
    warn        logged; a non-finite loss in it spoils waiting checkpoints, like a step's
    stop        its reason decides finished-or-not when the worker exits; once every rank said `stop`,
                the exit itself gets a deadline (a process that hangs on its way out is still caught)
Each line counts from when it was written, not when it was read (reads are coalesced): its file's
modification time when the supervisor runs on the real clock, its file system keeps local times and this
pass saw no suspension; else the pass's `now`.  A step line costs a decode and a few dict updates.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Collection, Optional

import structlog

from hangwatch.common.config import Config, dump_config
from hangwatch.common.durable import FsOps, describe_write_error, disk_error
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_FAILED, EXIT_IOERR, EXIT_NO_RETRY, EXIT_OK
from hangwatch.common.inbox_layout import queue_status
from hangwatch.common.rundir import CALIBRATION_NAME, CONFIG_NAME, STATE_NAME, attempt_dir, next_attempt
from hangwatch.supervisor.concerns import Concern, PassState, RunContext, registered
from hangwatch.supervisor.concerns.oom_remediation import state_fields as healing_fields
from hangwatch.supervisor.control.paths import socket_path_for
from hangwatch.supervisor.escalation.episode import (
    Episode,
    EscalationContext,
    crash_loop_incident,
    no_retry,
    spawn_failed_incident,
    teardown_crash_of,
)
from hangwatch.supervisor.incidents import IncidentStore, signal_name
from hangwatch.supervisor.loop import control_requests
from hangwatch.supervisor.loop.control_requests import DumpRequest
from hangwatch.supervisor.loop.wakeup import Wakeup
from hangwatch.supervisor.nodes.interface import Nodes, SingleNode
from hangwatch.supervisor.nodes.multi_node import MultiNode
from hangwatch.supervisor.nodes.peers import SpawnHelper, spawn_helper
from hangwatch.supervisor.ops import logsetup
from hangwatch.supervisor.ops.notify import NullNotifier
from hangwatch.supervisor.ops.signal_source import SignalSource
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes import leftovers, process
from hangwatch.supervisor.processes import snapshot as snapshots
from hangwatch.supervisor.processes.interpreter import instrument_note, note_for
from hangwatch.supervisor.processes.standby import SpawnStandby, spawn_standby
from hangwatch.supervisor.processes.terminal_wait import first_reading
from hangwatch.supervisor.read_model import view as views
from hangwatch.supervisor.read_model.view import View
from hangwatch.supervisor.records import run_state
from hangwatch.supervisor.records.checkpoint_ledger import (
    BAD,
    PersistedLedger,
    resolved_path,
    resume_choice,
    set_aside_bad,
)
from hangwatch.supervisor.rules import stop_signals
from hangwatch.supervisor.rules.outcome import STOPS, Intent, Outcome, done_before_stop, next_outcome, run_exit_status
from hangwatch.supervisor.rules.policy import Decision, RestartPolicy
from hangwatch.supervisor.rules.states import State, StateMachine
from hangwatch.supervisor.watch.beat_files import written_at
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired, SuspensionDetector

log = structlog.get_logger("hangwatch")

TREE_SCAN_S = (
    5.0  # how often descendants are re-listed (to find those that leave the group); in passes, never a wake-up
)
STATE_WRITE_S = 5.0
STATUS_NOTE_S = 10.0
REAP_EVERY_S = 1.0  # a running worker is waited for at least this often even without a SIGCHLD
CALIBRATION_SAVE_S = 30.0  # new step samples reach calibration.json at most this often (and at every attempt end)
OUTPUT_READ_S = 1.0  # the worker's output is read at most this often (and always before a deadline is believed)
OUTPUT_SETTLE_S = 2.0  # the longest an ended tree's output streams are waited for (`_output_settling`)
FAST_PASS_S = 0.1  # loop period while escalating or stopping: prompt, yet cheap (each pass scans the tree)
IDLE_WAIT_S = 5.0  # the longest sleep with nothing due: bounds what runs only in passes (idle control clients)
_UNASKED = object()


class Supervisor:
    def __init__(
        self,
        cfg: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        spawn: attempts.Spawn = process.spawn,
        kill: process.Kill = os.kill,
        table: Optional[process.ProcessTable] = None,
        control: Any = None,
        notifier: Any = None,
        snapshot: Callable[..., Any] = snapshots.TreeSample,
        gpu: Callable[[], dict] = snapshots.gpu,
        gpu_pids: Callable[[], Optional[set]] = snapshots.gpu_pids,
        wakeup: Optional[Wakeup] = None,
        install_signals: bool = True,
        subreaper: bool = False,
        cpu_sample_s: float = 0.5,
        end_leftovers: bool = True,
        fs: Optional[FsOps] = None,
        policy: Optional[RestartPolicy] = None,
        file_times: Optional[bool] = None,
        peer_spawn: Optional[SpawnHelper] = None,
        spawn_standby: SpawnStandby = spawn_standby,
        listeners: tuple = (),
        probe: Callable[..., str] = instrument_note,
        signal_source: Optional[SignalSource] = None,
        transparent: bool = False,
        hangup_stops: bool = False,
    ):
        """Seams only; no I/O (that is `prepare`).  `file_times`: date heartbeat lines by their files'
        modification times; by default only on the real clock, to which those times relate.  `peer_spawn`:
        how the peer-link helper of a multi-node run is started.  `spawn_standby`: how a prewarmed standby is.
        `listeners`: told once a pass, with the read model (`pass_done(view, now)`) — the ops side.
        `probe`: what instrumentation a `worker.command` gets, in words (`processes.interpreter.instrument_note`:
        asks the command's Python for its version).  `signal_source`: who sent a stopping signal, in words (a Slurm
        job's scancel, time limit or warning: `ops.signal_source`).  `transparent`: `hangwatch run` in the foreground,
        standing in for the command: stopping signals reach it as themselves and the run exits with its status
        (`rules.stop_signals`, `rules.outcome.run_exit_status`); `hangup_stops`: there, SIGHUP is the terminal's
        hang-up (one of our streams is a terminal), passed on, rather than a request to reopen the logs."""
        self.cfg = cfg
        self.watchdog_cfg = wd = cfg.watchdog
        self.run_dir = Path(cfg.run_dir)
        self.config_path = self.run_dir / CONFIG_NAME
        self.state_path = self.run_dir / STATE_NAME
        self.clock = clock
        self.file_times = (clock is time.monotonic) if file_times is None else file_times
        self.file_times_now = self.file_times  # …and in this pass (not in one that follows a suspension)
        self.spawn = spawn
        self.fs = fs if fs is not None else FsOps()  # every write in the run dir (the seam that makes one fail)
        self.table = table if table is not None else process.PsutilProcessTable(kill)
        self.control = control
        self.notifier = notifier if notifier is not None else NullNotifier()
        self.listeners = tuple(listeners)
        self.wakeup = wakeup if wakeup is not None else Wakeup(install_signals=install_signals)
        self._subreaper = subreaper
        self._end_leftovers = end_leftovers

        self.lifecycle = StateMachine(State.STARTING)
        self.calibration = Calibration(wd, self.run_dir / CALIBRATION_NAME, fs=self.fs)
        self.deadlines = Deadlines(wd, self.calibration)
        self.policy = policy if policy is not None else RestartPolicy(cfg.restart)
        self.incidents = IncidentStore(self.run_dir, fs=self.fs, on_write_error=self.write_failed)
        self.suspension = SuspensionDetector(wd.poll_interval_s)
        self.gpu = snapshots.GpuCache(gpu)
        self.tools = EscalationContext(
            self.table, self.incidents, wd, snapshot, self.gpu, gpu_pids, cpu_sample_s, subreaper
        )
        self.ledger = PersistedLedger(self.run_dir, cfg.checkpoint.confirm_steps, fs=self.fs)  # announced checkpoints
        # What the concerns are handed; its `facts` is the run's record (replaced in `prepare` by the one read back).
        self.context = RunContext(
            cfg,
            self.run_dir,
            self.fs,
            self.incidents,
            self.deadlines,
            run_state.RunRecord(checkpoints=self.ledger.ledger),
            changed=self._stale,
            write_failed=self.write_failed,
            where=self._where,
        )
        self.concerns: list[Concern] = registered(
            self.context, table=self.table, config_path=self.config_path, spawn_standby=spawn_standby
        )
        # Several nodes: the peer link and this node's part in the run; one node: a null object.  The loop
        # talks to either through the same interface and has no multi-node branch of its own.
        self.nodes: Nodes = (
            MultiNode(cfg, self.run_dir, spawn=peer_spawn or spawn_helper, poke=self.wakeup.poke)
            if cfg.worker.nnodes > 1
            else SingleNode()
        )

        self.attempt = 0  # the number of the current (or last) attempt
        self.current: Optional[attempts.Attempt] = None
        self.episode: Optional[Episode] = None  # the failure (or end) being handled until the tree is gone
        self.after_teardown = Intent.NONE  # what an operator asked to follow the current worker
        self.force = False  # a second stop: kill without waiting
        self.escalate_now = False  # `restart now`: dump and kill
        self.awaiting_rendezvous = False  # multi-node: the next attempt waits for the store / a new generation
        self.expired: Optional[Expired] = None  # this pass's overdue deadline
        self.backoff_until: Optional[float] = None
        self._settle_since: Optional[float] = None  # the tree was gone, its output streams not yet closed, since
        self.dump_requests: list[DumpRequest] = []
        self.exit_code = EXIT_OK
        self.fail_reason: Optional[str] = None  # why the run must end failed (the disk refused a write)
        self.abort: Optional[str] = None  # end the run at once (a concern said so: a diverged resume, say)
        self.holding = False  # a concern keeps the loop in KILLING after the tree's teardown (unkillable processes)
        self.started_at = 0.0
        self.no_progress_recorded = False
        self._read_all = True  # this pass read every heartbeat file (not only those the file events named)
        self._last_reap = float("-inf")
        self._control_fd_value: Any = _UNASKED
        self._ready_sent = False
        self._last_state_write = self._last_status_note = float("-inf")
        self._healing: Optional[dict] = None  # state.json's remediation/quarantine fields, as last read
        self._socket: Optional[str] = None  # where the control socket is (fixed for this supervisor's life)
        self._view: Optional[View] = None  # the read model of this pass (None: not built since the state moved)
        self.instrumentation = ""  # what instrumentation the worker gets, in words (the start line; `prepare`)
        self._probe = probe
        self.signal_source = signal_source if signal_source is not None else SignalSource()
        self.stopped_by: Optional[str] = None  # who asked for the stop (a signal's sender, a control request)
        self.transparent = transparent
        self.hangup_stops = hangup_stops
        self.stop_signal: Optional[int] = None  # the signal that stopped the run (passed on to the command)
        self.term_at: Optional[float] = None  # a stop passed on as SIGINT/SIGHUP/SIGQUIT: when SIGTERM follows
        self.by_itself = False  # the current attempt's worker ended on its own (not killed after a stall)
        self.stop_answered = False  # …and it was while stopping: its status is its answer to the stop
        self.handlers: dict[State, Callable[[float], None]] = {
            State.STARTING: self.on_running,
            State.RUNNING: self.on_running,
            State.STOPPING: self.on_stopping,
            State.STALLED: self.on_stalled,
            State.DUMPING: self.on_dumping,
            State.RECOVERING: self.on_recovering,
            State.KILLING: self.on_killing,
            State.BACKOFF: self.on_backoff,
            State.PAUSED: self.on_paused,
        }
        self.requests: dict[str, Callable[[dict, float], control_requests.Reply]] = {
            "status": self._cmd_status,
            "restart": self._cmd_restart,
            "stop": self._cmd_stop,
            "pause": self._cmd_pause,
            "resume": self._cmd_resume,
            "dump": self._cmd_dump,
            "incidents": self._cmd_incidents,
        }

    @property
    def facts(self) -> run_state.RunRecord:
        """The run's record (what the run has established: steps, checkpoints, incidents, restarts)."""
        return self.context.facts

    @facts.setter
    def facts(self, value: run_state.RunRecord) -> None:
        self.context.facts = value

    def concern(self, name: str) -> Optional[Concern]:
        """The registered concern of that name (None: not registered for this run)."""
        return next((c for c in self.concerns if c.name == name), None)

    def _stale(self) -> None:
        self._view = None

    def _where(self) -> PassState:
        dl = self.deadlines
        return PassState(
            state=self.lifecycle.state,
            intent=self.after_teardown,
            attempt=self.current,
            episode=self.episode,
            expired=self.expired,
            main=dl.ranks.get(dl.main_rank()) if self.current is not None else None,
        )

    # ================================================================================ set-up and loop

    def prepare(self, now: float) -> Optional[str]:
        """The set-up's I/O: the run dir, a previous supervisor's state and leftovers, calibration,
        config.yaml.  Returns why the supervisor must not run, or None."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = now
        previous, problem = run_state.read(self.state_path)
        if problem:
            log.warning("state_unreadable", problem=problem)
        problem = self.ledger.load()
        if problem:  # the run goes on without its record: every checkpoint must earn its place again
            print(f"hangwatch: warning: {problem}", file=sys.stderr, flush=True)
            log.warning("checkpoint_ledger_unreadable", problem=problem)
        known = bool(self.ledger.ledger.entries)
        self.facts = run_state.RunRecord.from_previous(previous, self.ledger.ledger)
        if self.ledger.ledger.entries and not known:  # seeded from an older supervisor's state.json
            self.ledger.save()
        problem = leftovers.clear(
            previous or {},
            self.table,
            state_path=self.state_path,
            grace_s=self.watchdog_cfg.term_grace_s,
            end_leftovers=self._end_leftovers,
        )
        if problem:
            return problem
        problem = self.calibration.reload()
        if problem:
            log.warning("calibration_ignored", problem=problem)
        self.attempt = next_attempt(self.run_dir) - 1
        for c in self.concerns:
            c.prepare(now)
        try:
            self.fs.write_file(self.config_path, dump_config(self.cfg).encode())
        except OSError as exc:
            self.exit_code = EXIT_IOERR if disk_error(exc) else EXIT_FAILED
            return f"cannot write {self.config_path}: {describe_write_error(exc, self.config_path)}"
        if run_state.paused_before(previous):
            # A pause outlives the supervisor: start paused; `resume` starts a worker.
            self.transition(State.PAUSED, "paused before this supervisor started (state.json)", now)
        if self._subreaper:
            process.set_child_subreaper()
        self.nodes.start(now)
        self.instrumentation = note_for(self.cfg, self._probe)  # asked once, before the loop
        return None

    def run(self) -> int:
        """Run until finished, stopped or failed; returns the process exit code."""
        problem = self.prepare(self.clock())
        if problem:
            print(f"hangwatch: {problem}", file=sys.stderr)
            log.error("refused", problem=problem)
            self._close_control()  # the socket file must not outlive a supervisor that never ran
            return self.exit_code if self.exit_code != EXIT_OK else EXIT_FAILED
        self.wakeup.open(extra=[fd for fd in (self._control_fd(),) if fd is not None])
        if self.wakeup.events_problem:
            log.warning(
                "heartbeat_events_unavailable",
                problem=self.wakeup.events_problem,
                note=f"heartbeat files are read every {self.watchdog_cfg.poll_interval_s:g} s instead",
            )
        log.info("supervisor_started", run_dir=str(self.run_dir), pid=os.getpid(), config=str(self.config_path))
        try:
            while not self.lifecycle.state.final:
                now = self.clock()
                wait = self.next_wait(now)
                # A new attempt's files made no event before the watch existed: read them at once.
                if self.wakeup.watch(self._beat_dir()):
                    wait = 0.0
                self.wakeup.wait(wait)
                self.run_once(self.clock())
                # The pass's own work (fsynced writes, process listings) is not a suspension.
                self.suspension.touch(self.clock())
                self.wakeup.pass_done()
        except BaseException:  # the supervisor itself is failing: leave no worker tree behind
            if self.worker_alive():
                self.current.kill_all(self.table)
            raise
        finally:
            if self.ledger.dirty:
                self.ledger.save()
            now = self.clock()
            self._settle(now)
            self.write_state(now, force=True)
            self._tell_listeners(now)  # the final view: the last metrics snapshot, the last alerts
            self._teardown()
        log.info("supervisor_exit", state=self.lifecycle.state.value, exit_code=self.exit_code)
        return self.exit_code

    def run_once(self, now: float) -> None:
        """One pass at `now`: drain events, check deadlines, reconcile."""
        self._view = None
        signals = self.wakeup.drain()
        # SIGCONT: this process was stopped since the last pass (SIGSTOP, a frozen unit); for how long
        # it cannot tell, so the whole time since then counts as suspended (deadlines move, never fire).
        gap = self.suspension.observe(now, continued=signal.SIGCONT in signals)
        self.file_times_now = self.file_times and gap <= 0  # lines written in a gap count from now
        if gap > 0:
            self.deadlines.shift(gap)
            if self.backoff_until is not None:
                self.backoff_until += gap
            log.warning("supervisor_suspended", gap_s=round(gap, 3), note="deadlines extended by the gap")
        self._drain_events(now, signals)
        self.expired = self._overdue(now)  # 2. deadlines: only recorded here; the reconcile step opens the episode
        self._reconcile(now)

    def next_wait(self, now: float) -> float:
        """How long the loop may sleep from `now`: until the earliest thing due — a deadline, the end of
        a backoff, the notifier's next watchdog ping, the peer link's next due moment — and at most
        IDLE_WAIT_S; FAST_PASS_S while escalating (an episode's own timers: snapshot interval, SIGKILL at
        the grace, a dump's quiet period); `poll_interval_s` where a heartbeat write or a control request
        could not wake it.  The planned wake-up is handed to the suspension detector (a pass much later
        than planned means this process was not running)."""
        wait = self._wait(now)
        self.suspension.expect(now + wait)
        return wait

    def _wait(self, now: float) -> float:
        st = self.lifecycle.state
        if st is State.STARTING and self.current is None and not self.awaiting_rendezvous:
            return 0.0  # the first attempt is spawned in the next pass
        if st.escalating or st is State.STOPPING or self.dump_requests:
            due = self.episode.next_due_s(now, self.tools.cpu_sample_s) if self.episode is not None else None
            if self.holding and due is not None:
                return due  # a held teardown (survivors of SIGKILL): looked at on the episode's own clock
            return FAST_PASS_S if due is None else min(FAST_PASS_S, due)
        if self.current is not None and self.current.tail.backlog:
            return 0.0  # the last read stopped at its size bound with more lines waiting
        if self._settle_since is not None:
            return FAST_PASS_S  # an ended worker's output streams: looked at again soon
        waits = [IDLE_WAIT_S]
        if st is State.BACKOFF and self.backoff_until is not None:
            waits.append(self.backoff_until - now)
        if st.watched:
            due = self.deadlines.next_due_s(now)
            if due is not None:
                waits.append(due)
            if self.worker_alive() and not self.wakeup.hears_beats:
                waits.append(self.watchdog_cfg.poll_interval_s)  # no file events: read on a timer
        if self.control is not None and self._control_fd() is None:
            waits.append(self.watchdog_cfg.poll_interval_s)  # requests are only seen in passes
        dues = [notifier_due(self.notifier, now), self.nodes.next_due_s(now)]
        for due in dues + [c.next_due_s(now) for c in self.concerns]:
            if due is not None:
                waits.append(due)
        return max(0.0, min(waits))

    def _beat_dir(self) -> Optional[Path]:
        """The directory whose heartbeat files the loop listens to: the current attempt's, while it runs."""
        return self.current.dir if self.current is not None and not self.current.worker.exited else None

    def _control_fd(self) -> Optional[int]:
        """A descriptor that is readable when the control server has something to do, if it offers one
        (asked once: the server's descriptor lives as long as the server)."""
        if self._control_fd_value is _UNASKED:
            fileno = getattr(self.control, "fileno", None)
            try:
                self._control_fd_value = fileno() if callable(fileno) else None
            except (OSError, ValueError):
                self._control_fd_value = None
        return self._control_fd_value

    def worker_alive(self) -> bool:
        return self.current is not None and not self.current.worker.exited

    def _teardown(self) -> None:
        now = self.clock()
        for c in self.concerns:
            c.close(now)
        self.wakeup.close()
        self.nodes.close()
        self.save_calibration()
        self._close_control()

    def _close_control(self) -> None:
        if self.control is not None:
            try:
                self.control.close()
            except Exception as exc:  # a broken control server must not hide the run's result
                log.warning("control_close_failed", error=str(exc))

    # ================================================================================ 1. events

    def _drain_events(self, now: float, signals: list[int]) -> None:
        for sig in signals:  # SIGCHLD only woke the loop: children are reaped below
            if stop_signals.stops(
                sig, self.transparent, self.hangup_stops
            ):  # SIGUSR1: a batch job's time limit is near
                intent = Intent.REQUEUE if sig == signal.SIGUSR1 else Intent.EXIT
                batch = self.signal_source.batch
                self.request_stop(self.signal_source.describe(sig), intent, repeat_forces=not batch, signum=sig)
            elif sig == signal.SIGHUP:
                logsetup.reopen()
                log.info("log_reopened", why="SIGHUP")
        heard = signal.SIGCHLD in signals or not self.wakeup.signals_installed
        st = self.lifecycle.state
        if heard or now - self._last_reap >= REAP_EVERY_S or st not in (State.STARTING, State.RUNNING):
            self._last_reap = now
            self._reap(now, orphans=heard or st not in (State.STARTING, State.RUNNING))
        self.nodes.poll(now)  # what the peer link heard: the generation, peers' notices and records
        if self.current is not None and self.nodes.helper_pid:
            self.current.foreign.add(self.nodes.helper_pid)  # our child, never an orphan of the worker's tree
        grown = self.wakeup.grown()  # the heartbeat files the file events said grew (None: read them all)
        if self.current is not None and self.current.worker.exited:
            grown = None  # an ended worker's last lines (its last step, its stop) decide what its end means
        self._read_beats(now, grown)
        self._read_all = grown is None
        self._read_output(now)
        if self.control is not None:
            try:
                self.control.poll(lambda req: control_requests.dispatch(req, self.requests, now))
            except Exception:  # a broken control channel must not take the training run down with it
                log.exception("control_poll_failed")

    def request_stop(
        self, why: str = "requested", intent: Intent = Intent.EXIT, repeat_forces: bool = True, signum: int = 0
    ) -> None:
        """Ask the worker to checkpoint and stop, then exit 0 (`Intent.REQUEUE`: 75, to be run again; in the
        foreground after signal `signum`: the command's status); a second request kills at once, unless
        `repeat_forces` is false (a batch job's signals: the scheduler's SIGKILL follows on its own clock)."""
        if self.after_teardown in STOPS:
            if repeat_forces:
                self.force = True
                log.warning("stop_forced", why=why, say=f"{why} again: ending the command's tree now")
            else:
                log.info("stop_requested_again", why=why, state=self.lifecycle.state.value)
            return
        self.after_teardown, self.stopped_by = intent, why
        self.stop_signal = signum or None
        log.info("stop_requested", why=why, intent=intent.value, state=self.lifecycle.state.value)
        self.notify("stopping")

    def _reap(self, now: float, orphans: bool = True) -> None:
        """The one place exits are observed: the worker's is recorded on it, adopted orphans are reaped.
        While a worker runs this happens when a child's exit was heard (SIGCHLD) or cannot be (no
        handlers), and every REAP_EVERY_S besides (a signal lost is not an exit missed); orphans only then
        (`orphans`): one waitpid per known pid would be the bulk of a pass with many ranks."""
        cur = self.current
        if cur is None:
            return
        w = cur.worker
        if not w.exited:
            status = self.table.reap(w.pid)
            if status is not None:
                w.record_exit(status, now)
                log.info(
                    "worker_exited",
                    attempt=cur.number,
                    pid=w.pid,
                    code=w.exit_code,
                    signal=signal_name(w.exit_signal),
                    state=self.lifecycle.state.value,
                )
                self._view = None
        if not orphans:
            return
        killer = self.episode.killer if self.episode is not None else None
        for pid in (set(cur.tree) | {r.pid for r in (killer.refs if killer else ())}) - {w.pid}:
            self.table.reap(pid)  # adopted orphans (we are their subreaper); not our child otherwise

    def _read_beats(self, now: float, names: Optional[Collection[str]] = None) -> None:
        """Read the current attempt's new lines (in the files named in `names` only, when given): feed the
        deadlines, record what they establish."""
        cur = self.current
        if cur is None:
            return
        torn_before = cur.tail.torn
        state_changed = False  # state.json is written once, after the lines (64 ranks start in one pass)
        lines = cur.tail.read_timed(names)
        if lines:
            self._view = None
        exact = bool(lines) and self.file_times_now and cur.tail.local_times()
        wall_now = time.time() if exact else 0.0
        lo = cur.tail.read_at if cur.tail.read_at is not None else cur.worker.started_at
        cur.tail.read_at = now
        for mtime, rec in lines:
            at = written_at(mtime, wall_now, now, lo) if exact else now
            before = self.deadlines.ranks.get(rec.get("rank") if isinstance(rec.get("rank"), int) else 0)
            left = before.phase if before is not None else None
            tr = self.deadlines.observe(rec, at)
            ev = rec["event"]
            if ev == "start":
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
                if self.lifecycle.state is State.STARTING:
                    self.transition(State.RUNNING, f"start beat from rank {a.rank}", now)
                state_changed = True
            elif ev != "stop" and cur.announced:
                back = cur.follow(rec, self.table)
                if back is not None:
                    log.info(
                        "rank_process_changed",
                        attempt=cur.number,
                        rank=back.rank,
                        pid=rec.get("pid"),
                        note="the process that announced the rank last is gone; this one, which announced it "
                        "before, goes on",
                    )
            if ev in ("step", "checkpoint", "warn") and self.ledger.observe(rec, cur.number):
                state_changed = True  # a checkpoint announced, confirmed or spoiled: state.json says so at once
            if ev == "step":
                self.facts.last_step = rec
                self.policy.observed_step(int(rec["step"]), now)
            elif ev == "phase":
                log.debug("phase", rank=tr.rank, phase=tr.phase, budget_s=tr.phase_budget, step=tr.step)
                self.status_note(now, force=True)
            elif ev == "warn":
                log.warning("worker_warning", rank=tr.rank, message=rec.get("message"), step=tr.step)
            elif ev == "stop":
                cur.stop_lines[tr.rank] = {"reason": rec.get("reason"), "code": rec.get("code")}
                log.info(
                    "worker_stop_line",
                    rank=tr.rank,
                    reason=rec.get("reason"),
                    step=tr.step,
                    **({"code": rec["code"]} if "code" in rec else {}),
                )
                if all(t.stopped for t in self.deadlines.ranks.values()):
                    # No per-rank deadline applies after `stop`; a process that then hangs on its way
                    # out (a non-daemon thread, CUDA/NCCL teardown) is still caught.
                    wd = self.watchdog_cfg
                    self.deadlines.arm_extra(
                        "exit", now, wd.exit_after_stop_s + wd.term_grace_s, "exit after stop line"
                    )
            for c in self.concerns:
                c.beat(cur, tr, rec, left, at, now)
        if cur.tail.torn != torn_before:
            self.facts.torn_lines += cur.tail.torn - torn_before
            log.warning(
                "torn_heartbeat_lines",
                count=cur.tail.torn - torn_before,
                total=self.facts.torn_lines,
                example=cur.tail.torn_examples[-1] if cur.tail.torn_examples else None,
            )
        if state_changed:
            self.write_state(now, force=True)
        self.save_calibration(only_if_changed=True, now=now)

    def _read_output(self, now: float, force: bool = False) -> None:
        """The current attempt's new output (at most every OUTPUT_READ_S unless `force`d: a chatty log is not read
        on every heartbeat): when it grew, and progress lines, into the deadlines.  A worker that never beat but
        shows progress in its output is running."""
        cur = self.current
        if cur is None or cur.output is None or (not force and now - cur.output_read_at < OUTPUT_READ_S):
            return
        cur.output_read_at = now
        grew, progressed = cur.output.read(now, time.time() if self.file_times_now else None)
        if not grew:
            return
        self.deadlines.output_seen(cur.output.last_output_at, progressed, cur.output.steps_read)
        self._view = None
        if progressed:
            for c in self.concerns:
                c.output_progress(cur, now)
        if progressed and self.lifecycle.state is State.STARTING and not self.deadlines.started:
            self.transition(State.RUNNING, f"progress in its output: {cur.output.last_progress_line[:80]!r}", now)

    def _resumed(self, cur: attempts.Attempt, rec: dict) -> None:
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

    def _busy(self) -> Optional[str]:
        st = self.lifecycle.state
        if st.final:
            return f"the run is over (state {st.value})"
        if self.after_teardown in STOPS:
            return "the supervisor is stopping"
        return None

    def _cmd_status(self, req: dict, now: float) -> dict:
        return {"ok": True, "result": views.status_reply(self.view(now))}

    def _cmd_restart(self, req: dict, now: float) -> dict:
        mode = req.get("mode", "graceful")
        if mode not in ("graceful", "now"):
            return {"ok": False, "error": f"restart mode must be 'graceful' or 'now', got {mode!r}"}
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        st = self.lifecycle.state
        self.after_teardown = Intent.RESTART
        if st.escalating:
            return {
                "ok": True,
                "result": {"accepted": "restart", "mode": mode, "note": f"restarting after the current {st.value}"},
            }
        if st in (State.BACKOFF, State.PAUSED) or not self.worker_alive():
            return {
                "ok": True,
                "result": {"accepted": "restart", "mode": mode, "note": f"starting a worker now (was {st.value})"},
            }
        if mode == "now":
            self.escalate_now = True  # the loop dumps and kills; a graceful restart asks the worker to stop
        return {"ok": True, "result": {"accepted": "restart", "mode": mode, "attempt": self.attempt}}

    def _cmd_stop(self, req: dict, now: float) -> dict:
        st = self.lifecycle.state
        if st.final:
            return {"ok": False, "error": f"the run is over (state {st.value})"}
        self.request_stop("control request")
        return {"ok": True, "result": {"accepted": "stop", "state": st.value}}

    def _cmd_pause(self, req: dict, now: float) -> dict:
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        if self.lifecycle.state is State.PAUSED:
            return {"ok": True, "result": {"accepted": "pause", "note": "already paused"}}
        self.after_teardown = Intent.PAUSE
        self.write_state(now, force=True)  # the pause must survive this supervisor from now on
        return {"ok": True, "result": {"accepted": "pause", "state": self.lifecycle.state.value}}

    def _cmd_resume(self, req: dict, now: float) -> dict:
        st = self.lifecycle.state
        if st is not State.PAUSED and self.after_teardown is not Intent.PAUSE:
            return {"ok": False, "error": f"not paused (state {st.value})"}
        # paused, or a pause still under way: either way a worker runs again once nothing is left of the old one
        self.after_teardown = Intent.RESTART
        self.write_state(now, force=True)
        return {"ok": True, "result": {"accepted": "resume"}}

    def _cmd_dump(self, req: dict, now: float) -> control_requests.Reply:
        grace_s = max(self.watchdog_cfg.dump_grace_s, control_requests.MIN_DUMP_GRACE_S)
        ep = self.episode
        if self.lifecycle.state in (State.STALLED, State.DUMPING) and ep is not None and ep.incident is not None:
            pending = DumpRequest(self.table, grace_s, episode=ep)
        else:
            targets = self.current.dump_targets() if self.worker_alive() else []
            if not targets:
                return {
                    "ok": False,
                    "error": f"no running worker process announced a dump signal (state {self.lifecycle.state.value})",
                }
            pending = DumpRequest(self.table, grace_s, targets)
        self.dump_requests.append(pending)
        return pending

    def _cmd_incidents(self, req: dict, now: float) -> dict:
        return control_requests.incidents_reply(self.incidents, req.get("id"))

    # ================================================================================ 2. deadlines

    def _overdue(self, now: float) -> Optional[Expired]:
        """The deadline that is overdue at `now`, if any.  When this pass read only the files whose
        writes were heard, every file is read before a deadline is believed: a line the events have
        not told of yet must not make a worker look stuck."""
        if not self.lifecycle.state.watched or not self.worker_alive():
            return None
        expired = self.deadlines.check(now)
        if expired is not None and not self._read_all:
            self._read_beats(now)
            self._read_all = True
            expired = self.deadlines.check(now)
        if expired is not None and self.current.output is not None and self.current.output_read_at < now:
            self._read_output(now, force=True)  # output written since the last read must not look like silence
            expired = self.deadlines.check(now)
        if expired is not None and self.nodes.absorbs_overdue(expired, now, self.deadlines, self.current, self.table):
            return None  # torchrun between rounds, or peers still missing at the rendezvous (`nodes`)
        if expired is not None and not self.escalate_now:
            for c in self.concerns:
                if c.overdue(self.current, expired, now):
                    return None  # handled in the worker's process (a runaway generate ended): no stall
        return expired

    # ================================================================================ 3. reconcile

    def _reconcile(self, now: float) -> None:
        """Run the current state's handler until the state settles (each handler moves at most one step),
        then the bookkeeping."""
        for c in self.concerns:
            c.pass_begins(now)
        for _ in range(len(State)):
            st = self.lifecycle.state
            handler = self.handlers.get(st)  # final states have none
            if handler is None:
                break
            handler(now)
            if self.lifecycle.state is st:
                break
        self.dump_requests = [r for r in self.dump_requests if not r.advance(now, self.episode)]
        self._record_no_progress(now)
        self._scan_tree(now)
        self.notify("watchdog", now)
        self._settle(now)
        self.write_state(now)
        self._tell_listeners(now)

    # ---- per state

    def _settle(self, now: float) -> None:
        where = self._where()
        for c in self.concerns:
            c.settled(where, now)

    def on_running(self, now: float) -> None:  # STARTING, RUNNING
        changed, failed = self.nodes.while_running(now, self.incidents, self.facts, self.attempt)
        if changed:
            self.write_state(now, force=True)
        if failed and self.after_teardown is Intent.NONE:
            log.error("peer_failed", why=failed)
            self.after_teardown, self.fail_reason = Intent.PEER_FAILED, failed
        if self.current is None or self.awaiting_rendezvous:
            out = next_outcome(self.after_teardown, None, during="the wait for the rendezvous", reason=self.fail_reason)
            if out is not None and self.awaiting_rendezvous:
                if out.state is not State.STARTING:
                    self.follow(out, now)  # no worker to stop: a stop, a pause, a failed peer end the wait at once
                    return
                self.after_teardown = Intent.NONE  # a restart while waiting to start: it is starting
            self.start_attempt(now)
        elif not self._escalated(now) and self.after_teardown is not Intent.NONE:
            self.graceful_stop(now)

    def on_stopping(self, now: float) -> None:
        if self.term_at is not None and now >= self.term_at and self.worker_alive():
            self.term_at = None  # a SIGINT (SIGHUP, SIGQUIT) the command did not end on: SIGTERM, as a person would
            sent = self.table.signal_group(self.current.worker.pgid, signal.SIGTERM)
            log.info("stop_escalated", signal="SIGTERM", sent=sent, say="the command is still running: SIGTERM")
        if not self._escalated(now) and self.force:
            self.force = False
            self._decided_end(Episode(None, None, now, reason="forced stop"), None, now, send_term=False)

    def _escalated(self, now: float) -> bool:
        """A worker exit, `restart now`, a peer's restart, a concern's reason to end the run or an overdue deadline
        starts an episode (True when one did)."""
        cur = self.current
        for c in self.concerns:  # each pass while a worker runs: a concern may end the run (a diverged resume)
            why = c.while_running(cur, now)
            if why and self.abort is None:
                self.abort = why
        peer = self.nodes.peer_restart()
        if cur.worker.exited:
            self.worker_exited(now)
        elif peer is not None and not self.escalate_now and self.expired is None:
            # A peer node restarted: its ranks are gone from the collective ours wait in.  Dump ours (where they
            # waited), kill, and join the new generation at once.
            gen, notice = peer
            if not cur.announced:  # still at the rendezvous: nothing ran, nothing to dump or report
                node = notice.get("node")
                why = f"peer node {node} restarted into generation {gen} before this attempt's ranks started"
                log.info("rendezvous_moved", node=self.nodes.name, generation=gen, attempt=self.attempt, why=why)
                ep = Episode(None, None, now, reason=why)
                self._decided_end(ep, Decision("restart", f"{why}; joining it"), now, why=why)
                return True
            self._open(Episode.peer(self.tools, cur, self.deadlines, self.facts, now, notice, gen), now)
            self.deadlines.disarm_extra("stop")
            self.transition(State.STALLED, self.episode.reason, now)
        elif self.abort is not None and not self.escalate_now:
            why = self.abort
            ep = Episode(None, None, now, reason=why)
            # a concern's reason to end the run (a diverged resume): running it again would do the same
            fail = Decision("fail", why, exit_code=EXIT_NO_RETRY)
            self._decided_end(ep, fail, now, send_term=False, why=f"ending the run: {why}")
        elif self.escalate_now or self.expired is not None:
            ex = None if self.escalate_now else self.expired
            self.escalate_now = False
            kind = ex.incident_kind if ex else "manual"
            self._open(Episode.stall(self.tools, cur, self.deadlines, self.facts, now, kind, ex), now)
            self.deadlines.disarm_extra("stop")
            self.transition(State.STALLED, self.episode.reason, now)
        else:
            return False
        return True

    def _open(self, ep: Episode, now: float) -> None:
        """An episode begins: the concerns hear of it and add what they know to its incident."""
        self.episode = ep
        fields: dict = {}
        for c in self.concerns:
            fields.update(c.episode_opened(self.current, ep, self.after_teardown, now))
        ep.amend(fields)

    def on_stalled(self, now: float) -> None:
        if self.episode.sample_then_dump(self.tools, self.current, now):
            pids = [t.ref.pid for t in self.episode.dumps.targets]
            self.transition(State.DUMPING, f"snapshot taken; dumps of {pids} under way (signalled at detection)", now)

    def on_dumping(self, now: float) -> None:
        ep = self.episode
        if ep.dumps.advance(now):
            ep.collect_dumps(self.current, now)
            # Several nodes: local evidence first, then the peers hear of it — before anything is killed.
            self.nodes.stall_read(ep, self.current, now)
            # A concern may ask the worker to get out of it in its own process first (`restart.in_process`).
            for c in self.concerns:
                why = c.before_kill(self.current, ep, now)
                if why:
                    self.transition(State.RECOVERING, why, now)
                    return
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
            ep.recovered(cur, self.facts, now)
            inc = ep.incident
            log.warning(
                "recovered_in_process",
                attempt=cur.number,
                incident=inc.id if inc else None,
                kind=ep.kind,
                text=(inc.data.get("summary") if inc else None),
            )
            self.episode = None
            self.expired = None
            self.transition(State.RUNNING, "recovered in the worker's process: the stuck step abandoned", now)

    def on_killing(self, now: float) -> None:
        killer = self.episode.killer
        if self.force and killer.kill_at is None:
            self.force = False
            killer.kill_now(now)
        if not killer.advance(now):
            return
        if self._output_settling(now):
            return  # its last output is on its way into worker.log, which the incident and the decision read
        # Every concern is asked (none may miss the tree's end); one that holds keeps the next attempt from starting
        # on top of what is left (restart.on_unkillable: wait).
        held = [c.hold_teardown(self.current, self.episode, self.after_teardown, now) for c in self.concerns]
        if any(held):
            if not self.holding:
                self.holding = True
                self.status_note(now, force=True)
            return
        self.holding = False
        self.finish_episode(now)

    def _output_settling(self, now: float) -> bool:
        """The tree is gone but the relay has not yet copied the last of its output (at most OUTPUT_SETTLE_S: a
        descendant that escaped the tree may hold a stream open)."""
        if not self.current.worker.output_open():
            self._settle_since = None
            return False
        self._settle_since = self._settle_since if self._settle_since is not None else now
        return now - self._settle_since < OUTPUT_SETTLE_S

    def on_backoff(self, now: float) -> None:
        out = next_outcome(self.after_teardown, None, during="backoff", reason=self.fail_reason)
        if out is not None:
            self.follow(out, now)
        elif self.backoff_until is None or now >= self.backoff_until:
            self.start_attempt(now)

    def on_paused(self, now: float) -> None:
        out = next_outcome(self.after_teardown, None, during="paused", reason=self.fail_reason)
        if out is not None and out.state is not State.PAUSED:
            self.follow(out, now)

    # ---- actions

    def start_attempt(self, now: float) -> None:
        number = self.attempt + 1
        if not self.nodes.ready_for_attempt(now):
            # Several nodes: no torchrun before the store is reached and — after a failure — a new generation
            # exists (the old one's rendezvous may be closed); the peer link wakes the loop when it is.
            self._await_rendezvous(f"attempt {number}: waiting for the rendezvous store and a new generation", now)
            return
        if self.cfg.worker.command is not None and set_aside_bad(self.ledger.ledger, self.cfg.worker.cwd):
            self.ledger.save()  # where they went, on record (the built-in worker skips bad ones itself: left in place)
        resume, step = resume_choice(self.ledger.ledger, self.cfg.worker.cwd, number)
        chosen = resume
        settled, resume = self.nodes.resume_point({"path": resume, "step": step} if resume else None, now)
        if not settled:  # the store answers within a pass or two; the peer link wakes the loop
            self._await_rendezvous(f"attempt {number}: agreeing on the resume point", now)
            return
        resume_step = step if resume == chosen else None  # the peers agreed on another: its step is theirs
        self.awaiting_rendezvous = False
        if self.current is not None:
            self.facts.restarts += 1
        self.attempt = number
        if self.lifecycle.state is not State.STARTING:
            self.transition(State.STARTING, f"attempt {number}", now)
        self.episode, self.backoff_until, self.expired, self.escalate_now = None, None, None, False
        self.abort, self.holding, self.by_itself, self.term_at = None, False, False, None
        try:
            self.current = attempts.start(
                self.cfg,
                number,
                self.config_path,
                self.spawn,
                now,
                fs=self.fs,
                resume_from=resume,
                take_standby=self._take_worker,
                rdzv_id=self.nodes.rdzv_id(),
                resume_step=resume_step,
            )
            for c in self.concerns:
                self.current.foreign |= c.own_pids()  # a concern's processes (standbys) are not the tree's orphans
            if self.nodes.helper_pid:
                self.current.foreign.add(self.nodes.helper_pid)  # the peer-link helper: ours, not the tree's
            self.current.oom_kills_at_start = self.tools.kernel.oom_kills()
            for c in self.concerns:
                c.attempt_started(self.current, resume_step, now)
        except OSError as exc:
            self.current = None
            if disk_error(exc):  # the attempt's directory or log cannot be made: the disk, not the config
                self.write_failed(exc, Path(exc.filename or attempt_dir(self.run_dir, number)))
                self.follow(Outcome(State.FAILED, self.fail_reason, EXIT_IOERR), now)
                return
            spawn_failed_incident(
                self.incidents,
                number,
                attempts.worker_argv(self.cfg, self.config_path),
                self.cfg.worker.cwd,
                exc,
                self.facts,
            )
            self.follow(Outcome(State.FAILED, f"cannot start the worker: {exc}", EXIT_CONFIG), now)
            return
        self.deadlines.arm_startup(now)
        self.policy.attempt_started(now, last_good_step=self.facts.last_good_step)
        self.nodes.spawned(number, now)
        w = self.current.worker
        log.info(
            "worker_spawned",
            attempt=number,
            pid=w.pid,
            argv=w.argv,
            log=str(w.log_path),
            prewarmed=self.current.prewarmed,
            instrumentation=self.instrumentation,
        )
        if not self._ready_sent:  # systemd hears READY once
            self._ready_sent = True
            self.notify("ready")
        self._view = None
        self.write_state(now, force=True)  # state.json records the new tree

    def _take_worker(self, number: int, adir: Path, resume_from: str, now: float):
        """A worker a concern already loaded for this attempt (a prewarmed standby), or None: spawn one."""
        for c in self.concerns:
            w = c.take_worker(number, adir, resume_from, now)
            if w is not None:
                return w
        return None

    def _await_rendezvous(self, why: str, now: float) -> None:
        if self.lifecycle.state is not State.STARTING:
            self.transition(State.STARTING, why, now)
        self.awaiting_rendezvous = True

    def graceful_stop(self, now: float) -> None:
        self.transition(State.STOPPING, f"{self.after_teardown.value} requested", now)
        w = self.current.worker
        how = stop_signals.passing(self.stop_signal, self.transparent)
        sent = self.table.signal_group(w.pgid, how.send) if how.group else self.table.signal(w.ref, how.send)
        budget, source = self.deadlines.step_budget()
        grace = self.watchdog_cfg.term_grace_s
        self.term_at = now + grace if how.term_after_grace else None
        bound = grace * (2 if how.term_after_grace else 1) + budget
        self.deadlines.arm_extra("stop", now, bound, f"term_grace + {source} step budget")
        name = signal.Signals(how.send).name
        log.info(
            "graceful_stop",
            intent=self.after_teardown.value,
            pid=w.pid,
            signal=name,
            sent=sent,
            bound_s=round(bound, 3),
            say=stop_signals.words(how, self.stopped_by, self.transparent) if self.stop_signal else None,
        )
        for c in self.concerns:
            c.stop_requested(self.current, self.after_teardown, now)

    def worker_exited(self, now: float) -> None:
        if self._output_settling(now):
            return  # its last words (a traceback) are on their way into worker.log, which classifies the exit
        cur, w = self.current, self.current.worker
        if self.lifecycle.state is State.STOPPING:
            self.by_itself = self.stop_answered = True  # its answer to the stop it was passed
            stopping = f"graceful stop ({self.after_teardown.value})"
            ep = Episode.exited(self.tools, cur, self.deadlines, self.facts, now, stopping=stopping)
            # the stop came as the last step was done: the work is complete, the run finished (not to be run again)
            ep.decision = done_before_stop(w.exit_code, cur.stop_reason(self.deadlines.main_rank()))
            self._open(ep, now)
            self.begin_kill(self.episode, now, why="worker exited; ending what is left of its tree")
            return
        self.by_itself = True
        stop_reason = cur.stop_reason(self.deadlines.main_rank())
        code = w.exit_code if w.exit_signal is None else None
        free = self.nodes.exit_cause(cur, code, stop_reason)  # several nodes: a peer's doing, not this node's
        # A signal after every rank said it had finished: a crash in the process's teardown, not a failed run
        done = None if free is not None else teardown_crash_of(cur, self.deadlines.ranks)
        if done is not None:
            log.warning("worker_teardown_crash", attempt=cur.number, why=done)
        # torchrun exits 1 for a rank's configuration, data or disk error: the ranks' last words and torchrun's
        # root-cause report keep the run from restarting it for ever
        decision = free or self.policy.on_exit(
            now,
            code,
            stop_reason,
            own_command=self.cfg.worker.command is not None,
            no_retry=no_retry(cur) if done is None else None,
            teardown=done,
        )
        if free is not None and code == 0:  # a clean stop a peer's stop caused: nothing failed here
            ep = Episode(None, None, now, reason=decision.reason)
        else:
            ep = Episode.exited(self.tools, cur, self.deadlines, self.facts, now, decision=decision)
        self._decide(ep, decision, now)  # an OOM's remedy replaces the policy's restart
        if ep.incident is not None:
            self.nodes.exit_read(ep, decision, cur, now)
        self._open(ep, now)
        self.begin_kill(ep, now, why="worker exited; ending what is left of its tree")

    def _decided_end(
        self, ep: Episode, decision: Optional[Decision], now: float, send_term: bool = True, why: Optional[str] = None
    ) -> None:
        """An end the loop decides itself (a forced stop, a concern's reason to end the run, a peer's new generation
        before this attempt's ranks started): no detection, no incident; the tree is killed (`begin_kill` makes it
        the current episode)."""
        self._decide(ep, decision, now)
        self.begin_kill(ep, now, send_term=send_term, why=why)

    def _decide(self, ep: Episode, base: Optional[Decision], now: float, tree_gone: bool = False) -> None:
        """The one writer of an episode's decision: `base` (the restart policy's on an exit, the loop's own), then
        each concern's replacement (an OOM's remedy, a failure that cannot be survived); once the tree is gone and
        nothing decided it — no request either — the nodes (a peer's doing), then the policy on a failure."""
        decision = base
        for c in self.concerns:
            decision = c.decision(self.current, ep, decision, now) or decision
        if decision is None and tree_gone and self.after_teardown is Intent.NONE:
            if ep.kind:
                decision = self.nodes.stall_cause(ep, now)  # several nodes: free when the culprit is elsewhere
            if decision is None:
                done = ep.work_done  # every rank had finished: the way out hung
                decision = Decision("finish", done) if done is not None else self.policy.on_failure(now, ep.reason)
        ep.decision = decision

    def begin_kill(self, ep: Episode, now: float, send_term: bool = True, why: Optional[str] = None) -> None:
        self.episode = ep
        ep.begin_kill(self.tools, self.current, now, send_term)
        self.deadlines.disarm_extra("stop")
        self.transition(
            State.KILLING, why or ("SIGTERM to the process group" if send_term else "SIGKILL to the tree"), now
        )

    def finish_episode(self, now: float) -> None:
        """The tree is gone: decide what follows, complete the incident, go there."""
        ep, cur = self.episode, self.current
        cur.tail.finish()
        if cur.output is not None:
            self._read_output(now, force=True)  # its last words: where its own output says it ended
            cur.output.close()
        self.ledger.attempt_ended(cur.number)  # what it left unconfirmed stays unconfirmed
        for c in self.concerns:
            c.attempt_ended(cur, ep, now)
        self.save_calibration()
        self._decide(ep, ep.decision, now, tree_gone=True)
        out = next_outcome(self.after_teardown, ep.decision, cur.worker.exit_code, reason=self.fail_reason)
        ep.finish(cur, self.facts, now, out.state.value, out.why, self.deadlines.main_rank())
        log.info(
            "tree_gone",
            attempt=self.attempt,
            next=out.state.value,
            why=out.why,
            gone_after_s=ep.killer.timings()["tree_gone_after_s"],
        )
        self.episode = None
        if out.state is State.FAILED and ep.decision is not None and ep.decision.crash_loop:
            crash_loop_incident(self.incidents, self.attempt, ep.decision, self.policy, self.cfg.restart, self.facts)
        self.follow(out, now, ep.decision)

    def follow(self, out: Outcome, now: float, decision: Optional[Decision] = None) -> None:
        """Go where the outcome says: a new attempt now or after a backoff, paused, or a final state."""
        for c in self.concerns:
            c.outcome(out, now)
        if out.state is State.STARTING:
            self.after_teardown = Intent.NONE
            self.start_attempt(now)
        elif out.state is State.BACKOFF:
            self.backoff_until = now + out.delay_s
            self.transition(State.BACKOFF, out.why, now)
        elif out.state is State.PAUSED:
            self.after_teardown = Intent.NONE
            self.transition(State.PAUSED, out.why, now)
        else:
            self.finish(out, now, decision)

    def finish(self, out: Outcome, now: float, decision: Optional[Decision] = None) -> None:
        """A final state; `decision`: the episode's that led here (what the run's exit status follows)."""
        w = self.current.worker if self.current is not None else None
        self.exit_code = run_exit_status(
            out,
            decision,
            code=w.exit_code if w and (out.state is not State.STOPPED or self.stop_answered) else None,
            signum=w.exit_signal if w else None,
            by_itself=self.by_itself,
            stop_signal=self.stop_signal,
            transparent=self.transparent,
        )
        if out.state is not State.FAILED:
            self.notify("stopping")
        stopped_by = f" ({self.stopped_by})" if out.state is State.STOPPED and self.stopped_by else ""
        self.transition(out.state, out.why + stopped_by, now)

    def _record_no_progress(self, now: float) -> None:
        """The policy gave up for lack of progress: the run's final incident (after the failure's own)."""
        gave_up = getattr(self.policy, "gave_up", None)
        if gave_up is None or self.no_progress_recorded:
            return
        self.no_progress_recorded = True
        inc = self.incidents.create(
            "no_progress",
            attempt=self.attempt,
            phase=None,
            step=gave_up["attempt_top_step"],
            classification="no progress",
            summary=gave_up["reason"],
            status="final",
            last_incident=self.facts.last_incident,
            last_good_checkpoint=self.facts.last_good_checkpoint,
            **gave_up,
        )
        self.facts.note_incident(inc)
        self._view = None
        log.error("no_progress", incident=inc.id, reason=gave_up["reason"])

    # ================================================================================ bookkeeping

    def view(self, now: float) -> View:
        """The read model at `now`: built once per pass, again only when the state moved within it."""
        v = self._view
        if v is not None and v.now == now:
            return v
        st, cur, dl, facts = self.lifecycle.state, self.current, self.deadlines, self.facts
        watching = st.watched and self.worker_alive()
        last = dict(facts.last_step)
        if self._healing is None:
            self._healing = healing_fields(self.run_dir)
        if self._socket is None:
            self._socket = str(getattr(self.control, "path", None) or socket_path_for(self.cfg, self.run_dir))
        extra: dict = {}
        for c in self.concerns:  # the goodput ledger, the standby
            extra.update(c.readers(now))
        readers = views.Readers(
            ranks=lambda: tuple(t for _, t in sorted(dl.ranks.items())) if cur else (),
            deadlines=lambda: tuple(dl.active(now)) if watching else (),
            announced=lambda: cur.announced_refs() if cur else {},
            descendants=lambda: tuple(cur.tree.values()) if cur else (),
            stragglers=lambda: cur.stragglers.status() if cur else {},
            incidents=self.incidents.count,
            gpu=lambda: self.gpu.summary(now),
            queue=lambda: queue_status(self.run_dir) if self.cfg.data.inbox else None,
            output=lambda: cur.output.evidence(now) if cur is not None and cur.output is not None else None,
            budgets=dl.phase_budgets,
            waiting_for_input=lambda: first_reading([cur.worker.pid, *cur.tree]) if watching else None,
            **extra,
        )
        v = View(
            now=now,
            state=st,
            intent=self.after_teardown,
            attempt=self.attempt,
            exit_code=self.exit_code,
            worker=cur.worker if cur else None,
            watching=watching,
            main=dl.ranks.get(dl.main_rank()),
            restarts=facts.restarts,
            last_step=last,
            last_good_checkpoint=facts.last_good_checkpoint,
            last_good_step=facts.last_good_step,
            last_incident=facts.last_incident,
            torn_lines=facts.torn_lines,
            max_steps=views.max_steps(last, self.cfg.train.max_steps if self.cfg.worker.command is None else None),
            backoff_remaining_s=round(max(0.0, self.backoff_until - now), 3)
            if self.backoff_until is not None and st is State.BACKOFF
            else None,
            step_budget=dl.step_budget(),
            calibration_samples=len(self.calibration.step_samples),
            uptime_s=now - self.started_at,
            run_dir=str(self.run_dir),
            config=str(self.cfg._source or self.config_path),
            socket=self._socket,
            readers=readers,
            healing=dict(self._healing),
            nodes=self.nodes.status(),
        )
        self._view = v
        return v

    def transition(self, dst: State, why: str, now: float) -> None:
        src = self.lifecycle.state
        self.lifecycle.transition(dst, why)
        self._view = None
        if dst.final:
            self.nodes.ended(dst.value, why)
        log.info("state", frm=src.value, to=dst.value, why=why, attempt=self.attempt)
        self.status_note(now, force=True)
        self.write_state(now, force=True)

    def _scan_tree(self, now: float) -> None:
        cur = self.current
        if (
            cur is None
            or cur.worker.exited
            or now - cur.last_tree_scan < TREE_SCAN_S
            or not self.lifecycle.state.watched
        ):
            return
        cur.last_tree_scan = now
        if cur.scan_tree(self.table, self._subreaper):
            self._view = None
            self.write_state(now, force=True)

    def status_note(self, now: float, force: bool = False) -> None:
        """systemd's STATUS= line (at most every STATUS_NOTE_S unless forced)."""
        if force or now - self._last_status_note >= STATUS_NOTE_S:
            self._last_status_note = now
            self.notify("status", views.status_line(self.view(now)))

    def notify(self, what: str, *args) -> None:
        try:
            getattr(self.notifier, what)(*args)
        except Exception:  # systemd notification is a courtesy: never fatal
            log.exception("notify_failed", what=what)

    def _tell_listeners(self, now: float) -> None:
        """The ops side hears of every pass, with the read model (alerts, the dead-man's ping, metrics)."""
        if not self.listeners:
            return
        v = self.view(now)
        for listener in self.listeners:
            try:
                listener.pass_done(v, now)
            except Exception:  # an observer must never take the loop down
                log.exception("listener_failed", listener=type(listener).__name__)

    def save_calibration(self, only_if_changed: bool = False, now: Optional[float] = None) -> None:
        """Persist the calibration (`Calibration.persist`: new samples at most every CALIBRATION_SAVE_S)."""
        self.calibration.persist(only_if_changed, now, CALIBRATION_SAVE_S)

    def write_failed(self, exc: OSError, path: Path) -> None:
        """A write in the run dir failed.  Said on stderr first (the log file may be on the same disk);
        when it is the disk's fault (full, read-only, I/O error) the run cannot go on: the worker is
        stopped (it checkpoints if it still can; the last good checkpoint is never touched) and the run
        ends `failed`, exit 74, its reason naming the path.  Resuming is `hangwatch run` once there is room."""
        what = describe_write_error(exc, path)
        print(f"hangwatch: cannot write {path}: {exc}", file=sys.stderr, flush=True)
        log.error("write_failed", path=str(path), error=str(exc))
        if disk_error(exc) and self.fail_reason is None and not self.lifecycle.state.final:
            self.fail_reason = what
            self.after_teardown = Intent.FAIL
            log.error("run_cannot_go_on", why=what)

    def write_state(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_state_write < STATE_WRITE_S:
            return
        self._last_state_write = now
        if (
            force or self.lifecycle.state.final or self._healing is None
        ):  # self-healing's record: read when it can change
            self._healing = healing_fields(self.run_dir)
            self._view = None
        data = views.state_record(self.view(now), self.table.ref_of(os.getpid()), why=self.lifecycle.reason or None)
        self.nodes.offer(self.facts.last_good_checkpoint, self.facts.last_good_step)  # for the peers' resume choice
        try:
            run_state.write(self.state_path, data, fs=self.fs)
        except OSError as exc:
            self.write_failed(exc, self.state_path)


def notifier_due(notifier: Any, now: float) -> Optional[float]:
    """Seconds until the notifier wants its next `watchdog` call (systemd's WatchdogSec, a ping), if it says."""
    due = getattr(notifier, "next_due_s", None)
    try:
        value = due(now) if callable(due) else getattr(notifier, "watchdog_interval_s", None)
    except Exception:  # a courtesy: never a reason to stop the loop
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
