"""The one wiring of a supervisor: logging into the run dir, the control socket, systemd notify, the ops side, the loop.

`hangwatch run` and the tests (`python -m hangwatch.supervisor run …`) go through here, so what is
tested is what users run.  The seams (clock, spawn, kill, process table, …: `loop.seams.Seams`) are built here,
one value, and handed to `Supervisor`.

The ops side (`Ops`: alerts, the dead-man's ping, Prometheus metrics) listens to the loop: once a pass it
is handed the loop's read model (`pass_done(view, now)`), and it taps the log (a `logsetup` tap) for the
events alerts are made of.  It only decides on the loop; everything slow (HTTP, a command, the textfile,
scrapes) runs on threads of its own, so it never delays detection or recovery.  It never reads the
supervisor itself.

When the loop returns, the run's end is written once where `logging.termination_log` says — in a pod, the
container's termination message (`ops.termination_message`).
"""

from __future__ import annotations

import functools
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.config import Config
from hangwatch.common.config.ops_schema import host_port
from hangwatch.common.exitcodes import EX_CANTCREAT, EXIT_FAILED
from hangwatch.supervisor.control import make_control
from hangwatch.supervisor.loop.seams import Seams
from hangwatch.supervisor.loop.supervisor import Supervisor
from hangwatch.supervisor.ops import logsetup, termination_message
from hangwatch.supervisor.ops.alerts import EVENTS, AlertDesk, AppriseSink, CommandSink, Courier
from hangwatch.supervisor.ops.deadman import DeadMan, Pinger
from hangwatch.supervisor.ops.metrics import Metrics, Recovery
from hangwatch.supervisor.ops.narrator import Narrator
from hangwatch.supervisor.ops.notify import Fanout, Notifier, Outbox, Stats, helper_pids
from hangwatch.supervisor.ops.trackers import Ending, Runner, TrackerDesk, TrackerReporter, helper_env, run_helper
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes.interpreter import python_of
from hangwatch.supervisor.processes.streams import Relay, hangup_is_the_terminals
from hangwatch.supervisor.read_model.view import View
from hangwatch.supervisor.records.runlock import RunDirBusy, RunLock
from hangwatch.supervisor.rules.policy import ProgressPolicy

log = structlog.get_logger("hangwatch")

CLOSE_WAIT_S = 10.0  # the longest a supervisor on its way out waits for queued alerts
TRACKERS_CLOSE_WAIT_S = 90.0  # and for the last report to the tracker runs (the run's summary): a few seconds' work
METRIC_EVENTS = frozenset({"stall_detected", "worker_failed"})


def no_progress_limit(cfg: Config) -> int:
    """`restart.no_progress_restarts` (0: off)."""
    return cfg.restart.no_progress_restarts


@dataclass
class Foreground:
    """`hangwatch run` in a person's terminal, pipe or script, standing in for the command: its output relayed to
    our stdout and stderr (`show`; a terminal where we have one: `processes.streams`), hangwatch's own plain lines on
    stderr (`say`), the structured log on stderr too only when asked (`verbose`), stopping signals passed on and the
    command's exit status (`transparent` in the loop).  `died_of`, filled in by `run`: the signal the command died of
    after hangwatch passed that very signal on (the caller dies of it too, as the bare command would have)."""

    show: bool = True
    say: bool = True
    verbose: bool = False
    died_of: Optional[int] = None


def run(
    cfg: Config,
    *,
    control_factory: Optional[Callable[[Config], Any]] = make_control,
    notifier: Any = None,
    configure_logging: bool = True,
    ops: Optional["Ops"] = None,
    foreground: Optional[Foreground] = None,
    **seams,
) -> int:
    """Supervise `cfg` until done; return the exit code.

    Exit codes (`common.exitcodes`): as a service (`foreground` None) 0 finished or stopped, the worker's 65/74/78
    when it reported a do-not-restart error, 1 for another failure; in the foreground the command's own status where
    its exit ended the run (`rules.outcome.run_exit_status`).  Either way 1 when the control socket or the metrics
    port cannot be opened, 73 when another supervisor holds the run dir (then nothing in it was touched).
    """
    # The run-dir lock comes first: a second supervisor must not write one byte (log, socket-path
    # record, state.json) into a run dir another one is supervising.
    try:
        lock = RunLock.acquire(cfg.run_dir)
    except RunDirBusy as busy:
        print(f"hangwatch: {busy}", file=sys.stderr)
        return EX_CANTCREAT
    with lock:
        if configure_logging:
            logsetup.configure(cfg.run_dir, cfg.logging.level, console=foreground is None or foreground.verbose)
        ops = ops if ops is not None else Ops(cfg)
        try:
            ops.start()
        except OSError as exc:
            print(f"hangwatch: cannot serve metrics on {cfg.metrics.listen}: {exc}", file=sys.stderr)
            ops.close()
            return EXIT_FAILED
        control = None
        if control_factory is not None:
            try:
                control = control_factory(cfg)
            except OSError as exc:
                print(f"hangwatch: cannot open the control socket: {exc}", file=sys.stderr)
                ops.close()
                return EXIT_FAILED
        seams.setdefault("subreaper", True)
        systemd = notifier if notifier is not None else Notifier.from_env()
        # The no-progress stop rides on the restart policy; the loop hands it each attempt's last good step.
        seams.setdefault("policy", ProgressPolicy(cfg.restart, no_progress_limit(cfg)))
        relay = narrator = None
        if foreground is not None:
            relay = Relay(show=foreground.show)
            relay.follow_window()
            seams.setdefault("spawn", functools.partial(process.spawn, relay=relay))
            # the user's command: its signals and exit status as bare (the built-in worker keeps a service's codes)
            seams.setdefault("transparent", cfg.worker.command is not None)
            seams.setdefault("hangup_stops", hangup_is_the_terminals())  # before the loop's handlers replace it
            if foreground.say:
                narrator = Narrator(relay.say)
                logsetup.add_tap(narrator)
        seams.update(control=control, notifier=Fanout(systemd, ops), listeners=(ops,))
        seams.setdefault("helpers", lambda: tuple(helper_pids))
        sup = Supervisor(cfg, Seams(**seams))
        try:
            code = sup.run()
            termination_message.leave(cfg.logging.termination_log, lambda: sup.view(sup.clock()), sup.lifecycle.reason,
                                      code, sup.incidents, fs=sup.fs)  # fmt: skip
            died_of = sup.intents.stop_signal
            if foreground is not None and sup.seams.transparent and died_of and code == 128 + died_of:
                foreground.died_of = died_of
            return code
        finally:
            if narrator is not None:
                logsetup.remove_tap(narrator)
            if relay is not None:
                relay.close()  # the last of the worker's output before the run's summary
                if foreground.say:
                    relay.end_line()  # which starts a line of its own
            ops.close()


class Ops:
    """Alerts, the dead-man's ping, metrics and the reports on the tracker runs of one supervisor.

    A listener of the loop: `pass_done(view, now)` once a pass, at its end, with the loop's read model; it
    is also in the notifier fan-out, for `next_due_s` (when the loop must pass again on its account).
    Seams: `sinks` replaces the alert sinks (apprise URLs, the command), `ping_get` the ping's HTTP GET,
    `tracker_runner` how a tracker report's helper runs."""

    def __init__(
        self,
        cfg: Config,
        *,
        sinks: Optional[list] = None,
        ping_get: Optional[Callable[[str, float], int]] = None,
        tracker_runner: Runner = run_helper,
    ):
        a, m = cfg.alerts, cfg.metrics
        self.cfg = cfg
        self.stats = Stats()
        self.events: deque = deque(maxlen=10_000)  # the tap's: appended on any thread, read on the loop's
        self.view: Optional[View] = None  # the read model of the loop's last pass
        self.desk: Optional[AlertDesk] = None
        self.outbox: Optional[Outbox] = None
        self._sinks = sinks
        if a.urls or a.command or sinks is not None:
            self.courier: Optional[Courier] = None
            self.outbox = Outbox("alerts", self._deliver, setup=self._setup_sinks, stats=self.stats)
            self.desk = AlertDesk(set(a.on), a.min_interval_s, self.outbox.put)
        self.deadman = None
        if a.ping_url:
            pinger = Pinger(a.ping_url, a.timeout_s, self.stats, get=ping_get)
            self.deadman = DeadMan(a.ping_every_s, Outbox("deadman", pinger, maxsize=1, stats=self.stats))
        self.metrics = (
            Metrics(host_port(m.listen) if m.listen else None, m.textfile, m.textfile_every_s, self.stats)
            if (m.listen or m.textfile)
            else None
        )
        self.recovery = Recovery()
        self.trackers: Optional[TrackerDesk] = None
        self.tracker_outbox: Optional[Outbox] = None
        if cfg.trackers.report:
            env = {**os.environ, **cfg.worker.env}
            reporter = TrackerReporter(
                cfg.run_dir, tracker_python(cfg, env), helper_env(env), cfg.worker.cwd, cfg.trackers.timeout_s,
                self.stats, runner=tracker_runner,
            )  # fmt: skip
            self.tracker_outbox = Outbox("trackers", reporter.deliver, stats=self.stats, batch=True)
            self.trackers = TrackerDesk(self.tracker_outbox.put)
        self._ended = False
        self._tapped = False

    # ---- set-up ------------------------------------------------------------------------------

    def _setup_sinks(self) -> None:
        """On the alerts thread: apprise's import and plugin scan take most of a second."""
        a = self.cfg.alerts
        sinks = self._sinks
        if sinks is None:
            sinks = []
            for url in a.urls:
                try:
                    sinks.append(AppriseSink(url, a.timeout_s))
                except ValueError as exc:  # the other URLs still work
                    log.error("alert_url_invalid", error=str(exc))
            if a.command:
                sinks.append(CommandSink(a.command, a.timeout_s))
        self.courier = Courier(self.cfg.run_dir, sinks, a.retries, self.stats)

    def _deliver(self, notice) -> None:
        self.courier.deliver(notice)

    def _tap(self, ev: dict) -> None:
        if ev.get("event") in EVENTS:
            self.events.append(dict(ev))

    def start(self) -> None:
        if self.desk is not None or self.metrics is not None or self.trackers is not None:
            logsetup.add_tap(self._tap)
            self._tapped = True
        if self.outbox is not None:
            self.outbox.start()
        if self.tracker_outbox is not None:
            self.tracker_outbox.start()
        if self.deadman is not None:
            self.deadman.outbox.start()
        if self.metrics is not None:
            self.metrics.start()

    # ---- the notifier interface (the loop's notifications) -------------------------------------

    def ready(self, status: Optional[str] = None) -> bool:
        return False

    def status(self, text: str) -> bool:
        return False

    def stopping(self, status: Optional[str] = None) -> bool:
        return False

    def next_due_s(self, now: float) -> Optional[float]:
        """When the next pass must come for the ops layer: a dead-man's ping, a metrics snapshot, an alert
        event waiting to be handled (at once); None when nothing is configured."""
        due = [0.0] if self.events else []
        if self.deadman is not None:
            due.append(self.deadman.next_due_s(now))
        if self.metrics is not None:
            due.append(self.metrics.next_due_s(now))
        return min(due) if due else None

    def watchdog(self, now: Optional[float] = None) -> bool:
        return False  # systemd's ping; the ops side hears of each pass through `pass_done`

    # ---- once a pass, on the loop --------------------------------------------------------------

    def pass_done(self, view: View, now: float) -> None:
        self.view = view
        while self.events:
            self._event(self.events.popleft(), now)
        tr = view.main if view.worker is not None else None
        stepped = tr.step if tr is not None and tr.last_step_at is not None else None
        if self.desk is not None:
            self.desk.observe(view.attempt, stepped, now)
            self.desk.tick(now)
        if self.trackers is not None:
            self.trackers.observe(view.attempt, stepped, now)
            self.trackers.tick(now)
        if self.metrics is not None:
            if stepped is not None:
                took = self.recovery.stepped(view.attempt, now)
                if took is not None:
                    self.metrics.recovery.observe(took)
            if self.desk is not None:
                self.metrics.held = self.desk.throttle.suppressed
            if self.metrics.due(now):
                self.metrics.take(view)
        if self.deadman is not None:
            self.deadman.pass_done(view.state, tr, now)

    def _event(self, ev: dict, now: float) -> None:
        if self.desk is not None:
            self.desk.feed(ev, now)
        if self.trackers is not None:
            self.trackers.feed(ev, now)
        if self.metrics is not None and ev.get("event") in METRIC_EVENTS and ev.get("incident"):
            self.recovery.detected_at(now, ev.get("attempt") or (self.view.attempt if self.view else 0))
            if isinstance(ev.get("elapsed_s"), (int, float)):
                self.metrics.detection.observe(ev["elapsed_s"])

    # ---- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """After the loop: the last events, the final snapshot, then what is queued goes out (bounded)."""
        if self.view is not None:
            now = self.view.now
            while self.events:
                self._event(self.events.popleft(), now)
            if self.desk is not None:
                self.desk.tick(now)
            if self.trackers is not None:
                self.trackers.tick(now)
                self.tracker_outbox.put(ending(self.view))
            if self.metrics is not None:
                self.metrics.take(self.view)
        if self._tapped:
            logsetup.remove_tap(self._tap)
            self._tapped = False
        a = self.cfg.alerts
        if self.outbox is not None:
            # At most one delivery's worth of waiting, capped: a dead endpoint must not hold the exit for long.
            wait_s = min(a.timeout_s, CLOSE_WAIT_S)
            if not self.outbox.close(wait_s):
                log.warning("alerts_not_all_sent", note=f"gave up waiting for the alert endpoints after {wait_s:g}s")
        if self.tracker_outbox is not None:
            wait_s = min(self.cfg.trackers.timeout_s, TRACKERS_CLOSE_WAIT_S)
            if not self.tracker_outbox.close(wait_s):
                log.warning("tracker_reports_not_all_sent", note=f"gave up waiting for the reports after {wait_s:g}s")
        if self.deadman is not None:
            self.deadman.outbox.close(1.0)
        if self.metrics is not None:
            self.metrics.close()


def ending(view: View) -> Ending:
    """The run's end as the tracker runs' summary says it (from the loop's last read model)."""
    step = view.main.step if view.main is not None else None
    if step is None and isinstance(view.last_step, dict):
        step = view.last_step.get("step")
    return Ending(
        outcome=view.state.value,
        exit_code=view.exit_code,
        attempts=view.attempt,
        restarts=view.restarts,
        step=step if isinstance(step, int) else None,
        goodput=view.goodput,
    )


def tracker_python(cfg: Config, env: dict) -> str:
    """`trackers.python`, else the interpreter the worker's command names, else the supervisor's own (which the
    built-in worker runs with)."""
    if cfg.trackers.python:
        return cfg.trackers.python
    if cfg.worker.command:
        found = python_of(list(cfg.worker.command), cfg.worker.cwd, env)
        if found:
            return str(found)
    return sys.executable
