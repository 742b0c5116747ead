"""bench-results.md: one markdown section per bench section, every table drawn by `table`, each figure
followed by how it was measured; and the machine the figures came from."""

from __future__ import annotations

import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import subprocess
from typing import Callable, Optional

import psutil

from .harness import ROOT

FIGURE_STATS = ["figure", "value (median; n, min, p95, max)"]


def machine_info() -> dict:
    def version(dist):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
        return None

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=5
            ).stdout.strip()
            or None
        )
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "peft": version("peft"),
        "psutil": version("psutil"),
        "commit": commit,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_start": os.getloadavg(),
    }


def fmt_s(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def stats_cell(s: Optional[dict], unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    if not s or not s.get("n"):
        return "not measured"
    f = lambda v: f"{v * scale:.{digits}f}"  # noqa: E731
    return f"{f(s['median'])} {unit} (n={s['n']}; min {f(s['min'])}, p95 {f(s['p95'])}, max {f(s['max'])})"


def four(s: dict) -> str:
    """min / p50 / p95 / max of a summary, in seconds."""
    return " / ".join(fmt_s(s.get(k)) for k in ("min", "median", "p95", "max")) if s.get("n") else "not measured"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row."""
    return [f"| {' | '.join(header)} |", "|" + "---|" * len(header)] + [f"| {' | '.join(cells)} |" for cells in rows]


def end_of_allowance(r: dict) -> str:
    if r["contender"] == "cron_watchdog":
        rep = r.get("cron_report") or {}
        polls, restarts = rep.get("polls"), rep.get("restarts")
        text = (
            f"gave up at the allowance after {polls} poll{'' if polls == 1 else 's'}, {restarts} "
            f"restart{'' if restarts == 1 else 's'}; worker killed"
            if rep
            else "no report from the watchdog; killed"
        )
    elif r["ended_by_itself"]:
        text = f"ended by itself, exit {r['exit_code']}"
    elif r["still_running_at_end"]:
        text = "worker still " + ", ".join(
            f"{h['status']} at {h['cpu_percent']:.0f}% CPU" for h in r["still_running_at_end"]
        )
    else:
        text = "still running; killed"
    if r["hang_began_after_s"] is None:
        text += "; the fault never fired (the worker did not reach it)"
    return text


# Each renderer: a section's results → (title, table header, table rows, how it was measured).


def heartbeat(h: dict) -> tuple:
    return (
        "1. Heartbeat cost (demo model, CPU)",
        FIGURE_STATS,
        [
            ["step time with heartbeats", stats_cell(h["summary_with"], "ms", 1000, 2)],
            ["step time without heartbeats", stats_cell(h["summary_without"], "ms", 1000, 2)],
            ["**ratio of medians (with / without)**", f"**{h['ratio_of_medians']:.3f}**"],
            [
                f"one `step` beat on its own (Heartbeat.step, {h['beat_call']['n']} calls)",
                stats_cell(h["beat_call"], "µs", 1e6, 1),
            ],
            [
                "checkpoint save (full commit, fsynced)",
                f"{stats_cell(h['checkpoint_save'], 'ms', 1000, 1)} · {h['checkpoint_bytes'] / 1024:.0f} KiB",
            ],
            ["worker cold start: spawn → `start` beat", stats_cell(h["cold_start_to_start_beat"], "s", 1, 2)],
            ["worker cold start: spawn → first step", stats_cell(h["cold_start_to_first_step"], "s", 1, 2)],
        ],
        f"{h['method']}; cold start = `python -m hangwatch.daemon` spawned alone (bench/heartbeat_cost.py), sequential "
        "trials.",
    )


def detection(d: dict) -> tuple:
    goal = d.get("goal_p95_s", 0.05)

    def met(x: dict) -> str:
        m = x.get("p95_meets_goal") or {}
        word = {True: "yes", False: "no"}
        return f"{word.get(m.get('overdue_s'), '–')} / {word.get(m.get('beyond_budget_from_last_line_s'), '–')}"

    rows = [
        [
            dl,
            str(x["overdue_s"].get("n", 0)),
            four(x["overdue_s"]),
            four(x["beyond_budget_from_last_line_s"]),
            met(x),
            fmt_s(x["detection_to_gone_s"].get("median")),
            str(len(x["other_deadline_fired"])),
            str(x["trials_with_loop_gaps"]),
        ]
        for dl, x in d["deadlines"].items()
    ]
    return (
        f"2. Detection latency beyond the budget ({d['budget_s'][0]:g}–{d['budget_s'][1]:g} s budgets)",
        [
            "deadline",
            "trials",
            "supervisor clock: min / p50 / p95 / max (s)",
            "from the worker's last line: min / p50 / p95 / max (s)",
            f"p95 ≤ {goal:g} s (supervisor / last line)",
            "detection → tree gone p50 (s)",
            "other deadline fired",
            "trials where the supervisor logged a loop gap",
        ],
        rows,
        f"{d['method']}.",
    )


def recovery(r: dict) -> tuple:
    """One column per world size (the ranks of the built-in worker), one row per figure; each goal as the
    median of (figure − goal) per trial — the goal taken from the same trial — and the trials that met it."""
    worlds = r["worlds"]
    cold = r.get("cold_start_to_first_step_s")

    def row(label: str, key: str, unit: str = "s", digits: int = 2) -> list[str]:
        return [label] + [stats_cell(w.get(key), unit, 1, digits) for w in worlds.values()]

    def goal(label: str, key: str, met: str) -> list[str]:
        def cell(w: dict) -> str:
            s = w.get(key) or {}
            if not s.get("n"):
                return "not measured"
            return (
                f"{'meets' if s['median'] <= 0 else 'misses'}: median {s['median']:+.2f} s "
                f"(max {s['max']:+.2f} s); met in {w.get(met, 0)} of {s['n']}"
            )

        return [label] + [cell(w) for w in worlds.values()]

    def verdict(n: str, w: dict) -> str:
        done = w["trials"] - len(w["errors"])
        return "– (one process)" if n == "1" else f"{w['culprit_named']} of {done}"

    return (
        "3. Detection and recovery of the built-in worker, 1 and 2 ranks (demo model, hang in C)",
        ["figure"] + [f"{n} rank" if n == "1" else f"{n} ranks (torchrun, gloo)" for n in worlds],
        [
            row("step deadline: beyond the budget, supervisor clock", "overdue_s", digits=3),
            row(
                "step deadline: beyond the budget, from the last step line", "beyond_budget_from_last_line_s", digits=3
            ),
            ["verdict names the hung rank as the culprit"] + [verdict(n, w) for n, w in worlds.items()],
            row("detection → process tree gone", "detection_to_gone_s"),
            row("· process snapshot (CPU sample)", "snapshot_s"),
            row("· dump settle: SIGUSR1 → every dump in", "dump_settle_s"),
            row("  · faulthandler files in (whole, or stopped growing; goal ≤ 0.3 s)", "dump_files_s"),
            row("  · py-spy done (run beside them, time-boxed)", "py_spy_s"),
            row("· detection → SIGTERM to the tree", "detection_to_sigterm_s"),
            row("· SIGTERM → tree gone", "sigterm_to_gone_s"),
            goal(
                "**goal: detection → tree gone ≤ dump settle + 0.5 s** (figure − goal)",
                "gone_minus_goal_s",
                "gone_goal_met",
            ),
            row("restart delay the policy chose (backoff)", "restart_delay_s"),
            row("detection → next attempt spawned", "detection_to_next_spawn_s"),
            row("next attempt: spawned → first step", "next_spawn_to_first_step_s"),
            row("detection → first step of the next attempt", "detection_to_next_step_s"),
            row("first attempt: worker spawned → first step (the cold start of this run)", "spawn_to_first_step_s"),
            goal(
                "**goal: detection → next step ≤ this run's cold start + 1.0 s** (figure − goal)",
                "next_step_minus_goal_s",
                "next_step_goal_met",
            ),
            row(
                "· of which: the next attempt's cold start − the first attempt's (the machine's noise)",
                "cold_start_difference_s",
            ),
            ["worker's own cold start → first step (heartbeat section, for comparison)"]
            + [stats_cell(cold, "s", 1, 2) if cold else "not measured (run the heartbeat section)"]
            + ["–"] * (len(worlds) - 1),
            row("steps lost per fault: hang (resume from the last good checkpoint)", "steps_lost_hang", "steps", 0),
            row("steps lost per fault: graceful `restart`", "steps_lost_graceful", "steps", 0),
            row("graceful `restart` request → first step of the next attempt", "request_to_next_step_s"),
            ["trials that could not be measured"]
            + ["; ".join(w["errors"]) if w["errors"] else "none" for w in worlds.values()],
        ],
        r["method"],
    )


def footprint(f: dict) -> tuple:
    return (
        f"4. Supervisor footprint ({f['ranks']} ranks at {f['hz']:g} Hz, {f['window_s']:.0f} s)",
        ["figure", "value"],
        [
            ["CPU, whole window", f"{f['cpu_percent_whole_window']:.2f} % of one core"],
            ["CPU, per 1 s sample", stats_cell(f["cpu_percent"], "%", 1, 2)],
            ["RSS", stats_cell(f["rss_mib"], "MiB", 1, 1)],
            [
                "heartbeat lines handled",
                f"{f['heartbeat_lines_in_window']} ({f['lines_per_s']:.0f}/s), {f['torn_lines']} torn",
            ],
            ["start: spawn → worker spawned", stats_cell(f["start_to_worker_spawned_s"], "s", 1, 3)],
            ["start: spawn → control socket answers", stats_cell(f["start_to_socket_ready_s"], "s", 1, 3)],
            *footprint_loads(f),
        ],
        f["method"],
    )


def footprint_loads(f: dict) -> list[list[str]]:
    """Each load (8 ranks × 20 Hz, 64 × 10 Hz) against its goals, and the idle supervisor."""
    rows = []
    for load in f.get("loads", []):
        name = f"{load.get('ranks')} ranks × {load.get('hz', 0):g} Hz"
        rows.append(
            [
                f"{name}: CPU (goal ≤ {load.get('cpu_goal_percent', 0):g} %)",
                f"{load['cpu_percent_whole_window']:.2f} % — {'met' if load.get('cpu_meets_goal') else 'missed'}",
            ]
        )
        if load.get("rss_goal_mib") is not None:
            rss = load["rss_mib"]
            rows.append(
                [
                    f"{name}: RSS (goal ≤ {load['rss_goal_mib']:g} MiB)",
                    f"{rss if isinstance(rss, (int, float)) else stats_cell(rss, 'MiB', 1, 1)}"
                    f" — {'met' if load.get('rss_meets_goal') else 'missed'}",
                ]
            )
        if load.get("wakeups_per_s") is not None:
            rows.append([f"{name}: loop wake-ups", f"{load['wakeups_per_s']:.1f}/s"])
    idle = f.get("idle")
    if isinstance(idle, dict):
        rows.append(
            [
                "idle supervisor",
                f"{idle.get('cpu_percent_whole_window', 0):.3f} % of one core, "
                f"{idle.get('wakeups_per_s', 0):.1f} wake-ups/s",
            ]
        )
    for t in f.get("tracker_reports", []):
        if "skipped" in t:
            rows.append(["tracker reports", f"skipped: {t['skipped']}"])
            continue
        name = f"tracker reports {'on' if t.get('report') else 'off'}"
        rows.append([f"{name}: supervisor RSS, whole run", stats_cell(t["supervisor_rss_mib"], "MiB", 1, 1)])
        cpu = t["supervisor_cpu_percent_whole_run"]
        rows.append([f"{name}: supervisor CPU, whole run", f"{cpu:.2f} % of one core"])
        if t.get("reports"):
            took = ", ".join(f"{x:.1f} s" for x in t["report_took_s"] if x is not None)
            peak = ", ".join(f"{x:.0f}" for x in t["helper_rss_peak_mib"])
            rows.append([f"{name}: reports", f"{t['reports']} ({took}); helper peak RSS {peak} MiB"])
    return rows


def trackers_render(t: dict) -> tuple:
    if "skipped" in t:
        return ("Tracker hooks: cost per logging call", ["figure", "value"], [["skipped", t["skipped"]]], "")
    rows = []
    for key, lib in (("wandb_us", "W&B run.log(step=)"), ("tensorboard_us", "SummaryWriter.add_scalar")):
        for how in ("bare", "hooked", "hooked_half_replayed"):
            rows.append([f"{lib}: {how.replace('_', ' ')}", stats_cell(t[key][how], "µs", 1, 1)])
    return ("Tracker hooks: cost per logging call", ["figure", "value"], rows, t["method"])


def side_by_side(s: dict) -> tuple:
    rows = []
    for r in s["runs"]:
        after = f"{r['noticed_after_hang_s']:.1f} s" if r["noticed_after_hang_s"] is not None else "–"
        rows.append(
            [
                r["fault"],
                r["contender"],
                f"yes ({r['noticed_how']})" if r["noticed"] else "no",
                after,
                "yes" if r["stack_dump"] else "no",
                f"yes, {r['finished_after_s']:.0f} s after its start" if r["finished"] else "no",
                str(r["attempts"]),
                end_of_allowance(r),
            ]
        )
    return (
        f"5. Side by side: the same hung worker, {s['allowance_s']:g} s allowance each",
        [
            "fault",
            "contender",
            "noticed?",
            "noticed after the hang began",
            "stack dump?",
            "run finished?",
            "attempts",
            "at the end of the allowance",
        ],
        rows,
        s["method"],
    )


def against(s: Optional[dict], goal: float, key: str = "median") -> str:
    """Whether a summary's `key` (the median by default) meets a goal in seconds."""
    if not s or not s.get("n"):
        return "not measured"
    return f"{'meets' if s[key] <= goal else 'misses'} ≤ {goal * 1000:.0f} ms"


def cli(c: dict) -> tuple:
    def ms(s: Optional[dict]) -> str:
        return (
            f"p50 {s['median'] * 1000:.0f} ms, p95 {s['p95'] * 1000:.0f} ms (n={s['n']})"
            if s and s.get("n")
            else "not measured"
        )

    goals, n = c["goals"], c["lines"]
    first = c.get("submit_local_first_s")
    return (
        "6. Command-line round trips",
        ["figure", "value", "goal"],
        [
            ["`python -c pass` (the interpreter's own start, for comparison)", ms(c["python_startup_s"]), "–"],
            [
                "`hangwatch status` (rich view) against the supervisor, spawn → exit",
                ms(c["status_s"]),
                against(c["status_s"], goals["status_p50_s"]),
            ],
            [
                "`hangwatch status --json` against the supervisor, spawn → exit",
                ms(c["status_json_s"]),
                against(c["status_json_s"], goals["status_p50_s"]),
            ],
            [
                "`hangwatch status` / `--json` against a socket that answers at once (the command's own share)",
                f"{ms(c['status_instant_s'])} / {ms(c['status_json_instant_s'])}",
                "–",
            ],
            [
                "heavy packages imported by `status` / `status --json`",
                f"{', '.join(c['status_imports']) or 'none'} / {', '.join(c['status_json_imports']) or 'none'}",
                "no pydantic, no torch",
            ],
            [
                f"`hangwatch submit` of {n} lines, tiny tokenizer",
                ms(c["submit_tiny_s"]),
                against(c["submit_tiny_s"], goals["submit_s"]),
            ],
            [
                "heavy packages imported by that submit (CLI and its child)",
                ", ".join(c["submit_tiny_imports"]) or "none",
                "no torch",
            ],
            [
                f"`hangwatch submit` of {n} lines, local tokenizer dir: first use",
                "not measured" if first is None else f"{first * 1000:.0f} ms",
                "–",
            ],
            [
                f"`hangwatch submit` of {n} lines, local tokenizer dir: later",
                ms(c["submit_local_s"]),
                against(c["submit_local_s"], goals["submit_s"]),
            ],
            ["runs that failed", "; ".join(c["errors"]) or "none", "none"],
        ],
        c["method"],
    )


def prewarm_render(p: dict) -> tuple:
    from bench.prewarm import render

    return render(p)


def in_process_render(p: dict) -> tuple:
    from bench.in_process import render

    return render(p)


def multinode_render(p: dict) -> tuple:
    from bench.multinode import render

    return render(p)


def instrument_render(p: dict) -> tuple:
    from bench.instrument_cost import render

    return render(p)


def overrun_render(p: dict) -> tuple:
    from bench.overrun import render

    return render(p)


def own_command_render(p: dict) -> tuple:
    from bench.own_command import render

    return render(p)


def early_stalls_render(p: dict) -> tuple:
    from bench.early_stalls import render

    return render(p)


def soak_render(p: dict) -> tuple:
    from bench.soak import render

    return render(p)


def weight_render(p: dict) -> tuple:
    from bench.weight import render

    return render(p)


RENDERERS: dict[str, Callable[[dict], tuple]] = {
    "heartbeat": heartbeat,
    "detection": detection,
    "recovery": recovery,
    "footprint": footprint,
    "side_by_side": side_by_side,
    "cli": cli,
    "prewarm": prewarm_render,
    "in_process": in_process_render,
    "multinode": multinode_render,
    "instrument": instrument_render,
    "own_command": own_command_render,
    "overrun": overrun_render,
    "early_stalls": early_stalls_render,
    "soak": soak_render,
    "weight": weight_render,
    "trackers": trackers_render,
}


def header(res: dict) -> list[str]:
    m = res["machine"]
    return [
        f"## hangwatch benchmark — {m['date']}",
        "",
        f"`{res['command']}` · {m['cores_usable']} of {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
        f"Python {m['python']}, torch {m['torch']}, commit {m['commit']} · load average at start "
        f"{', '.join(f'{x:.2f}' for x in m['load_average_start'])} · whole run {res['wall_s']:.0f} s"
        + (" · **--quick: tiny trial counts, figures not representative**" if res["quick"] else ""),
        "",
        "Sections (wall time, 1-min load average when it began): "
        + ", ".join(
            f"{k} {v:.0f} s ({res['section_load_average_1min_at_start'][k]:.1f})"
            for k, v in res["section_wall_s"].items()
        )
        + ". The machine may be shared: a load well above the core count means the figures below include "
        "waiting for a CPU.",
        "",
    ]


def to_markdown(res: dict) -> str:
    lines = header(res)
    for name, v in res["sections"].items():
        if "error" in v:
            lines += [
                f"### {name}: not measured",
                "",
                f"The section failed: `{v['error']}` (traceback in bench-results.json).",
                "",
            ]
    for name, v in res["sections"].items():
        if "error" not in v:
            title, head, rows, how = RENDERERS[name](v)
            lines += [f"### {title}", ""] + table(head, rows) + ["", f"How: {how}", ""]
    return "\n".join(lines)
