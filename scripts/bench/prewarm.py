"""Section `prewarm`: the restart of the built-in worker with `restart.prewarm` off (a cold spawn once the stuck
tree is gone) and on (a standby spawned at detection loads torch, transformers, peft, the model and the data on
the CPU while the stuck attempt is dumped and killed, and is released once the tree is gone), side by side, in
alternating runs of the same hang; with this run's own cold start (the first attempt: spawned → first step)
measured in every run, and whether both ended in the same weights."""
from __future__ import annotations

import datetime as dt
import hashlib
import time
from pathlib import Path
from typing import Optional

from .harness import (first, hangwatch_run, read_beats, stall_incidents, summary, supervisor_log, wait_exit,
                      demo_worker_config, write_yaml)

HANG_AT = 12
STEP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 300.0
MODES = ("cold", "prewarm")
FIGURES = ("spawn_to_first_step_s", "detection_to_gone_s", "detection_to_next_process_s", "standby_preload_s",
           "standby_spawn_to_ready_s", "ready_and_released_to_first_step_s", "release_to_start_beat_s",
           "handoff_to_first_step_s", "detection_to_next_step_s", "next_step_minus_cold_start_s",
           "handoff_to_first_step_over_cold_start")


def trial_config(run_dir: Path, prewarm: bool) -> dict:
    return demo_worker_config(
        run_dir,
        train={"max_steps": 24, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 5, "confirm_steps": 2},
        watchdog={"step_timeout_s": STEP_TIMEOUT_S},
        restart={"backoff_initial_s": 0, "prewarm": prewarm},
        faults=[{"kind": "block_c", "at_step": HANG_AT}],
    )


def log_times(run_dir: Path) -> list[tuple[str, Optional[int], float, dict]]:
    """(event, attempt, wall time, record) of every supervisor.log record with a timestamp."""
    out = []
    for rec in supervisor_log(run_dir):
        try:
            t = dt.datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (KeyError, ValueError):
            continue
        out.append((rec.get("event"), rec.get("attempt"), t, rec))
    return out


def when(times: list, event: str, attempt: Optional[int] = None) -> Optional[float]:
    return next((t for e, a, t, _ in times if e == event and (attempt is None or a == attempt)), None)


def weights_digest(run_dir: Path) -> Optional[str]:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def minus(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def trial(tmp: Path, mode: str) -> dict:
    """One run: the demo model hangs in C at step HANG_AT; the supervisor detects, dumps, kills, restarts."""
    run_dir = tmp / "run"
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", trial_config(run_dir, mode == "prewarm")), tmp / "supervisor.out")
    t0 = time.time()
    code = wait_exit(proc, RUN_LIMIT_S)
    row: dict = {"mode": mode, "supervisor_exit": code, "dir": str(tmp), "run_wall_s": time.time() - t0}
    times = log_times(run_dir)
    step_1 = first(read_beats(run_dir, 1), "step")
    row["spawn_to_first_step_s"] = minus(step_1 and step_1["t"], when(times, "worker_spawned", 1))
    incs = stall_incidents(run_dir)
    if not incs:
        row["error"] = "no stall incident"
        return row
    inc = incs[0]
    nxt = inc["attempt"] + 1
    detected = inc["time_unix"]
    beats = read_beats(run_dir, nxt)
    start, step = first(beats, "start"), first(beats, "step")
    prewarmed = bool(start and start.get("prewarmed"))
    loaded = next((b for b in beats if b["event"] == "progress" and "standby_preload_s" in b), {})
    handoff = when(times, "standby_released", nxt) if prewarmed else when(times, "worker_spawned", nxt)
    next_process = when(times, "standby_spawned", nxt) if prewarmed else when(times, "worker_spawned", nxt)
    row.update(
        prewarmed=prewarmed,
        detection_to_gone_s=(inc.get("timings") or {}).get("detection_to_gone_s"),
        detection_to_next_process_s=minus(next_process, detected),
        standby_preload_s=loaded.get("standby_preload_s"),
        standby_ready_before_release=(loaded.get("standby_wait_s") or 0) > 0 if prewarmed else None,
        standby_spawn_to_ready_s=minus(loaded.get("standby_ready_t"), next_process),
        ready_and_released_to_first_step_s=minus(step and step["t"], max(handoff or 0, loaded.get("standby_ready_t") or 0))
        if handoff and loaded.get("standby_ready_t") else None,
        release_to_start_beat_s=minus(start and start["t"], handoff),
        handoff_to_first_step_s=minus(step and step["t"], handoff),
        detection_to_next_step_s=minus(step and step["t"], detected),
        weights=weights_digest(run_dir),
    )
    row["next_step_minus_cold_start_s"] = minus(row["detection_to_next_step_s"], row["spawn_to_first_step_s"])
    cold = row["spawn_to_first_step_s"]
    row["handoff_to_first_step_over_cold_start"] = (None if row["handoff_to_first_step_s"] is None or not cold
                                                    else row["handoff_to_first_step_s"] / cold)
    if mode == "prewarm" and not prewarmed:
        row["error"] = "the next attempt did not come from the standby"
    return row


def mode_summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    out: dict = {"raw": rows, "trials": len(rows), "errors": [r["error"] for r in rows if "error" in r],
                 **{key: summary([r.get(key) for r in ok]) for key in FIGURES}}
    out["below_cold_start"] = sum(1 for r in ok if (r.get("next_step_minus_cold_start_s") or 0) < 0)
    out["standby_ready_before_release"] = sum(1 for r in ok if r.get("standby_ready_before_release"))
    return out


def section(work: Path, quick: bool) -> dict:
    trials = 1 if quick else 3
    rows: dict[str, list] = {m: [] for m in MODES}
    for i in range(trials):  # interleaved, so that a busier stretch of the machine falls on both alike
        for m in MODES:
            rows[m].append(trial(work / f"{m}-{i}", m))
    pairs = list(zip(rows["cold"], rows["prewarm"]))
    same = [a.get("weights") is not None and a.get("weights") == b.get("weights") for a, b in pairs]
    # The prewarmed restart against a cold start in the same situation: the cold run's restart, same round.
    versus = [minus(b.get("detection_to_next_step_s"), a.get("handoff_to_first_step_s")) for a, b in pairs
              if "error" not in a and "error" not in b]
    return {
        "method": f"{trials} runs of `hangwatch run` per mode, alternating, on the demo model (configs/demo.yaml "
                  f"watchdog: dump_grace_s 3, term_grace_s 5; step_timeout_s {STEP_TIMEOUT_S:g}; checkpoint every 5 "
                  f"steps, confirmed after 2; 0.05 s sleep per step; no backoff): a block_c fault (a read on a pipe "
                  f"nobody writes) at step {HANG_AT}, `restart.prewarm` false (cold) or true (prewarm). Cold start: "
                  "the run's first attempt, `worker_spawned` log line → its first step line. Detection: the incident "
                  "time. Next process: the cold worker's `worker_spawned`, or the `standby_spawned` line. Handoff: "
                  "`worker_spawned` (cold) or `standby_released` (prewarm) → the next attempt's first step line. "
                  "Standby preload: its `load` progress beat's standby_preload_s (imports, model and data on the CPU); "
                  "ready before release: its standby_wait_s > 0; ready → first step: the first step line − the "
                  "later of `standby_released` and that beat's standby_ready_t (wall clock). Against a cold start: "
                  "the prewarmed run's detection → next step − the cold run's spawn → first step of its restart, "
                  "same round. Weights: sha256 of final/*.safetensors of the cold and the prewarmed run of a round.",
        "trials": trials,
        "modes": {m: mode_summary(rows[m]) for m in MODES},
        "same_final_weights": f"{sum(same)} of {len(same)}",
        "prewarm_detection_to_next_step_minus_cold_restart_start_s": summary(versus),
        "below_cold_restart_start": f"{sum(1 for v in versus if v is not None and v < 0)} of {len(versus)}",
    }


def render(p: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    modes = p["modes"]

    def cell(s: Optional[dict], unit: str = "s", digits: int = 2) -> str:
        if not s or not s.get("n"):
            return "–"
        return (f"{s['median']:.{digits}f} {unit} (n={s['n']}; min {s['min']:.{digits}f}, "
                f"max {s['max']:.{digits}f})")

    def row(label: str, key: str, unit: str = "s", digits: int = 2) -> list[str]:
        return [label] + [cell(modes[m].get(key), unit, digits) for m in MODES]

    def count(key: str) -> list[str]:
        return [f"{modes[m][key]} of {modes[m]['trials'] - len(modes[m]['errors'])}" for m in MODES]

    return ("7. Restart with `restart.prewarm` (demo model, hang in C): cold spawn vs standby",
            ["figure", "prewarm off (cold spawn)", "prewarm on (standby)"], [
        row("this run's cold start: first attempt spawned → first step", "spawn_to_first_step_s"),
        row("detection → process tree gone", "detection_to_gone_s"),
        row("detection → next attempt's process spawned (cold worker / standby)", "detection_to_next_process_s"),
        row("standby: imports, model and data on the CPU", "standby_preload_s"),
        row("standby: spawned → preloaded (its own start included)", "standby_spawn_to_ready_s"),
        ["standby ready before its release"] + ["–", count("standby_ready_before_release")[1]],
        row("standby: released and preloaded (the later of the two) → first step: what a restart costs once "
            "the standby is ready", "ready_and_released_to_first_step_s"),
        row("spawn (cold) / release (standby) → its `start` beat", "release_to_start_beat_s"),
        row("spawn (cold) / release (standby) → first step of the next attempt", "handoff_to_first_step_s"),
        row("· as a fraction of this run's cold start", "handoff_to_first_step_over_cold_start", "×", 2),
        row("detection → first step of the next attempt", "detection_to_next_step_s"),
        row("**detection → next step − this run's cold start** (goal: below 0 with prewarm)", "next_step_minus_cold_start_s"),
        ["runs where detection → next step was below the cold start"] + count("below_cold_start"),
        ["**prewarmed detection → next step − the cold restart's spawn → first step, same round** (below 0: the "
         "whole prewarmed recovery is shorter than a cold worker's start)", "–",
         cell(p["prewarm_detection_to_next_step_minus_cold_restart_start_s"])],
        ["rounds where it was below 0", "–", p["below_cold_restart_start"]],
        ["same final weights, cold vs prewarmed run of a round (bitwise)", p["same_final_weights"], "–"],
        ["runs that could not be measured"] + ["; ".join(modes[m]["errors"]) or "none" for m in MODES],
    ], p["method"])
