"""Section `in_process`: recovery inside the worker's process (`restart.in_process`) beside the restarts it replaces.

1. Detection → the next step, for the same Python spin (`busy_loop`) on the demo model: abandoned in the process,
   restarted from a prewarmed standby (`restart.prewarm: always`), restarted cold; the restarts each took, and
   whether the three ended in the same weights.  With `--full` also on a ~1B-parameter Llama (the prewarm section's,
   float32 on the CPU), in the process against cold.
2. An out-of-memory step of the demo model on a capped (fake) device — 16 examples need 16.7 GB of 4 GiB: adapted
   in the process, and by the restart path (a restart one rung down, then the micro-batch measured in the new
   process): OOM → the first step taken at a size that fits, the restarts, the micro-batch it ended at.
3. The goodput of a demo run of `duration` with a failure every `every` seconds, in turn: a Python spin, a
   non-finite streak, an out-of-memory step, a SIGKILL of the worker (the one failure no process survives: a
   restart from the prewarmed standby) — the run's own goodput ledger (`goodput.json`) at the end."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

from .harness import (
    attempts_of,
    control,
    demo_worker_config,
    hangwatch_run,
    incidents_of,
    read_beats,
    stall_incidents,
    steps_of,
    summary,
    wait_exit,
    write_yaml,
)
from .prewarm import LARGE_HANG_AT, LARGE_RUN_LIMIT_S, LARGE_STEP_TIMEOUT_S, large_model_dir, weights_digest

HANG_AT = 12
STEP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 300.0
MODES = {
    "in_process": {"in_process": True, "prewarm": False},
    "standby": {"in_process": False, "prewarm": "always"},
    "cold": {"in_process": False, "prewarm": False},
}
DEVICE = {"kind": "memory_limit", "weights_mb": 700, "per_example_mb": 1000, "capacity_mb": 4096, "at_step": 4}


def spin_config(run_dir: Path, mode: str) -> dict:
    return demo_worker_config(
        run_dir,
        train={"max_steps": 24, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 5, "confirm_steps": 2},
        watchdog={"step_timeout_s": STEP_TIMEOUT_S},
        restart={"backoff_initial_s": 0, **MODES[mode]},
        faults=[{"kind": "busy_loop", "at_step": HANG_AT}],
    )


def run_to_end(tmp: Path, cfg: dict, limit_s: float) -> tuple[Optional[int], Path]:
    run_dir = Path(cfg["run_dir"])
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", cfg), tmp / "supervisor.out")
    return wait_exit(proc, limit_s), run_dir


def next_step_after(run_dir: Path, t: float) -> Optional[dict]:
    """The first step line of any attempt written after unix time `t`."""
    for n in attempts_of(run_dir):
        step = next((b for b in steps_of(read_beats(run_dir, n)) if b["t"] > t), None)
        if step is not None:
            return step
    return None


def spin_trial(tmp: Path, mode: str, cfg: Optional[dict] = None, limit_s: float = RUN_LIMIT_S) -> dict:
    code, run_dir = run_to_end(tmp, cfg or spin_config(tmp / "run", mode), limit_s)
    row: dict = {"mode": mode, "supervisor_exit": code, "dir": str(tmp)}
    incs = stall_incidents(run_dir)
    if not incs:
        row["error"] = "no stall incident"
        return row
    detected = incs[0]["time_unix"]
    step = next_step_after(run_dir, detected)
    row.update(
        path=(incs[0].get("recovery") or {}).get("path", "restart"),
        detection_to_next_step_s=None if step is None else step["t"] - detected,
        restarts=len(attempts_of(run_dir)) - 1,
        weights=weights_digest(run_dir),
    )
    if mode == "in_process" and row["path"] != "in_process":
        row["error"] = f"not recovered in the process: {(incs[0].get('recovery') or {}).get('why')}"
    return row


def oom_config(run_dir: Path, in_process: bool) -> dict:
    return demo_worker_config(
        run_dir,
        train={"max_steps": 8, "micro_batch_size": 16, "grad_accum": 1, "sleep_per_step_s": 0.0},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 2, "confirm_steps": 0},
        restart={"backoff_initial_s": 0, "in_process": in_process, "prewarm": False},
        faults=[DEVICE],
    )


def oom_trial(tmp: Path, in_process: bool) -> dict:
    code, run_dir = run_to_end(tmp, oom_config(tmp / "run", in_process), RUN_LIMIT_S)
    row: dict = {"in_process": in_process, "supervisor_exit": code, "restarts": len(attempts_of(run_dir)) - 1}
    beats = read_beats(run_dir, 1)
    oom_at = next((b["t"] for b in beats if b["event"] == "warn" and "oom_adapted" in b), None)
    if oom_at is None:  # the restart path: the failing attempt's last words
        from hangwatch.common.rundir import exit_path, read_json

        words = read_json(exit_path(run_dir, 1)) or {}
        oom_at = words.get("t")
    failing = DEVICE["at_step"]
    fit = next(
        (b for n in attempts_of(run_dir) for b in steps_of(read_beats(run_dir, n)) if b["step"] == failing), None
    )
    last = read_beats(run_dir, attempts_of(run_dir)[-1]) if attempts_of(run_dir) else []
    probe = next((b.get("remediation_probe") for b in last if "remediation_probe" in b), None)
    from hangwatch.common.rundir import read_json

    record = read_json(run_dir / "remediation.json") or {}
    row.update(
        oom_to_fitting_step_s=None if fit is None or oom_at is None else fit["t"] - oom_at,
        micro_batch_at_end=record.get("micro_batch_size"),
        measured_pick=probe.get("picked") if isinstance(probe, dict) else None,
        oom_incidents=sum(1 for i in incidents_of(run_dir) if i.get("kind") in ("oom", "oom_adapted")),
    )
    if fit is None:
        row["error"] = f"step {failing} never taken"
    return row


GOODPUT_SLEEP_S = 0.1  # per step: a step time the schedule can count on (the demo model alone takes ~20 ms)
GOODPUT_CHECKPOINT_EVERY = 25
GOODPUT_STEP_TIMEOUT_S = 2.0


def goodput_config(run_dir: Path, duration_s: float, every_s: float, step_s: float) -> tuple[dict, list[float]]:
    """A demo run of about `duration_s` (steps of ~`step_s`), a failure every `every_s` seconds in turn: spin,
    non-finite streak, OOM (placed by step number), SIGKILL (at a time: `kills`, seconds from the first step)."""
    steps = int(duration_s / step_s)
    faults, kills = [], []
    n = int(duration_s // every_s)
    for i in range(n):
        at_s = every_s * (i + 1) - every_s / 2  # mid-interval: the last one still inside the run
        at = max(2, int(at_s / step_s))
        kind = ("busy_loop", "nan", "oom", "sigkill")[i % 4]
        if kind == "busy_loop":
            faults.append({"kind": "busy_loop", "at_step": at})
        elif kind == "nan":
            faults.append({"kind": "nan", "at_step": at, "steps": 3})
        elif kind == "oom":
            faults.append({"kind": "oom", "at_step": at})
        else:
            kills.append(at_s)
    cfg = demo_worker_config(
        run_dir,
        train={"max_steps": steps, "sleep_per_step_s": GOODPUT_SLEEP_S, "max_nonfinite_streak": 3},
        eval={"every_steps": 0},
        checkpoint={"every_steps": GOODPUT_CHECKPOINT_EVERY, "confirm_steps": 1},
        watchdog={"step_timeout_s": GOODPUT_STEP_TIMEOUT_S},
        restart={"backoff_initial_s": 0, "in_process": True, "prewarm": "always", "max_restarts": 50},
        faults=faults,
    )
    return cfg, kills


def goodput_run(tmp: Path, duration_s: float, every_s: float) -> dict:
    step_s = measured_step_s(tmp / "calibrate")
    cfg, kills = goodput_config(tmp / "run", duration_s, every_s, step_s)
    run_dir = Path(cfg["run_dir"])
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", cfg), tmp / "supervisor.out")
    started: Optional[float] = None
    killed = 0
    deadline = time.monotonic() + duration_s * 4 + 300
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        if started is None:
            if steps_of(read_beats(run_dir, 1)):
                started = time.monotonic()
            continue
        if killed < len(kills) and time.monotonic() - started >= kills[killed]:
            status, _ = control(run_dir, "status", 5.0)
            pid = status.get("pid") if isinstance(status, dict) else None
            if isinstance(pid, int):
                os.kill(pid, signal.SIGKILL)
                killed += 1
    code = wait_exit(proc, max(1.0, deadline - time.monotonic()))
    from hangwatch.common.rundir import read_json

    ledger = read_json(run_dir / "goodput.json") or {}
    kinds: dict[str, int] = {}
    for inc in incidents_of(run_dir):
        path = (inc.get("recovery") or {}).get("path") or (
            "in_process" if inc.get("kind") == "oom_adapted" else "restart"
        )
        key = f"{inc.get('kind')} ({path})"
        kinds[key] = kinds.get(key, 0) + 1
    return {
        "supervisor_exit": code,
        "step_s": round(step_s, 3),
        "steps": cfg["train"]["max_steps"],
        "faults": len(cfg["faults"]),
        "kills": killed,
        "restarts": len(attempts_of(run_dir)) - 1,
        "incidents": kinds,
        "wall_s": ledger.get("wall_s"),
        "goodput_pct": ledger.get("goodput_pct"),
        "categories": ledger.get("categories"),
    }


def measured_step_s(tmp: Path) -> float:
    """The demo model's step time on this machine now: a short run's median step interval."""
    cfg = demo_worker_config(
        tmp / "run",
        train={"max_steps": 30, "sleep_per_step_s": GOODPUT_SLEEP_S},
        eval={"every_steps": 0},
        checkpoint={"every_steps": GOODPUT_CHECKPOINT_EVERY},
        faults=[],
    )
    _, run_dir = run_to_end(tmp, cfg, RUN_LIMIT_S)
    ts = [b["t"] for b in steps_of(read_beats(run_dir, 1))]
    gaps = sorted(b - a for a, b in zip(ts[5:], ts[6:]))
    return gaps[len(gaps) // 2] if gaps else 0.3


def large_rows(work: Path, trials: int) -> dict:
    """The ~1B Llama's spin, in the process and cold, `trials` runs each, interleaved."""
    from .prewarm import large_config

    model_dir, params = large_model_dir()
    rows: dict[str, list] = {"in_process": [], "cold": []}
    for i in range(trials):
        for mode in rows:
            tmp = work / f"large-{mode}-{i}"
            cfg = large_config(tmp / "run", model_dir, "cold")
            cfg["restart"] = {**cfg["restart"], **MODES[mode]}
            cfg["faults"] = [{"kind": "busy_loop", "at_step": LARGE_HANG_AT}]
            cfg["watchdog"] = {**cfg["watchdog"], "step_timeout_s": LARGE_STEP_TIMEOUT_S}
            rows[mode].append(spin_trial(tmp, mode, cfg, LARGE_RUN_LIMIT_S))
    return {
        "params": params,
        "rows": rows,
        "detection_to_next_step_s": {
            m: summary([r.get("detection_to_next_step_s") for r in rs]) for m, rs in rows.items()
        },
        "same_final_weights": sum(
            1 for a, b in zip(*rows.values()) if a.get("weights") and a.get("weights") == b.get("weights")
        ),
    }


def section(work: Path, quick: bool, full: bool = False) -> dict:
    trials = 1 if quick else 3
    spins: dict[str, list] = {m: [] for m in MODES}
    for i in range(trials):  # interleaved: a busier stretch of the machine falls on every mode alike
        for m in MODES:
            spins[m].append(spin_trial(work / f"spin-{m}-{i}", m))
    same = [len({r.get("weights") for r in rnd}) == 1 and rnd[0].get("weights") for rnd in zip(*spins.values())]
    ooms = {"in_process": oom_trial(work / "oom-in", True), "restart": oom_trial(work / "oom-restart", False)}
    duration, every = (120.0, 30.0) if quick else (600.0, 60.0)
    return {
        "method": (
            f"Spin: {trials} run(s) per mode, interleaved, of `hangwatch run` on the demo model (configs/demo.yaml; "
            f"step_timeout_s {STEP_TIMEOUT_S:g}, checkpoint every 5 steps confirmed after 2, 0.05 s sleep per step, "
            f"no backoff), a busy_loop fault (a Python spin in the attention's forward) at step {HANG_AT}: "
            "detection (the incident's time) → the first step line written after it, in any attempt. OOM: the "
            "memory_limit fault (a fake device capped at 4096 MiB, 700 MiB of weights, 1000 MiB per example, "
            "failing at the first of 8 allocations that does not fit) from step 4, micro-batch 16: the OOM (the "
            "worker's `oom_adapted` line, or its last words) → the first step line of step 4. Goodput: a demo run "
            f"(0.1 s sleep per step, no eval, checkpoint every {GOODPUT_CHECKPOINT_EVERY} steps confirmed after 1, "
            f"step_timeout_s {GOODPUT_STEP_TIMEOUT_S:g}) of {duration:g} s of steps with a failure every {every:g} "
            "s, in the middle of each interval, in turn — busy_loop, "
            "nan (3 steps, the streak limit), oom, SIGKILL of the worker (by the bench, at that time) — "
            "`restart.in_process` on and `restart.prewarm: always`; the goodput is the run's own ledger "
            "(goodput.json: kept training time / wall). With --large: the ~1B Llama of the prewarm section "
            f"(float32 on the CPU), a busy_loop at step {LARGE_HANG_AT}, step_timeout_s {LARGE_STEP_TIMEOUT_S:g}, "
            "in the process and cold, interleaved, 2 runs each (1 with --quick)."
        ),
        "trials": trials,
        "spin": {
            m: {
                "raw": rows,
                "detection_to_next_step_s": summary([r.get("detection_to_next_step_s") for r in rows]),
                "restarts": summary([r.get("restarts") for r in rows]),
                "errors": [r["error"] for r in rows if "error" in r],
            }
            for m, rows in spins.items()
        },
        "same_final_weights": f"{sum(1 for s in same if s)} of {len(same)}",
        "oom": ooms,
        "goodput": goodput_run(work / "goodput", duration, every),
        "large": large_rows(work, 1 if quick else 2) if full else None,
    }


def render(p: dict) -> tuple:
    """(title, header, rows, how) for report.py."""

    def med(s: Optional[dict], unit: str = "s") -> str:
        if not s or not s.get("n"):
            return "–"
        extra = f" (n={s['n']}; min {s['min']:.2f}, max {s['max']:.2f})" if s["n"] > 1 else ""
        return f"{s['median']:.2f} {unit}{extra}"

    spin = p["spin"]
    rows = [
        ["Python spin: detection → next step"] + [med(spin[m]["detection_to_next_step_s"]) for m in MODES],
        ["Python spin: restarts"] + [med(spin[m]["restarts"], "") for m in MODES],
        ["same final weights (all three modes)", p["same_final_weights"], "", ""],
    ]
    for name, r in p["oom"].items():
        rows.append(
            [
                f"OOM at micro-batch 16 ({name.replace('_', ' ')}): OOM → first step that fits",
                "–" if r.get("oom_to_fitting_step_s") is None else f"{r['oom_to_fitting_step_s']:.2f} s",
                f"{r['restarts']} restart(s)",
                f"micro-batch {r.get('micro_batch_at_end')}",
            ]
        )
    g = p["goodput"]
    rows.append(
        [
            f"goodput, {g.get('wall_s') or 0:.0f} s run, {g['faults'] + g['kills']} failures",
            f"{g.get('goodput_pct')} %",
            f"{g['restarts']} restart(s)",
            ", ".join(f"{k}: {v}" for k, v in sorted((g.get("incidents") or {}).items())),
        ]
    )
    large = p.get("large")
    if large:
        d = large["detection_to_next_step_s"]
        rows.append(
            [
                f"~{large['params'] / 1e9:.2f} B Llama (CPU), Python spin: detection → next step",
                med(d["in_process"]),
                "",
                med(d["cold"]),
            ]
        )
        rows.append(
            [
                f"~{large['params'] / 1e9:.2f} B Llama: same final weights (in the process, cold)",
                f"{large['same_final_weights']} of {len(large['rows']['cold'])}",
                "",
                "",
            ]
        )
    return ("Recovery in the process", ["", "in the process", "standby (prewarm: always)", "cold"], rows, p["method"])
