"""Alerts without a network: which log events become which alert (storm control included), the words of each,
the courier's retries, the outbox that never blocks, the notifier fan-out and the log tap."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest
import structlog

from hangwatch.supervisor.ops import logsetup
from hangwatch.supervisor.ops.alerts import EVENTS, AlertDesk, Courier, Notice, Throttle, compose
from hangwatch.supervisor.ops.notify import Fanout, Outbox, Stats

ALL = {
    "incident",
    "recovered",
    "failed",
    "crash_loop",
    "no_progress",
    "lost_peer",
    "resume_diverged",
    "generate_truncated",
    "unkillable",
}


def desk(on=ALL, interval=300.0):
    sent: list[Notice] = []
    return AlertDesk(set(on), interval, sent.append), sent


def stall(d, ident, now, attempt=1, step=4, kind="stall"):
    d.feed(
        {
            "event": "stall_detected",
            "incident": ident,
            "kind": kind,
            "step": step,
            "attempt": attempt,
            "deadline": "step",
            "elapsed_s": 2.0,
        },
        now,
    )
    d.feed(
        {"event": "stack_dumped", "incident": ident, "stuck": "f (x.py:1)", "classification": "blocked in C"}, now + 1
    )


def crash(d, ident, now, attempt):
    d.feed(
        {
            "event": "worker_failed",
            "kind": "crash",
            "incident": ident,
            "attempt": attempt,
            "classification": "crash with RuntimeError",
        },
        now,
    )


def gone(d, now, nxt="backoff", attempt=1):
    d.feed({"event": "tree_gone", "attempt": attempt, "next": nxt, "why": "x; next attempt in 0s"}, now)


# ---------------------------------------------------------------------------------------------- the desk


def test_a_handled_stall_is_one_incident_alert_with_what_the_log_said():
    d, sent = desk()
    stall(d, "0001", 10.0)
    assert sent == []  # nothing before the tree is gone: the alert says what was done
    gone(d, 13.5)
    [n] = sent
    assert n.event == "incident"
    assert n.facts["id"] == "0001" and n.facts["kind"] == "stall" and n.facts["step"] == 4
    assert n.facts["stuck"] == "f (x.py:1)" and n.facts["next"] == "backoff" and n.facts["handled_s"] == 3.5


def test_a_stall_recovered_in_the_process_is_one_incident_alert_saying_nothing_restarted(tmp_path):
    d, sent = desk()
    stall(d, "0001", 10.0)
    d.feed({"event": "recovered_in_process", "incident": "0001", "attempt": 1, "text": "step 5 abandoned"}, 10.8)
    [n] = sent
    assert n.event == "incident" and n.facts["next"] == "recovered_in_process" and n.facts["handled_s"] == 0.8
    msg = compose(n, tmp_path / "run", "box")
    assert "recovered in the worker's process, nothing restarted: step 5 abandoned" in msg["body"]
    d.feed({"event": "oom_adapted", "incident": "0002", "kind": "oom_adapted", "step": 7, "text": "16 → 8"}, 11.0)
    assert len(sent) == 1  # inside the storm window: held, counted into the next summary


def test_a_crash_loop_is_one_incident_alert_and_one_summary():
    d, sent = desk()
    for i, attempt in enumerate((1, 2, 3, 4)):
        crash(d, f"000{attempt}", 10.0 + i, attempt)
        gone(d, 10.1 + i, nxt="failed" if attempt == 4 else "backoff", attempt=attempt)
        d.observe(attempt, 2, 10.2 + i)  # each attempt steps to 2 and crashes: never past the step it hit
        d.tick(10.3 + i)
    d.feed({"event": "crash_loop", "incident": "0005", "reason": "crash loop: 3 restart(s) …"}, 14.0)
    d.feed({"event": "state", "to": "failed", "why": "crash loop: 3 restart(s) …", "attempt": 4}, 14.0)
    d.tick(14.0)
    assert [n.event for n in sent] == ["incident", "crash_loop"]
    assert [h["id"] for h in sent[1].held] == ["0002", "0003", "0004"]
    assert sent[1].facts["id"] == "0005"
    assert d.throttle.suppressed == 3


@pytest.mark.parametrize(
    "ending, on, expected",
    [
        ("crash_loop", ALL, "crash_loop"),
        ("no_progress", ALL, "no_progress"),
        (None, ALL, "failed"),
        ("crash_loop", {"failed"}, "failed"),  # the specific kind is off: the run's end still says failed
        ("no_progress", {"incident"}, None),
    ],
)
def test_the_runs_end_is_one_alert_of_the_most_specific_kind_enabled(ending, on, expected):
    d, sent = desk(on)
    d.feed({"event": "state", "to": "failed", "why": "why", "attempt": 3}, 5.0)
    if ending:  # the no-progress incident is recorded after the state changed, in the same pass
        d.feed({"event": ending, "incident": "0009", "reason": "because"}, 5.0)
    d.tick(5.0)
    d.tick(6.0)
    assert [n.event for n in sent] == ([expected] if expected else [])


def test_recovered_comes_once_training_passes_the_step_the_incident_hit():
    d, sent = desk()
    stall(d, "0001", 1.0, step=40)
    gone(d, 2.0)
    d.observe(2, 35, 3.0)  # the replay after resuming from step 30
    d.observe(2, 40, 4.0)
    assert [n.event for n in sent] == ["incident"]
    d.observe(2, 41, 5.0)
    d.observe(2, 42, 6.0)
    assert [n.event for n in sent] == ["incident", "recovered"]
    assert sent[1].facts == {"id": "0001", "step": 41, "attempt": 2, "hit_step": 40}


def test_an_operators_restart_or_stop_alerts_nobody():
    d, sent = desk()
    d.feed({"event": "restart_now", "incident": "0001", "kind": "manual", "attempt": 1}, 1.0)
    gone(d, 2.0, nxt="starting")
    d.feed({"event": "stall_detected", "incident": "0002", "kind": "stall", "attempt": 2}, 3.0)
    gone(d, 4.0, nxt="stopped", attempt=2)
    assert sent == []


def test_held_incidents_go_out_as_one_summary_after_the_interval():
    d, sent = desk(interval=60)
    stall(d, "0001", 0.0)
    gone(d, 1.0)
    d.observe(2, 5, 2.0)  # recovered
    stall(d, "0002", 10.0, attempt=2, step=9)
    gone(d, 11.0, attempt=2)
    d.tick(30.0)
    assert [n.event for n in sent] == ["incident", "recovered"]
    d.tick(61.0)
    assert [n.event for n in sent] == ["incident", "recovered", "summary"]
    assert [h["id"] for h in sent[2].held] == ["0002"]
    d.tick(200.0)
    assert len(sent) == 3


def test_events_not_in_alerts_on_are_not_sent():
    d, sent = desk({"failed"})
    stall(d, "0001", 0.0)
    gone(d, 1.0)
    d.observe(2, 9, 2.0)
    assert sent == []


@pytest.mark.parametrize(
    "steps, sent_events",
    [
        ([], ["incident"]),
        ([("recovered", 5)], ["incident", "recovered"]),
    ],
)
def test_throttle_table(steps, sent_events):
    t = Throttle(100)
    out = t.incident(Notice("incident", {"id": "1"}), 0.0)
    for what, now in steps:
        out += getattr(t, what)(Notice(what, {}), now)
    assert [n.event for n in out] == sent_events
    assert t.incident(Notice("incident", {"id": "2"}), 10.0) == []  # within the interval: held, recovered or not
    assert t.held == [{"id": "2", "kind": None, "step": None}]


# ---------------------------------------------------------------------------------------------- the words


def write_incident(run_dir, ident="0001", kind="stall", **extra):
    d = run_dir / "incidents" / f"{ident}-{kind}"
    d.mkdir(parents=True)
    rec = {
        "id": ident,
        "kind": kind,
        "attempt": 1,
        "step": 40,
        "classification": "blocked in C (CPU 0%, state S)",
        "stuck_frame": {"function": "__call__", "file": "daemon/faults.py", "line": 121},
        "dump_rank": 0,
        "dumps": {"0": "stack-rank0.txt"},
        "deadline": {"name": "phase", "budget_s": 10.0, "elapsed_s": 10.001},
        "timings": {"sigkill_after_s": 0.5, "detection_to_gone_s": 6.1},
        "last_good_checkpoint": "ckpt/step-30",
        "last_good_step": 30,
        "summary": "in generate(): phase deadline 10.0s exceeded",
        **extra,
    }
    (d / "incident.json").write_text(json.dumps(rec))
    return d


def test_the_incident_alert_names_run_kind_culprit_frame_step_action_duration_and_place(tmp_path):
    run_dir = tmp_path / "demo"
    inc_dir = write_incident(run_dir)
    n = Notice(
        "incident", {"id": "0001", "kind": "stall", "next": "backoff", "why": "…; next attempt in 1s", "handled_s": 6.2}
    )
    msg = compose(n, run_dir, "box1")
    assert msg["title"] == "hangwatch demo: stall at step 40 — restarting"
    body = msg["body"]
    for needle in (
        f"run: demo ({run_dir.resolve()}) on box1, attempt 1",
        "kind: stall",
        "culprit: rank 0: blocked in C (CPU 0%, state S)",
        "frame: __call__ (daemon/faults.py:121)",
        "step: 40",
        "done: dumped the stacks of rank(s) 0; stopped the process tree (SIGTERM, then SIGKILL); "
        "restarting from ckpt/step-30 (step 30); next attempt in 1s",
        "took: detected 10.001 s after the last sign of progress (phase deadline 10.0 s); handled 6.2 s after "
        "detection; tree gone 6.1 s after detection",
        f"incident: {inc_dir.resolve()}",
    ):
        assert needle in body, (needle, body)
    assert msg["level"] == "failure" and msg["kind"] == "stall" and msg["incident_dir"] == str(inc_dir.resolve())


def test_an_incident_whose_record_cannot_be_read_is_still_worded_from_the_log(tmp_path):
    n = Notice(
        "incident",
        {
            "id": "0007",
            "kind": "crash",
            "step": 3,
            "classification": "crash with ValueError",
            "next": "failed",
            "why": "crash loop",
            "handled_s": 0.1,
        },
    )
    msg = compose(n, tmp_path / "r", "h")
    assert "kind: crash" in msg["body"] and "culprit: crash with ValueError" in msg["body"]
    assert "ended the run failed: crash loop" in msg["body"] and "incident: 0007" in msg["body"]


def test_a_summary_lists_what_was_held(tmp_path):
    n = Notice("crash_loop", {"reason": "crash loop: 3 restart(s)", "id": None})
    n.held = [{"id": "0002", "kind": "crash"}, {"id": "0003", "kind": "crash"}, {"id": "0004", "kind": "oom"}]
    msg = compose(n, tmp_path / "r", "h")
    assert msg["title"] == "hangwatch r: run FAILED — crash loop"
    assert "also 3 incident(s) not sent one by one: 2 crash, 1 oom (0002, 0003, 0004)" in msg["body"]


# ---------------------------------------------------------------------------------------------- delivery


class FlakySink:
    name = "flaky"

    def __init__(self, failures):
        self.failures, self.calls = failures, 0

    def __call__(self, msg):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError("connection refused")


@pytest.mark.parametrize(
    "failures, retries, calls, result",
    [
        (0, 2, 1, "sent"),
        (2, 2, 3, "sent"),
        (3, 2, 3, "failed"),
        (1, 0, 1, "failed"),
    ],
)
def test_the_courier_retries_then_counts(tmp_path, failures, retries, calls, result):
    stats, sink, naps = Stats(), FlakySink(failures), []
    Courier(tmp_path, [sink], retries, stats, sleep=naps.append, host="h").deliver(Notice("failed", {"why": "x"}))
    assert sink.calls == calls
    assert stats.snapshot() == {(f"alerts_{result}", "flaky"): 1}
    assert naps == [1.0, 2.0][: min(failures, retries)]


def test_one_failing_sink_does_not_stop_the_others(tmp_path):
    stats, good = Stats(), []
    Courier(tmp_path, [FlakySink(99), good.append], 0, stats, sleep=lambda s: None, host="h").deliver(
        Notice("failed", {})
    )
    assert len(good) == 1 and stats.snapshot()[("alerts_failed", "flaky")] == 1


def test_the_outbox_never_blocks_and_counts_what_it_drops():
    gate, done = threading.Event(), []
    box = Outbox("t", lambda item: (gate.wait(5), done.append(item)), maxsize=2).start()
    t0 = time.monotonic()
    results = [box.put(i) for i in range(6)]  # one in delivery, two queued, the rest dropped
    assert time.monotonic() - t0 < 1.0
    assert results.count(False) >= 3 and box.stats.snapshot()[("t_dropped", "")] == results.count(False)
    assert not box.idle()
    gate.set()
    assert box.close(5) and done == [i for i, ok in enumerate(results) if ok]


def test_an_outbox_whose_setup_fails_drops_and_counts():
    def broken():
        raise ValueError("no such plugin")

    box = Outbox("a", lambda item: None, setup=broken).start()
    box.put(1)
    assert box.close(5)
    assert box.broken == "no such plugin" and box.stats.snapshot()[("a_dropped", "")] == 1


def test_the_fanout_reaches_every_listener_even_when_one_raises():
    class Boom:
        def watchdog(self, now):
            raise RuntimeError("boom")

    class Ear:
        calls = []

        def watchdog(self, now):
            self.calls.append(now)
            return True

    ear = Ear()
    assert Fanout(Boom(), None, ear).watchdog(3.0) is True
    assert ear.calls == [3.0]


def test_a_tap_sees_every_logged_event_and_a_broken_tap_costs_no_line(tmp_path):
    seen, stream = [], io.StringIO()
    logsetup.configure(tmp_path, "info", stream=stream, environ={})

    def broken(ev):
        raise RuntimeError("tap")

    logsetup.add_tap(broken)
    logsetup.add_tap(seen.append)
    try:
        structlog.get_logger("hangwatch").warning("stall_detected", incident="0001", kind="stall")
    finally:
        logsetup.remove_tap(broken)
        logsetup.remove_tap(seen.append)
    assert [(e["event"], e["incident"]) for e in seen] == [("stall_detected", "0001")]
    assert "stall_detected" in stream.getvalue()
    assert '"incident": "0001"' in (tmp_path / "supervisor.log").read_text()


def test_a_lost_peer_is_one_warning_alert_with_the_wait_in_words(tmp_path):
    d, sent = desk()
    words = "waiting for 1 of 2 nodes at the rendezvous since 08:28:26 (job-g1 at gpu01:29400); missing: gpu02:/r"
    d.feed({"event": "peer_lost", "incident": "0003", "node": "gpu01:/r", "why": words, "reason": words}, 5.0)
    [n] = sent
    assert n.event == "lost_peer"
    msg = compose(n, tmp_path / "job", "gpu01")
    assert msg["title"] == "hangwatch job: a peer node is missing" and msg["level"] == "warning"
    assert f"why: {words}" in msg["body"]


# ----------------------------------------------------------------------------------- incidents that restart nothing


def diverged(d, ident, now, attempt=3, step=41):
    d.feed(
        {
            "event": "resume_diverged",
            "incident": ident,
            "attempt": attempt,
            "step": step,
            "figure": "lr",
            "now": 1.2e-4,
            "before": 2.0e-4,
            "on_divergence": "warn",
            "text": f"resume diverged at step {step}: lr 0.00012 now, 0.0002 before",
        },
        now,
    )


def truncated(d, ident, now, attempt=1, step=50):
    d.feed(
        {
            "event": "generate_truncated",
            "incident": ident,
            "attempt": attempt,
            "step": step,
            "tokens": {"0": 512},
            "limit": 512,
            "text": "generate ran past its 60 s budget still producing tokens: ended at token 512",
        },
        now,
    )


def test_alert_events_known_to_the_config_are_the_ones_the_desk_can_send():
    from hangwatch.common.config.ops_schema import ALERT_EVENTS, AlertsCfg

    assert set(ALERT_EVENTS) == ALL and set(AlertsCfg().on) == ALL
    assert {"resume_diverged", "generate_truncated"} <= EVENTS


def test_a_diverged_resume_is_sent_at_once_even_inside_an_incident_storm():
    d, sent = desk()
    stall(d, "0001", 0.0)
    gone(d, 1.0)  # an incident alert: the storm window is open
    stall(d, "0002", 2.0, attempt=2)
    gone(d, 3.0, attempt=2)  # held
    diverged(d, "0003", 4.0)
    assert [n.event for n in sent] == ["incident", "resume_diverged"]
    n = sent[1]
    assert n.facts == {
        "id": "0003",
        "kind": "resume_diverged",
        "attempt": 3,
        "step": 41,
        "figure": "lr",
        "now": 1.2e-4,
        "before": 2.0e-4,
        "on_divergence": "warn",
        "text": "resume diverged at step 41: lr 0.00012 now, 0.0002 before",
    }
    assert n.held == [] and [h["id"] for h in d.throttle.held] == ["0002"]  # the storm's count is the storm's
    diverged(d, "0004", 5.0, attempt=4)
    assert [n.event for n in sent] == ["incident", "resume_diverged", "resume_diverged"]  # never held


def test_an_unkillable_tree_is_sent_at_once_inside_an_incident_storm_and_says_what_to_do():
    d, sent = desk()
    stall(d, "0001", 0.0)
    gone(d, 1.0)  # an incident alert: the storm window is open
    d.feed(
        {
            "event": "unkillable",
            "incident": "0002",
            "attempt": 1,
            "pids": [4242],
            "on_unkillable": "wait",
            "text": "1 process(es) of attempt 1's tree outlived SIGKILL by 30 s: 4242 (disk-sleep, waiting in "
            "nfs_wait_bit_killable)",
        },
        2.0,
    )
    assert [n.event for n in sent] == ["incident", "unkillable"]
    n = sent[1]
    assert n.held == [] and n.facts["pids"] == [4242] and n.facts["on_unkillable"] == "wait"
    assert "nfs_wait_bit_killable" in n.facts["text"]
    d2, sent2 = desk(on=ALL - {"unkillable"})
    d2.feed(
        {"event": "unkillable", "incident": "0002", "attempt": 1, "pids": [4242], "on_unkillable": "fail", "text": "…"},
        0.0,
    )
    assert sent2 == []


def test_a_diverged_resume_leaves_the_storm_window_shut():
    d, sent = desk()
    diverged(d, "0002", 0.0)
    stall(d, "0003", 1.0, attempt=3)
    gone(d, 2.0, attempt=3)
    assert [n.event for n in sent] == ["resume_diverged", "incident"]


def test_generate_truncated_is_one_warning_then_counted_into_summaries():
    d, sent = desk(interval=60)
    truncated(d, "0001", 0.0, step=50)
    truncated(d, "0002", 10.0, step=100)  # every eval: the same lost EOS
    truncated(d, "0003", 20.0, step=150)
    d.tick(30.0)
    assert [n.event for n in sent] == ["generate_truncated"]
    assert sent[0].facts["tokens"] == {"0": 512} and sent[0].facts["limit"] == 512 and sent[0].facts["step"] == 50
    d.tick(61.0)
    assert [n.event for n in sent] == ["generate_truncated", "summary"]
    assert [(h["id"], h["kind"]) for h in sent[1].held] == [
        ("0002", "generate_truncated"),
        ("0003", "generate_truncated"),
    ]
    truncated(d, "0004", 70.0, step=200)
    d.tick(100.0)
    assert len(sent) == 2  # within the interval of the last summary
    d.tick(122.0)
    assert [n.event for n in sent][-1] == "summary" and [h["id"] for h in sent[-1].held] == ["0004"]
    assert d.throttle.suppressed == 3


def test_a_truncation_never_holds_back_an_incident_alert_nor_the_other_way_round():
    d, sent = desk(interval=300)
    truncated(d, "0001", 0.0)
    stall(d, "0002", 5.0)
    gone(d, 6.0)  # a real stall seconds after a truncation: alerted
    truncated(d, "0003", 7.0, attempt=2)  # the second truncation: held however quiet the incidents are
    assert [n.event for n in sent] == ["generate_truncated", "incident"]
    d.observe(2, 60, 8.0)  # recovered: what was held rides along
    assert [n.event for n in sent] == ["generate_truncated", "incident", "recovered"]
    assert [h["id"] for h in sent[-1].held] == ["0003"]


def test_a_summary_of_truncations_alone_leaves_the_incident_window_shut():
    d, sent = desk(interval=60)
    truncated(d, "0001", 0.0)
    truncated(d, "0002", 1.0)
    d.tick(61.0)
    stall(d, "0003", 62.0)
    gone(d, 63.0)
    assert [n.event for n in sent] == ["generate_truncated", "summary", "incident"]


def test_the_new_events_are_not_sent_when_not_in_alerts_on():
    d, sent = desk({"incident"})
    diverged(d, "0001", 0.0)
    truncated(d, "0002", 1.0)
    truncated(d, "0003", 2.0)
    d.tick(1000.0)
    assert sent == [] and d.throttle.suppressed == 0


def test_the_diverged_resume_alert_names_step_figure_the_audit_and_the_first_difference(tmp_path):
    run_dir = tmp_path / "demo"
    audit = {
        "attempt": 3,
        "previous_attempt": 2,
        "resumed_step": 40,
        "replayed": [41, 44],
        "verdict": "diverged",
        "text": "resume diverged at step 41: lr 0.00012 now, 0.0002 before",
        "difference": {"step": 41, "rank": 0, "figure": "lr", "now": 1.2e-4, "before": 2.0e-4},
    }
    inc_dir = write_incident(
        run_dir, "0005", "resume_diverged", step=41, attempt=3, resume_audit=audit, on_divergence="stop"
    )
    n = Notice(
        "resume_diverged",
        {"id": "0005", "kind": "resume_diverged", "attempt": 3, "step": 41, "figure": "lr", "text": audit["text"]},
    )
    msg = compose(n, run_dir, "box1")
    assert msg["title"] == "hangwatch demo: resume DIVERGED at step 41 — lr differs from before the restart"
    assert msg["level"] == "failure" and msg["kind"] == "resume_diverged" and msg["figure"] == "lr"
    assert msg["difference"] == audit["difference"]
    for needle in (
        f"run: demo ({run_dir.resolve()}) on box1, attempt 3",
        f"audit: {audit['text']}",
        "difference: step 41, rank 0: lr 0.00012 now, 0.0002 before",
        "then: the run ends failed (watchdog.resume_audit.on_divergence: stop)",
        f"incident: {inc_dir.resolve()}",
    ):
        assert needle in msg["body"], (needle, msg["body"])


def test_the_truncation_alert_names_tokens_limit_budget_prompt_and_output(tmp_path):
    run_dir = tmp_path / "demo"
    inc_dir = write_incident(
        run_dir,
        "0002",
        "generate_truncated",
        step=50,
        attempt=1,
        ranks=[0, 1],
        tokens={"0": 512, "1": 512},
        limit=512,
        prompt="reverse: cat",
        output_tail="tac tac tac " * 40,
        budget_s=60.0,
        elapsed_s=61.2,
        phase="generate",
        summary="generate truncated",
    )
    n = Notice(
        "generate_truncated",
        {
            "id": "0002",
            "kind": "generate_truncated",
            "attempt": 1,
            "step": 50,
            "tokens": {"0": 512, "1": 512},
            "limit": 512,
            "text": "ended at 512 tokens",
        },
    )
    msg = compose(n, run_dir, "box1")
    assert msg["title"] == "hangwatch demo: generate truncated at step 50 — 512 tokens"
    assert msg["level"] == "warning" and msg["tokens"] == {"0": 512, "1": 512} and msg["limit"] == 512
    body = msg["body"]
    for needle in (
        "what: ended at 512 tokens",
        "took: 61.2 s in phase generate, budget 60.0 s; ended at 512 tokens (limit 512) on rank(s) 0, 1",
        "prompt: reverse: cat",
        "done: nothing restarted",
        f"incident: {inc_dir.resolve()}",
    ):
        assert needle in body, (needle, body)
    [tail] = [line for line in body.splitlines() if line.startswith("output ends: ")]
    assert tail.startswith("output ends: …") and len(tail) <= len("output ends: ") + 200


def test_the_new_alerts_read_from_the_log_alone_when_the_incident_cannot_be_read(tmp_path):
    n = Notice(
        "generate_truncated",
        {"id": "0009", "step": 7, "tokens": {"0": 64, "1": 60}, "limit": 64, "text": "cut", "attempt": 2},
    )
    msg = compose(n, tmp_path / "r", "h")
    assert msg["title"] == "hangwatch r: generate truncated at step 7 — 64 tokens (rank 0), 60 tokens (rank 1)"
    assert "incident: 0009" in msg["body"]
    n = Notice("resume_diverged", {"id": "0010", "step": 12, "figure": "loss", "text": "loss differs", "attempt": 2})
    msg = compose(n, tmp_path / "r", "h")
    assert msg["title"] == "hangwatch r: resume DIVERGED at step 12 — loss differs from before the restart"
    assert "audit: loss differs" in msg["body"] and "difference:" not in msg["body"]
