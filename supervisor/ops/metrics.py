"""Prometheus metrics: `/metrics` on `metrics.listen` and/or a textfile for node_exporter (`metrics.textfile`).

The loop's read model becomes a `Snapshot` (`take(view)`, at most once a second, on the loop thread) and
swaps it in whole; the scrape thread (prometheus-client's HTTP server) and the textfile thread only read
the latest one, so a scrape never races the loop and never costs it a pass.
`hangwatch_snapshot_timestamp_seconds` says when the loop last took one: a wedged loop shows as a stale
timestamp even while the HTTP thread still answers (configs/prometheus/hangwatch-rules.yml alerts on it).

Counters that must survive a supervisor restart are read from the run dir rather than counted in memory:
`hangwatch_incidents_total{kind}` from the incident directories, `hangwatch_restarts_total` from the run
facts (state.json).  The durations are histograms observed as they happen (detection: the stall's age when
its deadline fired; recovery: detection → the next attempt's first step) and start empty with each supervisor.
The goodput ledger's seconds per category (`hangwatch_seconds_total{category}`) are the ledger's own totals,
which it keeps in goodput.json across supervisor restarts: served as they are, never counted here.

Every name is listed in `METRICS` (docs/alerts-metrics-report.md's table and the dashboard use them).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import structlog

from hangwatch.common.inbox_layout import LineCounter, queue_status
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.ops.notify import Stats
from hangwatch.supervisor.rules.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.read_model.view import View

log = structlog.get_logger("hangwatch")

SNAPSHOT_S = 1.0
DURATION_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
METRICS = {
    "hangwatch_up": "1 while the supervisor runs (the textfile keeps its last value: see the snapshot timestamp).",
    "hangwatch_snapshot_timestamp_seconds": "When the supervisor's loop last took this snapshot (unix time).",
    "hangwatch_state": "The supervisor's state (1 for the current one).",
    "hangwatch_attempt": "The current attempt number.",
    "hangwatch_step": "The last optimizer step reported by the main rank.",
    "hangwatch_max_steps": "The run's length in steps, when known.",
    "hangwatch_last_step_timestamp_seconds": "When the last step beat was written (the worker's clock, unix time).",
    "hangwatch_loss": "Loss of the last step.",
    "hangwatch_learning_rate": "Learning rate of the last step.",
    "hangwatch_tokens_per_second": "Tokens per second of the last step.",
    "hangwatch_step_seconds": "Time of the last step (its own `step_time_s`, else between the last two step beats).",
    "hangwatch_beat_age_seconds": "Seconds since each rank's last heartbeat line.",
    "hangwatch_deadline_remaining_seconds": "Seconds left before each armed deadline of each rank fires.",
    "hangwatch_restarts_total": "Restarts of the worker in this run (across supervisor restarts).",
    "hangwatch_incidents_total": "Incidents of this run by kind (counted from the run dir).",
    "hangwatch_last_good_checkpoint_step": "Step of the last good checkpoint (-1: none yet).",
    "hangwatch_gpu_memory_used_bytes": "GPU memory used, per GPU (NVML).",
    "hangwatch_gpu_utilization_ratio": "GPU utilisation 0..1, per GPU (NVML).",
    "hangwatch_inbox_files": "Continuous mode: data files per stage of the inbox.",
    "hangwatch_detection_seconds": "How long a stall had lasted when its deadline fired.",
    "hangwatch_recovery_seconds": "Detection of a failure → the next attempt's first step.",
    "hangwatch_alerts_total": "Alerts delivered (result=sent) or given up on (result=failed), per sink.",
    "hangwatch_alerts_held_total": "Incidents not alerted one by one (storm control): counted into summaries.",
    "hangwatch_deadman_pings_total": "Dead-man's pings delivered (result=sent) or failed (result=failed).",
    "hangwatch_dropped_total": "Deliveries dropped because their queue was full (a dead endpoint), per outbox.",
    "hangwatch_seconds_total": "The run's wall time by goodput category (the goodput ledger: training, redone, eval, "
    "detection, …; the categories add up to the wall time).",
    "hangwatch_goodput_ratio": "Kept training time over the run's wall time, 0..1.",
}


@dataclass(frozen=True)
class Snapshot:
    wall: float
    state: str
    attempt: int
    step: Optional[int] = None
    max_steps: Optional[int] = None
    last_step: dict = field(default_factory=dict)
    step_seconds: Optional[float] = None
    ranks: tuple = ()  # (rank, beat age, ((deadline, remaining), …))
    restarts: int = 0
    incidents: dict = field(default_factory=dict)
    last_good_step: Optional[int] = None
    gpus: tuple = ()  # (index, name, memory used, utilisation %)
    queue: Optional[dict] = None
    goodput: Optional[dict] = None  # the goodput ledger's snapshot (categories, goodput_pct), as status shows it


class Recovery:
    """Detection → the next attempt's first step, observed on the loop (pure: `now` given)."""

    def __init__(self):
        self.detected: Optional[tuple[float, int]] = None  # (when, attempt)

    def detected_at(self, now: float, attempt: int) -> None:
        if self.detected is None:
            self.detected = (now, attempt)

    def stepped(self, attempt: int, now: float) -> Optional[float]:
        if self.detected is not None and attempt > self.detected[1]:
            took = now - self.detected[0]
            self.detected = None
            return took
        return None


class Metrics:
    """The registry, the snapshot it serves, and the histograms; `start` opens the server, `close` ends all."""

    def __init__(
        self, listen: Optional[tuple[str, int]], textfile: Optional[str], textfile_every_s: float, stats: Stats
    ):
        from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics  # noqa: PLC0415 (only when on)

        disable_created_metrics()  # `_created` series: noise for a single-process exporter and its textfile

        self.listen, self.textfile, self.textfile_every_s, self.stats = listen, textfile, textfile_every_s, stats
        self.registry = CollectorRegistry(auto_describe=True)
        self.detection = Histogram(
            "hangwatch_detection_seconds",
            METRICS["hangwatch_detection_seconds"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.recovery = Histogram(
            "hangwatch_recovery_seconds",
            METRICS["hangwatch_recovery_seconds"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.snap: Optional[Snapshot] = None
        self.held = 0  # alerts held by storm control (set by the ops layer)
        self.up = 1
        self.last_taken = float("-inf")
        self._prev_step: Optional[tuple[int, float]] = None  # (step, t) of the step beat the last snapshot saw
        self._step_s: Optional[float] = None
        self._lines = LineCounter()
        self._server = None
        self.port: Optional[int] = None
        self._stop = threading.Event()
        self._writer: Optional[threading.Thread] = None
        self.registry.register(_Collector(self))

    # ---- loop side -----------------------------------------------------------------------------

    def due(self, now: float) -> bool:
        return now - self.last_taken >= SNAPSHOT_S

    def next_due_s(self, now: float) -> float:
        """Seconds until the next snapshot is due (the loop's wait: gauges stay at most ~1 s old)."""
        return max(0.0, self.last_taken + SNAPSHOT_S - now)

    def take(self, view: "View") -> Snapshot:
        """Turn the loop's read model (loop thread only) into a new snapshot and publish it."""
        now = self.last_taken = view.now
        tr, last = view.main, dict(view.last_step)
        ranks = (
            tuple(
                (
                    t.rank,
                    round(now - t.last_line_at, 3),
                    tuple((d["name"], d["remaining_s"]) for d in view.deadlines if d["rank"] == t.rank),
                )
                for t in view.ranks
            )
            if view.worker is not None
            else ()
        )
        kinds = Counter(d.name.split("-", 1)[1] for d in IncidentStore(view.run_dir).dirs())
        gpus = (
            tuple(
                (d.get("index"), d.get("name"), d.get("memory_used_bytes"), d.get("utilization_percent"))
                for d in view.gpu.get("devices", ())
            )
            if view.gpu.get("available")
            else ()
        )
        snap = Snapshot(
            wall=time.time(),
            state=view.state.value,
            attempt=view.attempt,
            step=tr.step if tr else last.get("step"),
            max_steps=view.max_steps,
            last_step=last,
            step_seconds=self._step_seconds(last),
            ranks=ranks,
            restarts=view.restarts,
            incidents=dict(kinds),
            last_good_step=view.last_good_step,
            gpus=gpus,
            queue=queue_status(view.run_dir, self._lines) if view.queue is not None else None,
            goodput=_goodput(getattr(view, "goodput", None)),
        )
        self.snap = snap  # one reference swap: readers see the old snapshot or the new, never half
        return snap

    def _step_seconds(self, last: dict) -> Optional[float]:
        """The step's own `step_time_s`, else the time between the last two step beats the snapshots saw."""
        own = _num(last.get("step_time_s"))
        if own is not None:
            return own
        step, t = last.get("step"), _num(last.get("t"))
        if not isinstance(step, int) or t is None:
            return None
        prev = self._prev_step
        if prev is None or prev[0] != step:
            self._prev_step = (step, t)
            if prev is not None and step > prev[0] and t > prev[1]:
                self._step_s = (t - prev[1]) / (step - prev[0])
        return self._step_s

    # ---- outputs -------------------------------------------------------------------------------

    def start(self) -> None:
        if self.listen is not None:
            from prometheus_client import start_http_server  # noqa: PLC0415

            host, port = self.listen
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
            self.port = self._server.server_address[1]
            log.info("metrics_listening", url=f"http://{_host(host)}:{self.port}/metrics")
        if self.textfile is not None:
            self._writer = threading.Thread(target=self._write_loop, name="hangwatch-textfile", daemon=True)
            self._writer.start()

    def write_textfile(self) -> None:
        from prometheus_client import write_to_textfile  # noqa: PLC0415

        try:
            Path(self.textfile).parent.mkdir(parents=True, exist_ok=True)
            write_to_textfile(self.textfile, self.registry)
        except OSError as exc:
            self.stats.add("textfile_failed")
            log.warning("metrics_textfile_failed", path=self.textfile, error=str(exc))

    def _write_loop(self) -> None:
        while not self._stop.wait(0 if self.snap is None else self.textfile_every_s):
            if self.snap is None:
                self._stop.wait(SNAPSHOT_S)
                continue
            self.write_textfile()

    def close(self) -> None:
        self.up = 0
        self._stop.set()
        if self._writer is not None:
            self._writer.join(5)
        if self.textfile is not None and self.snap is not None:
            self.write_textfile()  # the final state, for node_exporter to keep showing
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Collector:
    """Builds the metric families from the latest snapshot at scrape time (the scrape thread)."""

    def __init__(self, metrics: Metrics):
        self.m = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        def gauge(name, value, labels=None, label_values=None):
            g = GaugeMetricFamily(name, METRICS[name], labels=labels)
            if value is not None:
                g.add_metric(label_values or [], float(value))
            return g

        m, s = self.m, self.m.snap
        yield gauge("hangwatch_up", m.up)
        stats = m.stats.snapshot()
        alerts = CounterMetricFamily("hangwatch_alerts", METRICS["hangwatch_alerts_total"], labels=["sink", "result"])
        for (name, label), n in sorted(stats.items()):
            if name in ("alerts_sent", "alerts_failed"):
                alerts.add_metric([label, name.split("_")[1]], n)
        yield alerts
        yield CounterMetricFamily("hangwatch_alerts_held", METRICS["hangwatch_alerts_held_total"], value=m.held)
        pings = CounterMetricFamily(
            "hangwatch_deadman_pings", METRICS["hangwatch_deadman_pings_total"], labels=["result"]
        )
        pings.add_metric(["sent"], stats.get(("deadman_pings", ""), 0))
        pings.add_metric(["failed"], stats.get(("deadman_failed", ""), 0))
        yield pings
        dropped = CounterMetricFamily("hangwatch_dropped", METRICS["hangwatch_dropped_total"], labels=["outbox"])
        for (name, _), n in sorted(stats.items()):
            if name.endswith("_dropped"):
                dropped.add_metric([name[: -len("_dropped")]], n)
        yield dropped
        if s is None:
            return
        yield gauge("hangwatch_snapshot_timestamp_seconds", s.wall)
        state = GaugeMetricFamily("hangwatch_state", METRICS["hangwatch_state"], labels=["state"])
        for st in State:
            state.add_metric([st.value], 1.0 if st.value == s.state else 0.0)
        yield state
        yield gauge("hangwatch_attempt", s.attempt)
        yield gauge("hangwatch_step", s.step)
        yield gauge("hangwatch_max_steps", s.max_steps)
        last = s.last_step
        yield gauge("hangwatch_last_step_timestamp_seconds", _num(last.get("t")))
        yield gauge("hangwatch_loss", _num(last.get("loss")))
        yield gauge("hangwatch_learning_rate", _num(last.get("lr")))
        yield gauge("hangwatch_tokens_per_second", _num(last.get("tokens_per_s")))
        yield gauge("hangwatch_step_seconds", s.step_seconds)
        age = GaugeMetricFamily("hangwatch_beat_age_seconds", METRICS["hangwatch_beat_age_seconds"], labels=["rank"])
        left = GaugeMetricFamily(
            "hangwatch_deadline_remaining_seconds",
            METRICS["hangwatch_deadline_remaining_seconds"],
            labels=["rank", "deadline"],
        )
        for rank, beat_age, deadlines in s.ranks:
            age.add_metric([str(rank)], beat_age)
            for name, remaining in deadlines:
                left.add_metric([str(rank), name], remaining)
        yield age
        yield left
        yield CounterMetricFamily("hangwatch_restarts", METRICS["hangwatch_restarts_total"], value=s.restarts)
        inc = CounterMetricFamily("hangwatch_incidents", METRICS["hangwatch_incidents_total"], labels=["kind"])
        for kind, n in sorted(s.incidents.items()):
            inc.add_metric([kind], n)
        yield inc
        yield gauge("hangwatch_last_good_checkpoint_step", s.last_good_step if s.last_good_step is not None else -1)
        if s.gpus:
            mem = GaugeMetricFamily(
                "hangwatch_gpu_memory_used_bytes", METRICS["hangwatch_gpu_memory_used_bytes"], labels=["gpu", "name"]
            )
            util = GaugeMetricFamily(
                "hangwatch_gpu_utilization_ratio", METRICS["hangwatch_gpu_utilization_ratio"], labels=["gpu", "name"]
            )
            for index, name, used, pct in s.gpus:
                if used is not None:
                    mem.add_metric([str(index), str(name)], used)
                if pct is not None:
                    util.add_metric([str(index), str(name)], pct / 100.0)
            yield mem
            yield util
        if s.queue is not None:
            q = GaugeMetricFamily("hangwatch_inbox_files", METRICS["hangwatch_inbox_files"], labels=["stage"])
            for stage in ("inbox", "waiting", "processing", "done", "rejected"):
                if isinstance(s.queue.get(stage), int):
                    q.add_metric([stage], s.queue[stage])
            yield q
        if s.goodput is not None:
            spent = CounterMetricFamily("hangwatch_seconds", METRICS["hangwatch_seconds_total"], labels=["category"])
            for category, seconds in s.goodput["categories"].items():
                spent.add_metric([category], seconds)
            yield spent
            pct = s.goodput.get("goodput_pct")
            yield gauge("hangwatch_goodput_ratio", pct / 100.0 if pct is not None else None)


def _goodput(snap: Any) -> Optional[dict]:
    """The ledger's figures the collector serves, copied: the scrape thread must not read a dict the loop goes on
    filling."""
    if not isinstance(snap, dict) or not isinstance(snap.get("categories"), dict):
        return None
    # A counter must never go down: the settled seconds, not the pending time a detection may yet reclassify.
    source = snap["settled"] if isinstance(snap.get("settled"), dict) else snap["categories"]
    cats = {str(c): v for c, v in ((c, _num(v)) for c, v in source.items()) if v is not None}
    return {"categories": cats, "goodput_pct": _num(snap.get("goodput_pct"))}


def _num(v: Any) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        try:
            return float(v) if isinstance(v, str) else None
        except ValueError:
            return None
    return float(v)
