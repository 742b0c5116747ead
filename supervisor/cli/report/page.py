"""The report page: one HTML file with plotly's JavaScript inlined, so it opens anywhere without a network.

Up to four charts share the step axis — loss, learning rate, step time, tokens/s, each only when the beats carry
that figure, each y axis from its own data (a constant learning rate is a flat line at its value) — one trace per
attempt (a resumed
attempt replays the steps after its checkpoint, so the replay shows as its own line), a dotted line where
each attempt after the first began, and a red line with the incident's number and kind where each incident
hit.  Below: where the run's wall time went (the goodput ledger: a strip over wall-clock time, one colour per
category, and a table of the categories), the incidents table, the resume audits (was each resumed attempt the
same training?) and, per eval prompt, its outputs over the steps.  The layout is one column that narrows to a
phone's width (the tables scroll sideways there).  Plotly's JavaScript is inlined once, in the page's head: its basic
bundle (scatter and bar, ~1.2 MB, `plotly-basic.min.js` beside this module), not the whole library (4.6 MB).
"""

from __future__ import annotations

import html
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

from hangwatch.supervisor.cli.report.run_records import RunData, read_run
from hangwatch.supervisor.records.goodput import CATEGORIES, LABELS, LOST, goodput_line, short

CHARTS = (("loss", "loss"), ("lr", "learning rate"), ("step_s", "step time (s)"), ("tokens_per_s", "tokens/s"))
MAX_POINTS = 5000  # per attempt and chart: a week-long run stays a page a phone can draw
COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;
  margin:0 auto;max-width:1100px;padding:12px;color:#222}
h1{font-size:1.4em;margin:.2em 0} h2{font-size:1.15em;margin:1.2em 0 .4em}
.facts{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:.95em;color:#444}
.facts b{color:#222} .state-failed{color:#c0392b} .state-finished{color:#1e8449}
.scroll{overflow-x:auto} table{border-collapse:collapse;font-size:.9em;min-width:100%}
th,td{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.num{text-align:right;white-space:nowrap} code{font-size:.95em}
pre{white-space:pre-wrap;margin:0;font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.9em}
.kind{font-weight:600;color:#c0392b} .muted{color:#777} tr.more td{border-bottom:1px solid #ddd;padding-top:0}
table.incidents tr:not(.more) td{border-bottom:none} details summary{cursor:pointer;color:#555;font-size:.9em}
table.gen td.num{width:4.5em}
.swatch{display:inline-block;width:.8em;height:.8em;border-radius:2px;margin-right:.4em;vertical-align:-1px}
tr.lost td{color:#8e2c20} tr.zero td{color:#999} tr.total td{font-weight:600;border-top:2px solid #bbb}
.verdict-verified{color:#1e8449} .verdict-diverged{color:#c0392b;font-weight:600} .verdict-partial,.verdict-pending,
.verdict-unverifiable{color:#8a6d00}
"""
# One colour per goodput category: kept work in green and blue, failures' cost in reds, waiting in greys.
CATEGORY_COLORS = {
    "training": "#2ca02c",
    "redone": "#ff7f0e",
    "eval": "#1f77b4",
    "checkpoint": "#9467bd",
    "startup": "#17becf",
    "detection": "#d62728",
    "dumps": "#e377c2",
    "abandon": "#f7b6d2",
    "kill": "#8c1c13",
    "gpu_release": "#c76f6f",
    "restart_startup": "#f4a582",
    "backoff": "#bcbd22",
    "paused": "#7f7f7f",
    "idle": "#c7c7c7",
    "other": "#8c564b",
}


def _thin(points: list[dict]) -> list[dict]:
    if len(points) <= MAX_POINTS:
        return points
    every = -(-len(points) // MAX_POINTS)
    return points[::every] + ([points[-1]] if (len(points) - 1) % every else [])


PLOTLY_JS = Path(__file__).with_name("plotly-basic.min.js")


def y_range(values: list[float]) -> Optional[list[float]]:
    """A y axis for `values` from the data: a flat series gets a band around its value (plotly's own pick for one
    is ±1 around it — a learning rate of 0.001 drawn on −1…1); None: let plotly choose."""
    finite = [v for v in values if isinstance(v, (int, float)) and v == v and abs(v) != float("inf")]
    if not finite:
        return None
    lo, hi = min(finite), max(finite)
    if hi > lo:
        return None
    pad = abs(lo) * 0.1 or 0.5
    return [lo - pad, hi + pad]


def charts_of(run: RunData) -> list[tuple[str, str]]:
    """The charts the beats have data for (a script that reports no tokens/s gets no empty tokens/s chart)."""
    return [(key, title) for key, title in CHARTS if any(s.get(key) is not None for s in run.steps)]


def figure(run: RunData):
    """The plotly figure: a chart per figure the beats carry, over steps, attempts and incidents marked."""
    import plotly.graph_objects as go  # noqa: PLC0415 (only when a report is made)
    from plotly.subplots import make_subplots  # noqa: PLC0415

    charts = charts_of(run)
    fig = make_subplots(
        rows=len(charts),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04,
        subplot_titles=[title for _, title in charts],
    )
    for row, (key, _) in enumerate(charts, start=1):
        band = y_range([s[key] for s in run.steps if s.get(key) is not None])
        if band is not None:
            fig.update_yaxes(range=band, row=row, col=1)
    attempts = sorted({s["attempt"] for s in run.steps})
    for i, number in enumerate(attempts):
        pts = _thin([s for s in run.steps if s["attempt"] == number])
        color = COLORS[i % len(COLORS)]
        for row, (key, title) in enumerate(charts, start=1):
            xs = [p["step"] for p in pts if p[key] is not None]
            ys = [p[key] for p in pts if p[key] is not None]
            fig.add_trace(
                go.Scatter(
                    x=xs,
                    y=ys,
                    mode="lines+markers" if len(xs) < 60 else "lines",
                    name=f"attempt {number}",
                    legendgroup=f"a{number}",
                    showlegend=row == 1,
                    line={"color": color, "width": 1.6},
                    marker={"size": 4},
                    hovertemplate=f"attempt {number}<br>step %{{x}}<br>{title} %{{y:.4g}}<extra></extra>",
                ),
                row=row,
                col=1,
            )
    for a in run.attempts[1:]:
        if a.get("first_step") is not None:
            fig.add_vline(x=a["first_step"] - 0.5, line={"color": "#888", "dash": "dot", "width": 1})
    for inc in run.incidents:
        if isinstance(inc.get("step"), int):
            fig.add_vline(
                x=inc["step"],
                line={"color": "#c0392b", "width": 2},
                annotation={
                    "text": f"{inc['id']} {inc['kind']}",
                    "font": {"color": "#c0392b", "size": 11},
                    "textangle": -90,
                    "yanchor": "top",
                },
                annotation_position="top left",
            )
    fig.update_layout(
        autosize=True,
        height=230 * len(charts) + 60,
        margin={"l": 50, "r": 10, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.06},
        hovermode="x unified",
        template="plotly_white",
    )
    fig.update_xaxes(title_text="step", row=len(charts), col=1)
    return fig


def _td(v, cls: str = "") -> str:
    text = "" if v is None else html.escape(str(v))
    return f'<td class="{cls}">{text}</td>' if cls else f"<td>{text}</td>"


def incidents_table(run: RunData) -> str:
    """One row per incident; its summary (what the supervisor concluded) folds open beneath it."""
    if not run.incidents:
        return '<p class="muted">No incidents.</p>'
    head = ("id", "kind", "attempt", "step", "culprit", "frame", "detected", "steps lost", "time to recover")
    rows = []
    for i in run.incidents:
        clock = (i.get("time") or "")[11:19]
        detected = clock + (
            f" ({i['deadline']} deadline, {i['detected_after_s']} s after the last progress)"
            if i.get("detected_after_s") is not None
            else ""
        )
        rows.append(
            "<tr>"
            + _td(i["id"])
            + f'<td class="kind">{html.escape(str(i["kind"]))}</td>'
            + _td(i["attempt"], "num")
            + _td(i["step"], "num")
            + _td(i["culprit"])
            + f'<td><code title="{html.escape(i["frame"])}">{html.escape(i["frame_short"] or "—")}</code></td>'
            + _td(detected)
            + _td(i["steps_lost"], "num")
            + _td(f"{i['recover_s']} s" if i.get("recover_s") is not None else "—", "num")
            + "</tr>"
        )
        if i.get("summary"):
            rows.append(
                f'<tr class="more"><td></td><td colspan="{len(head) - 1}"><details><summary>summary and evidence'
                f'</summary><p>{html.escape(i["summary"])}</p><p class="muted">{html.escape(i["dir"])}</p>'
                f"</details></td></tr>"
            )
    return (
        '<div class="scroll"><table class="incidents"><tr>'
        + "".join(f"<th>{h}</th>" for h in head)
        + "</tr>"
        + "".join(rows)
        + "</table></div>"
    )


def generations_section(run: RunData) -> str:
    if not run.generations:
        return '<p class="muted">No eval generations (evolution.jsonl) in this run.</p>'

    def _truncated_mark(g: dict) -> str:  # the supervisor ended this generation (watchdog.generate_overrun)
        if not g.get("truncated"):
            return ""
        skipped = f", {g['skipped_prompts']} prompts skipped" if g.get("skipped_prompts") else ""
        return html.escape(f"\u2026 [truncated at {g.get('tokens')} tokens{skipped}]")

    prompts: dict[str, list[dict]] = {}
    for g in run.generations:
        prompts.setdefault(str(g["prompt"]), []).append(g)
    out = []
    for prompt, gens in prompts.items():
        ref = next((g["reference"] for g in gens if g.get("reference")), None)
        out.append(
            f"<h3>{html.escape(prompt)}</h3>"
            + (f"<p>reference: <code>{html.escape(str(ref))}</code></p>" if ref else "")
        )
        rows = "".join(
            "<tr>"
            + _td(g["step"], "num")
            + _td(g.get("attempt"), "num")
            + f"<td><pre>{html.escape(str(g.get('output') or ''))}{_truncated_mark(g)}</pre></td></tr>"
            for g in sorted(gens, key=lambda g: (g["step"], g.get("attempt") or 0))
        )
        out.append(
            '<div class="scroll"><table class="gen"><tr><th>step</th><th>attempt</th><th>output</th></tr>'
            + rows
            + "</table></div>"
        )
    return "".join(out)


def _segments(goodput: dict) -> list[tuple[float, float, str]]:
    out = []
    for seg in goodput.get("segments") or []:
        if not isinstance(seg, (list, tuple)) or len(seg) < 3:
            continue
        start, end = _float(seg[0]), _float(seg[1])
        if start is not None and end is not None and end > start:
            out.append((start, end, str(seg[2])))
    return out


def _float(v) -> Optional[float]:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def timeline_figure(goodput: dict):
    """The run's wall time as one strip of segments, coloured by category (None: the ledger kept no timeline)."""
    import plotly.graph_objects as go  # noqa: PLC0415

    segments = _segments(goodput)
    if not segments:
        return None
    present = {c for _, _, c in segments}
    fig = go.Figure()
    for cat in [c for c in CATEGORIES if c in present] + sorted(present - set(CATEGORIES)):
        mine = [(a, b) for a, b, c in segments if c == cat]
        label = LABELS.get(cat, cat)
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=["wall time"] * len(mine),
                x=[(b - a) * 1000.0 for a, b in mine],
                base=[_clock(a) for a, _ in mine],
                name=label,
                marker={"color": CATEGORY_COLORS.get(cat, "#999999")},
                customdata=[[_clock(a)[11:19], _clock(b)[11:19], short(b - a)] for a, b in mine],
                hovertemplate=f"{html.escape(label)}<br>%{{customdata[0]}} → %{{customdata[1]}}"
                f" (%{{customdata[2]}})<extra></extra>",
            )
        )
    fig.update_layout(
        barmode="overlay",
        bargap=0.1,
        height=230,
        template="plotly_white",
        margin={"l": 10, "r": 10, "t": 10, "b": 40},
        legend={"orientation": "h", "y": -0.35},
        hovermode="closest",
    )
    fig.update_xaxes(type="date")
    fig.update_yaxes(visible=False)
    return fig


def goodput_table(goodput: dict) -> str:
    """Every category with its seconds and share of the wall time, the ones failures cost marked."""
    cats = goodput.get("categories") or {}
    wall = _float(goodput.get("wall_s")) or sum(_float(v) or 0.0 for v in cats.values())
    rows = []
    for cat in list(CATEGORIES) + sorted(set(cats) - set(CATEGORIES)):
        sec = _float(cats.get(cat)) or 0.0
        cls = "zero" if sec <= 0 else ("lost" if cat in LOST else "")
        share = f"{100 * sec / wall:.1f} %" if wall else "—"
        swatch = f'<span class="swatch" style="background:{CATEGORY_COLORS.get(cat, "#999999")}"></span>'
        rows.append(
            f'<tr class="{cls}" data-category="{html.escape(cat)}"><td>{swatch}<code>{html.escape(cat)}</code></td>'
            + _td(LABELS.get(cat, ""))
            + f'<td class="num" title="{sec:.1f} s">{html.escape(short(sec))}</td>'
            + _td(share, "num")
            + "</tr>"
        )
    rows.append(
        '<tr class="total"><td>wall time</td><td></td>'
        + f'<td class="num" title="{wall:.1f} s">{html.escape(short(wall))}</td>'
        + _td("100 %" if wall else "—", "num")
        + "</tr>"
    )
    return (
        '<div class="scroll"><table class="goodput"><tr><th>category</th><th>what</th><th>time</th>'
        "<th>share</th></tr>" + "".join(rows) + "</table></div>"
    )


def goodput_section(run: RunData, plot) -> str:
    """The goodput line, the timeline (drawn by `plot`, which inlines plotly's JavaScript if no chart has yet) and
    the table; one muted line when the run dir holds no ledger."""
    g = run.goodput
    if not g:
        return '<p class="muted">No goodput ledger (goodput.json) in this run.</p>'
    line = g.get("line") if isinstance(g.get("line"), str) and g.get("line") else goodput_line(g)
    fig = timeline_figure(g)
    chart = plot(fig) if fig is not None else '<p class="muted">No timeline in goodput.json.</p>'
    return (
        f'<section id="goodput"><p class="goodput-line"><b>{html.escape(line)}</b></p>'
        f"{chart}{goodput_table(g)}</section>"
    )


def _steps(span) -> str:
    if isinstance(span, (list, tuple)) and len(span) == 2 and all(isinstance(x, int) for x in span):
        return f"{span[0]}–{span[1]}" if span[0] != span[1] else str(span[0])
    return "—"


def _difference(d) -> str:
    if not isinstance(d, dict):
        return ""
    return f"step {d.get('step')}, rank {d.get('rank')}: {d.get('figure')} {d.get('now')} now, {d.get('before')} before"


def _incidents(audit: dict) -> str:
    """The failure whose restart was audited, and the `resume_diverged` incident the audit raised."""
    parts = [str(audit["incident"])] if audit.get("incident") else []
    if audit.get("diverged_incident"):
        parts.append(f"{audit['diverged_incident']} resume_diverged")
    return ", ".join(parts) or "—"


def audits_table(run: RunData) -> str:
    """One row per restart that resumed: what it replayed and whether the replay matched the steps before."""
    if not run.audits:
        return '<p class="muted">No resume audits (resume-audit.json): no attempt resumed, or none was audited.</p>'
    rows = []
    for a in run.audits:
        verdict = str(a.get("verdict") or "")
        text = html.escape(str(a.get("text") or verdict or ""))
        diff = _difference(a.get("difference"))
        if diff:
            text += f'<br><span class="muted">{html.escape(diff)}</span>'
        rows.append(
            "<tr>"
            + _td(a.get("attempt"), "num")
            + _td(a.get("resumed_step"), "num")
            + _td(_steps(a.get("replayed")), "num")
            + f'<td class="verdict-{html.escape(verdict)}">{text}</td>'
            + _td(_incidents(a))
            + "</tr>"
        )
    return (
        '<div class="scroll"><table class="audits"><tr><th>attempt</th><th>resumed from step</th>'
        "<th>replayed steps</th><th>verdict</th><th>incident</th></tr>" + "".join(rows) + "</table></div>"
    )


def render(run: RunData) -> str:
    """The whole page as one string."""
    import plotly.io as pio  # noqa: PLC0415

    drawn = []

    def plot(fig) -> str:
        drawn.append(True)
        return pio.to_html(
            fig,
            include_plotlyjs=False,
            full_html=False,
            default_width="100%",
            config={"responsive": True, "displaylogo": False},
        )

    st = run.state
    state = str(st.get("state") or "unknown")
    last_step = max((s["step"] for s in run.steps), default=None)
    day = next((i["time"][:10] for i in run.incidents if i.get("time")), None)
    facts = [
        ("state", f'<b class="state-{html.escape(state)}">{html.escape(state)}</b>'),
        ("last step", last_step),
        ("attempts", len(run.attempts)),
        ("incidents", len(run.incidents)),
        ("restarts", st.get("restarts")),
        ("last good checkpoint", st.get("last_good_checkpoint")),
        ("first incident on", day),
        ("goodput", _goodput_pct(run.goodput)),
        ("run dir", str(run.run_dir.resolve())),
    ]
    facts_html = "".join(
        f"<span>{k}: <b>{v if k == 'state' else html.escape(str(v))}</b></span>" for k, v in facts if v is not None
    )
    chart = plot(figure(run)) if run.steps else '<p class="muted">No step beats yet.</p>'
    where = goodput_section(run, plot)
    made = time.strftime("%Y-%m-%d %H:%M:%S %z")
    script = f'<script type="text/javascript">{PLOTLY_JS.read_text(encoding="utf-8")}</script>' if drawn else ""
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>hangwatch report: {html.escape(run.name)}</title><style>{CSS}</style>{script}</head><body>"
        f'<h1>hangwatch report: {html.escape(run.name)}</h1><div class="facts">{facts_html}</div>'
        f"<h2>Training</h2>{chart}<h2>Where the time went</h2>{where}"
        f"<h2>Incidents</h2>{incidents_table(run)}<h2>Resume audits</h2>{audits_table(run)}"
        f"<h2>Eval generations over steps</h2>{generations_section(run)}"
        f'<p class="muted">made {made} by hangwatch report from {html.escape(str(run.run_dir.resolve()))}</p>'
        f"</body></html>"
    )


def _goodput_pct(g: Optional[dict]) -> Optional[str]:
    pct = _float((g or {}).get("goodput_pct"))
    return f"{pct:.1f} %" if pct is not None else None


def write_report(run_dir, out: Optional[Path] = None) -> Path:
    """Read `run_dir`, write the page to `out` (default `<run_dir>/report.html`) and return its path."""
    run = read_run(run_dir)
    path = Path(out) if out is not None else Path(run_dir) / "report.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render(run), encoding="utf-8")
    tmp.replace(path)
    return path
