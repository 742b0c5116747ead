"""hangwatch's incidents on the experiment-tracker runs the worker logs to (W&B, MLflow, TensorBoard).

People look at their tracker, not at a run directory; and a hung process keeps its tracker's heartbeat alive, so the
tracker's own "crashed" never fires.  So every incident, restart, in-process recovery and resume verdict goes onto
the tracker run itself, at its step, and the run's goodput into its summary at the end (docs/trackers.md):

    supervisor log events ──tap──▶ TrackerDesk.feed (loop thread: the alert desk's reading, nothing held back)
                                      ▼
                                   Notice / Ending ──Outbox("trackers": a thread)──▶ TrackerReporter.deliver
                                          words it (alerts.compose), reads which runs the worker's hooks recorded
                                          (<run_dir>/trackers/, common.trackers), runs daemon/trackers/report.py
                                          with the worker's own Python, the payload on its stdin, time-boxed

Why a helper process: the trackers' libraries weigh hundreds of MiB and start threads and services of their own; the
supervisor stays small (≤ 40 MiB) and never imports them.  The worker's interpreter has them — that is where the
script logs from — and works when the worker itself is hung or dead.  A report waits for the first record: an
incident before the script opened its tracker run (a hang while loading the model) goes onto the run with the next
report, at the latest with the run's summary.  A tracker that fails (offline, bad credentials, no library) is said
once in the supervisor's log per tracker; the run never notices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import structlog

from hangwatch.common.config.ops_schema import ALERT_EVENTS
from hangwatch.common.instrumentation import SOURCE_ROOT
from hangwatch.common.rundir import INCIDENTS
from hangwatch.common.trackers import read_records
from hangwatch.supervisor.ops.alerts import AlertDesk, Notice, Throttle, compose
from hangwatch.supervisor.ops.notify import helper_pids

log = structlog.get_logger("hangwatch")

REPORT_SCRIPT = SOURCE_ROOT / "daemon" / "trackers" / "report.py"
# Every event the alert desk words: on a tracker run nothing is held back (it is a record, not a pager).
EVENTS = frozenset({*ALERT_EVENTS, "resume_verified"})
LEVELS = {"failure": "ERROR", "warning": "WARN", "success": "INFO", "info": "INFO"}
# An attempt that ended by itself failed; one hangwatch ended was killed (MLflow's two terminal states for them).
ENDED_BY_ITSELF = frozenset(
    {"crash", "oom", "nan", "signal", "config_error", "data_error", "checkpoint_failed", "disk"}
)
WAITING_MAX = 100
Runner = Callable[[list, bytes, dict, Optional[str], float], tuple[int, bytes, bytes]]


class Unthrottled(Throttle):
    """Storm control switched off: each notice goes at once (a tracker run records every incident)."""

    def incident(self, notice: Notice, now: float) -> list[Notice]:
        return [notice]

    def warning(self, notice: Notice, now: float) -> list[Notice]:
        return [notice]

    def recovered(self, notice: Notice, now: float) -> list[Notice]:
        return [notice]

    def terminal(self, notice: Notice, now: float) -> list[Notice]:
        return [notice]

    def tick(self, now: float) -> list[Notice]:
        return []


class TrackerDesk(AlertDesk):
    """The alert desk's reading of the supervisor's events, every event enabled and nothing throttled."""

    def __init__(self, send: Callable[[Notice], Any]):
        super().__init__(set(EVENTS), 0.0, send)
        self.throttle = Unthrottled(0.0)


@dataclass
class Ending:
    """The run's end, once: its outcome and where its time went (the tracker run's summary)."""

    outcome: str  # the supervisor's final state: finished | failed | stopped | …
    exit_code: Optional[int]
    attempts: int
    restarts: int
    step: Optional[int]
    goodput: Optional[dict] = None
    wall: float = field(default_factory=time.time)


def mark(notice: Notice, msg: Mapping[str, Any]) -> dict:
    """One notice, worded (`alerts.compose`), as the report helper puts it on a run (see report.py's payload).
    `status`: what the attempt's tracker run must say now — an incident whose tree is gone ended its attempt: FAILED
    when the attempt failed by itself (a crash, an OOM), KILLED when hangwatch ended it (a stall); recovered in the
    worker's own process, the attempt goes on."""
    event, kind = msg.get("event"), msg.get("kind") or notice.facts.get("kind")
    status = None
    if event == "incident" and notice.facts.get("next") != "recovered_in_process":
        status = "FAILED" if kind in ENDED_BY_ITSELF else "KILLED"
    step = msg.get("step", notice.facts.get("step"))
    return {
        "event": event,
        "title": msg.get("title"),
        "text": msg.get("body"),
        "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
        "level": LEVELS.get(str(msg.get("level")), "INFO"),
        "incident": msg.get("incident"),
        "kind": kind or event,
        "attempt": msg.get("attempt", notice.facts.get("attempt")),
        "status": status,
    }


def summary(end: Ending, incidents: int) -> dict:
    """The tracker run's summary at the run's end (see report.py's payload)."""
    g = end.goodput or {}
    ok = end.outcome in ("finished", "stopped")
    return {
        "goodput_pct": g.get("goodput_pct"),
        "lost_s": g.get("lost_s"),
        "wall_s": g.get("wall_s"),
        "attempts": end.attempts,
        "restarts": end.restarts,
        "incidents": incidents,
        "outcome": end.outcome,
        "exit_code": end.exit_code,
        "status": "FINISHED" if ok else "FAILED",
        "step": end.step,
    }


def run_helper(argv: list, stdin: bytes, env: dict, cwd: Optional[str], timeout_s: float) -> tuple[int, bytes, bytes]:
    """Run the report helper in a session of its own (a terminal's ^C is not meant for it); past `timeout_s` the whole
    session is killed (the trackers' libraries start services of their own).  Listed in `helper_pids` while it runs:
    the supervisor's child, but no worker's orphan (the tree scan would adopt it, and reap it under us)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    helper_pids.add(proc.pid)
    try:
        out, err = proc.communicate(stdin, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        out, err = proc.communicate()
        return -signal.SIGKILL, out, (err or b"") + f"\ntimed out after {timeout_s:g}s".encode()
    finally:
        helper_pids.discard(proc.pid)
    return proc.returncode, out, err


class TrackerReporter:
    """The trackers' outbox thread: word each notice, and put what is waiting on the recorded tracker runs.

    Seams: `runner` runs the helper (argv, stdin, env, cwd, timeout) → (code, stdout, stderr)."""

    def __init__(
        self,
        run_dir: Path,
        python: str,
        env: Mapping[str, str],
        cwd: Optional[str],
        timeout_s: float,
        stats: Any,
        runner: Runner = run_helper,
        host: Optional[str] = None,
    ):
        self.run_dir, self.python, self.cwd, self.timeout_s, self.stats = Path(run_dir), python, cwd, timeout_s, stats
        self.env = dict(env)
        self.runner = runner
        self.host = host or os.uname().nodename
        # marks not on a run yet (no tracker recorded so far): the latest WAITING_MAX — a run that never opens a
        # tracker run must not grow the supervisor with every incident of its days
        self.waiting: deque = deque(maxlen=WAITING_MAX)
        self.said: set[str] = set()  # trackers whose failure the log has told
        self.reports = 0

    def deliver(self, items: Any) -> None:
        """Everything queued (the outbox batches): the notices become marks, the run's end its summary; one report
        carries them all with what waited for a record."""
        end: Optional[dict] = None
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, Notice):
                self.waiting.append(mark(item, compose(item, self.run_dir, self.host)))
            elif isinstance(item, Ending):
                end = summary(item, _incident_count(self.run_dir))
        records = read_records(self.run_dir)
        if not records:
            if end is not None and self.waiting:
                log.info("tracker_reports_unsent", marks=len(self.waiting), why="the worker recorded no tracker run")
            return
        if not self.waiting and end is None:
            return
        payload = {
            "run": self.run_dir.name,
            "trackers": records,
            "marks": list(self.waiting),
            "summary": end,
            "timeout_s": self.timeout_s,
        }
        self.waiting.clear()
        self._report(payload)

    def _report(self, payload: dict) -> None:
        self.reports += 1
        argv = [self.python, str(REPORT_SCRIPT)]
        t0 = time.monotonic()
        try:
            code, out, err = self.runner(argv, json.dumps(payload).encode(), self.env, self.cwd, self.timeout_s)
        except OSError as exc:  # the interpreter is gone or not executable
            code, out, err = 127, b"", str(exc).encode()
        results = _results(out)
        log.info(
            "tracker_reported",
            trackers=sorted(payload["trackers"]),
            marks=[m["event"] for m in payload["marks"]],
            summary=payload["summary"] is not None,
            outcome=results,
            took_s=round(time.monotonic() - t0, 3),
        )
        if code != 0 or results is None:
            why = (err.decode(errors="replace").strip().splitlines() or [f"exited {code}"])[-1][-300:]
            results = {name: f"report helper failed ({why})" for name in payload["trackers"]}
        for name, outcome in sorted(results.items()):
            if outcome in ("ok", "disabled"):
                self.stats.add("tracker_reports", name)
                continue
            self.stats.add("tracker_reports_failed", name)
            if name not in self.said:  # once per tracker: a dead endpoint must not fill the log
                self.said.add(name)
                log.warning("tracker_failed", tracker=name, error=str(outcome)[:500], python=self.python)


def _results(out: bytes) -> Optional[dict]:
    for line in reversed(out.decode(errors="replace").strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return {str(k): str(v) for k, v in data.items()}
    return None


def _incident_count(run_dir: Path) -> int:
    try:
        return sum(1 for p in (run_dir / INCIDENTS).iterdir() if p.is_dir())
    except OSError:
        return 0


def helper_env(environ: Mapping[str, str]) -> dict:
    """The worker's environment without hangwatch's own variables: the helper reaches the trackers as the script
    does (WANDB_*, MLFLOW_*, credentials) and is not instrumented."""
    return {k: v for k, v in environ.items() if not k.startswith("HANGWATCH_")}
