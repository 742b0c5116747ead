"""The report's reading of a run dir (written here by hand) and the page it makes — no supervisor, no browser."""

from __future__ import annotations

import json
import re

from hangwatch.supervisor.cli.report import read_run, render, write_report


def beats(run_dir, attempt, lines):
    d = run_dir / "attempts" / f"{attempt:04d}"
    d.mkdir(parents=True)
    with open(d / "heartbeat-rank0.jsonl", "w") as f:
        for rec in lines:
            f.write(json.dumps({"v": 1, "pid": 1, "rank": 0, "attempt": attempt, "phase": "train", **rec}) + "\n")
        f.write('{"v":1,"t":1,"eve\n')  # a torn line: skipped


def incident(run_dir, ident, kind, **rec):
    d = run_dir / "incidents" / f"{ident}-{kind}"
    d.mkdir(parents=True)
    (d / "incident.json").write_text(json.dumps({"id": ident, "kind": kind, **rec}))


def make_run(tmp_path):
    run = tmp_path / "r"
    beats(
        run,
        1,
        [{"event": "start", "t": 100.0, "step": 0, "resumed_from": None}]
        + [
            {"event": "step", "t": 100.0 + s, "step": s, "loss": 3.0 / s, "lr": 1e-4, "tokens_per_s": 500}
            for s in range(1, 8)
        ],
    )
    beats(
        run,
        2,
        [{"event": "start", "t": 120.0, "step": 4, "resumed_from": "ckpt-4"}]
        + [
            {"event": "step", "t": 120.0 + s, "step": 4 + s, "loss": "nan" if s == 2 else 1.0, "step_time_s": 0.5}
            for s in range(1, 4)
        ]
        + [{"event": "stop", "t": 124.0, "step": 7, "reason": "finished"}],
    )
    incident(
        run,
        "0001",
        "stall",
        attempt=1,
        step=7,
        time="2026-11-23T03:14:15+0000",
        time_unix=110.0,
        classification="busy loop in Python (CPU 100%) at spin (/srv/train.py:88)",
        stuck_frame={"function": "spin", "file": "/srv/train.py", "line": 88},
        dump_rank=0,
        deadline={"name": "step", "elapsed_s": 3.2},
        summary="step deadline …",
        last_good_step=4,
    )
    (run / "evolution.jsonl").write_text(
        json.dumps({"step": 5, "prompt": "upper: fox", "reference": "FOX", "output": "F<o>x", "attempt": 1})
        + "\n"
        + json.dumps({"step": 6, "prompt": "upper: fox", "reference": "FOX", "output": "FOX", "attempt": 2})
        + "\n"
    )
    (run / "state.json").write_text(json.dumps({"state": "finished", "restarts": 1, "last_good_checkpoint": "ckpt-6"}))
    return run


def test_the_run_as_the_report_reads_it(tmp_path):
    data = read_run(make_run(tmp_path))
    assert [(s["attempt"], s["step"]) for s in data.steps] == [(1, s) for s in range(1, 8)] + [(2, 5), (2, 6), (2, 7)]
    assert data.steps[1]["step_s"] == 1.0  # between beats when the step gives no time of its own
    assert data.steps[-1]["step_s"] == 0.5
    assert data.steps[-2]["finite"] is False  # "nan" arrives as a string
    assert [(a["attempt"], a["first_step"], a["last_step"], a["resumed_from"], a["stop"]) for a in data.attempts] == [
        (1, 1, 7, None, None),
        (2, 5, 7, "ckpt-4", "finished"),
    ]
    [inc] = data.incidents
    assert inc["steps_lost"] == 3  # hit at step 7, the next attempt resumed from step 4
    assert inc["recover_s"] == 11.0  # detected at 110, the next attempt's first step at 121
    assert inc["culprit"] == "rank 0: busy loop in Python (CPU 100%)"
    assert inc["frame"] == "spin (/srv/train.py:88)" and inc["frame_short"] == "spin (train.py:88)"
    assert [g["output"] for g in data.generations] == ["F<o>x", "FOX"]


def test_the_page_stands_alone_and_escapes_what_the_run_wrote(tmp_path):
    page = render(read_run(make_run(tmp_path)))
    assert page.startswith("<!DOCTYPE html>") and 'name="viewport"' in page
    assert not re.search(r"<script[^>]+src=", page)  # plotly inlined: opens without a network
    assert "F&lt;o&gt;x" in page and "F<o>x" not in page
    assert ">0001 stall<" not in page  # annotations are drawn by the browser, from the figure's JSON
    assert '"text":"0001 stall"' in page
    assert "spin (train.py:88)" in page and ">3</td>" in page and "11.0 s" in page


def test_a_run_with_no_steps_yet_still_renders(tmp_path):
    run = tmp_path / "new"
    (run / "attempts" / "0001").mkdir(parents=True)
    out = write_report(run)
    assert out == run / "report.html"
    text = out.read_text()
    assert "No step beats yet." in text and "No incidents." in text and "No eval generations" in text
