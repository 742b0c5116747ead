"""The goodput ledger and the resume audits where a person looks: the `status` row, the run's closing summary and
the report's sections, each rendered from a snapshot or a run dir written here by hand."""

from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from hangwatch.supervisor.cli.render import status_view
from hangwatch.supervisor.cli.report import read_run, render
from hangwatch.supervisor.cli.report.run_records import read_resume_audits
from hangwatch.supervisor.cli.summary import run_summary
from hangwatch.supervisor.records.goodput import CATEGORIES, LABELS

LINE = "goodput 93.1 % — lost 6 min: 2 failures (detection 40 s, recovery 3 min), redone steps 2 min"
T0 = 1_700_000_000.0


def snapshot(**extra) -> dict:
    cats = dict.fromkeys(CATEGORIES, 0.0)
    cats.update(training=5400.0, redone=120.0, eval=60.0, detection=40.0, dumps=20.0, kill=10.0, restart_startup=150.0)
    wall = sum(cats.values())
    return {
        "version": 1,
        "started_unix": T0,
        "updated_unix": T0 + wall,
        "wall_s": wall,
        "categories": cats,
        "goodput_pct": 100 * cats["training"] / wall,
        "lost_s": 340.0,
        "failures": 2,
        "line": LINE,
        **extra,
    }


SEGMENTS = [
    [T0, T0 + 3000, "training"],
    [T0 + 3000, T0 + 3040, "detection"],
    [T0 + 3040, T0 + 3060, "dumps"],
    [T0 + 3060, T0 + 3070, "kill"],
    [T0 + 3070, T0 + 3220, "restart_startup"],
    [T0 + 3220, T0 + 3340, "redone"],
    [T0 + 3340, T0 + 3400, "eval"],
    [T0 + 3400, T0 + 5800, "training"],
]

VERIFIED = {
    "attempt": 2,
    "previous_attempt": 1,
    "resumed_step": 30,
    "replayed": [31, 39],
    "compared": [31, 39],
    "steps_compared": 9,
    "figures": ["loss"],
    "rtol": 0.0,
    "verdict": "verified",
    "text": "resume verified: steps 31–39 replayed, loss bitwise equal",
    "incident": "0003",
}
DIVERGED = {
    "attempt": 3,
    "previous_attempt": 2,
    "resumed_step": 40,
    "replayed": [41, 44],
    "compared": [41, 41],
    "steps_compared": 1,
    "figures": ["loss", "lr"],
    "rtol": 0.0,
    "verdict": "diverged",
    "text": "resume diverged at step 41: lr 0.00012 now, 0.0002 before",
    "difference": {"step": 41, "rank": 0, "figure": "lr", "now": 1.2e-4, "before": 2.0e-4},
    "incident": "0004",
    "diverged_incident": "0005",
}


def shown(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(renderable)
    return out.getvalue()


def incident(run_dir, ident, kind, **rec):
    d = run_dir / "incidents" / f"{ident}-{kind}"
    d.mkdir(parents=True)
    (d / "incident.json").write_text(json.dumps({"id": ident, "kind": kind, "summary": f"{kind} it was", **rec}))


def run_dir_with(tmp_path, goodput=None, audits=None):
    run = tmp_path / "r"
    (run / "attempts" / "0001").mkdir(parents=True)
    (run / "state.json").write_text(json.dumps({"state": "finished", "attempt": 3}))
    if goodput is not None:
        (run / "goodput.json").write_text(json.dumps(goodput))
    if audits is not None:
        (run / "resume-audit.json").write_text(json.dumps({"audits": audits}))
    return run


# ---------------------------------------------------------------------------------------------- status


def test_status_shows_the_goodput_line_as_one_row():
    text = shown(status_view({"state": "running", "attempt": 3, "goodput": snapshot()}))
    [row] = [line for line in text.splitlines() if line.startswith("goodput")]
    assert row.split(None, 1)[1].strip() == LINE


@pytest.mark.parametrize("st", [{"state": "running"}, {"state": "running", "goodput": None}])
def test_status_without_a_ledger_has_no_goodput_row(st):
    assert not any(line.startswith("goodput") for line in shown(status_view(st)).splitlines())


def test_a_snapshot_without_its_line_is_worded_from_its_figures():
    snap = snapshot()
    del snap["line"]
    text = shown(status_view({"state": "running", "goodput": snap}))
    assert re.search(r"^goodput\s+goodput 93\.\d % — lost \d+ min: 2 failures \(detection 40 s, recovery", text, re.M)


# ---------------------------------------------------------------------------------------------- summary


def test_the_runs_summary_has_the_goodput_line_then_one_line_per_resume_audit(tmp_path):
    run = run_dir_with(tmp_path, snapshot(segments=SEGMENTS), [VERIFIED, DIVERGED])
    incident(run, "0003", "stall", attempt=1)
    lines = run_summary(str(run), 0)
    at = next(i for i, line in enumerate(lines) if line.startswith("  incident 0003"))
    assert lines[at + 1 : at + 4] == [
        f"  {LINE}",
        "  resume after incident 0003: resume verified: steps 31–39 replayed, loss bitwise equal",
        "  resume after incident 0004: resume diverged at step 41: lr 0.00012 now, 0.0002 before (incident 0005)",
    ]


def test_a_run_without_ledger_or_audits_says_nothing_of_them(tmp_path):
    lines = run_summary(str(run_dir_with(tmp_path)), 0)
    assert not any("goodput" in line or "resume" in line for line in lines)


# ---------------------------------------------------------------------------------------------- audits read


def test_audits_fall_back_to_what_the_incidents_carry(tmp_path):
    run = run_dir_with(tmp_path)
    incident(run, "0003", "stall", attempt=1, resume_audit={k: v for k, v in VERIFIED.items() if k != "incident"})
    incident(
        run, "0004", "resume_diverged", attempt=2, resume_audit={**VERIFIED, "incident": "0003"}
    )  # the same restart
    incident(run, "0001", "crash", attempt=1)
    audits = read_resume_audits(run)
    assert [(a["attempt"], a["incident"], a["verdict"]) for a in audits] == [(2, "0003", "verified")]


def test_the_file_wins_over_the_incidents(tmp_path):
    run = run_dir_with(tmp_path, audits=[DIVERGED])
    incident(run, "0003", "stall", attempt=1, resume_audit=VERIFIED)
    assert [a["verdict"] for a in read_resume_audits(run)] == ["diverged"]


# ---------------------------------------------------------------------------------------------- report


def section(page: str, title: str) -> str:
    return page.split(f"<h2>{title}</h2>", 1)[1].split("<h2>", 1)[0]


def test_the_report_says_where_the_time_went(tmp_path):
    page = render(read_run(run_dir_with(tmp_path, snapshot(segments=SEGMENTS))))
    where = section(page, "Where the time went")
    assert f"<b>{LINE}</b>" in where
    rows = re.findall(r'<tr class="(\w*)" data-category="(\w+)">(.*?)</tr>', where)
    assert [r[1] for r in rows] == list(CATEGORIES)
    by_cat = {cat: (cls, cells) for cls, cat, cells in rows}
    assert LABELS["training"] in by_cat["training"][1] and 'title="5400.0 s">1.5 h<' in by_cat["training"][1]
    assert ">93.1 %<" in by_cat["training"][1] and by_cat["training"][0] == ""
    assert by_cat["detection"][0] == "lost" and by_cat["paused"][0] == "zero"
    assert '<tr class="total"><td>wall time</td><td></td><td class="num" title="5800.0 s">' in where
    assert where.count("<th>") == 4  # category, what, time, share: one column of time
    # the timeline: one horizontal bar trace per category present, named by its label, drawn over wall-clock time
    names = re.findall(r'"name":"([^"]+)","orientation":"h"', where)
    assert sorted(names) == sorted(LABELS[c] for c in {s[2] for s in SEGMENTS})
    assert '"type":"date"' in where
    assert ">goodput: <b>93.1 %</b>" in page  # among the facts at the top


@pytest.mark.parametrize("stepped", [False, True])
def test_plotlys_basic_bundle_is_inlined_once_before_the_charts(tmp_path, stepped):
    run = run_dir_with(tmp_path, snapshot(segments=SEGMENTS))
    if stepped:
        (run / "attempts" / "0001" / "heartbeat-rank0.jsonl").write_text(
            json.dumps({"v": 1, "event": "step", "t": T0, "step": 1, "loss": 2.0, "rank": 0, "attempt": 1}) + "\n"
        )
    page = render(read_run(run))
    assert ("No step beats yet." in page) is not stepped
    assert not re.search(r"<script[^>]+src=", page)  # opens without a network
    assert page.count("plotly.js (basic - minified)") == 1  # the bundle of the traces it draws, once
    assert page.index("plotly.js (basic - minified)") < page.index("Plotly.newPlot")
    assert page.count("Plotly.newPlot") == (2 if stepped else 1)
    assert len(page.encode()) < 2_000_000  # not the whole library (4.6 MB)


def steps_file(run, rows):
    (run / "attempts" / "0001" / "heartbeat-rank0.jsonl").write_text(
        "".join(
            json.dumps({"v": 1, "event": "step", "t": T0 + i, "rank": 0, "attempt": 1, "step": i + 1, **row}) + "\n"
            for i, row in enumerate(rows)
        )
    )


def test_a_chart_only_for_what_the_beats_carry_and_a_flat_lr_at_its_value(tmp_path):
    run = run_dir_with(tmp_path, snapshot(segments=SEGMENTS))
    steps_file(run, [{"loss": 2.0 - i / 10, "lr": 0.001, "step_time_s": 0.5} for i in range(5)])
    page = render(read_run(run))
    training = section(page, "Training")
    titles = re.findall(r'"text":"(loss|learning rate|step time \(s\)|tokens/s)"', training)
    assert titles == ["loss", "learning rate", "step time (s)"]  # no tokens/s: no beat carried it
    ranges = re.findall(r'"range":\[([^\]]+)\]', training)
    assert ["0.0009,0.0011"] == [r for r in ranges if r.startswith("0.0009")], ranges  # not −1…1


def test_the_report_lists_the_resume_audits(tmp_path):
    page = render(read_run(run_dir_with(tmp_path, audits=[VERIFIED, DIVERGED])))
    audits = section(page, "Resume audits")
    rows = re.findall(r"<tr>(<td.*?)</tr>", audits)
    assert len(rows) == 2
    assert (
        '<td class="num">2</td><td class="num">30</td><td class="num">31–39</td>'
        '<td class="verdict-verified">resume verified: steps 31–39 replayed, loss bitwise equal</td><td>0003</td>'
    ) == rows[0]
    assert 'class="verdict-diverged"' in rows[1] and "step 41, rank 0: lr 0.00012 now, 0.0002 before" in rows[1]
    assert rows[1].endswith("<td>0004, 0005 resume_diverged</td>")


def test_no_ledger_and_no_audits_is_a_muted_line_each(tmp_path):
    page = render(read_run(run_dir_with(tmp_path)))
    assert section(page, "Where the time went") == '<p class="muted">No goodput ledger (goodput.json) in this run.</p>'
    assert section(page, "Resume audits").startswith('<p class="muted">No resume audits')


def test_a_ledger_without_a_timeline_still_has_its_table(tmp_path):
    where = section(
        render(read_run(run_dir_with(tmp_path, snapshot(segments=[["x", 1, "training"]])))), "Where the time went"
    )
    assert "No timeline in goodput.json." in where and where.count("data-category=") == len(CATEGORIES)
