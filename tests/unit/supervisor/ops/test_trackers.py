"""The supervisor's reports on the tracker runs, without the trackers: which events become marks (none held back),
what each mark says the attempt's run must be now, when a report waits for the worker's record, what the helper is
handed, and a failing tracker said once.  The helper itself, with the real libraries: tests/faults."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from hangwatch.common.trackers import write_rank
from hangwatch.supervisor.ops.alerts import Notice
from hangwatch.supervisor.ops.notify import Outbox, Stats
from hangwatch.supervisor.ops.trackers import (
    REPORT_SCRIPT,
    WAITING_MAX,
    Ending,
    TrackerDesk,
    TrackerReporter,
    helper_env,
    mark,
    run_helper,
    summary,
)
from hangwatch.supervisor.processes.process import PsutilProcessTable

from .test_alerts import crash, gone, stall

WANDB = {"id": "abc123", "project": "p", "root_dir": "/tmp/x", "mode": "offline", "attempt": 1, "last_step": 24}


def desk():
    sent: list = []
    return TrackerDesk(sent.append), sent


def test_every_incident_is_marked_none_held_back_as_alerts_are():
    d, sent = desk()
    stall(d, "0001", 10.0, attempt=1, step=24)
    gone(d, 12.0, attempt=1)
    crash(d, "0002", 20.0, attempt=2)  # an alert desk holds this one until recovered or min_interval_s
    gone(d, 21.0, attempt=2)
    assert [(n.event, n.facts["id"]) for n in sent] == [("incident", "0001"), ("incident", "0002")]
    d.observe(3, 30, 40.0)
    assert sent[-1].event == "recovered" and sent[-1].facts["step"] == 30


def test_resume_verdicts_are_marked_though_no_alert_is_sent_for_a_verified_one():
    d, sent = desk()
    d.feed({"event": "resume_verified", "attempt": 2, "step": 21, "text": "steps 21-24 match"}, 1.0)
    d.feed({"event": "resume_diverged", "attempt": 2, "step": 22, "incident": "0003", "figure": "loss"}, 2.0)
    assert [n.event for n in sent] == ["resume_verified", "resume_diverged"]
    assert sent[0].facts["step"] == 21


@pytest.mark.parametrize(
    "kind, nxt, status",
    [
        ("stall", "backoff", "KILLED"),  # hangwatch ended the attempt
        ("livelock", "failed", "KILLED"),
        ("crash", "backoff", "FAILED"),  # the attempt failed by itself
        ("oom", "failed", "FAILED"),
        ("stall", "recovered_in_process", None),  # the attempt goes on
    ],
)
def test_a_mark_says_what_the_attempts_run_must_be_now(kind, nxt, status):
    n = Notice("incident", {"id": "0001", "kind": kind, "step": 24, "attempt": 1, "next": nxt})
    m = mark(n, {"event": "incident", "kind": kind, "step": 24, "title": "t", "body": "b", "level": "failure"})
    assert (m["status"], m["step"], m["level"], m["kind"]) == (status, 24, "ERROR", kind)


def test_the_summary_says_the_outcome_and_where_the_time_went():
    end = Ending("failed", 75, attempts=3, restarts=2, step=31, goodput={"goodput_pct": 61.5, "lost_s": 12.0})
    s = summary(end, incidents=2)
    assert (s["status"], s["goodput_pct"], s["lost_s"], s["restarts"], s["incidents"]) == ("FAILED", 61.5, 12.0, 2, 2)
    assert summary(Ending("finished", 0, 1, 0, 40), 0)["status"] == "FINISHED"


class Runs:
    """Records what the helper would be handed; answers as report.py does (one JSON line of outcomes)."""

    def __init__(self, answer: dict | None = None, code: int = 0, err: bytes = b""):
        self.calls: list = []
        self.answer, self.code, self.err = answer, code, err

    def __call__(self, argv, stdin, env, cwd, timeout_s):
        payload = json.loads(stdin)
        self.calls.append((argv, payload, env, cwd, timeout_s))
        answer = self.answer if self.answer is not None else {k: "ok" for k in payload["trackers"]}
        return self.code, (json.dumps(answer) + "\n").encode(), self.err


def reporter(tmp_path: Path, runs: Runs) -> TrackerReporter:
    return TrackerReporter(tmp_path, "/venv/bin/python", {"WANDB_MODE": "offline"}, "/work", 30.0, Stats(), runner=runs)


def test_a_report_waits_for_the_workers_record_then_carries_what_waited(tmp_path):
    runs = Runs()
    rep = reporter(tmp_path, runs)
    rep.deliver(Notice("incident", {"id": "0001", "kind": "stall", "step": 3, "attempt": 1, "next": "backoff"}))
    assert runs.calls == []  # the script had not opened a tracker run yet: nothing to put it on
    write_rank(tmp_path, 0, {"wandb": WANDB})
    rep.deliver(Notice("resume_verified", {"attempt": 2, "step": 21, "text": "same"}))
    [(argv, payload, env, cwd, timeout_s)] = runs.calls
    assert argv == ["/venv/bin/python", str(REPORT_SCRIPT)] and REPORT_SCRIPT.is_file()
    assert [m["event"] for m in payload["marks"]] == ["incident", "resume_verified"]
    assert payload["marks"][0]["status"] == "KILLED" and payload["marks"][0]["step"] == 3
    assert payload["trackers"] == {"wandb": WANDB} and payload["summary"] is None
    assert (env, cwd, timeout_s) == ({"WANDB_MODE": "offline"}, "/work", 30.0)
    rep.deliver(Ending("finished", 0, 2, 1, 40, {"goodput_pct": 80.0, "lost_s": 5.0}))
    last = runs.calls[-1][1]
    assert last["marks"] == [] and last["summary"]["goodput_pct"] == 80.0


def test_a_failing_tracker_is_said_once_and_the_others_go_on(tmp_path):
    write_rank(tmp_path, 0, {"wandb": WANDB, "mlflow": {"run_id": "r", "tracking_uri": "sqlite:///x.db"}})
    runs = Runs(answer={"wandb": "ok", "mlflow": "MlflowException: no such run"})
    rep = reporter(tmp_path, runs)
    with structlog.testing.capture_logs() as logs:
        for i in range(3):
            rep.deliver(Notice("incident", {"id": f"000{i}", "kind": "stall", "step": i, "next": "backoff"}))
    failed = [e for e in logs if e["event"] == "tracker_failed"]
    assert len(runs.calls) == 3 and [(e["tracker"], e["error"]) for e in failed] == [
        ("mlflow", "MlflowException: no such run")
    ]
    assert rep.stats.snapshot()[("tracker_reports_failed", "mlflow")] == 3


def test_a_helper_that_dies_fails_every_tracker_once_with_its_last_line(tmp_path):
    write_rank(tmp_path, 0, {"wandb": WANDB})
    rep = reporter(
        tmp_path, Runs(answer={}, code=1, err=b"Traceback ...\nModuleNotFoundError: No module named 'wandb'")
    )
    with structlog.testing.capture_logs() as logs:
        rep.deliver(Ending("finished", 0, 1, 0, 5))
    [e] = [e for e in logs if e["event"] == "tracker_failed"]
    assert e["tracker"] == "wandb" and "No module named 'wandb'" in e["error"]


def test_a_helper_past_its_time_is_killed_with_its_session(tmp_path):
    script = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    script += "time.sleep(60)"
    code, out, err = run_helper([sys.executable, "-c", script], b"{}", {}, None, 0.5)
    assert code < 0 and b"timed out after 0.5s" in err


def test_the_helper_runs_in_the_workers_environment_without_hangwatchs_own():
    env = helper_env({"WANDB_API_KEY": "k", "HANGWATCH_RUN_DIR": "/r", "HANGWATCH_INSTRUMENT": "auto", "PATH": "/b"})
    assert env == {"WANDB_API_KEY": "k", "PATH": "/b"}


def test_one_report_carries_everything_that_was_queued_while_the_last_one_ran(tmp_path):
    write_rank(tmp_path, 0, {"wandb": WANDB})
    runs = Runs()
    rep = reporter(tmp_path, runs)
    rep.deliver(
        [
            Notice("incident", {"id": "0001", "kind": "stall", "step": 3, "next": "backoff"}),
            Notice("recovered", {"id": "0001", "step": 5, "attempt": 2, "hit_step": 3}),
            Ending("finished", 0, 2, 1, 9),
        ]
    )
    [(_, payload, *_)] = runs.calls
    assert [m["event"] for m in payload["marks"]] == ["incident", "recovered"] and payload["summary"]["step"] == 9


def test_a_batching_outbox_hands_over_what_waited_and_what_came_before_its_close():
    import threading

    got: list = []
    gate = threading.Event()

    def deliver(items):
        gate.wait(5)
        got.append(items)

    box = Outbox("t", deliver, batch=True).start()
    box.put(1)
    time.sleep(0.05)  # the thread holds item 1 at the gate; 2 and 3 queue behind it
    box.put(2)
    box.put(3)
    gate.set()
    assert box.close(5)
    assert got == [[1], [2, 3]]


def test_the_supervisors_own_helpers_are_never_taken_for_a_workers_orphans():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        plain, told = PsutilProcessTable(), PsutilProcessTable(helpers=lambda: {child.pid})
        assert child.pid in [r.pid for r in plain.own_children()]
        assert child.pid not in [r.pid for r in told.own_children()]
    finally:
        child.kill()
        child.wait()


def test_a_run_that_never_opens_a_tracker_run_keeps_only_the_latest_marks(tmp_path):
    rep = reporter(tmp_path, Runs())
    for i in range(WAITING_MAX + 50):
        rep.deliver(Notice("incident", {"id": f"{i:04d}", "kind": "oom_adapted", "step": i, "next": "backoff"}))
    assert len(rep.waiting) == WAITING_MAX and rep.waiting[0]["step"] == 50
