"""Section 2, detection latency: for each deadline (startup, silence, step, phase) a real supervisor and
a light stdlib worker (scripts/baselines/stall_worker.py) that breaks it; how long after the budget the
incident came, by the supervisor's own clock and from the worker's last line, each p95 against the goal
(DETECTION_GOAL_S); `jobs` trials at once."""

from __future__ import annotations

import concurrent.futures as futures
import time
from pathlib import Path
from typing import Optional

from .harness import (
    PY,
    STALL_WORKER,
    hangwatch_run,
    read_beats,
    stall_incidents,
    steps_of,
    summary,
    supervisor_log_time,
    suspension_gaps,
    wait_exit,
    write_yaml,
)

DEADLINES = ("startup", "silence", "step", "phase")
DETECTION_BUDGET_S = 1.0  # small, so 80 trials fit the time budget; the latency beyond it does not scale with it
DETECTION_GOAL_S = 0.05  # the goal: p95 of the latency beyond the budget, for every deadline
POLL_INTERVAL_S = 0.25  # the supervisor's default (watchdog.poll_interval_s: its fallback timer), written out
SPREAD_S = 0.25  # the budgets under test are spread evenly over this much (see detection_budget)
FAR_S = 60.0  # the deadlines not under test
STALL_MODE = {"startup": "nostart", "silence": "block", "step": "block", "phase": "phase"}


def detection_budget(i: int, trials: int) -> float:
    """Trial i's budget: spread evenly over SPREAD_S above 1 s, so that every offset between the deadline
    and any periodic work of the supervisor (a fallback timer, the coalescing of heartbeat reads) is
    sampled: a budget that is a multiple of a period would show only the best or the worst case."""
    return round(DETECTION_BUDGET_S + SPREAD_S * (i + 0.5) / trials, 4)


def detection_config(tmp: Path, deadline: str, budget: float) -> tuple[Path, Path]:
    wd = {
        "startup_timeout_s": budget if deadline == "startup" else 30,
        "silence_timeout_s": budget if deadline == "silence" else FAR_S,
        "step_timeout_s": budget if deadline == "step" else FAR_S,
        "dump_grace_s": 0.5,
        "term_grace_s": 0.5,
        "py_spy": False,
        "poll_interval_s": POLL_INTERVAL_S,
    }
    run_dir = tmp / "run"
    cfg = {
        "run_dir": str(run_dir),
        # the stall worker speaks the heartbeat protocol itself (each deadline on its own): no bootstrap beside it
        "worker": {
            "command": [PY, str(STALL_WORKER), STALL_MODE[deadline], "--phase-budget", str(budget)],
            "instrument": "off",
        },
        "watchdog": wd,
        "restart": {"backoff_initial_s": 0, "max_restarts": 3},
    }
    return write_yaml(tmp / "cfg.yaml", cfg), run_dir


def anchor_time(deadline: str, run_dir: Path, beats: list[dict]) -> Optional[float]:
    """Wall time of what started the deadline's clock: the spawn, the last line, the last step, the phase."""
    if deadline == "startup":
        return supervisor_log_time(run_dir, "worker_spawned")
    if deadline == "silence":
        return beats[-1]["t"] if beats else None
    if deadline == "step":
        return max(
            (b["t"] for b in beats if b["event"] == "step" or (b["event"] == "phase" and b["phase"] == "train")),
            default=None,
        )
    return max((b["t"] for b in beats if b["event"] == "phase" and b["phase"] == "eval"), default=None)


def detection_trial(tmp: Path, deadline: str, budget: float) -> dict:
    cfg_path, run_dir = detection_config(tmp, deadline, budget)
    code = wait_exit(hangwatch_run(cfg_path, tmp / "supervisor.out"), 120)
    incs = stall_incidents(run_dir)
    if not incs:
        return {"deadline": deadline, "error": f"no stall incident (supervisor exit {code})", "dir": str(tmp)}
    inc = incs[0]
    d = inc["deadline"]
    anchor = anchor_time(
        deadline, run_dir, [b for b in read_beats(run_dir, inc["attempt"]) if b["t"] <= inc["time_unix"]]
    )
    nxt = steps_of(read_beats(run_dir, inc["attempt"] + 1))
    return {
        "deadline": deadline,
        "fired": d["name"],
        "budget_s": d["budget_s"],
        "overdue_s": d["overdue_s"],
        "beyond_budget_from_last_line_s": None if anchor is None else inc["time_unix"] - (anchor + d["budget_s"]),
        "detection_to_gone_s": (inc.get("timings") or {}).get("detection_to_gone_s"),
        "detection_to_next_step_s": nxt[0]["t"] - inc["time_unix"] if nxt else None,
        "classification": inc.get("classification"),
        "supervisor_exit": code,
        "supervisor_suspended_gaps_s": suspension_gaps(run_dir),
        "incident": inc["_dir"],
    }


def meets(s: dict, goal: float) -> Optional[bool]:
    """Whether a summary's p95 is within `goal` (None when nothing was measured)."""
    return s["p95"] <= goal if s.get("n") else None


def per_deadline(rows: list[dict], deadline: str) -> dict:
    """The trials of one deadline summed up; a trial where another deadline fired is counted, not averaged."""
    good = [r for r in rows if r.get("fired") == deadline]
    out = {
        "raw": rows,
        "other_deadline_fired": [r.get("fired", r.get("error")) for r in rows if r.get("fired") != deadline],
        "trials_with_loop_gaps": sum(1 for r in good if r.get("supervisor_suspended_gaps_s")),
        **{
            key: summary([r[key] for r in good])
            for key in (
                "overdue_s",
                "beyond_budget_from_last_line_s",
                "detection_to_gone_s",
                "detection_to_next_step_s",
            )
        },
    }
    out["goal_p95_s"] = DETECTION_GOAL_S
    out["p95_meets_goal"] = {
        key: meets(out[key], DETECTION_GOAL_S) for key in ("overdue_s", "beyond_budget_from_last_line_s")
    }
    return out


def section(work: Path, quick: bool, jobs: int) -> dict:
    trials = 2 if quick else 20
    plan = [(dl, i) for i in range(trials) for dl in DEADLINES]  # round robin: load falls on every deadline alike
    results: dict[str, list] = {dl: [] for dl in DEADLINES}
    t0 = time.monotonic()
    with futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for r in pool.map(
            lambda item: detection_trial(work / f"{item[0]}-{item[1]:02d}", item[0], detection_budget(item[1], trials)),
            plan,
        ):
            results[r["deadline"]].append(r)
    lo, hi = detection_budget(0, trials), detection_budget(trials - 1, trials)
    deadlines = {dl: per_deadline(rows, dl) for dl, rows in results.items()}
    return {
        "method": f"{trials} trials per deadline, {jobs} supervisors at a time (round robin over the deadlines); "
        f"`hangwatch run` with the default poll_interval_s {POLL_INTERVAL_S:g} and, on the deadline under "
        f"test, budgets {lo:g}–{hi:g} s spread evenly over {SPREAD_S:g} s (the other deadlines far "
        "away); worker scripts/baselines/stall_worker.py (nostart / block / phase, blocked in read(2)). "
        f"Goal: p95 ≤ {DETECTION_GOAL_S:g} s beyond the budget for every deadline. "
        "'supervisor clock' = incident.json deadline.overdue_s (elapsed − budget on the supervisor's "
        "monotonic clock, from when the anchoring line was written: its heartbeat file's modification "
        "time, one file-time tick later, never later than the pass that read it); 'from the worker's "
        "last line' = incident time − (wall time the worker wrote the anchoring line + budget), which "
        "adds the file-time tick and any read delay; it can come out a few ms below zero for startup, "
        "whose anchor is the `worker_spawned` log line, written just after the fork. A 'loop gap' is "
        "the supervisor's own `supervisor_suspended` log line: its loop did not run for > 2 s (an "
        "overloaded or paused machine, or a slow fsync), and it extended every deadline by the gap",
        "budget_s": [lo, hi],
        "trials": trials,
        "jobs": jobs,
        "wall_s": time.monotonic() - t0,
        "goal_p95_s": DETECTION_GOAL_S,
        "all_meet_goal": all(v is not False for d in deadlines.values() for v in d["p95_meets_goal"].values()),
        "deadlines": deadlines,
    }
