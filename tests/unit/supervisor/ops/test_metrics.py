"""Prometheus metrics from the supervisor's state, read back with prometheus-client's own parser (no server, no
loop)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hangwatch.common.config import Config
from hangwatch.common.config.ops_schema import MetricsCfg, host_port
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.ops.metrics import METRICS, Metrics, Recovery
from hangwatch.supervisor.ops.notify import Stats
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.processes.snapshot import GpuCache
from hangwatch.supervisor.read_model.view import Readers, View, max_steps
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State, StateMachine
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

GPU = {
    "available": True,
    "devices": [
        {
            "index": 0,
            "name": "H100",
            "utilization_percent": 46,
            "memory_used_bytes": 7 << 30,
            "memory_total_bytes": 80 << 30,
            "processes": [],
        }
    ],
}


def fake_sup(tmp_path, inbox=False, gpu=None):
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path),
            "worker": {"command": ["python", "train.py"]},
            "data": {"inbox": inbox},
            "watchdog": {"step_timeout_s": 30},
        }
    )
    dl = Deadlines(cfg.watchdog, Calibration(cfg.watchdog))
    sup = SimpleNamespace(
        cfg=cfg,
        run_dir=tmp_path,
        deadlines=dl,
        facts=RunRecord(),
        lifecycle=StateMachine(State.STARTING),
        incidents=IncidentStore(tmp_path),
        gpu=GpuCache(lambda: gpu or {"available": False, "reason": "no GPU"}),
        attempt=1,
        current=object(),
    )
    sup.worker_alive = lambda: True
    sup.view = lambda now: view_of(sup, now)
    return sup


def view_of(sup, now) -> View:
    """The read model a running worker's loop would hand the metrics (only what they read is filled in)."""
    dl, facts = sup.deadlines, sup.facts
    readers = Readers(
        ranks=lambda: tuple(t for _, t in sorted(dl.ranks.items())),
        deadlines=lambda: tuple(dl.active(now)),
        announced=dict,
        descendants=tuple,
        stragglers=dict,
        incidents=sup.incidents.count,
        gpu=lambda: sup.gpu.summary(now),
        queue=lambda: {} if sup.cfg.data.inbox else None,
    )
    return View(
        now=now,
        state=sup.lifecycle.state,
        intent=Intent.NONE,
        attempt=sup.attempt,
        exit_code=0,
        worker=Worker(pid=9, create_time=1.0, argv=["python"], log_path=sup.run_dir / "w.log", started_at=0.0),
        watching=True,
        main=dl.ranks.get(dl.main_rank()),
        restarts=facts.restarts,
        last_step=dict(facts.last_step),
        last_good_checkpoint=facts.last_good_checkpoint,
        last_good_step=facts.last_good_step,
        last_incident=None,
        torn_lines=0,
        max_steps=max_steps(facts.last_step, None),
        backoff_remaining_s=None,
        step_budget=dl.step_budget(),
        calibration_samples=0,
        uptime_s=now,
        run_dir=str(sup.run_dir),
        config="c.yaml",
        socket="s",
        readers=readers,
    )


def beat(sup, now, event, step=0, **kw):
    rec = {
        "v": 1,
        "t": 1_700_000_000.0 + now,
        "pid": 9,
        "rank": 0,
        "attempt": sup.attempt,
        "event": event,
        "step": step,
        "phase": kw.pop("phase", "train"),
        **kw,
    }
    sup.deadlines.observe(rec, now)
    if event == "step":
        sup.facts.last_step = rec


def samples(m: Metrics) -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_a_snapshot_of_a_running_worker(tmp_path):
    sup = fake_sup(tmp_path, gpu=GPU)
    m = Metrics(None, None, 15, Stats())
    beat(sup, 0.0, "start")
    sup.lifecycle.transition(State.RUNNING)
    beat(sup, 0.1, "phase", phase="train")
    for i, now in enumerate((1.0, 1.5, 2.0), start=1):
        beat(sup, now, "step", step=i, loss=2.0 / i, lr=1e-4, tokens_per_s=900.0, max_steps=100)
        m.take(sup.view(now))
    s = samples(m)
    assert s[("hangwatch_step", ())] == 3 and s[("hangwatch_max_steps", ())] == 100
    assert s[("hangwatch_state", (("state", "running"),))] == 1 and s[("hangwatch_state", (("state", "failed"),))] == 0
    assert s[("hangwatch_last_step_timestamp_seconds", ())] == 1_700_000_002.0
    assert s[("hangwatch_loss", ())] == pytest.approx(2 / 3) and s[("hangwatch_learning_rate", ())] == 1e-4
    assert s[("hangwatch_tokens_per_second", ())] == 900
    assert s[("hangwatch_step_seconds", ())] == pytest.approx(0.5)  # between the step beats the snapshots saw
    assert s[("hangwatch_beat_age_seconds", (("rank", "0"),))] == 0
    assert s[("hangwatch_deadline_remaining_seconds", (("deadline", "step"), ("rank", "0")))] == 30
    assert s[("hangwatch_last_good_checkpoint_step", ())] == -1
    assert s[("hangwatch_gpu_memory_used_bytes", (("gpu", "0"), ("name", "H100")))] == 7 << 30
    assert s[("hangwatch_gpu_utilization_ratio", (("gpu", "0"), ("name", "H100")))] == pytest.approx(0.46)
    assert ("hangwatch_inbox_files", (("stage", "inbox"),)) not in s
    assert s[("hangwatch_up", ())] == 1


def test_a_steps_own_time_wins_and_counters_come_from_the_run_dir(tmp_path):
    sup = fake_sup(tmp_path, inbox=True)
    for kind in ("stall", "stall", "crash"):
        sup.incidents.create(kind)
    sup.facts.restarts = 3
    m = Metrics(None, None, 15, Stats())
    beat(sup, 0.0, "start")
    beat(sup, 1.0, "step", step=5, step_time_s=0.25)
    m.take(sup.view(1.0))
    s = samples(m)
    assert s[("hangwatch_step_seconds", ())] == 0.25
    assert s[("hangwatch_incidents_total", (("kind", "stall"),))] == 2
    assert s[("hangwatch_incidents_total", (("kind", "crash"),))] == 1
    assert s[("hangwatch_restarts_total", ())] == 3
    assert s[("hangwatch_inbox_files", (("stage", "inbox"),))] == 0  # continuous mode: the queue sizes
    assert ("hangwatch_gpu_memory_used_bytes", (("gpu", "0"), ("name", "H100"))) not in s  # no NVML: no GPU series


def test_histograms_and_delivery_counters(tmp_path):
    stats = Stats()
    m = Metrics(None, None, 15, stats)
    m.detection.observe(2.5)
    rec = Recovery()
    rec.detected_at(100.0, attempt=1)
    assert rec.stepped(1, 101.0) is None  # the same attempt stepping is no recovery
    took = rec.stepped(2, 112.0)
    m.recovery.observe(took)
    stats.add("alerts_sent", "json")
    stats.add("alerts_failed", "slack", 2)
    stats.add("deadman_pings", "", 7)
    stats.add("alerts_dropped")
    s = samples(m)
    assert s[("hangwatch_detection_seconds_count", ())] == 1 and s[("hangwatch_detection_seconds_sum", ())] == 2.5
    assert (
        s[("hangwatch_recovery_seconds_sum", ())] == 12
        and s[("hangwatch_recovery_seconds_bucket", (("le", "20.0"),))] == 1
    )
    assert s[("hangwatch_alerts_total", (("result", "sent"), ("sink", "json")))] == 1
    assert s[("hangwatch_alerts_total", (("result", "failed"), ("sink", "slack")))] == 2
    assert s[("hangwatch_deadman_pings_total", (("result", "sent"),))] == 7
    assert s[("hangwatch_dropped_total", (("outbox", "alerts"),))] == 1


def test_the_textfile_is_written_whole_with_the_final_state(tmp_path):
    sup = fake_sup(tmp_path)
    prom = tmp_path / "textfile" / "hangwatch.prom"
    m = Metrics(None, str(prom), 15, Stats())
    m.take(sup.view(0.0))
    m.close()
    text = prom.read_text()
    assert 'hangwatch_state{state="starting"} 1.0' in text and "hangwatch_up 0.0" in text
    assert not list(prom.parent.glob("*.tmp*"))  # replaced atomically


def test_every_metric_is_documented():
    assert all(name.startswith("hangwatch_") and text for name, text in METRICS.items())


def test_every_metric_is_in_the_docs_table():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[4] / "docs" / "alerts-metrics-report.md").read_text()
    table = {
        m
        for line in doc.splitlines()
        if line.startswith("| `hangwatch_")
        for m in re.findall(r"`(hangwatch_\w+)", line)
    }
    assert set(METRICS) - table == set()
    assert table - set(METRICS) == set()


class WithGoodput:
    """A view as the loop hands it over once it carries the goodput ledger's snapshot."""

    def __init__(self, view, goodput):
        self._view, self.goodput = view, goodput

    def __getattr__(self, name):
        return getattr(self._view, name)


LEDGER = {
    "version": 1,
    "wall_s": 1000.0,
    "goodput_pct": 85.0,
    "lost_s": 100.0,
    "failures": 1,
    "line": "goodput 85.0 % — …",
    "categories": {
        "training": 850.0,
        "redone": 30.0,
        "eval": 50.0,
        "detection": 40.0,
        "dumps": 5.0,
        "kill": 5.0,
        "gpu_release": 0.0,
        "restart_startup": 20.0,
        "checkpoint": 0.0,
        "startup": 0.0,
        "backoff": 0.0,
        "paused": 0.0,
        "idle": 0.0,
        "other": 0.0,
    },
}


def test_the_goodput_ledger_is_a_counter_per_category_and_a_ratio(tmp_path):
    sup = fake_sup(tmp_path)
    m = Metrics(None, None, 15, Stats())
    m.take(WithGoodput(sup.view(0.0), LEDGER))
    s = samples(m)
    spent = {dict(labels)["category"]: v for (name, labels), v in s.items() if name == "hangwatch_seconds_total"}
    assert spent == LEDGER["categories"]
    assert s[("hangwatch_goodput_ratio", ())] == pytest.approx(0.85)
    text = generate_latest(m.registry).decode()
    assert "# TYPE hangwatch_seconds_total counter" in text and "# TYPE hangwatch_goodput_ratio gauge" in text


@pytest.mark.parametrize("goodput", [None, {"line": "no categories"}])
def test_no_ledger_no_goodput_series(tmp_path, goodput):
    sup = fake_sup(tmp_path)
    m = Metrics(None, None, 15, Stats())
    m.take(WithGoodput(sup.view(0.0), goodput) if goodput is not None else sup.view(0.0))
    assert not any(name in ("hangwatch_seconds_total", "hangwatch_goodput_ratio") for name, _ in samples(m))


def test_a_ledger_without_a_ratio_serves_its_seconds_only(tmp_path):
    sup = fake_sup(tmp_path)
    m = Metrics(None, None, 15, Stats())
    m.take(WithGoodput(sup.view(0.0), {**LEDGER, "goodput_pct": None}))
    s = samples(m)
    assert s[("hangwatch_seconds_total", (("category", "training"),))] == 850.0
    assert ("hangwatch_goodput_ratio", ()) not in s


@pytest.mark.parametrize(
    "listen, expected",
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        ("9464", ("127.0.0.1", 9464)),
        ("[::1]:9464", ("::1", 9464)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
    ],
)
def test_listen_addresses(listen, expected):
    assert host_port(listen) == expected


@pytest.mark.parametrize("bad", [{"listen": "localhost:http"}, {"listen": "1:99999"}, {"textfile": "/var/lib/x.txt"}])
def test_bad_metrics_settings_are_refused(bad):
    with pytest.raises(ValueError):
        MetricsCfg(**bad)


def test_the_shipped_rules_and_dashboard_use_only_metrics_hangwatch_serves():
    import json
    import re
    from pathlib import Path

    import yaml

    base = Path(__file__).resolve().parents[4] / "configs" / "prometheus"
    rules = yaml.safe_load((base / "hangwatch-rules.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert all(r.get("alert") and r.get("annotations", {}).get("summary") for g in rules["groups"] for r in g["rules"])
    dash = json.loads((base / "grafana-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    served = set(METRICS) | {f"{n}_{s}" for n in METRICS for s in ("bucket", "count", "sum")}
    used = {m for e in exprs for m in re.findall(r"\bhangwatch_[a-z_]+", e)}
    assert used and used <= served, used - served
    assert {"hangwatch_snapshot_timestamp_seconds", "hangwatch_incidents_total", "hangwatch_state"} <= used


def test_a_metrics_port_already_taken_refuses_to_start_and_says_why(tmp_path, capsys):
    import socket

    from hangwatch.supervisor import app

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        cfg = Config.model_validate(
            {
                "run_dir": str(tmp_path / "run"),
                "worker": {"command": ["python", "t.py"]},
                "metrics": {"listen": f"127.0.0.1:{port}"},
            }
        )
        assert app.run(cfg, control_factory=None, configure_logging=False) == 1
    finally:
        taken.close()
    err = capsys.readouterr().err
    assert err.startswith(f"hangwatch: cannot serve metrics on 127.0.0.1:{port}: ") and "in use" in err
    assert not (tmp_path / "run" / "attempts").exists()  # nothing was started
