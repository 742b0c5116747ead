"""The supervisor: launch the worker, watch its heartbeats, escalate stalls, restart, stop cleanly.

    hangwatch run CONFIG [--run-dir DIR]      (wired by `hangwatch.supervisor.app`)

Lifecycle (see `supervisor.states` for the full table):
    STARTING → RUNNING → (deadline) STALLED → DUMPING → KILLING → BACKOFF → STARTING → …
    RUNNING → (worker exited) KILLING → BACKOFF | FINISHED | FAILED
    any → STOPPING (SIGTERM/SIGINT, `stop`, `pause`, graceful `restart`) → KILLING → STOPPED | PAUSED | STARTING

One pass of the main loop, always in this order:
    1. drain events — recorded signals, new heartbeat lines, control requests, child exits;
    2. check deadlines (with the supervisor's own monotonic clock; a gap in the loop's own clock,
       i.e. this process was suspended, extends every deadline instead of firing it);
    3. bring processes in line with the desired state — spawn, snapshot and dump, signal, reap,
       back off.
Signal handlers only record the signal; file events and signals wake the loop through a pipe,
and a timer wakes it anyway, since a hang is exactly the absence of events.
"""
from __future__ import annotations

import argparse
import os
import selectors
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, NO_RESTART_CODES
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_HEARTBEAT_DIR, ENV_RUN_DIR
from hangwatch.common.rundir import attempt_dir, next_attempt
from hangwatch.common.inbox_layout import queue_status
from hangwatch.supervisor import logsetup, process, snapshot as snapshots, statefile
from hangwatch.supervisor.calibration import Calibration
from hangwatch.common.config import Config, ConfigError, dump_config, load_config
from hangwatch.supervisor.deadlines import Deadlines, Expired, SuspensionDetector
from hangwatch.supervisor.escalation import DumpCollector, DumpTarget, TreeKiller
from hangwatch.supervisor.heartbeats import FileEvents, HeartbeatTail
from hangwatch.supervisor.incidents import (Incident, IncidentStore, call_chain, classify_exit, classify_stall, fatal_error, frame_str,
                                  read_json, signal_name, stuck_frame, tail_text)
from hangwatch.supervisor.policy import Decision, RestartPolicy
from hangwatch.supervisor.process import ProcRef, Worker
from hangwatch.supervisor.states import State, StateMachine

log = structlog.get_logger("hangwatch")

EXIT_AFTER_STOP_S = 30.0  # a worker that said `stop` gets this long (plus term grace) to exit
MIN_PASS_S = 0.05  # at most 20 loop passes a second, however many heartbeat lines arrive
FAST_PASS_S = 0.1  # loop period while escalating or stopping: prompt, yet cheap (each pass scans the tree)
TREE_SCAN_S = 1.0  # how often descendants are re-listed (to find those that leave the group)
STATE_WRITE_S = 5.0
COMMANDS = ("status", "restart", "stop", "pause", "resume", "dump", "incidents")


class NullNotifier:
    def ready(self) -> None: ...

    def status(self, text: str) -> None: ...

    def watchdog(self) -> None: ...

    def stopping(self) -> None: ...


@dataclass
class Announced:
    """A process that sent `start`: the only ones that get SIGUSR1."""

    rank: int
    ref: Optional[ProcRef]
    dump_path: Optional[Path]
    dump_signal: Optional[str]


@dataclass
class Handling:
    """The failure (or end) being handled: from detection until the tree is gone."""

    kind: Optional[str]  # incident kind; None for a clean end (finished, graceful stop)
    incident: Optional[Incident]
    detected_at: float
    expired: Optional[Expired] = None
    reason: str = ""
    decision: Optional[Decision] = None
    dumps: Optional[DumpCollector] = None
    killer: Optional[TreeKiller] = None
    procs: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)


class Supervisor:
    def __init__(
        self,
        cfg: Config,
        *,
        clock: Callable[[], float] = time.monotonic,
        spawn: Callable[..., Worker] = process.spawn,
        kill: process.Kill = os.kill,
        control: Any = None,
        notifier: Any = None,
        snapshot: Callable[..., list] = snapshots.process_tree,
        gpu: Callable[[], dict] = snapshots.gpu,
        gpu_pids: Callable[[], Optional[set]] = snapshots.gpu_pids,
        install_signals: bool = True,
        subreaper: bool = False,
        cpu_sample_s: float = 0.5,
        end_leftovers: bool = True,
    ):
        self.cfg = cfg
        self.wd = cfg.watchdog
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.run_dir / "config.yaml"
        self.state_path = self.run_dir / "state.json"
        self.clock = clock
        self._spawn = spawn
        self._kill = kill
        self.control = control
        self.notifier = notifier if notifier is not None else NullNotifier()
        self._snapshot = snapshot
        self._gpu = gpu
        self._gpu_pids = gpu_pids
        self._install_signals = install_signals
        self._subreaper = subreaper
        self._cpu_sample_s = cpu_sample_s
        self._end_leftovers = end_leftovers

        self.sm = StateMachine(State.STARTING, on_change=self._on_state_change)
        self.calibration, problem = Calibration.load(self.wd, self.run_dir / "calibration.json")
        if problem:
            log.warning("calibration_ignored", problem=problem)
        self.deadlines = Deadlines(self.wd, self.calibration)
        self.policy = RestartPolicy(cfg.restart)
        self.incidents = IncidentStore(self.run_dir)
        self.suspension = SuspensionDetector(self.wd.poll_interval_s)

        self.attempt = next_attempt(self.run_dir) - 1
        self.worker: Optional[Worker] = None
        self.tail: Optional[HeartbeatTail] = None
        self.announced: dict[int, Announced] = {}
        self.tree: dict[int, ProcRef] = {}
        self.handling: Optional[Handling] = None
        self.intent: Optional[str] = None  # exit | pause | restart: what follows the current worker
        self.force = False
        self.backoff_until: Optional[float] = None
        self.last_step: dict = {}
        self.last_stop: dict[int, str] = {}
        self.last_good_checkpoint: Optional[str] = None
        self.last_good_step: Optional[int] = None
        self.restarts = 0
        self.torn_lines = 0
        self.exit_code = EXIT_OK
        self.started_mono = clock()
        self.last_incident: Optional[dict] = None
        self._signals: list[int] = []
        self._ready_sent = False
        self._last_state_write = float("-inf")
        self._last_tree_scan = float("-inf")
        self._last_status_note = float("-inf")
        self._gpu_cache: tuple[float, dict] = (float("-inf"), {})
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._selector: Optional[selectors.BaseSelector] = None
        self._events: Optional[FileEvents] = None
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: Optional[int] = None
        self._helpers: set[int] = set()
        self._last_pass_end = float("-inf")
        self._previous = self._load_previous_state()

    # ================================================================================ set-up

    def _load_previous_state(self) -> dict:
        data, problem = statefile.read(self.state_path)
        if problem:
            log.warning("state_unreadable", problem=problem)
        data = data or {}
        self.restarts = int(data.get("restarts") or 0)
        self.last_good_checkpoint = data.get("last_good_checkpoint")
        self.last_good_step = data.get("last_good_step")
        return data

    def _check_previous_instance(self) -> Optional[str]:
        """End what a dead supervisor left; refuse to run beside a live one."""
        prev = self._previous
        sup = process.ProcRef.from_dict(prev.get("supervisor") or {})
        if sup is not None and sup.pid != os.getpid() and sup.matches():
            return (f"another supervisor (pid {sup.pid}) is running on {self.run_dir} "
                    f"(from {self.state_path}); stop it first")
        if not (prev.get("worker") or prev.get("pids") or prev.get("descendants")) or not self._end_leftovers:
            return None
        refs, group, notes = process.leftovers(prev)
        for note in notes:
            log.info("leftover_skipped", note=note)
        if refs or group:
            log.warning("leftovers_found", pids=[r.pid for r in refs], pgid=group, state_file=str(self.state_path))
            survivors = process.end_processes(refs, group, grace_s=self.wd.term_grace_s, kill=self._kill)
            log.info("leftovers_ended", pids=[r.pid for r in refs], survivors=[r.pid for r in survivors])
        return None

    def _setup(self) -> None:
        self.config_path.write_text(dump_config(self.cfg))
        if self._subreaper:
            process.set_child_subreaper()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        if self._install_signals and threading.current_thread() is threading.main_thread():
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
                self._old_handlers[sig] = signal.signal(sig, self._record_signal)
        attempts = self.run_dir / "attempts"
        self._events = FileEvents(attempts, self._wake_w)
        self._events.start()

    def _teardown(self) -> None:
        if self._events is not None:
            self._events.stop()
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        if self._selector is not None:
            self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
        try:
            self.calibration.save()
        except OSError as exc:
            log.warning("calibration_not_saved", error=str(exc))
        if self.control is not None:
            try:
                self.control.close()
            except Exception as exc:  # a broken control server must not hide the run's result
                log.warning("control_close_failed", error=str(exc))

    def _record_signal(self, signum, frame) -> None:
        self._signals.append(signum)  # only recorded: the loop acts on it

    # ================================================================================ main loop

    def run(self) -> int:
        """Run until finished, stopped or failed; returns the process exit code."""
        problem = self._check_previous_instance()
        if problem:
            print(f"hangwatch: {problem}", file=sys.stderr)
            log.error("refused", problem=problem)
            if self.control is not None:
                self.control.close()  # the socket file must not outlive a supervisor that never ran
            return EXIT_FAILED
        self._setup()
        log.info("supervisor_started", run_dir=str(self.run_dir), pid=os.getpid(), config=str(self.config_path))
        try:
            while not self.sm.state.final:
                self.run_once()
        except BaseException:
            self._emergency_kill()
            raise
        finally:
            self._write_state(self.clock(), force=True)
            self._teardown()
        log.info("supervisor_exit", state=self.sm.state.value, exit_code=self.exit_code)
        return self.exit_code

    def run_once(self) -> None:
        """One pass: wait, drain events, check deadlines, bring processes in line."""
        self._wait(self._timeout())
        now = self.clock()
        gap = self.suspension.observe(now)
        if gap > 0:
            self.deadlines.shift(gap)
            if self.backoff_until is not None:
                self.backoff_until += gap
            log.warning("supervisor_suspended", gap_s=round(gap, 3), note="deadlines extended by the gap")
        self._drain_signals()
        self._read_heartbeats(now)
        if self.control is not None:
            try:
                self.control.poll(self.handle_request)
            except Exception:  # a broken control channel must not take the training run down with it
                log.exception("control_poll_failed")
        self._reap(now)
        self._check_deadlines(now)
        self._advance(now)
        self._scan_tree(now)
        self._notify("watchdog")
        self._write_state(now)
        # The pass's own work (fsynced state writes, snapshots) is not a suspension: the gap
        # detector measures from here to the next pass.
        self.suspension.touch(self.clock())
        self._last_pass_end = time.monotonic()

    def _timeout(self) -> float:
        st = self.sm.state
        if self.worker is None and st is State.STARTING:
            return 0.0
        if st in (State.STALLED, State.DUMPING, State.KILLING, State.STOPPING):
            return FAST_PASS_S
        if st is State.BACKOFF and self.backoff_until is not None:
            return max(0.0, min(self.wd.poll_interval_s, self.backoff_until - self.clock()))
        return self.wd.poll_interval_s

    def _wait(self, timeout: float) -> None:
        if self._selector is None:
            return
        # Coalesce wake-ups: 8 ranks beating at 20 Hz are 160 file events a second, and one pass per
        # event would cost a core. Lines are still read within MIN_PASS_S; deadlines are unaffected.
        # (Real time on purpose: this is about CPU, not about deadlines.)
        since = time.monotonic() - self._last_pass_end
        if since < MIN_PASS_S:
            time.sleep(MIN_PASS_S - since)
            timeout = max(0.0, timeout - (MIN_PASS_S - since))
        try:
            self._selector.select(timeout)
        except InterruptedError:
            pass
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    # ================================================================================ 1. events

    def _drain_signals(self) -> None:
        while self._signals:
            sig = self._signals.pop(0)
            if sig in (signal.SIGTERM, signal.SIGINT):
                self.request_stop(signal.Signals(sig).name)

    def request_stop(self, why: str = "requested") -> None:
        """Ask the worker to checkpoint and stop, then exit 0; a second request kills at once."""
        if self.intent == "exit":
            self.force = True
            log.warning("stop_forced", why=why)
            return
        self.intent = "exit"
        log.info("stop_requested", why=why, state=self.sm.state.value)
        self._notify("stopping")

    def _read_heartbeats(self, now: float) -> None:
        if self.tail is None:
            return
        torn_before = self.tail.torn
        for rec in self.tail.read():
            tr = self.deadlines.observe(rec, now)
            ev = rec["event"]
            if ev == "start":
                self._on_start_line(rec, now)
            elif ev == "step":
                self.last_step = rec
                self.policy.observed_step(int(rec["step"]), now)
            elif ev == "phase":
                log.debug("phase", rank=tr.rank, phase=tr.phase, budget_s=tr.phase_budget, step=tr.step)
                self._status_note(now, force=True)
            elif ev == "checkpoint":
                if rec.get("good"):
                    self.last_good_checkpoint = str(rec.get("path"))
                    self.last_good_step = rec.get("step")
                    log.info("good_checkpoint", path=self.last_good_checkpoint, step=self.last_good_step)
                    self._write_state(now, force=True)
            elif ev == "warn":
                log.warning("worker_warning", rank=tr.rank, message=rec.get("message"), step=tr.step)
            elif ev == "stop":
                self.last_stop[tr.rank] = str(rec.get("reason"))
                log.info("worker_stop_line", rank=tr.rank, reason=rec.get("reason"), step=tr.step)
                if all(t.stopped for t in self.deadlines.ranks.values()):
                    # No per-rank deadline applies after `stop`; a process that then hangs on its way
                    # out (a non-daemon thread, CUDA/NCCL teardown) is still caught.
                    self.deadlines.arm_extra("exit", now, EXIT_AFTER_STOP_S + self.wd.term_grace_s, "exit after stop line")
        if self.tail.torn != torn_before:
            self.torn_lines += self.tail.torn - torn_before
            log.warning("torn_heartbeat_lines", count=self.tail.torn - torn_before, total=self.torn_lines,
                        example=self.tail.torn_examples[-1] if self.tail.torn_examples else None)
        self.calibration.save_if_changed()

    def _on_start_line(self, rec: dict, now: float) -> None:
        rank = int(rec.get("rank") or 0)
        pid = rec.get("pid")
        ref = ProcRef.of(pid) if isinstance(pid, int) else None
        dump_path = rec.get("dump_path")
        self.announced[rank] = Announced(rank, ref, Path(dump_path) if dump_path else None, rec.get("dump_signal"))
        log.info("worker_started", attempt=self.attempt, rank=rank, pid=pid, resumed_from=rec.get("resumed_from"),
                 skipped_checkpoints=rec.get("skipped_checkpoints") or None,
                 startup_s=round(now - self.worker.started_at, 3) if self.worker else None)
        if self.sm.state is State.STARTING:
            self.sm.transition(State.RUNNING, f"start beat from rank {rank}")
        self._write_state(now, force=True)

    def _reap(self, now: float) -> None:
        w = self.worker
        if w is not None and not w.exited:
            status = process.reap(w.pid)
            if status is not None:
                w.exit_code, w.exit_signal = process.decode_status(status)
                w.exited_at = now
                if w.popen is not None:
                    w.popen.returncode = w.exit_code if w.exit_code is not None else -(w.exit_signal or 0)
                log.info("worker_exited", attempt=self.attempt, pid=w.pid, code=w.exit_code,
                         signal=signal_name(w.exit_signal), state=self.sm.state.value)
                self._on_worker_exit(now)
        killer = self.handling.killer if self.handling is not None else None
        adopted = set(self.tree) | ({r.pid for r in killer.refs} if killer is not None else set())
        for pid in adopted - {getattr(w, "pid", None)}:
            process.reap(pid)  # adopted orphans (we are their subreaper); ECHILD otherwise

    # ================================================================================ 2. deadlines

    def _check_deadlines(self, now: float) -> None:
        if self.sm.state not in (State.STARTING, State.RUNNING, State.STOPPING):
            return
        if self.worker is None or self.worker.exited:
            return
        expired = self.deadlines.check(now)
        if expired is None:
            return
        if expired.name == "startup":
            kind = "startup_timeout"
        elif expired.livelock:
            kind = "livelock"
        else:
            kind = "stall"
        self._begin_escalation(now, kind, expired)

    # ================================================================================ 3. converge

    def _advance(self, now: float) -> None:
        st = self.sm.state
        if st in (State.STARTING, State.RUNNING):
            if self.worker is None:
                self._start_attempt(now)
            elif self.intent in ("exit", "pause", "restart") and not self.worker.exited:
                self._begin_graceful_stop(now)
        elif st is State.STOPPING:
            if self.force:
                self.force = False
                self._begin_kill(now, send_term=False)
        elif st is State.STALLED:
            self._snapshot_and_dump(now)
        elif st is State.DUMPING:
            if self.handling.dumps.advance(now):
                self._collect_dumps(now)
                self._begin_kill(now)
        elif st is State.KILLING:
            if self.force and self.handling.killer.kill_at is None:
                self.force = False
                self.handling.killer.kill_now(now)
            if self.handling.killer.advance(now):
                self._tree_gone(now)
        elif st is State.BACKOFF:
            if self.intent == "exit":
                self._finish(State.STOPPED, "stop requested during backoff", EXIT_OK)
            elif self.intent == "pause":
                self.intent = None
                self.sm.transition(State.PAUSED, "pause requested during backoff")
            elif self.intent == "restart" or self.backoff_until is None or now >= self.backoff_until:
                self.intent = None
                self._start_attempt(now)
        elif st is State.PAUSED:
            if self.intent == "exit":
                self._finish(State.STOPPED, "stop requested while paused", EXIT_OK)
            elif self.intent == "restart":
                self.intent = None
                self._start_attempt(now)

    def _worker_env(self) -> dict:
        env = dict(os.environ)
        env.update(self.cfg.worker.env)
        adir = attempt_dir(self.run_dir, self.attempt)
        env[ENV_RUN_DIR] = str(self.run_dir)
        env[ENV_ATTEMPT] = str(self.attempt)
        env[ENV_HEARTBEAT_DIR] = str(adir)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def worker_argv(self) -> list[str]:
        if self.cfg.worker.command:
            return list(self.cfg.worker.command)
        return [sys.executable, "-m", "hangwatch.daemon", "--config", str(self.config_path), "--run-dir", str(self.run_dir)]

    def _start_attempt(self, now: float) -> None:
        if self.worker is not None:
            self.restarts += 1
        self.attempt += 1
        adir = attempt_dir(self.run_dir, self.attempt)
        adir.mkdir(parents=True, exist_ok=True)
        if self.sm.state is not State.STARTING:
            self.sm.transition(State.STARTING, f"attempt {self.attempt}")
        self.tail = HeartbeatTail(adir)
        self.announced = {}
        self.tree = {}
        self.last_stop = {}
        self.handling = None
        self.backoff_until = None
        argv = self.worker_argv()
        try:
            self.worker = self._spawn(argv, env=self._worker_env(), cwd=self.cfg.worker.cwd,
                                      log_path=adir / "worker.log", now=now)
        except OSError as exc:
            inc = self.incidents.create("config_error", attempt=self.attempt, phase=None, step=None,
                                        classification=f"cannot start the worker: {exc}",
                                        summary=f"cannot start {argv[0]!r}: {exc.strerror or exc}", argv=argv,
                                        cwd=self.cfg.worker.cwd)
            self._note_incident(inc)
            log.error("spawn_failed", argv=argv, error=str(exc))
            self.worker = None
            self._finish(State.FAILED, f"cannot start the worker: {exc}", EXIT_CONFIG)
            return
        self.deadlines.arm_startup(now)
        self.policy.attempt_started(now)
        log.info("worker_spawned", attempt=self.attempt, pid=self.worker.pid, argv=argv, log=str(adir / "worker.log"))
        if not self._ready_sent:
            self._ready_sent = True
            self._notify("ready")
        self._write_state(now, force=True)

    def _begin_graceful_stop(self, now: float) -> None:
        self.sm.transition(State.STOPPING, f"{self.intent} requested")
        sent = process.signal_ref(self.worker.ref, signal.SIGTERM, self._kill)
        budget, source = self.deadlines.step_budget()
        self.deadlines.arm_extra("stop", now, self.wd.term_grace_s + budget, f"term_grace + {source} step budget")
        log.info("graceful_stop", intent=self.intent, pid=self.worker.pid, sigterm_sent=sent,
                 bound_s=round(self.wd.term_grace_s + budget, 3))

    def _begin_escalation(self, now: float, kind: str, expired: Optional[Expired]) -> None:
        tr = self.deadlines.ranks.get(expired.rank if expired and expired.rank is not None else self._main_rank())
        phase = tr.phase if tr else None
        step = tr.step if tr else None
        deadline = None
        if expired is not None:
            deadline = {"name": expired.name, "budget_s": round(expired.budget_s, 3), "elapsed_s": round(expired.elapsed_s, 3),
                        "overdue_s": round(expired.overdue_s, 3), "source": expired.source, "rank": expired.rank,
                        "progress_lines": expired.progress_lines, "last_progress_age_s": expired.last_progress_age_s}
        why = (f"{expired.name} deadline {expired.budget_s:.1f}s exceeded by {expired.overdue_s:.1f}s"
               f" in phase {phase!r} at step {step}" if expired else "restart now requested")
        inc = self.incidents.create(kind, attempt=self.attempt, phase=phase, step=step, deadline=deadline,
                                    summary=why, status="in progress", worker_pid=self.worker.pid,
                                    last_good_checkpoint=self.last_good_checkpoint)
        self.handling = Handling(kind, inc, now, expired=expired, reason=why)
        log.warning("stall_detected" if kind != "manual" else "restart_now", kind=kind, incident=inc.id,
                    deadline=expired.name if expired else None, budget_s=deadline and deadline["budget_s"],
                    elapsed_s=deadline and deadline["elapsed_s"], overdue_s=deadline and deadline["overdue_s"],
                    phase=phase, step=step, rank=expired.rank if expired else None, attempt=self.attempt)
        self.deadlines.disarm_extra("stop")
        self.sm.transition(State.STALLED, why)

    def _snapshot_and_dump(self, now: float) -> None:
        h = self.handling
        t0 = self.clock()
        roots = [self.worker.pid] if not self.worker.exited else []
        extra = [a.ref.pid for a in self.announced.values() if a.ref]
        procs = self._snapshot(roots, extra, interval=self._cpu_sample_s)
        h.procs = procs
        for p in procs:
            if p.get("create_time") and p["pid"] != self.worker.pid:
                self.tree.setdefault(p["pid"], ProcRef(p["pid"], p["create_time"]))
        gpu = self._gpu()
        self._gpu_cache = (self.clock(), gpu)
        h.incident.data.update(process_snapshot=procs, gpu=gpu)
        h.timings["snapshot_s"] = round(self.clock() - t0, 3)
        self.suspension.touch(self.clock())
        targets = [DumpTarget(a.rank, a.ref, a.dump_path) for a in self.announced.values()
                   if a.ref is not None and a.dump_path is not None and a.dump_signal]
        h.dumps = DumpCollector(targets, grace_s=self.wd.dump_grace_s, py_spy=self.wd.py_spy,
                                py_spy_timeout_s=self.wd.py_spy_timeout_s, out_dir=h.incident.dir, kill=self._kill)
        now = self.clock()
        h.dumps.begin(now)
        h.timings["dump_started_at_s"] = round(now - h.detected_at, 3)
        self.sm.transition(State.DUMPING, f"SIGUSR1 to {[t.ref.pid for t in targets]}")

    def _collect_dumps(self, now: float) -> None:
        h = self.handling
        inc = h.incident
        texts = h.dumps.texts()
        for rank, text in texts.items():
            inc.add_file(f"stack-rank{rank}.txt", text)
        for rank, text in h.dumps.py_spy_texts().items():
            inc.add_file(f"py-spy-rank{rank}.txt", text)
        rank = h.expired.rank if h.expired and h.expired.rank in texts else (min(texts) if texts else None)
        frame, stack, user = stuck_frame(texts.get(rank, "")) if rank is not None else (None, [], None)
        own = [p for p in h.procs if p["pid"] in {a.ref.pid for a in self.announced.values() if a.ref}]
        if not own:
            own = [p for p in h.procs if p["pid"] == self.worker.pid]
        deadline = inc.data.get("deadline")
        classification = classify_stall(h.kind, deadline, own, frame)
        chain = call_chain(stack)
        inc.data.update(
            stuck_frame=frame, main_stack=stack, user_frame=user, dump_rank=rank, call_chain=chain,
            dumps={r: f"stack-rank{r}.txt" for r in texts},
            dump_signalled={r: ok for r, ok in h.dumps.signalled.items()},
            py_spy=h.dumps.py_spy_note or "not run",
            classification=classification,
            summary=f"{h.reason}; {classification}" + (f"; called from {chain}" if chain else ""),
        )
        h.timings["dump_s"] = round(now - h.dumps.started_at, 3)
        inc.write()
        log.warning("stack_dumped", incident=inc.id, stuck=frame_str(frame), classification=classification,
                    ranks=sorted(texts))

    def _begin_kill(self, now: float, send_term: bool = True, why: Optional[str] = None) -> None:
        if self.handling is None:
            self.handling = Handling(None, None, now, reason="forced stop")
        refs = list(self.tree.values()) + [a.ref for a in self.announced.values() if a.ref]
        refs += list(self._adopted(exclude={self.worker.pid}).values())
        killer = TreeKiller(self.worker, refs, term_grace_s=self.wd.term_grace_s,
                            gpu_release_timeout_s=self.wd.gpu_release_timeout_s, kill=self._kill,
                            reap=lambda: self._reap(self.clock()), gpu_pids=self._gpu_pids, send_term=send_term)
        self.handling.killer = killer
        killer.begin(now)
        self.deadlines.disarm_extra("stop")
        self.sm.transition(State.KILLING, why or ("SIGTERM to the process group" if send_term else "SIGKILL to the tree"))

    def _on_worker_exit(self, now: float) -> None:
        w = self.worker
        if self.tail is not None:
            self._read_heartbeats(now)  # its last lines (stop, a final step) may have just arrived
        st = self.sm.state
        if st in (State.STALLED, State.DUMPING, State.KILLING):
            if self.handling and self.handling.incident:
                self.handling.incident.data["exit"] = self._exit_info(w)
            return
        stop_reason = self.last_stop.get(self._main_rank())
        if st is State.STOPPING:
            kind = None
            inc = None
            if w.exit_code != 0 and w.exit_signal != signal.SIGTERM:  # our SIGTERM before its handler was set is clean
                kind, classification = self._classify_exit(w)
                inc = self._exit_incident(kind, classification, f"worker exited during a graceful stop: {classification}")
            self.handling = Handling(kind, inc, now, reason=f"graceful stop ({self.intent})")
            self._begin_kill(now, why="worker exited; ending what is left of its tree")
            return
        decision = self.policy.on_exit(now, w.exit_code if w.exit_signal is None else None, stop_reason)
        if decision.action == "finish":
            self.handling = Handling(None, None, now, decision=decision, reason=decision.reason)
        else:
            kind, classification = self._classify_exit(w)
            inc = self._exit_incident(kind, classification, classification, decision)
            self.handling = Handling(kind, inc, now, decision=decision, reason=classification)
        self._begin_kill(now, why="worker exited; ending what is left of its tree")

    def _classify_exit(self, w: Worker) -> tuple[str, str]:
        adir = attempt_dir(self.run_dir, self.attempt)
        return classify_exit(w.exit_code, w.exit_signal, read_json(adir / "exit.json"), tail_text(w.log_path, 80))

    def _exit_info(self, w: Worker) -> dict:
        adir = attempt_dir(self.run_dir, self.attempt)
        return {"code": w.exit_code, "signal": w.exit_signal, "signal_name": signal_name(w.exit_signal),
                "last_words": read_json(adir / "exit.json"), "stop_reason": self.last_stop.get(self._main_rank())}

    def _exit_incident(self, kind: str, classification: str, summary: str, decision: Optional[Decision] = None) -> Incident:
        w = self.worker
        tr = self.deadlines.ranks.get(self._main_rank())
        info = self._exit_info(w)
        frame = stack = user = None
        for a in self.announced.values():  # a fatal signal makes faulthandler write the stack too
            if a.dump_path is not None and a.dump_path.exists():
                text = a.dump_path.read_text(errors="replace")
                if fatal_error(text):
                    frame, stack, user = stuck_frame(text[text.rfind("Fatal Python error"):])
                    info["fatal_error"] = fatal_error(text)
                    break
        inc = self.incidents.create(
            kind, attempt=self.attempt, phase=tr.phase if tr else None, step=tr.step if tr else None, deadline=None,
            exit=info, classification=classification, summary=summary, stuck_frame=frame, main_stack=stack or [],
            user_frame=user, status="in progress", worker_pid=w.pid, last_good_checkpoint=self.last_good_checkpoint,
            decision=decision.as_dict() if decision else None,
        )
        if info.get("last_words"):
            inc.add_file("exit.json", (attempt_dir(self.run_dir, self.attempt) / "exit.json").read_text(errors="replace"))
        log.warning("worker_failed", kind=kind, incident=inc.id, classification=classification, attempt=self.attempt,
                    code=w.exit_code, signal=signal_name(w.exit_signal))
        return inc

    def _tree_gone(self, now: float) -> None:
        h = self.handling
        w = self.worker
        if self.tail is not None:
            self._read_heartbeats(now)
            self.tail.finish()
        try:
            self.calibration.save()
        except OSError as exc:
            log.warning("calibration_not_saved", error=str(exc))
        # what follows: an explicit request wins over the restart policy
        if self.intent == "exit":
            target, why = State.STOPPED, "stopped on request"
        elif self.intent == "pause":
            target, why = State.PAUSED, "paused on request"
        elif self.intent == "restart":
            target, why = State.STARTING, "restart on request"
        else:
            decision = h.decision or self.policy.on_failure(now, h.reason)
            h.decision = decision
            target = {"finish": State.FINISHED, "fail": State.FAILED, "restart": State.BACKOFF}[decision.action]
            why = decision.reason
        if h.incident is not None:
            inc = h.incident
            timings = dict(h.timings)
            timings.update(h.killer.timings() if h.killer else {})
            gone_at = h.killer.gone_at if h.killer and h.killer.gone_at is not None else now
            timings["detection_to_gone_s"] = round(gone_at - h.detected_at, 3)
            timings["total_s"] = round(now - h.detected_at, 3)
            inc.data.update(status="handled", timings=timings, gpu_release=h.killer.gpu_release if h.killer else None,
                            decision=h.decision.as_dict() if h.decision else {"action": target.value, "reason": why},
                            exit=inc.data.get("exit") or (self._exit_info(w) if w and w.exited else None),
                            last_good_checkpoint=self.last_good_checkpoint, last_good_step=self.last_good_step,
                            torn_lines=self.torn_lines)
            if h.decision and h.decision.rollback:
                inc.data["rollback_to"] = self.last_good_checkpoint
            self._write_evidence(inc)
            inc.write()
            self._note_incident(inc)
        log.info("tree_gone", attempt=self.attempt, next=target.value, why=why,
                 gone_after_s=h.killer.timings()["tree_gone_after_s"] if h.killer else None)
        self.handling = None
        if target is State.STARTING:
            self.intent = None
            self._start_attempt(now)
        elif target is State.BACKOFF:
            self.backoff_until = now + h.decision.delay_s
            self.sm.transition(State.BACKOFF, f"{why}; next attempt in {h.decision.delay_s:g}s")
        elif target is State.PAUSED:
            self.intent = None
            self.sm.transition(State.PAUSED, why)
        elif target is State.FAILED:
            code = w.exit_code if (w and w.exit_code in NO_RESTART_CODES) else EXIT_FAILED
            if h.decision and h.decision.crash_loop:
                inc = self.incidents.create(
                    "crash_loop", attempt=self.attempt, phase=None, step=self.policy.best_step,
                    classification="crash loop", summary=h.decision.reason, status="final",
                    restarts_in_window=len(self.policy.recent), window_s=self.cfg.restart.window_s,
                    max_restarts=self.cfg.restart.max_restarts,
                    last_incident=self.last_incident, last_good_checkpoint=self.last_good_checkpoint)
                self._note_incident(inc)
                log.error("crash_loop", incident=inc.id, reason=h.decision.reason)
            self._finish(State.FAILED, why, code)
        else:
            self._finish(target, why, EXIT_OK)

    def _write_evidence(self, inc: Incident) -> None:
        if self.tail is not None:
            for rank in sorted(self.tail.recent):
                inc.add_file(f"heartbeat-tail-rank{rank}.jsonl", self.tail.tail_text(rank))
        if self.worker is not None:
            inc.add_file("worker-log-tail.txt", tail_text(self.worker.log_path))

    def _note_incident(self, inc: Incident) -> None:
        self.last_incident = {"id": inc.id, "kind": inc.kind, "summary": inc.data.get("summary")}

    def _finish(self, state: State, why: str, code: int) -> None:
        self.exit_code = code
        if state is not State.FAILED:
            self._notify("stopping")
        self.sm.transition(state, why)

    def _emergency_kill(self) -> None:
        """The supervisor itself is failing: leave no worker tree behind."""
        w = self.worker
        if w is None or w.exited:
            return
        process.signal_group(w.pgid, signal.SIGKILL, self._kill)
        for r in list(self.tree.values()):
            process.signal_ref(r, signal.SIGKILL, self._kill)
        process.signal_ref(w.ref, signal.SIGKILL, self._kill)

    # ================================================================================ bookkeeping

    def _main_rank(self) -> int:
        return min(self.deadlines.ranks) if self.deadlines.ranks else 0

    def _scan_tree(self, now: float) -> None:
        """Remember the worker's descendants (with start times) to find those that leave the group."""
        w = self.worker
        if w is None or w.exited or now - self._last_tree_scan < TREE_SCAN_S:
            return
        if self.sm.state not in (State.STARTING, State.RUNNING, State.STOPPING):
            return
        self._last_tree_scan = now
        seen = {r.pid: r for r in process.descendants(w.pid)}
        for pid, r in self._adopted(exclude={w.pid}).items():
            seen.setdefault(pid, r)
        changed = set(seen) - set(self.tree)
        self.tree = {**{p: r for p, r in self.tree.items() if not process.is_gone(r)}, **seen}
        if changed:
            self._write_state(now, force=True)

    def _adopted(self, exclude: set[int] = frozenset()) -> dict[int, ProcRef]:
        """Orphans of the worker's tree that were re-parented to us (we are their subreaper), with their
        descendants: once the worker itself has exited, this is the only way to find a child that left
        its process group (setsid) before the tree scan saw it."""
        if not self._subreaper:
            return {}
        found: dict[int, ProcRef] = {}
        for r in process.own_children(exclude=set(exclude) | self._helpers):
            found.setdefault(r.pid, r)
            for d in process.descendants(r.pid):
                found.setdefault(d.pid, d)
        return found

    def _on_state_change(self, src: State, dst: State, why: str) -> None:
        log.info("state", frm=src.value, to=dst.value, why=why, attempt=self.attempt)
        self._status_note(self.clock(), force=True)
        self._write_state(self.clock(), force=True)

    def _status_note(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_status_note < 10:
            return
        self._last_status_note = now
        tr = self.deadlines.ranks.get(self._main_rank())
        parts = [f"{self.sm.state.value} attempt {self.attempt}"]
        if tr is not None:
            mx = self._max_steps()
            parts.append(f"step {tr.step}" + (f"/{mx}" if mx else ""))
            parts.append(f"phase {tr.phase}")
        if self.last_incident:
            parts.append(f"incidents {self.incidents.count()}")
        self._notify("status", ", ".join(parts))

    def _notify(self, what: str, *args) -> None:
        try:
            getattr(self.notifier, what)(*args)
        except Exception:  # systemd notification is a courtesy: never fatal
            log.exception("notify_failed", what=what)

    def _max_steps(self) -> Optional[int]:
        if isinstance(self.last_step.get("max_steps"), int):
            return self.last_step["max_steps"]
        return self.cfg.train.max_steps if self.cfg.worker.command is None else None

    def _socket_path(self) -> str:
        path = getattr(self.control, "path", None)
        if path:
            return str(path)
        if self.cfg.control.socket:
            return self.cfg.control.socket
        runtime = os.environ.get("RUNTIME_DIRECTORY")
        return str(Path(runtime.split(":")[0]) / "hangwatch.sock") if runtime else str(self.run_dir / "hangwatch.sock")

    def _write_state(self, now: float, force: bool = False) -> None:
        if not force and now - self._last_state_write < STATE_WRITE_S:
            return
        self._last_state_write = now
        me = ProcRef.of(os.getpid())
        w = self.worker
        gone = self.sm.state.final or self.sm.state in (State.BACKOFF, State.PAUSED)  # the tree was seen gone
        data = {
            "state": self.sm.state.value,
            "updated_wall": time.time(),
            "supervisor": me.as_dict() if me else {"pid": os.getpid()},
            # kept after the worker's exit until its tree is seen gone: the group may still hold processes
            "worker": w.as_dict() if w and not gone else None,
            "pids": {} if gone else {str(r): a.ref.as_dict() for r, a in self.announced.items() if a.ref},
            "descendants": [] if gone else [r.as_dict() for r in self.tree.values()],
            "attempt": self.attempt,
            "restarts": self.restarts,
            "last_good_checkpoint": self.last_good_checkpoint,
            "last_good_step": self.last_good_step,
            "incidents": self.incidents.count(),
            "last_incident": self.last_incident,
            "torn_lines": self.torn_lines,
            "socket": self._socket_path(),
            "run_dir": str(self.run_dir),
            "exit_code": self.exit_code if self.sm.state.final else None,
        }
        try:
            statefile.write(self.state_path, data)
        except OSError as exc:
            log.warning("state_not_written", error=str(exc))

    def _gpu_summary(self) -> dict:
        t, snap = self._gpu_cache
        if self.clock() - t > 5.0:
            snap = self._gpu()
            self._gpu_cache = (self.clock(), snap)
        return snapshots.gpu_summary(snap)

    # ================================================================================ control

    def status(self) -> dict:
        now = self.clock()
        tr = self.deadlines.ranks.get(self._main_rank())
        last_line = max((t.last_line_at for t in self.deadlines.ranks.values()), default=None)
        watching = self.sm.state in (State.STARTING, State.RUNNING, State.STOPPING) and self.worker and not self.worker.exited
        w = self.worker
        return {
            "state": self.sm.state.value,
            "attempt": self.attempt,
            "pid": w.pid if w and not w.exited else None,
            "pids": {str(r): a.ref.pid for r, a in self.announced.items() if a.ref},
            "phase": tr.phase if tr else None,
            "phase_age_s": round(now - tr.phase_since, 3) if tr else None,
            "phase_budget_s": tr.phase_budget if tr else None,
            "step": tr.step if tr else None,
            "max_steps": self._max_steps(),
            "loss": self.last_step.get("loss"),
            "tokens_per_s": self.last_step.get("tokens_per_s"),
            "lr": self.last_step.get("lr"),
            "last_beat_age_s": round(now - last_line, 3) if last_line is not None else None,
            "last_good_checkpoint": self.last_good_checkpoint,
            "last_good_step": self.last_good_step,
            "restarts": self.restarts,
            "incidents": self.incidents.count(),
            "last_incident": self.last_incident,
            "deadlines": self.deadlines.active(now) if watching else [],
            "backoff_remaining_s": round(max(0.0, self.backoff_until - now), 3) if self.backoff_until is not None
            and self.sm.state is State.BACKOFF else None,
            "intent": self.intent,
            "gpu": self._gpu_summary(),
            "run_dir": str(self.run_dir),
            "config": str(self.cfg._source or self.config_path),
            "supervisor_pid": os.getpid(),
            "uptime_s": round(now - self.started_mono, 3),
            "torn_lines": self.torn_lines,
            "calibration": {"step_budget_s": self.deadlines.step_budget()[0], "source": self.deadlines.step_budget()[1],
                            "samples": len(self.calibration.step_samples)},
            "queue": queue_status(self.run_dir) if self.cfg.data.inbox else None,
        }

    def handle_request(self, req: Any) -> dict:
        """One control request, inside the main loop; never raises."""
        if not isinstance(req, dict):
            return {"ok": False, "error": f"request must be a JSON object, got {type(req).__name__}"}
        cmd = req.get("cmd")
        handler = getattr(self, f"_cmd_{cmd}", None) if isinstance(cmd, str) and cmd in COMMANDS else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r} (known: {', '.join(COMMANDS)})"}
        try:
            return handler(req)
        except Exception as exc:  # a bad request must never take the supervisor down
            log.exception("request_failed", cmd=cmd)
            return {"ok": False, "error": f"{cmd} failed: {type(exc).__name__}: {exc}"}

    def _cmd_status(self, req: dict) -> dict:
        return {"ok": True, "result": self.status()}

    def _busy(self) -> Optional[str]:
        st = self.sm.state
        if st.final:
            return f"the run is over (state {st.value})"
        if self.intent == "exit":
            return "the supervisor is stopping"
        return None

    def _cmd_restart(self, req: dict) -> dict:
        mode = req.get("mode", "graceful")
        if mode not in ("graceful", "now"):
            return {"ok": False, "error": f"restart mode must be 'graceful' or 'now', got {mode!r}"}
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        st = self.sm.state
        if st in (State.STALLED, State.DUMPING, State.KILLING):
            self.intent = "restart"
            return {"ok": True, "result": {"accepted": "restart", "mode": mode, "note": f"restarting after the current {st.value}"}}
        if st in (State.BACKOFF, State.PAUSED) or self.worker is None or self.worker.exited:
            self.intent = "restart"
            return {"ok": True, "result": {"accepted": "restart", "mode": mode, "note": f"starting a worker now (was {st.value})"}}
        self.intent = "restart"
        if mode == "now":
            self._begin_escalation(self.clock(), "manual", None)
        return {"ok": True, "result": {"accepted": "restart", "mode": mode, "attempt": self.attempt}}

    def _cmd_stop(self, req: dict) -> dict:
        if self.sm.state.final:
            return {"ok": False, "error": f"the run is over (state {self.sm.state.value})"}
        self.request_stop("control request")
        return {"ok": True, "result": {"accepted": "stop", "state": self.sm.state.value}}

    def _cmd_pause(self, req: dict) -> dict:
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        if self.sm.state is State.PAUSED:
            return {"ok": True, "result": {"accepted": "pause", "note": "already paused"}}
        self.intent = "pause"
        return {"ok": True, "result": {"accepted": "pause", "state": self.sm.state.value}}

    def _cmd_resume(self, req: dict) -> dict:
        if self.sm.state is not State.PAUSED and self.intent != "pause":
            return {"ok": False, "error": f"not paused (state {self.sm.state.value})"}
        # paused, or a pause still under way: either way a worker runs again once nothing is left of the old one
        self.intent = "restart"
        return {"ok": True, "result": {"accepted": "resume"}}

    def _cmd_dump(self, req: dict) -> dict:
        targets = [DumpTarget(a.rank, a.ref, a.dump_path) for a in self.announced.values()
                   if a.ref is not None and a.dump_path is not None and a.dump_signal]
        if self.worker is None or self.worker.exited or not targets:
            return {"ok": False, "error": f"no running worker process announced a dump signal (state {self.sm.state.value})"}
        dc = DumpCollector(targets, grace_s=max(self.wd.dump_grace_s, 0.5), py_spy=False, kill=self._kill)
        dc.begin(self.clock())
        while not dc.advance(self.clock()):
            time.sleep(0.02)
        self.suspension.touch(self.clock())
        texts = dc.texts()
        return {"ok": True, "result": {"dumps": {str(r): t for r, t in texts.items()},
                                       "signalled": {str(r): ok for r, ok in dc.signalled.items()}}}

    def _cmd_incidents(self, req: dict) -> dict:
        ident = req.get("id")
        if ident is None:
            return {"ok": True, "result": self.incidents.list()}
        found = self.incidents.get(str(ident))
        if found is None:
            known = ", ".join(i["id"] for i in self.incidents.list()) or "none yet"
            return {"ok": False, "error": f"no incident {ident!r} (known: {known})"}
        return {"ok": True, "result": found}
