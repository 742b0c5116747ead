"""Section 3, detection and recovery of the built-in worker, one rank and two: the demo model hangs in C
(block_c); the step deadline's latency beyond its budget, detection → process tree gone (against the dump
settle + 0.5 s), the dump settle itself, detection → first step of the next attempt (against the worker's own
cold start in the same run + 1.0 s), steps lost; then a graceful `restart` over the control socket and the
steps that one loses.  The restart policy is the demo's own (`restart.backoff_initial_s: 1`): the first
restart after a healthy stretch is immediate, so no backoff shows unless the policy adds one.  With two ranks
the worker runs under torchrun (`worker.nproc_per_node: 2`, gloo) and the hang is on rank 1, so the incident's
verdict has a culprit to name that the tie-break of equal deadlines (rank 0) would not; the tree is torchrun
and both ranks."""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from pathlib import Path
from typing import Optional

from .detection import anchor_time
from .harness import (
    attempts_of,
    control,
    demo_worker_config,
    finished_at,
    first,
    hangwatch_run,
    last_step,
    read_beats,
    stall_incidents,
    summary,
    supervisor_log,
    supervisor_log_time,
    wait_exit,
    write_yaml,
)

HANG_AT = 16
RESTART_AT = 26
STEP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 300.0
WORLDS = (1, 2)  # ranks of the built-in worker; the table has one column each
GONE_ALLOWANCE_S = 0.5  # goal: detection → tree gone ≤ dump settle + this
NEXT_STEP_ALLOWANCE_S = 1.0  # goal: detection → next attempt's first step ≤ the cold start + this
FIGURES = (
    "overdue_s",
    "beyond_budget_from_last_line_s",
    "detection_to_gone_s",
    "snapshot_s",
    "dump_settle_s",
    "dump_files_s",
    "py_spy_s",
    "detection_to_sigterm_s",
    "sigterm_to_gone_s",
    "gone_minus_goal_s",
    "restart_delay_s",
    "detection_to_next_spawn_s",
    "next_spawn_to_first_step_s",
    "detection_to_next_step_s",
    "spawn_to_first_step_s",
    "next_step_minus_goal_s",
    "cold_start_difference_s",
    "steps_lost_hang",
    "steps_lost_graceful",
    "request_to_next_step_s",
)


def hang_rank(nproc: int) -> int:
    """The rank the hang is injected on: the last one (rank 0 alone in a single process)."""
    return nproc - 1


def newest_step(run_dir: Path, attempt: int, nproc: int) -> int:
    """The furthest step any rank of `attempt` reported (a hung rank stops a step before its peers can finish it)."""
    return max(last_step(read_beats(run_dir, attempt, rank)) for rank in range(nproc))


def request_restart_when_due(run_dir: Path) -> Optional[tuple[float, dict]]:
    """Once the second attempt passed RESTART_AT: ask for a graceful restart; (request time, reply)."""
    if len(attempts_of(run_dir)) < 2 or last_step(read_beats(run_dir, 2)) < RESTART_AT:
        return None
    requested = time.time()
    result, error = control(run_dir, "restart", 10, mode="graceful")
    return requested, result if error is None else {"error": error}


def resumed(run_dir: Path, before: int, after: int, nproc: int) -> tuple[int, Optional[dict], Optional[float]]:
    """Attempt `before`'s last step, attempt `after`'s start line (rank 0) and the wall time of its first step."""
    beats = read_beats(run_dir, after)
    step = first(beats, "step")
    return newest_step(run_dir, before, nproc), first(beats, "start"), None if step is None else step["t"]


def trial_config(run_dir: Path, nproc: int) -> dict:
    return demo_worker_config(
        run_dir,
        worker={"nproc_per_node": nproc},
        train={"max_steps": 32, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 10, "confirm_steps": 2},
        watchdog={"step_timeout_s": STEP_TIMEOUT_S},
        faults=[{"kind": "block_c", "at_step": HANG_AT, "rank": hang_rank(nproc)}],
        restart={"in_process": False},  # the restart is what is measured (in_process.py has the other path)
    )


def detection_figures(run_dir: Path, inc: dict) -> dict:
    """The step deadline's latency beyond its budget: the supervisor's clock, and from the anchoring step line
    of the rank whose deadline fired (wall clock), as in the detection section."""
    d = inc["deadline"] or {}
    rank = d.get("rank") or 0
    beats = [b for b in read_beats(run_dir, inc["attempt"], rank) if b["t"] <= inc["time_unix"]]
    anchor = anchor_time("step", run_dir, beats) if d.get("name") == "step" else None
    return {
        "deadline_fired": d.get("name"),
        "deadline_rank": rank,
        "overdue_s": d.get("overdue_s"),
        "beyond_budget_from_last_line_s": None if anchor is None else inc["time_unix"] - (anchor + d["budget_s"]),
    }


def log_times(run_dir: Path, event: str) -> list[float]:
    """Wall times of every `event` record in supervisor.log, in order."""
    out = []
    for rec in supervisor_log(run_dir):
        if rec.get("event") == event and rec.get("timestamp"):
            with contextlib.suppress(ValueError, AttributeError):
                out.append(dt.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp())
    return out


def escalation_figures(inc: dict) -> dict:
    """From the incident's timings (supervisor clock, all from detection unless said): the process snapshot's
    CPU interval, the dump settle (SIGUSR1 → every dump in: faulthandler files, py-spy, the snapshot taken
    beside them, flight recorder, DataLoader workers) and within it the faulthandler files and py-spy (from
    SIGUSR1; recorded by every supervisor), detection → SIGTERM, SIGTERM → tree gone, and
    detection → gone against its goal."""
    t = inc.get("timings") or {}
    gone, settle = t.get("detection_to_gone_s"), t.get("dump_s")
    term_at = t.get("sigterm_at_s")
    if term_at is None and gone is not None and t.get("tree_gone_after_s") is not None:
        term_at = gone - t["tree_gone_after_s"]  # an older supervisor's record: derived
    return {
        "snapshot_s": t.get("snapshot_s"),
        "dump_settle_s": settle,
        "dump_files_s": t.get("dump_files_s"),
        "py_spy_s": t.get("py_spy_s"),
        "detection_to_sigterm_s": term_at,
        "sigterm_to_gone_s": t.get("tree_gone_after_s"),
        "sigkill_after_s": t.get("sigkill_after_s"),
        "detection_to_gone_s": gone,
        "gone_minus_goal_s": None if gone is None or settle is None else gone - (settle + GONE_ALLOWANCE_S),
        "restart_delay_s": (inc.get("decision") or {}).get("delay_s"),
    }


def recovery_trial(tmp: Path, nproc: int) -> dict:
    """One run: hang (block_c) at step 16 → supervisor recovers → graceful `restart` at step ≥ 26 → finish."""
    run_dir = tmp / "run"
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", trial_config(run_dir, nproc)), tmp / "supervisor.out")
    t_spawn = time.time()
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
    row: dict = {
        "ranks": nproc,
        "hang_rank": hang_rank(nproc),
        "supervisor_exit": code,
        "restart_reply": reply,
        "dir": str(tmp),
    }
    spawned, step_1 = supervisor_log_time(run_dir, "worker_spawned"), first(read_beats(run_dir, 1), "step")
    row["spawn_to_first_step_s"] = None if spawned is None or step_1 is None else step_1["t"] - spawned
    if not incs:
        row["error"] = "no stall incident"
        return row
    inc = incs[0]
    a = inc["attempt"]
    hang_last, start_2, first_step_2 = resumed(run_dir, a, a + 1, nproc)
    spawns = log_times(run_dir, "worker_spawned")
    next_spawn = spawns[a] if len(spawns) > a else None  # attempt a + 1's (the run's attempts start at 1)
    to_next = None if first_step_2 is None else first_step_2 - inc["time_unix"]
    cold = row["spawn_to_first_step_s"]
    row.update(
        classification=inc.get("classification"),
        summary=inc.get("summary"),
        culprit_rank=inc.get("culprit_rank"),
        **detection_figures(run_dir, inc),
        **escalation_figures(inc),
        detection_to_next_spawn_s=None if next_spawn is None else next_spawn - inc["time_unix"],
        next_spawn_to_first_step_s=None if next_spawn is None or first_step_2 is None else first_step_2 - next_spawn,
        detection_to_next_step_s=to_next,
        next_step_minus_goal_s=None if to_next is None or cold is None else to_next - (cold + NEXT_STEP_ALLOWANCE_S),
        # how much the restart's own cold start differs from the first one's: the machine's noise in that goal
        cold_start_difference_s=None
        if next_spawn is None or first_step_2 is None or cold is None
        else (first_step_2 - next_spawn) - cold,
        hang_last_step=hang_last,
        hang_resumed_step=start_2["step"] if start_2 else None,
        hang_resumed_from=start_2.get("resumed_from") if start_2 else None,
    )
    row["steps_lost_hang"] = None if start_2 is None else hang_last - start_2["step"]
    last_2, start_3, first_step_3 = resumed(run_dir, a + 1, a + 2, nproc)
    if requested is not None and start_3 is not None:
        row.update(
            graceful_last_step=last_2,
            graceful_resumed_step=start_3["step"],
            graceful_resumed_from=start_3.get("resumed_from"),
            steps_lost_graceful=last_2 - start_3["step"],
            request_to_next_step_s=None if first_step_3 is None else first_step_3 - requested,
        )
    row["finished"] = finished_at(run_dir) is not None
    row["run_wall_s"] = time.time() - t_spawn
    return row


def world_summary(rows: list[dict], nproc: int) -> dict:
    """The trials of one world size summed up; with several ranks, how many verdicts named the hung rank."""
    ok = [r for r in rows if "error" not in r]
    out: dict = {
        "raw": rows,
        "trials": len(rows),
        "errors": [r["error"] for r in rows if "error" in r],
        **{key: summary([r.get(key) for r in ok]) for key in FIGURES},
        "gone_goal_met": sum(1 for r in ok if r.get("gone_minus_goal_s") is not None and r["gone_minus_goal_s"] <= 0),
        "next_step_goal_met": sum(
            1 for r in ok if r.get("next_step_minus_goal_s") is not None and r["next_step_minus_goal_s"] <= 0
        ),
    }
    if nproc > 1:
        out["culprit_named"] = sum(1 for r in ok if r.get("culprit_rank") == r["hang_rank"])
    return out


def section(work: Path, quick: bool, cold: Optional[dict]) -> dict:
    """`cold`: the heartbeat section's cold-start summary, shown beside recovery when that section ran."""
    trials = 1 if quick else 3
    rows: dict[int, list] = {n: [] for n in WORLDS}
    for i in range(trials):  # interleaved, so that a busier stretch of the machine falls on both alike
        for n in WORLDS:
            rows[n].append(recovery_trial(work / f"ranks{n}-trial-{i}", n))
    out = {
        "method": f"{trials} sequential runs of `hangwatch run` per world size, alternating, on the demo model "
        f"(configs/demo.yaml watchdog: dump_grace_s 3, term_grace_s 5, stuck_term_grace_s default; restart: "
        f"backoff_initial_s 1, max 10; step_timeout_s {STEP_TIMEOUT_S:g}; "
        f"checkpoint every 10 steps, confirmed after 2; 0.05 s sleep per step): a block_c fault (a mutex "
        f"locked twice) at step {HANG_AT} — with 2 ranks (`worker.nproc_per_node: 2`, torchrun, "
        f"gloo, micro-batch per rank) on rank 1, whose peer then waits in DDP's all-reduce — then a "
        f"graceful `restart` over the control socket once the next attempt passed step {RESTART_AT}. "
        "Beyond the budget: incident.json deadline.overdue_s (supervisor clock), and incident time − "
        "(wall time of the last step line of the rank whose deadline fired + budget). Detection → gone: "
        "incident timings (supervisor clock; torchrun and every rank); its goal: ≤ dump settle + "
        f"{GONE_ALLOWANCE_S:g} s, the dump settle being incident timings dump_s (SIGUSR1 → every dump in). "
        "Detection → next step: the next attempt's first step line − incident time (wall clock); its "
        f"goal: ≤ the same run's cold start + {NEXT_STEP_ALLOWANCE_S:g} s, the cold start being the first "
        "attempt's `worker_spawned` log line → its first step line (spawn → first step). Next attempt: its "
        "`worker_spawned` line − incident time, and from there to its first step. Steps lost: furthest "
        "step line of any rank of the stopped attempt − step the next attempt resumed at (its start line). "
        "Verdict: the incident's culprit_rank is the hung rank.",
        "trials": trials,
        "worlds": {str(n): world_summary(rows[n], n) for n in WORLDS},
    }
    if cold is not None:
        out["cold_start_to_first_step_s"] = cold
    return out
