"""The goodput ledger: the activity table, provisional time settled by progress or a detection, redone steps,
the sum against the wall clock, the timeline, a supervisor that goes on from goodput.json."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.records.goodput import (
    CATEGORIES,
    LOST,
    MAX_SEGMENTS,
    Goodput,
    activity,
    goodput_line,
    read_goodput,
)


@pytest.mark.parametrize(
    "state, kw, expected",
    [
        ("running", dict(phase="train", stepped=True, after_failure=False), ("training", True)),
        ("running", dict(phase="train", stepped=False, after_failure=False), ("startup", True)),
        ("running", dict(phase="load", stepped=False, after_failure=True), ("restart_startup", True)),
        ("starting", dict(phase=None, stepped=False, after_failure=True), ("restart_startup", True)),
        ("running", dict(phase=None, stepped=True, after_failure=False), ("training", True)),
        ("running", dict(phase="eval", stepped=True, after_failure=False), ("eval", True)),
        ("running", dict(phase="generate", stepped=False, after_failure=False), ("eval", True)),
        ("running", dict(phase="checkpoint", stepped=True, after_failure=True), ("checkpoint", True)),
        ("running", dict(phase="idle", stepped=True, after_failure=False), ("idle", True)),
        ("running", dict(phase="wait", stepped=True, after_failure=False), ("other", True)),
        ("stopping", dict(phase="checkpoint", stepped=True, after_failure=False), ("checkpoint", True)),
        ("stalled", dict(phase="train", stepped=True, after_failure=True), ("dumps", False)),
        ("dumping", dict(phase="train", stepped=True, after_failure=True), ("dumps", False)),
        ("recovering", dict(phase="generate", stepped=True, after_failure=False), ("abandon", False)),
        ("killing", dict(phase="train", stepped=True, after_failure=True), ("kill", False)),
        ("killing", dict(phase="train", stepped=True, after_failure=True, tree_gone=True), ("gpu_release", False)),
        ("killing", dict(phase="train", stepped=True, after_failure=False, failing=False), ("other", False)),
        ("backoff", dict(phase=None, stepped=False, after_failure=True), ("backoff", False)),
        ("paused", dict(phase=None, stepped=False, after_failure=False), ("paused", False)),
        ("finished", dict(phase="train", stepped=True, after_failure=False), None),
        ("failed", dict(phase=None, stepped=False, after_failure=True), None),
    ],
)
def test_activity_table(state, kw, expected):
    assert activity(state, **kw) == expected


def _ledger(t0=100.0, wall0=1_700_000_000.0):
    clock = {"t": t0}
    return Goodput(t0, wall=lambda: wall0 + clock["t"] - t0), clock


def test_steps_commit_training_then_a_stall_turns_pending_time_into_detection():
    g, _ = _ledger()
    g.tick(100.0, ("startup", True))
    g.progress(103.0, step=None)  # start line: 3 s of start-up
    g.tick(103.0, ("training", True))
    for i, t in enumerate((104.0, 105.0, 106.0), start=1):
        g.progress(t, step=i)
    g.tick(110.0, ("training", True))  # 4 s with no step: provisional
    assert g.categories()["training"] == pytest.approx(7.0)  # shown as it looks so far
    assert g.snapshot()["settled"]["training"] == pytest.approx(3.0)  # what a counter may serve: never taken back
    g.detected(110.0)
    g.tick(110.0, ("dumps", False))
    g.tick(112.0, ("kill", False))
    g.tick(113.0, ("gpu_release", False))
    g.tick(113.5, ("backoff", False))
    g.tick(114.5, ("restart_startup", True))
    g.progress(117.0, step=2)  # the first step of the next attempt: a replay of step 2
    g.tick(117.0, ("training", True))
    g.progress(118.0, step=3)
    g.progress(119.0, step=4)  # beyond every step reached before: kept
    cats = g.categories()
    assert cats["startup"] == pytest.approx(3.0)
    assert cats["training"] == pytest.approx(4.0)  # steps 1–3 of attempt 1, step 4 of attempt 2
    assert cats["detection"] == pytest.approx(4.0)
    assert cats["dumps"] == pytest.approx(2.0) and cats["kill"] == pytest.approx(1.0)
    assert cats["gpu_release"] == pytest.approx(0.5) and cats["backoff"] == pytest.approx(1.0)
    assert cats["restart_startup"] == pytest.approx(2.5)
    assert cats["redone"] == pytest.approx(1.0)  # step 3 again
    snap = g.snapshot()
    assert snap["wall_s"] == pytest.approx(19.0) == pytest.approx(sum(snap["categories"].values()))
    assert snap["updated_unix"] - snap["started_unix"] == pytest.approx(snap["wall_s"])
    assert snap["failures"] == 1
    assert snap["goodput_pct"] == pytest.approx(100 * 4 / 19, abs=0.01)
    assert snap["lost_s"] == pytest.approx(sum(cats[c] for c in LOST))
    assert snap["line"].startswith("goodput 21.1 % — lost 12 s: 1 failure (detection 4.0 s, recovery 6.0 s)")
    assert "redone steps 1.0 s" in snap["line"] and "backoff 1.0 s" in snap["line"]


def test_the_timeline_covers_the_run_in_order_and_coalesces():
    g, _ = _ledger()
    g.tick(100.0, ("training", True))
    for i in range(1, 6):
        g.progress(100.0 + i, step=i)
    g.tick(105.0, ("eval", True))
    g.progress(107.0)
    g.tick(107.0, ("paused", False))
    g.tick(109.0, None)  # the run is over: later time is nobody's
    g.tick(200.0, None)
    rec = g.record()
    segs = rec["segments"]
    assert [s[2] for s in segs] == ["training", "eval", "paused"]
    assert all(a[1] == pytest.approx(b[0]) for a, b in zip(segs, segs[1:]))
    assert segs[-1][1] - segs[0][0] == pytest.approx(rec["wall_s"]) == pytest.approx(9.0)
    assert rec["top_step"] == 5


def test_segments_stay_bounded_and_still_cover_the_run():
    g, _ = _ledger()
    t = 100.0
    for i in range(3 * MAX_SEGMENTS):
        g.tick(t, ("training" if i % 2 else "eval", False))
        t += 1.0
    g.tick(t, None)
    rec = g.record()
    assert len(rec["segments"]) <= MAX_SEGMENTS + 1
    assert rec["segments"][-1][1] - rec["segments"][0][0] == pytest.approx(rec["wall_s"])


def test_a_new_supervisor_goes_on_from_goodput_json(tmp_path):
    import json

    g, _ = _ledger()
    g.tick(100.0, ("training", True))
    g.progress(110.0, step=10)
    g.detected(111.0)
    (tmp_path / "goodput.json").write_text(json.dumps(g.record(111.0)))
    prev = read_goodput(tmp_path)
    h = Goodput(500.0, previous=prev)
    h.tick(500.0, ("restart_startup", True))
    h.progress(502.0, step=8)
    h.tick(502.0, ("training", True))
    h.progress(503.0, step=9)  # at or below step 10: redone
    h.progress(504.0, step=11)
    cats = h.categories()
    assert cats["training"] == pytest.approx(11.0) and cats["redone"] == pytest.approx(1.0)
    assert h.failures == 1 and h.top_step == 11
    assert sum(cats.values()) == pytest.approx(11.0 + 4.0)


def test_read_goodput_refuses_what_is_not_its_format(tmp_path):
    assert read_goodput(tmp_path) is None
    (tmp_path / "goodput.json").write_text("{not json")
    assert read_goodput(tmp_path) is None
    (tmp_path / "goodput.json").write_text('{"categories": 3}')
    assert read_goodput(tmp_path) is None


def test_goodput_line_words():
    assert goodput_line(None) == "goodput: nothing run yet"
    snap = {"wall_s": 100.0, "goodput_pct": 100.0, "categories": {c: 0.0 for c in CATEGORIES}}
    assert goodput_line(snap) == "goodput 100.0 % — nothing lost"
    cats = {c: 0.0 for c in CATEGORIES}
    cats.update(training=3000.0, detection=40.0, dumps=20.0, kill=10.0, restart_startup=150.0, redone=120.0)
    snap = {"wall_s": 3340.0, "goodput_pct": 89.8, "categories": cats, "failures": 2}
    assert goodput_line(snap) == (
        "goodput 89.8 % — lost 6 min: 2 failures (detection 40 s, recovery 3 min), redone steps 2 min"
    )
