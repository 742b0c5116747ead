"""Section 3, recovery: the built-in worker on the demo model hangs in C (block_c); detection → process
tree gone, detection → first step of the next attempt, steps lost; then a graceful `restart` over the
control socket and the steps that one loses."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from .harness import (attempts_of, control, demo_worker_config, finished_at, first, hangwatch_run, last_step,
                      read_beats, stall_incidents, summary, wait_exit, write_yaml)

HANG_AT = 16
RESTART_AT = 26
RUN_LIMIT_S = 300.0


def request_restart_when_due(run_dir: Path) -> Optional[tuple[float, dict]]:
    """Once the second attempt passed RESTART_AT: ask for a graceful restart; (request time, reply)."""
    if len(attempts_of(run_dir)) < 2 or last_step(read_beats(run_dir, 2)) < RESTART_AT:
        return None
    requested = time.time()
    result, error = control(run_dir, "restart", 10, mode="graceful")
    return requested, result if error is None else {"error": error}


def resumed(run_dir: Path, before: int, after: int) -> tuple[int, Optional[dict], Optional[float]]:
    """Attempt `before`'s last step, attempt `after`'s start line and the wall time of its first step."""
    beats = read_beats(run_dir, after)
    step = first(beats, "step")
    return last_step(read_beats(run_dir, before)), first(beats, "start"), None if step is None else step["t"]


def recovery_trial(tmp: Path) -> dict:
    """One run: hang (block_c) at step 16 → supervisor recovers → graceful `restart` at step ≥ 26 → finish."""
    run_dir = tmp / "run"
    cfg = demo_worker_config(
        run_dir,
        train={"max_steps": 32, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 10, "confirm_steps": 2},
        watchdog={"step_timeout_s": 3},
        restart={"backoff_initial_s": 0},
        faults=[{"kind": "block_c", "at_step": HANG_AT}],
    )
    t_spawn = time.time()
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", cfg), tmp / "supervisor.out")
    restart = None
    deadline = time.monotonic() + RUN_LIMIT_S
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            restart = restart or request_restart_when_due(run_dir)
            time.sleep(0.02)
    finally:
        code = wait_exit(proc, max(1.0, deadline - time.monotonic()))
    requested, reply = restart or (None, None)
    incs = stall_incidents(run_dir)
    row: dict = {"supervisor_exit": code, "restart_reply": reply, "dir": str(tmp)}
    if not incs:
        row["error"] = "no stall incident"
        return row
    inc = incs[0]
    a = inc["attempt"]
    hang_last, start_2, first_step_2 = resumed(run_dir, a, a + 1)
    row.update(
        classification=inc.get("classification"),
        detection_to_gone_s=(inc.get("timings") or {}).get("detection_to_gone_s"),
        detection_to_next_step_s=None if first_step_2 is None else first_step_2 - inc["time_unix"],
        hang_last_step=hang_last,
        hang_resumed_step=start_2["step"] if start_2 else None,
        hang_resumed_from=start_2.get("resumed_from") if start_2 else None,
    )
    row["steps_lost_hang"] = None if start_2 is None else hang_last - start_2["step"]
    last_2, start_3, first_step_3 = resumed(run_dir, a + 1, a + 2)
    if requested is not None and start_3 is not None:
        row.update(graceful_last_step=last_2, graceful_resumed_step=start_3["step"],
                   graceful_resumed_from=start_3.get("resumed_from"), steps_lost_graceful=last_2 - start_3["step"],
                   request_to_next_step_s=None if first_step_3 is None else first_step_3 - requested)
    row["finished"] = finished_at(run_dir) is not None
    row["run_wall_s"] = time.time() - t_spawn
    return row


def section(work: Path, quick: bool, cold: Optional[dict]) -> dict:
    """`cold`: the heartbeat section's cold-start summary, shown beside recovery when that section ran."""
    trials = 1 if quick else 3
    rows = [recovery_trial(work / f"trial-{i}") for i in range(trials)]
    ok = [r for r in rows if "error" not in r]
    out = {
        "method": f"{trials} sequential runs of `hangwatch run` on the demo model (configs/demo.yaml watchdog: "
                  f"dump_grace_s 3, term_grace_s 5; step_timeout_s 3; checkpoint every 10 steps, confirmed after 2; "
                  f"0.05 s sleep per step): a block_c fault (read on a pipe nobody writes) at step {HANG_AT}, "
                  f"then a graceful `restart` over the control socket once the next attempt passed step "
                  f"{RESTART_AT}. Detection → gone: incident timings (supervisor clock). Detection → next "
                  "step: the next attempt's first step line − incident time (wall clock). Steps lost: last step "
                  "line of the stopped attempt − step the next attempt resumed at (its start line).",
        "trials": trials,
        "raw": rows,
        **{key: summary([r.get(key) for r in ok]) for key in ("detection_to_gone_s", "detection_to_next_step_s",
                                                             "steps_lost_hang", "steps_lost_graceful",
                                                             "request_to_next_step_s")},
    }
    if cold is not None:
        out["cold_start_to_first_step_s"] = cold
    return out
