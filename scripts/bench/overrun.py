"""Section overrun: the time a runaway eval generate() costs, truncated in the worker's process vs restarted.

The demo model (configs/demo.yaml, CPU) trains 60 steps with an eval every 20; at the first eval at or after
step 20 its generate() runs away (`runaway_generate`: EOS suppressed, no token limit: it keeps producing tokens)
under a 5 s generate budget.  Three runs of `hangwatch run` per round, interleaved: no fault (the baseline),
`watchdog.generate_overrun: truncate` (the default: the generation is ended at the next token, in the same
process) and `restart` (the old way: a livelock, killed, the worker restarted from the last good checkpoint).
The figure is each run's wall time (its goodput ledger's sum, goodput.json) and what it adds to the baseline's;
beside it the ledger's lost time, the restarts and the incidents.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .harness import PY, ROOT, demo_worker_config, env, summary, write_yaml

MODES = ("baseline", "truncate", "restart")


def trial(work: Path, mode: str, i: int) -> dict:
    run_dir = work / f"{mode}-{i}"
    faults = [] if mode == "baseline" else [{"kind": "runaway_generate", "at_step": 20}]
    cfg = demo_worker_config(
        run_dir,
        faults=faults,
        train={"max_steps": 60, "sleep_per_step_s": 0.05},
        watchdog={
            "generate_overrun": "restart" if mode == "restart" else "truncate",
            "phase_budgets_s": {"eval": 60, "generate": 5, "checkpoint": 60},
        },
        checkpoint={"every_steps": 10, "keep_last": 3, "confirm_steps": 2},
    )
    path = write_yaml(work / f"{mode}-{i}.yaml", cfg)
    done = subprocess.run(
        [PY, "-m", "hangwatch.supervisor", "run", str(path)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{mode} run {i} ended {done.returncode}: {done.stdout[-800:]}{done.stderr[-800:]}")
    g = json.loads((run_dir / "goodput.json").read_text())
    incidents = (
        sorted(p.name.split("-", 1)[1] for p in (run_dir / "incidents").iterdir())
        if (run_dir / "incidents").is_dir()
        else []
    )
    state = json.loads((run_dir / "state.json").read_text())
    return {
        "wall_s": g["wall_s"],
        "lost_s": g["lost_s"],
        "eval_s": g["categories"]["eval"],
        "restarts": state.get("restarts", 0),
        "incidents": incidents,
        "goodput_pct": g["goodput_pct"],
    }


def section(work: Path, quick: bool) -> dict:
    rounds = 1 if quick else 3
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for i in range(rounds):
        for mode in MODES:
            runs[mode].append(trial(work, mode, i))
    walls = {m: summary([r["wall_s"] for r in runs[m]]) for m in MODES}
    base = walls["baseline"]["median"]
    return {
        "method": f"{rounds} interleaved round(s) of three `hangwatch run` on the demo model (60 steps, an eval every "
        "20, a 5 s generate budget): no fault; a runaway generate() (runaway_generate at the eval of step 20) with "
        "generate_overrun truncate; the same with restart. Wall time = the run's goodput ledger (goodput.json)",
        "runs": runs,
        "wall_s": walls,
        "added_s": {m: walls[m]["median"] - base for m in MODES if m != "baseline"},
    }


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    from .report import stats_cell

    rows = []
    for m, label in (
        ("baseline", "no fault"),
        ("truncate", "runaway generate, `generate_overrun: truncate`"),
        ("restart", "runaway generate, `generate_overrun: restart`"),
    ):
        last = s["runs"][m][-1]
        added = "—" if m == "baseline" else f"**{s['added_s'][m]:+.1f} s**"
        rows.append(
            [
                label,
                stats_cell(s["wall_s"][m], "s", 1, 1),
                added,
                str(last["restarts"]),
                ", ".join(last["incidents"]) or "none",
                f"{last['goodput_pct']:.1f} %",
            ]
        )
    return (
        "11. A runaway eval `generate()`: truncated in process vs restarted",
        ["run", "wall time", "added to no fault (medians)", "restarts", "incidents", "goodput"],
        rows,
        f"{s['method']} (bench/overrun.py).",
    )


__all__ = ["section", "render"]
