"""The supervisor's loop: launch the worker, watch its heartbeats, escalate stalls, restart, stop cleanly.

    hangwatch run CONFIG [--run-dir DIR]      (wired by `hangwatch.supervisor.app`)

Lifecycle: see `supervisor.states`.  One pass (`run_once(now)`), always in this order:
    1. drain events — recorded signals, child exits (reaped here and nowhere else), heartbeat lines,
       control requests.  Draining only records facts and intents; it never signals, spawns, kills
       or writes an incident.  Exits are reaped before lines are read, so a dead worker's last lines
       (`stop`, a final step) are read in the pass that sees it dead;
    2. check deadlines on the supervisor's own monotonic clock (a gap in the loop's own clock — this
       process was suspended — extends every deadline instead of firing it);
    3. reconcile: the handler of the current state (`{State: handler}`, `reconcile.Reconciler`) acts —
       spawn, snapshot and dump, signal, kill, write the incident, back off — until the state settles;
       then in-flight `dump` requests advance and the bookkeeping runs (tree scan, sd_notify, state.json).
Every time comes from the `now` the pass was given; only `run()` reads the clock, so a fake clock,
a fake process table and a fake spawn drive the whole lifecycle without a process.

Between passes the loop sleeps (`wakeup.Wakeup.wait`) until something needs a pass: a signal, a
heartbeat write (coalesced: one pass reads every new line of every rank), a control request, or the
earliest deadline (`next_wait`: the selector's timeout is the time to it, not a fixed period).  A
supervisor with nothing due sleeps up to IDLE_WAIT_S; only while escalating does it pass on a short
period (FAST_PASS_S), and only where a heartbeat write or a request cannot wake it (no inotify, a
control server without a descriptor) does it fall back to `watchdog.poll_interval_s`.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.config import Config, dump_config
from hangwatch.common.durable import FsOps, describe_write_error, disk_error
from hangwatch.common.exitcodes import EXIT_FAILED, EXIT_IOERR, EXIT_OK
from hangwatch.common.rundir import CALIBRATION_NAME, CONFIG_NAME, STATE_NAME, next_attempt
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.loop import beats
from hangwatch.supervisor.processes import leftovers
from hangwatch.supervisor.ops import logsetup
from hangwatch.supervisor.loop import pacing
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.records import remediation
from hangwatch.supervisor.processes import snapshot as snapshots
from hangwatch.supervisor.records import statefile
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.records.checkpoint_ledger import PersistedLedger
from hangwatch.supervisor.loop.commands import Commands, DumpRequest, status_line
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired, SuspensionDetector
from hangwatch.supervisor.episode.episode import Episode, Tools
from hangwatch.supervisor.incidents import IncidentStore, signal_name
from hangwatch.supervisor.nodes.nodes import Nodes
from hangwatch.supervisor.ops.notify import NullNotifier
from hangwatch.supervisor.nodes.peers import SpawnHelper, spawn_helper
from hangwatch.supervisor.loop.outcome import Intent
from hangwatch.supervisor.loop.policy import RestartPolicy
from hangwatch.supervisor.records.resume import resume_choice
from hangwatch.supervisor.loop.reconcile import Reconciler
from hangwatch.supervisor.loop.states import State, StateMachine
from hangwatch.supervisor.loop.pacing import WATCHED
from hangwatch.supervisor.loop.wakeup import Wakeup

log = structlog.get_logger("hangwatch")

TREE_SCAN_S = 5.0  # how often descendants are re-listed (to find those that leave the group); in passes, never a wake-up
STATE_WRITE_S = 5.0
STATUS_NOTE_S = 10.0
REAP_EVERY_S = 1.0  # a running worker is waited for at least this often even without a SIGCHLD
CALIBRATION_SAVE_S = 30.0  # new step samples reach calibration.json at most this often (and at every attempt end)
_UNASKED = object()


class Supervisor:
    def __init__(self, cfg: Config, *, clock: Callable[[], float] = time.monotonic, spawn: attempts.Spawn = process.spawn,
                 kill: process.Kill = os.kill, table: Optional[process.ProcessTable] = None, control: Any = None,
                 notifier: Any = None, snapshot: Callable[..., Any] = snapshots.TreeSample,
                 gpu: Callable[[], dict] = snapshots.gpu, gpu_pids: Callable[[], Optional[set]] = snapshots.gpu_pids,
                 wakeup: Optional[Wakeup] = None, install_signals: bool = True, subreaper: bool = False,
                 cpu_sample_s: float = 0.5, end_leftovers: bool = True, fs: Optional[FsOps] = None,
                 policy: Optional[RestartPolicy] = None, file_times: Optional[bool] = None,
                 peer_spawn: Optional[SpawnHelper] = None):
        """Seams only; no I/O (that is `prepare`).  `file_times`: date heartbeat lines by their files'
        modification times (`beats`); by default only on the real clock, to which those times relate."""
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
        self.tools = Tools(self.table, self.incidents, wd, snapshot, self.gpu, gpu_pids, cpu_sample_s, subreaper)
        self.commands = Commands(self)
        self.ledger = PersistedLedger(self.run_dir, cfg.checkpoint.confirm_steps, fs=self.fs)  # announced checkpoints
        self.facts = statefile.RunFacts(checkpoints=self.ledger.ledger)

        self.attempt = 0  # the number of the current (or last) attempt
        self.current: Optional[attempts.Attempt] = None
        self.episode: Optional[Episode] = None  # the failure (or end) being handled until the tree is gone
        self.after_teardown = Intent.NONE  # what an operator asked to follow the current worker
        self.force = False  # a second stop: kill without waiting
        self.escalate_now = False  # `restart now`: dump and kill
        self.awaiting_rendezvous = False  # multi-node: the next attempt waits for the store / a new generation
        self.expired: Optional[Expired] = None  # this pass's overdue deadline
        self._read_all = True  # this pass read every heartbeat file (not only those the file events named)
        self._last_reap = float("-inf")
        self._control_fd_value: Any = _UNASKED
        self.backoff_until: Optional[float] = None
        self.dump_requests: list[DumpRequest] = []
        self.exit_code = EXIT_OK
        self.fail_reason: Optional[str] = None  # why the run must end failed (the disk refused a write)
        self.started_at = 0.0
        self._ready_sent = False
        self._last_state_write = self._last_status_note = float("-inf")
        self._healing: Optional[dict] = None  # state.json's remediation/quarantine fields, as last read
        # Several nodes: the peer link and this node's part in the run (`supervisor.nodes`); None on one node.
        self.nodes = (Nodes(cfg, self.run_dir, spawn=peer_spawn or spawn_helper, poke=self.wakeup.poke)
                      if cfg.worker.nnodes > 1 else None)
        self.reconcile = Reconciler(self)

    # ================================================================================ set-up and loop

    def prepare(self, now: float) -> Optional[str]:
        """The set-up's I/O: the run dir, a previous supervisor's state and leftovers, calibration,
        config.yaml.  Returns why the supervisor must not run, or None."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.started_at = now
        previous, problem = statefile.read(self.state_path)
        if problem:
            log.warning("state_unreadable", problem=problem)
        problem = self.ledger.load()
        if problem:  # the run goes on without its record: every checkpoint must earn its place again
            print(f"hangwatch: warning: {problem}", file=sys.stderr, flush=True)
            log.warning("checkpoint_ledger_unreadable", problem=problem)
        known = bool(self.ledger.ledger.entries)
        self.facts = statefile.RunFacts.from_previous(previous, self.ledger.ledger)
        if self.ledger.ledger.entries and not known:  # seeded from an older supervisor's state.json
            self.ledger.save()
        problem = leftovers.clear(previous or {}, self.table, state_path=self.state_path,
                                  grace_s=self.watchdog_cfg.term_grace_s, end_leftovers=self._end_leftovers)
        if problem:
            return problem
        problem = self.calibration.reload()
        if problem:
            log.warning("calibration_ignored", problem=problem)
        self.attempt = next_attempt(self.run_dir) - 1
        try:
            self.fs.write_file(self.config_path, dump_config(self.cfg).encode())
        except OSError as exc:
            self.exit_code = EXIT_IOERR if disk_error(exc) else EXIT_FAILED
            return f"cannot write {self.config_path}: {describe_write_error(exc, self.config_path)}"
        if statefile.paused_before(previous):
            # A pause outlives the supervisor: start paused; `resume` starts a worker.
            self.transition(State.PAUSED, "paused before this supervisor started (state.json)", now)
        if self._subreaper:
            process.set_child_subreaper()
        if self.nodes is not None:
            self.nodes.start(now)
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
            log.warning("heartbeat_events_unavailable", problem=self.wakeup.events_problem,
                        note=f"heartbeat files are read every {self.watchdog_cfg.poll_interval_s:g} s instead")
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
            self.write_state(self.clock(), force=True)
            self._teardown()
        log.info("supervisor_exit", state=self.lifecycle.state.value, exit_code=self.exit_code)
        return self.exit_code

    def run_once(self, now: float) -> None:
        """One pass at `now`: drain events, check deadlines, reconcile."""
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
        # 2. deadlines: only recorded here; the reconcile step opens the episode
        self.expired = self._overdue(now)
        self._reconcile(now)

    def next_wait(self, now: float) -> float:
        """How long the loop may sleep from `now`: until the earliest thing due — a deadline, the end of
        a backoff, the notifier's next watchdog ping — and at most IDLE_WAIT_S; FAST_PASS_S while
        escalating; `poll_interval_s` where a heartbeat write or a control request could not wake it.
        The planned wake-up is handed to the suspension detector (a pass much later than planned means
        this process was not running)."""
        wait = pacing.next_wait(self, now)
        self.suspension.expect(now + wait)
        return wait

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
        self.reconcile.prewarm.close(self.clock())  # a standby nobody will release: killed and reaped
        self.wakeup.close()
        if self.nodes is not None:
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
            if sig in (signal.SIGTERM, signal.SIGINT):
                self.request_stop(signal.Signals(sig).name)
            elif sig == signal.SIGHUP:
                logsetup.reopen()
                log.info("log_reopened", why="SIGHUP")
        heard = signal.SIGCHLD in signals or not self.wakeup.signals_installed
        if heard or now - self._last_reap >= REAP_EVERY_S or self.lifecycle.state not in (State.STARTING, State.RUNNING):
            self._last_reap = now
            self._reap(now, orphans=heard or self.lifecycle.state not in (State.STARTING, State.RUNNING))
        if self.nodes is not None:
            self.nodes.poll(now)  # what the peer link heard: the generation, peers' notices and records
            if self.current is not None and self.nodes.link.pid:
                self.current.foreign.add(self.nodes.link.pid)  # our child, never an orphan of the worker's tree
        grown = self.wakeup.grown()  # the heartbeat files the file events said grew (None: read them all)
        if self.current is not None and self.current.worker.exited:
            grown = None  # an ended worker's last lines (its last step, its stop) decide what its end means
        beats.read(self, now, grown)
        self._read_all = grown is None
        if self.control is not None:
            try:
                self.control.poll(lambda req: self.commands.handle(req, now))
            except Exception:  # a broken control channel must not take the training run down with it
                log.exception("control_poll_failed")

    def request_stop(self, why: str = "requested") -> None:
        """Ask the worker to checkpoint and stop, then exit 0; a second request kills at once."""
        if self.after_teardown is Intent.EXIT:
            self.force = True
            log.warning("stop_forced", why=why)
            return
        self.after_teardown = Intent.EXIT
        log.info("stop_requested", why=why, state=self.lifecycle.state.value)
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
                log.info("worker_exited", attempt=cur.number, pid=w.pid, code=w.exit_code,
                         signal=signal_name(w.exit_signal), state=self.lifecycle.state.value)
        if not orphans:
            return
        killer = self.episode.killer if self.episode is not None else None
        for pid in (set(cur.tree) | {r.pid for r in (killer.refs if killer else ())}) - {w.pid}:
            self.table.reap(pid)  # adopted orphans (we are their subreaper); not our child otherwise

    # ================================================================================ 2. deadlines

    def _overdue(self, now: float) -> Optional[Expired]:
        """The deadline that is overdue at `now`, if any.  When this pass read only the files whose
        writes were heard, every file is read before a deadline is believed: a line the events have
        not told of yet must not make a worker look stuck."""
        if self.lifecycle.state not in WATCHED or not self.worker_alive():
            return None
        expired = self.deadlines.check(now)
        if expired is not None and not self._read_all:
            beats.read(self, now)
            self._read_all = True
            expired = self.deadlines.check(now)
        if expired is not None and self.nodes is not None and self.nodes.holds(expired, now, self.deadlines, self.current,
                                                                                 self.table):
            return None  # torchrun between rounds, or peers still missing at the rendezvous (`nodes.Nodes.holds`)
        return expired

    # ================================================================================ 3. reconcile

    def _reconcile(self, now: float) -> None:
        self.reconcile(now)  # the current state's handler: {State: handler} in `reconcile.Reconciler`
        self.dump_requests = [r for r in self.dump_requests if not r.advance(now, self.episode)]
        self._scan_tree(now)
        self.notify("watchdog", now)
        self.write_state(now)

    # ================================================================================ bookkeeping

    def spawned(self, now: float) -> None:
        """A worker was spawned: systemd hears READY once, state.json records the new tree."""
        if not self._ready_sent:
            self._ready_sent = True
            self.notify("ready")
        self.write_state(now, force=True)

    def resume_entry(self, attempt: int) -> tuple[str, Optional[int]]:
        """What attempt `attempt` resumes from (HANGWATCH_RESUME_FROM): (the newest good checkpoint still on disk,
        its step), ("", None) for none (`resume.resume_choice`).  Several nodes: the one agreed for the
        generation is used instead (`reconcile.start_attempt`, `nodes.Nodes.agreed_resume`)."""
        return resume_choice(self.ledger.ledger, self.cfg.worker.cwd, attempt)

    def transition(self, dst: State, why: str, now: float) -> None:
        src = self.lifecycle.state
        self.lifecycle.transition(dst, why)
        if dst.final and self.nodes is not None:
            self.nodes.ended(dst.value, why)
        log.info("state", frm=src.value, to=dst.value, why=why, attempt=self.attempt)
        self.status_note(now, force=True)
        self.write_state(now, force=True)

    def _scan_tree(self, now: float) -> None:
        cur = self.current
        if cur is None or cur.worker.exited or now - cur.last_tree_scan < TREE_SCAN_S or self.lifecycle.state not in WATCHED:
            return
        cur.last_tree_scan = now
        if cur.scan_tree(self.table, self._subreaper):
            self.write_state(now, force=True)

    def status_note(self, now: float, force: bool = False) -> None:
        """systemd's STATUS= line (at most every STATUS_NOTE_S unless forced)."""
        if force or now - self._last_status_note >= STATUS_NOTE_S:
            self._last_status_note = now
            self.notify("status", status_line(self))

    def notify(self, what: str, *args) -> None:
        try:
            getattr(self.notifier, what)(*args)
        except Exception:  # systemd notification is a courtesy: never fatal
            log.exception("notify_failed", what=what)

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
        if force or self.lifecycle.state.final or self._healing is None:  # self-healing's record: read when it can change
            self._healing = remediation.state_fields(self.run_dir)
        data = statefile.of_supervisor(self, self._healing)
        if self.nodes is not None:
            self.nodes.offer(self.facts.last_good_checkpoint, self.facts.last_good_step)  # for the peers' resume choice
        try:
            statefile.write(self.state_path, data, fs=self.fs)
        except OSError as exc:
            self.write_failed(exc, self.state_path)
