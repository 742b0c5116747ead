#!/usr/bin/env python
"""hangwatch benchmark: how fast a hang is caught, what watching costs, how much a failure loses.

    .venv/bin/python scripts/bench.py [--quick] [--out DIR] [--only SECTION[,SECTION…]] [--jobs N]
                                      [--allowance-s S] [--workdir DIR] [--keep]
    hangwatch bench …                  (the same command)

Sections (all by default, in this order; `--only` picks some):

  heartbeat     median step time of the demo model with real heartbeats vs none, same process,
                interleaved rounds; cold start of `python -m hangwatch.daemon` to its first step; checkpoint save.
  detection     for each deadline (startup, silence, step, phase): a real supervisor (`hangwatch run`)
                and a light stdlib worker (scripts/baselines/stall_worker.py) that breaks that deadline;
                the latency beyond the budget, read from the incident (the supervisor's own clock),
                and from the worker's last line (wall clock); `--jobs` trials at once.
  recovery      the built-in worker on the demo model hangs in C (block_c); detection → process tree
                gone, detection → first step of the next attempt, steps lost; then a graceful
                `restart` over the control socket and the steps that loses.
  footprint     supervisor RSS and CPU% while watching 8 synthetic ranks beating at 20 Hz
                (scripts/baselines/synthetic_ranks.py), run alone; supervisor start time.
  side_by_side  the same hung worker (busy_loop, hang_generate) under hangwatch, plain
                `torchrun --max-restarts=3`, and a cron-style watchdog (scripts/baselines/cron_watchdog.py),
                each with the same wall-clock allowance.

Writes bench-results.json (every raw sample, the summaries, the machine) and bench-results.md (the
tables, each figure with how it was measured) into --out (default: the repository root), prints the
markdown, exits 0.  Nothing here passes or fails: figures are for reading.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import contextlib
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

import psutil
import yaml

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

PY = sys.executable
STALL_WORKER = ROOT / "scripts" / "baselines" / "stall_worker.py"
SYNTHETIC_RANKS = ROOT / "scripts" / "baselines" / "synthetic_ranks.py"
CRON_WATCHDOG = ROOT / "scripts" / "baselines" / "cron_watchdog.py"
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"
SECTIONS = ("heartbeat", "detection", "recovery", "footprint", "side_by_side")
DEADLINES = ("startup", "silence", "step", "phase")
DETECTION_BUDGET_S = 1.0  # small, so 80 trials fit the time budget; the latency beyond it does not scale with it
POLL_INTERVAL_S = 0.25  # the supervisor's default (watchdog.poll_interval_s), written out so the figure says it


# ============================================================================ plumbing


def summary(values: list[float]) -> dict:
    """n, min, median, p95 (nearest rank), max of the samples; {"n": 0} when there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"n": 0}
    p95 = vals[max(0, math.ceil(0.95 * len(vals)) - 1)]
    return {"n": len(vals), "min": vals[0], "median": statistics.median(vals), "p95": p95, "max": vals[-1]}


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in e.get("PYTHONPATH", "").split(os.pathsep) if p])
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TRANSFORMERS_OFFLINE", "1")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def hangwatch_run(cfg_path: Path, out_path: Path, run_dir: Optional[Path] = None) -> subprocess.Popen:
    """`hangwatch run CONFIG` as a user starts it (control socket, supervisor.log), in its own session."""
    argv = [PY, "-m", "hangwatch.supervisor.cli", "run", str(cfg_path)] + (["--run-dir", str(run_dir)] if run_dir else [])
    out = open(out_path, "ab")
    try:
        return subprocess.Popen(argv, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        out.close()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (torchrun puts its workers in sessions of their own)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def wait_exit(proc: subprocess.Popen, timeout: float) -> Optional[int]:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return None


def read_beats(run_dir: Path, attempt: int, rank: int = 0) -> list[dict]:
    f = run_dir / "attempts" / f"{attempt:04d}" / f"heartbeat-rank{rank}.jsonl"
    out = []
    if f.exists():
        for line in f.read_bytes().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def attempts_of(run_dir: Path) -> list[int]:
    base = run_dir / "attempts"
    return sorted(int(d.name) for d in base.iterdir() if d.name.isdigit()) if base.is_dir() else []


def incidents_of(run_dir: Path) -> list[dict]:
    base = run_dir / "incidents"
    out = []
    if base.is_dir():
        for d in sorted(base.iterdir()):
            with contextlib.suppress(OSError, ValueError):
                out.append({**json.loads((d / "incident.json").read_text()), "_dir": str(d)})
    return out


def has_stack_dump(run_dir: Path) -> Optional[str]:
    """The first file under `run_dir` that holds a Python stack dump (faulthandler or py-spy), or None."""
    for pattern in ("incidents/*/stack-rank*.txt", "incidents/*/py-spy-rank*.txt", "attempts/*/stack-rank*.txt"):
        for f in sorted(run_dir.glob(pattern)):
            with contextlib.suppress(OSError):
                text = f.read_text(errors="replace")
                if "most recent call first" in text or text.startswith("Process "):  # faulthandler / py-spy
                    return str(f.relative_to(run_dir))
    return None


def finished_at(run_dir: Path) -> Optional[float]:
    """Wall time of a `stop finished` line in any attempt, or None."""
    for a in attempts_of(run_dir):
        for b in read_beats(run_dir, a):
            if b.get("event") == "stop" and b.get("reason") == "finished":
                return b["t"]
    return None


def supervisor_log_time(run_dir: Path, event: str) -> Optional[float]:
    """Wall time of the first `event` line in supervisor.log (structlog, ISO timestamps in UTC)."""
    f = run_dir / "supervisor.log"
    if not f.exists():
        return None
    for line in f.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("event") == event and rec.get("timestamp"):
                return dt.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def suspension_gaps(run_dir: Path) -> list[float]:
    """Gaps the supervisor logged in its own loop (it was not scheduled: an overloaded or paused machine)."""
    f = run_dir / "supervisor.log"
    out = []
    if f.exists():
        for line in f.read_text(errors="replace").splitlines():
            if '"supervisor_suspended"' in line:
                with contextlib.suppress(ValueError, KeyError):
                    out.append(json.loads(line)["gap_s"])
    return out


def demo_worker_config(run_dir: Path, **changes) -> dict:
    """configs/demo.yaml with absolute data paths, `run_dir`, and `changes` merged one level deep."""
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    cfg["run_dir"] = str(run_dir)
    cfg["data"] = {**cfg["data"], "train": str(ROOT / "configs/data/train.jsonl"),
                   "eval": str(ROOT / "configs/data/eval.jsonl")}
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ============================================================================ 1. heartbeat cost


def section_heartbeat(work: Path, quick: bool) -> dict:
    """Step time with real heartbeats vs a no-op heartbeat, interleaved in one process; cold start; save."""
    from bench_worker import bench_cold_start, bench_config, build_trainer as make_trainer, timed_steps

    from hangwatch.daemon import checkpoint as ckpt
    from hangwatch.daemon.heartbeat import Heartbeat
    from hangwatch.daemon.train import NullHeartbeat

    rounds, per_round, warmup = (2, 3, 2) if quick else (10, 6, 5)
    cfg = bench_config(DEMO_CONFIG, work / "steps")
    real = Heartbeat(work / "steps" / "hb" / "heartbeat-rank0.jsonl")
    null = NullHeartbeat()
    trainer = make_trainer(cfg, null)

    def timed(n: int) -> list[float]:
        return timed_steps(trainer, n)

    timed(warmup)
    with_hb, without_hb = [], []
    for r in range(rounds):  # alternate which goes first so drift and cache effects fall on both alike
        order = [(real, with_hb), (null, without_hb)] if r % 2 == 0 else [(null, without_hb), (real, with_hb)]
        for hb, bucket in order:
            trainer.hb = hb
            bucket.extend(timed(per_round))
    real.close()
    lines = sum(1 for _ in open(real.path, "rb"))

    # what one beat costs on its own: the ratio above is the sum of these drowned in step-time noise
    calls = 200 if quick else 2000
    probe = Heartbeat(work / "steps" / "probe" / "heartbeat-rank0.jsonl")
    beat_s = []
    for i in range(calls):
        t0 = time.perf_counter()
        probe.step(i, loss=1.0, lr=1e-3, grad_norm=0.5, tokens_per_s=1234.5, samples=16)
        beat_s.append(time.perf_counter() - t0)
    probe.close()

    saves = []
    trainer.hb = null
    for _ in range(2 if quick else 5):
        trainer.after_step(trainer.train_step())
        t0 = time.perf_counter()
        path = ckpt.commit(ckpt.checkpoints_root(trainer.run_dir), trainer.step, trainer._fill)
        saves.append(time.perf_counter() - t0)
    ckpt_bytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    cold = [bench_cold_start(DEMO_CONFIG, work / f"cold-{i}") for i in range(1 if quick else 3)]
    s_with, s_without = summary(with_hb), summary(without_hb)
    return {
        "method": f"{rounds} interleaved rounds × {per_round} optimizer steps each way after {warmup} warm-up steps, "
                  "one process, same model and data stream (configs/demo.yaml, no sleeps, no evals); heartbeat "
                  "= daemon.heartbeat.Heartbeat writing to a file vs daemon.train.NullHeartbeat",
        "step_s_with_heartbeat": with_hb,
        "step_s_without_heartbeat": without_hb,
        "summary_with": s_with,
        "summary_without": s_without,
        "ratio_of_medians": s_with["median"] / s_without["median"],
        "heartbeat_lines_written": lines,
        "beat_call_s": beat_s,
        "beat_call": summary(beat_s),
        "checkpoint_save_s": saves,
        "checkpoint_save": summary(saves),
        "checkpoint_bytes": ckpt_bytes,
        "cold_start": cold,
        "cold_start_to_first_step": summary([c["to_first_step_s"] for c in cold]),
        "cold_start_to_start_beat": summary([c["to_start_s"] for c in cold]),
    }


# ============================================================================ 2. detection latency


def detection_budget(i: int, trials: int) -> float:
    """Trial i's budget: spread evenly over one poll interval above 1 s, so that every offset between the
    deadline and the supervisor's poll timer is sampled (a budget that is a multiple of the interval
    would land on a poll pass every time and show only the best case)."""
    return round(DETECTION_BUDGET_S + POLL_INTERVAL_S * (i + 0.5) / trials, 4)


def detection_config(tmp: Path, deadline: str, budget: float) -> tuple[Path, Path]:
    far = 60.0
    mode = {"startup": "nostart", "silence": "block", "step": "block", "phase": "phase"}[deadline]
    wd = {"startup_timeout_s": budget if deadline == "startup" else 30,
          "silence_timeout_s": budget if deadline == "silence" else far,
          "step_timeout_s": budget if deadline == "step" else far,
          "dump_grace_s": 0.5, "term_grace_s": 0.5, "py_spy": False, "poll_interval_s": POLL_INTERVAL_S}
    run_dir = tmp / "run"
    cfg = {"run_dir": str(run_dir),
           "worker": {"command": [PY, str(STALL_WORKER), mode, "--phase-budget", str(budget)]},
           "watchdog": wd, "restart": {"backoff_initial_s": 0, "max_restarts": 3}}
    return write_yaml(tmp / "cfg.yaml", cfg), run_dir


def detection_trial(tmp: Path, deadline: str, budget: float) -> dict:
    cfg_path, run_dir = detection_config(tmp, deadline, budget)
    proc = hangwatch_run(cfg_path, tmp / "supervisor.out")
    code = wait_exit(proc, 120)
    incs = [i for i in incidents_of(run_dir) if i.get("deadline")]
    if not incs:
        return {"deadline": deadline, "error": f"no stall incident (supervisor exit {code})", "dir": str(tmp)}
    inc = incs[0]
    d = inc["deadline"]
    beats = [b for b in read_beats(run_dir, inc["attempt"]) if b["t"] <= inc["time_unix"]]
    if deadline == "startup":
        anchor = supervisor_log_time(run_dir, "worker_spawned")
    elif deadline == "silence":
        anchor = beats[-1]["t"] if beats else None
    elif deadline == "step":
        anchor = max((b["t"] for b in beats if b["event"] == "step" or (b["event"] == "phase" and b["phase"] == "train")),
                     default=None)
    else:
        anchor = max((b["t"] for b in beats if b["event"] == "phase" and b["phase"] == "eval"), default=None)
    nxt = [b for b in read_beats(run_dir, inc["attempt"] + 1) if b["event"] == "step"]
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


def section_detection(work: Path, quick: bool, jobs: int) -> dict:
    trials = 2 if quick else 20
    plan = [(dl, i) for i in range(trials) for dl in DEADLINES]  # round robin: load falls on every deadline alike
    results: dict[str, list] = {dl: [] for dl in DEADLINES}
    t0 = time.monotonic()
    with futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        done = pool.map(lambda item: detection_trial(work / f"{item[0]}-{item[1]:02d}", item[0],
                                                      detection_budget(item[1], trials)), plan)
        for r in done:
            results[r["deadline"]].append(r)
    lo, hi = detection_budget(0, trials), detection_budget(trials - 1, trials)
    out = {"method": f"{trials} trials per deadline, {jobs} supervisors at a time (round robin over the deadlines); "
                     f"`hangwatch run` with the default poll_interval_s {POLL_INTERVAL_S:g} and, on the deadline under "
                     f"test, budgets {lo:g}–{hi:g} s spread evenly over one poll interval (the other deadlines far "
                     "away); worker scripts/baselines/stall_worker.py (nostart / block / phase, blocked in read(2)). "
                     "'supervisor clock' = incident.json deadline.overdue_s (elapsed − budget on the supervisor's "
                     "monotonic clock, from when it read the anchoring line); 'from the worker's last line' = "
                     "incident time − (wall time the worker wrote the anchoring line + budget), which adds the "
                     "file-event and read delay; it can come out a few ms below zero because the supervisor stamps a "
                     "line with the start of the loop pass that reads it, and for startup the anchor is its "
                     "`worker_spawned` log line, written just after the fork. A 'loop gap' is "
                     "the supervisor's own `supervisor_suspended` log line: its loop did not run for > 2 s (an "
                     "overloaded or paused machine, or a slow fsync), and it extended every deadline by the gap",
           "budget_s": [lo, hi], "trials": trials, "jobs": jobs, "wall_s": time.monotonic() - t0,
           "deadlines": {}}
    for dl, rows in results.items():
        good = [r for r in rows if r.get("fired") == dl]
        out["deadlines"][dl] = {
            "raw": rows,
            "other_deadline_fired": [r.get("fired", r.get("error")) for r in rows if r.get("fired") != dl],
            "trials_with_loop_gaps": sum(1 for r in good if r.get("supervisor_suspended_gaps_s")),
            "overdue_s": summary([r["overdue_s"] for r in good]),
            "beyond_budget_from_last_line_s": summary([r["beyond_budget_from_last_line_s"] for r in good]),
            "detection_to_gone_s": summary([r["detection_to_gone_s"] for r in good]),
            "detection_to_next_step_s": summary([r["detection_to_next_step_s"] for r in good]),
        }
    return out


# ============================================================================ 3. recovery


RECOVERY_HANG_AT = 16
RECOVERY_RESTART_AT = 26


def recovery_trial(tmp: Path) -> dict:
    """One run: hang (block_c) at step 16 → supervisor recovers → graceful `restart` at step ≥ 26 → finish."""
    from hangwatch.supervisor.client import Client, ClientError
    from hangwatch.supervisor.control import socket_path_in

    run_dir = tmp / "run"
    cfg = demo_worker_config(
        run_dir,
        train={"max_steps": 32, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 10, "confirm_steps": 2},
        watchdog={"step_timeout_s": 3},
        restart={"backoff_initial_s": 0},
        faults=[{"kind": "block_c", "at_step": RECOVERY_HANG_AT}],
    )
    cfg_path = write_yaml(tmp / "cfg.yaml", cfg)
    t_spawn = time.time()
    proc = hangwatch_run(cfg_path, tmp / "supervisor.out")
    requested = None
    reply = None
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if requested is None and len(attempts_of(run_dir)) >= 2:
                steps = [b["step"] for b in read_beats(run_dir, 2) if b["event"] == "step"]
                if steps and max(steps) >= RECOVERY_RESTART_AT:
                    try:
                        requested = time.time()
                        reply = Client(socket_path_in(run_dir), timeout=10).call("restart", mode="graceful")
                    except ClientError as exc:
                        reply = {"error": str(exc)}
            time.sleep(0.02)
    finally:
        code = wait_exit(proc, max(1.0, deadline - time.monotonic()))
    incs = [i for i in incidents_of(run_dir) if i.get("deadline")]
    row: dict = {"supervisor_exit": code, "restart_reply": reply, "dir": str(tmp)}
    if not incs:
        row["error"] = "no stall incident"
        return row
    inc = incs[0]
    a1 = read_beats(run_dir, inc["attempt"])
    a2 = read_beats(run_dir, inc["attempt"] + 1)
    first_step_2 = next((b["t"] for b in a2 if b["event"] == "step"), None)
    start_2 = next((b for b in a2 if b["event"] == "start"), None)
    row.update(
        classification=inc.get("classification"),
        detection_to_gone_s=(inc.get("timings") or {}).get("detection_to_gone_s"),
        detection_to_next_step_s=None if first_step_2 is None else first_step_2 - inc["time_unix"],
        hang_last_step=max((b["step"] for b in a1 if b["event"] == "step"), default=0),
        hang_resumed_step=start_2["step"] if start_2 else None,
        hang_resumed_from=start_2.get("resumed_from") if start_2 else None,
    )
    row["steps_lost_hang"] = None if start_2 is None else row["hang_last_step"] - start_2["step"]
    a3 = read_beats(run_dir, inc["attempt"] + 2)
    start_3 = next((b for b in a3 if b["event"] == "start"), None)
    first_step_3 = next((b["t"] for b in a3 if b["event"] == "step"), None)
    if requested is not None and start_3 is not None:
        last_2 = max((b["step"] for b in a2 if b["event"] == "step"), default=0)
        row.update(graceful_last_step=last_2, graceful_resumed_step=start_3["step"],
                   graceful_resumed_from=start_3.get("resumed_from"), steps_lost_graceful=last_2 - start_3["step"],
                   request_to_next_step_s=None if first_step_3 is None else first_step_3 - requested)
    row["finished"] = finished_at(run_dir) is not None
    row["run_wall_s"] = time.time() - t_spawn
    return row


def section_recovery(work: Path, quick: bool, cold: Optional[dict]) -> dict:
    trials = 1 if quick else 3
    rows = [recovery_trial(work / f"trial-{i}") for i in range(trials)]
    ok = [r for r in rows if "error" not in r]
    out = {
        "method": f"{trials} sequential runs of `hangwatch run` on the demo model (configs/demo.yaml watchdog: "
                  f"dump_grace_s 3, term_grace_s 5; step_timeout_s 3; checkpoint every 10 steps, confirmed after 2; "
                  f"0.05 s sleep per step): a block_c fault (read on a pipe nobody writes) at step {RECOVERY_HANG_AT}, "
                  f"then a graceful `restart` over the control socket once the next attempt passed step "
                  f"{RECOVERY_RESTART_AT}. Detection → gone: incident timings (supervisor clock). Detection → next "
                  "step: the next attempt's first step line − incident time (wall clock). Steps lost: last step "
                  "line of the stopped attempt − step the next attempt resumed at (its start line).",
        "trials": trials,
        "raw": rows,
        "detection_to_gone_s": summary([r.get("detection_to_gone_s") for r in ok]),
        "detection_to_next_step_s": summary([r.get("detection_to_next_step_s") for r in ok]),
        "steps_lost_hang": summary([r.get("steps_lost_hang") for r in ok]),
        "steps_lost_graceful": summary([r.get("steps_lost_graceful") for r in ok]),
        "request_to_next_step_s": summary([r.get("request_to_next_step_s") for r in ok]),
    }
    if cold is not None:
        out["cold_start_to_first_step_s"] = cold
    return out


# ============================================================================ 4. footprint


def section_footprint(work: Path, quick: bool) -> dict:
    ranks, hz = 8, 20.0
    window = 3.0 if quick else 60.0
    settle = 1.0 if quick else 2.0
    run_dir = work / "run"
    cfg = {"run_dir": str(run_dir),
           "worker": {"command": [PY, str(SYNTHETIC_RANKS), "--ranks", str(ranks), "--hz", str(hz),
                                  "--seconds", str(window + settle + 20)]},
           "watchdog": {"py_spy": False}}
    cfg_path = write_yaml(work / "cfg.yaml", cfg)
    proc = hangwatch_run(cfg_path, work / "supervisor.out")
    sup = psutil.Process(proc.pid)
    hb_files = [run_dir / "attempts" / "0001" / f"heartbeat-rank{r}.jsonl" for r in range(ranks)]
    limit = time.monotonic() + 60
    while not all(f.exists() and f.stat().st_size for f in hb_files):
        if time.monotonic() > limit or proc.poll() is not None:
            wait_exit(proc, 1)
            raise RuntimeError(f"the synthetic ranks did not all start (see {work})")
        time.sleep(0.05)
    time.sleep(settle)
    rss, cpu_pct = [], []
    lines_before = sum(f.read_bytes().count(b"\n") for f in hb_files)
    c0 = sup.cpu_times()
    w0 = time.monotonic()
    prev_c, prev_w = c0.user + c0.system, w0
    while time.monotonic() - w0 < window:
        time.sleep(1.0)
        c = sup.cpu_times()
        now = time.monotonic()
        rss.append(sup.memory_info().rss)
        cpu_pct.append(100.0 * (c.user + c.system - prev_c) / (now - prev_w))
        prev_c, prev_w = c.user + c.system, now
    c1 = sup.cpu_times()
    w1 = time.monotonic()
    lines = sum(f.read_bytes().count(b"\n") for f in hb_files) - lines_before
    threads = sup.num_threads()
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 60)
    state = json.loads((run_dir / "state.json").read_text()) if (run_dir / "state.json").exists() else {}
    starts = [supervisor_start_trial(work / f"start-{i}") for i in range(2 if quick else 10)]
    return {
        "method": f"`hangwatch run` watching {ranks} synthetic ranks (scripts/baselines/synthetic_ranks.py) "
                  f"beating a step line at {hz:g} Hz each, nothing else of this benchmark running; after all ranks "
                  f"started and {settle:g} s to settle, the supervisor process (all its threads) sampled every 1 s "
                  f"for {window:g} s with psutil: CPU% = CPU time / wall time (100% = one core), RSS. Start time: "
                  "spawn of `hangwatch run` → the worker spawned (attempts/0001/worker.log created) and → the "
                  "control socket answering `status`, sequential trials.",
        "ranks": ranks, "hz": hz, "window_s": w1 - w0,
        "cpu_percent_whole_window": 100.0 * (c1.user + c1.system - c0.user - c0.system) / (w1 - w0),
        "cpu_percent_per_second": cpu_pct, "cpu_percent": summary(cpu_pct),
        "rss_bytes_samples": rss, "rss_mib": summary([r / 2**20 for r in rss]),
        "threads": threads,
        "heartbeat_lines_in_window": lines, "lines_per_s": lines / (w1 - w0),
        "torn_lines": state.get("torn_lines"), "supervisor_exit": code,
        "start": starts,
        "start_to_worker_spawned_s": summary([s.get("to_worker_spawned_s") for s in starts]),
        "start_to_socket_ready_s": summary([s.get("to_socket_ready_s") for s in starts]),
    }


def supervisor_start_trial(tmp: Path) -> dict:
    from hangwatch.supervisor.client import Client, ClientError
    from hangwatch.supervisor.control import socket_path_in

    run_dir = tmp / "run"
    cfg = {"run_dir": str(run_dir), "worker": {"command": [PY, "-c", "import time; time.sleep(600)"]},
           "watchdog": {"py_spy": False, "startup_timeout_s": 600}}
    cfg_path = write_yaml(tmp / "cfg.yaml", cfg)
    t0 = time.monotonic()
    proc = hangwatch_run(cfg_path, tmp / "supervisor.out")
    got: dict = {}
    limit = t0 + 30
    while len(got) < 2 and time.monotonic() < limit and proc.poll() is None:
        if "to_worker_spawned_s" not in got and (run_dir / "attempts" / "0001" / "worker.log").exists():
            got["to_worker_spawned_s"] = time.monotonic() - t0
        if "to_socket_ready_s" not in got and run_dir.is_dir():
            with contextlib.suppress(ClientError, OSError):
                Client(socket_path_in(run_dir), timeout=1).call("status")
                got["to_socket_ready_s"] = time.monotonic() - t0
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    got["supervisor_exit"] = wait_exit(proc, 30)
    return got


# ============================================================================ 5. side by side


CONTENDERS = ("hangwatch", "torchrun", "cron_watchdog")
BASELINES = ("torchrun", "cron_watchdog")
FAULTS = {"hang_generate": {"kind": "hang_generate", "at_step": 20}, "busy_loop": {"kind": "busy_loop", "at_step": 15}}
BASELINE_NICE = 19
CRON_REPORT_GRACE_S = 15.0  # the cron watchdog ends itself at the allowance and prints its report; wait for that


def contender_argv(contender: str, cfg_path: Path, run_dir: Path, allowance: float) -> list[str]:
    worker = ["-m", "hangwatch.daemon", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    if contender == "hangwatch":
        return [PY, "-m", "hangwatch.supervisor.cli", "run", str(cfg_path), "--run-dir", str(run_dir)]
    nice = ["nice", "-n", str(BASELINE_NICE)] if shutil.which("nice") else []
    if contender == "torchrun":  # --standalone: a free rendezvous port, so several can run at once
        return nice + [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=3"] + worker
    return nice + [PY, str(CRON_WATCHDOG), "--status-file", str(run_dir / "worker-stdout.log"), "--poll-s", "30",
                   "--threshold-s", "600", "--allowance-s", str(allowance), "--", PY] + worker


class Contender:
    """One contender on one faulty run: started, then `finish()`ed once its allowance is over."""

    def __init__(self, tmp: Path, contender: str, fault: str, allowance: float):
        self.tmp, self.contender, self.fault, self.allowance = tmp, contender, fault, allowance
        self.run_dir = tmp / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = demo_worker_config(self.run_dir, train={"max_steps": 30, "sleep_per_step_s": 0.0},
                                 eval={"every_steps": 10}, checkpoint={"every_steps": 10, "confirm_steps": 2},
                                 faults=[FAULTS[fault]])
        cfg_path = write_yaml(tmp / "cfg.yaml", cfg)
        self.argv = contender_argv(contender, cfg_path, self.run_dir, allowance)
        self.out_path = tmp / "contender.out"
        self.started = time.time()
        self.t0 = time.monotonic()
        with open(self.out_path, "ab") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env(), stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def fault_fired_at(self) -> Optional[float]:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            return json.loads((self.run_dir / "faults-fired.json").read_text())["fired"][0]["t"]
        return None

    def limit(self) -> float:
        return self.t0 + self.allowance + (CRON_REPORT_GRACE_S if self.contender == "cron_watchdog" else 0)

    def done(self) -> bool:
        return self.proc.poll() is not None or time.monotonic() >= self.limit()

    def finish(self) -> dict:
        while not self.done():
            time.sleep(0.2)
        ended_by_itself = self.proc.poll() is not None
        hung = []  # what still ran at the end of the allowance: the worker, and its state
        if not ended_by_itself:
            with contextlib.suppress(psutil.Error):
                for p in psutil.Process(self.proc.pid).children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        if "daemon" in p.cmdline():
                            hung.append({"pid": p.pid, "status": p.status(), "cpu_percent": p.cpu_percent(interval=0.5)})
            kill_tree(self.proc.pid)
        code = self.proc.wait()
        run_dir = self.run_dir
        hang_t = self.fault_fired_at()
        row = {"contender": self.contender, "fault": self.fault, "allowance_s": self.allowance, "argv": self.argv,
               "started_unix": self.started, "wall_s": time.monotonic() - self.t0, "exit_code": code,
               "ended_by_itself": ended_by_itself, "still_running_at_end": hung,
               "hang_began_after_s": None if hang_t is None else hang_t - self.started,
               "attempts": len(attempts_of(run_dir)), "stack_dump": has_stack_dump(run_dir), "dir": str(self.tmp)}
        fin = finished_at(run_dir)
        row["finished"] = fin is not None
        row["finished_after_s"] = None if fin is None else fin - self.started
        noticed_t = how = None
        if self.contender == "hangwatch":
            incs = incidents_of(run_dir)
            if incs:
                noticed_t = incs[0]["time_unix"]
                d = incs[0].get("deadline") or {}
                how = f"{d.get('name')} deadline, {d.get('budget_s'):g} s ({d.get('source')})" if d else incs[0]["kind"]
                row["classification"] = incs[0].get("classification")
                row["supervisor_suspended_gaps_s"] = suspension_gaps(run_dir)
        elif self.contender == "torchrun":
            later = [a for a in attempts_of(run_dir) if a > 1]
            if later:  # torchrun restarted the worker: the new attempt's first line says when
                beats = read_beats(run_dir, later[0])
                noticed_t = beats[0]["t"] if beats else None
                how = "restarted the worker"
        else:
            report: dict = {}
            for line in reversed(self.out_path.read_text(errors="replace").splitlines()):
                with contextlib.suppress(ValueError):
                    obj = json.loads(line)
                    if isinstance(obj, dict) and "noticed" in obj:
                        report = obj
                        break
            row["cron_report"] = report
            if report.get("noticed"):
                noticed_t = report.get("noticed_unix")
                how = f"status file older than {report.get('threshold_s'):g} s"
        row["noticed"] = noticed_t is not None
        row["noticed_how"] = how
        row["noticed_after_hang_s"] = None if noticed_t is None or hang_t is None else noticed_t - hang_t
        return row


def section_side_by_side(work: Path, allowance: float) -> dict:
    """The four baseline runs start together (at nice 19); once their faults fired, or after half the
    allowance, the two hangwatch runs start together; every run gets `allowance` from its own start."""
    t0 = time.monotonic()
    runs = [Contender(work / f"{f}-{c}", c, f, allowance) for f in FAULTS for c in BASELINES]
    limit = time.monotonic() + allowance / 2
    while time.monotonic() < limit and not all(r.fault_fired_at() or r.done() for r in runs):
        time.sleep(0.2)
    waited = time.monotonic() - t0
    runs += [Contender(work / f"{f}-hangwatch", "hangwatch", f, allowance) for f in FAULTS]
    rows = [r.finish() for r in runs]
    order = {(f, c): i for i, (f, c) in enumerate((f, c) for f in FAULTS for c in CONTENDERS)}
    rows.sort(key=lambda r: order[(r["fault"], r["contender"])])
    return {
        "method": f"The built-in worker on the demo model (configs/demo.yaml: max_steps 30, eval every 10, checkpoint "
                  f"every 10 confirmed after 2, no sleeps) with one fault: hang_generate (generate() waits forever at "
                  f"the eval of step 20) or busy_loop (a pure-Python loop in attention's forward from step 15). Each "
                  f"run gets {allowance:g} s of wall clock from its own start; then whatever still runs is killed. "
                  f"hangwatch: `hangwatch run` with the demo's watchdog settings; torchrun: `python -m "
                  f"torch.distributed.run --standalone --nproc-per-node=1 --max-restarts=3 -m hangwatch.daemon …`; cron "
                  f"watchdog: scripts/baselines/cron_watchdog.py, status file = the worker's stdout log, polled every "
                  f"30 s, threshold 600 s, kill -9 and restart. Schedule: the four torchrun/cron runs start together "
                  f"at nice {BASELINE_NICE} (a hung busy_loop spins a core for the whole allowance; the niceness "
                  f"cannot change whether they notice: torchrun reacts only to a worker's exit, the cron watchdog "
                  f"only to the status file's age); the two hangwatch runs start together once those four faults "
                  f"fired ({waited:.0f} s later). 'Noticed' = an incident (hangwatch), a new attempt (torchrun), "
                  f"the watchdog's own report (cron), timed from the fault's record in faults-fired.json; 'stack "
                  f"dump' = a file under the run dir holding a Python stack; 'finished' = a `stop finished` "
                  f"heartbeat line.",
        "allowance_s": allowance, "baselines_alone_s": waited, "wall_s": time.monotonic() - t0, "runs": rows,
    }


# ============================================================================ report


def machine_info() -> dict:
    def version(dist):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
        return None

    commit = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(), "platform": platform.platform(),
        "python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers"),
        "peft": version("peft"), "psutil": version("psutil"), "commit": commit,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "load_average_start": os.getloadavg(),
    }


def fmt_s(x: Optional[float], digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def stats_cell(s: dict, unit: str = "s", scale: float = 1.0, digits: int = 3) -> str:
    if not s or not s.get("n"):
        return "not measured"
    f = lambda v: f"{v * scale:.{digits}f}"  # noqa: E731
    return f"{f(s['median'])} {unit} (n={s['n']}; min {f(s['min'])}, p95 {f(s['p95'])}, max {f(s['max'])})"


def end_of_allowance(r: dict) -> str:
    if r["contender"] == "cron_watchdog":
        rep = r.get("cron_report") or {}
        polls, restarts = rep.get("polls"), rep.get("restarts")
        text = (f"gave up at the allowance after {polls} poll{'' if polls == 1 else 's'}, {restarts} "
                f"restart{'' if restarts == 1 else 's'}; worker killed"
                if rep else "no report from the watchdog; killed")
    elif r["ended_by_itself"]:
        text = f"ended by itself, exit {r['exit_code']}"
    elif r["still_running_at_end"]:
        text = "worker still " + ", ".join(f"{h['status']} at {h['cpu_percent']:.0f}% CPU" for h in r["still_running_at_end"])
    else:
        text = "still running; killed"
    if r["hang_began_after_s"] is None:
        text += "; the fault never fired (the worker did not reach it)"
    return text


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"## hangwatch benchmark — {m['date']}", "",
             f"`{res['command']}` · {m['cores_usable']} of {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, "
             f"Python {m['python']}, torch {m['torch']}, commit {m['commit']} · load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_start'])} · whole run {res['wall_s']:.0f} s"
             + (" · **--quick: tiny trial counts, figures not representative**" if res["quick"] else ""), "",
             "Sections (wall time, 1-min load average when it began): " + ", ".join(
                 f"{k} {v:.0f} s ({res['section_load_average_1min_at_start'][k]:.1f})" for k, v in res["section_wall_s"].items())
             + ". The machine may be shared: a load well above the core count means the figures below include "
               "waiting for a CPU.", ""]
    sec = {k: v for k, v in res["sections"].items() if "error" not in v}
    for name, v in res["sections"].items():
        if "error" in v:
            lines += [f"### {name}: not measured", "", f"The section failed: `{v['error']}` (traceback in bench-results.json).", ""]
    if "heartbeat" in sec:
        h = sec["heartbeat"]
        lines += ["### 1. Heartbeat cost (demo model, CPU)", "", "| figure | value (median; n, min, p95, max) |", "|---|---|",
                  f"| step time with heartbeats | {stats_cell(h['summary_with'], 'ms', 1000, 2)} |",
                  f"| step time without heartbeats | {stats_cell(h['summary_without'], 'ms', 1000, 2)} |",
                  f"| **ratio of medians (with / without)** | **{h['ratio_of_medians']:.3f}** |",
                  f"| one `step` beat on its own (Heartbeat.step, {h['beat_call']['n']} calls) | "
                  f"{stats_cell(h['beat_call'], 'µs', 1e6, 1)} |",
                  f"| checkpoint save (full commit, fsynced) | {stats_cell(h['checkpoint_save'], 'ms', 1000, 1)} "
                  f"· {h['checkpoint_bytes'] / 1024:.0f} KiB |",
                  f"| worker cold start: spawn → `start` beat | {stats_cell(h['cold_start_to_start_beat'], 's', 1, 2)} |",
                  f"| worker cold start: spawn → first step | {stats_cell(h['cold_start_to_first_step'], 's', 1, 2)} |",
                  "", f"How: {h['method']}; cold start = bench_worker.bench_cold_start, sequential trials.", ""]
    if "detection" in sec:
        d = sec["detection"]
        lines += [f"### 2. Detection latency beyond the budget ({d['budget_s'][0]:g}–{d['budget_s'][1]:g} s budgets)", "",
                  "| deadline | trials | supervisor clock: min / p50 / p95 / max (s) | from the worker's last line: "
                  "min / p50 / p95 / max (s) | detection → tree gone p50 (s) | other deadline fired | "
                  "trials where the supervisor logged a loop gap |",
                  "|---|---|---|---|---|---|---|"]
        for dl in DEADLINES:
            x = d["deadlines"][dl]
            a, b = x["overdue_s"], x["beyond_budget_from_last_line_s"]
            four = lambda s: " / ".join(fmt_s(s.get(k)) for k in ("min", "median", "p95", "max")) if s.get("n") else "not measured"  # noqa: E731
            lines.append(f"| {dl} | {a.get('n', 0)} | {four(a)} | {four(b)} | {fmt_s(x['detection_to_gone_s'].get('median'))} "
                         f"| {len(x['other_deadline_fired'])} | {x['trials_with_loop_gaps']} |")
        lines += ["", f"How: {d['method']}.", ""]
    if "recovery" in sec:
        r = sec["recovery"]
        cold = r.get("cold_start_to_first_step_s")
        lines += ["### 3. Recovery (demo model, hang in C)", "", "| figure | value (median; n, min, p95, max) |", "|---|---|",
                  f"| detection → process tree gone | {stats_cell(r['detection_to_gone_s'], 's', 1, 2)} |",
                  f"| detection → first step of the next attempt | {stats_cell(r['detection_to_next_step_s'], 's', 1, 2)} |",
                  f"| worker's own cold start → first step (for comparison) | "
                  f"{stats_cell(cold, 's', 1, 2) if cold else 'not measured (run the heartbeat section)'} |",
                  f"| steps lost per fault: hang (resume from the last good checkpoint) | {stats_cell(r['steps_lost_hang'], 'steps', 1, 0)} |",
                  f"| steps lost per fault: graceful `restart` | {stats_cell(r['steps_lost_graceful'], 'steps', 1, 0)} |",
                  f"| graceful `restart` request → first step of the next attempt | {stats_cell(r['request_to_next_step_s'], 's', 1, 2)} |",
                  "", f"How: {r['method']}", ""]
    if "footprint" in sec:
        f = sec["footprint"]
        lines += [f"### 4. Supervisor footprint ({f['ranks']} ranks at {f['hz']:g} Hz, {f['window_s']:.0f} s)", "",
                  "| figure | value |", "|---|---|",
                  f"| CPU, whole window | {f['cpu_percent_whole_window']:.2f} % of one core |",
                  f"| CPU, per 1 s sample | {stats_cell(f['cpu_percent'], '%', 1, 2)} |",
                  f"| RSS | {stats_cell(f['rss_mib'], 'MiB', 1, 1)} |",
                  f"| heartbeat lines handled | {f['heartbeat_lines_in_window']} ({f['lines_per_s']:.0f}/s), "
                  f"{f['torn_lines']} torn |",
                  f"| start: spawn → worker spawned | {stats_cell(f['start_to_worker_spawned_s'], 's', 1, 3)} |",
                  f"| start: spawn → control socket answers | {stats_cell(f['start_to_socket_ready_s'], 's', 1, 3)} |",
                  "", f"How: {f['method']}", ""]
    if "side_by_side" in sec:
        s = sec["side_by_side"]
        lines += [f"### 5. Side by side: the same hung worker, {s['allowance_s']:g} s allowance each", "",
                  "| fault | contender | noticed? | noticed after the hang began | stack dump? | run finished? | "
                  "attempts | at the end of the allowance |", "|---|---|---|---|---|---|---|---|"]
        for r in s["runs"]:
            noticed = f"yes ({r['noticed_how']})" if r["noticed"] else "no"
            after = f"{r['noticed_after_hang_s']:.1f} s" if r["noticed_after_hang_s"] is not None else "–"
            fin = f"yes, {r['finished_after_s']:.0f} s after its start" if r["finished"] else "no"
            lines.append(f"| {r['fault']} | {r['contender']} | {noticed} | {after} | "
                         f"{'yes' if r['stack_dump'] else 'no'} | {fin} | {r['attempts']} | {end_of_allowance(r)} |")
        lines += ["", f"How: {s['method']}", ""]
    return "\n".join(lines)


# ============================================================================ main


def parse_only(text: Optional[str]) -> list[str]:
    if not text:
        return list(SECTIONS)
    picked = [s.strip().replace("-", "_") for s in text.split(",") if s.strip()]
    unknown = [s for s in picked if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    return [s for s in SECTIONS if s in picked]


def run_section(name: str, work: Path, args, res: dict, allowance: float) -> dict:
    if name == "heartbeat":
        return section_heartbeat(work, args.quick)
    if name == "detection":
        return section_detection(work, args.quick, args.jobs)
    if name == "recovery":
        hb = res["sections"].get("heartbeat") or {}
        return section_recovery(work, args.quick, hb.get("cold_start_to_first_step"))
    if name == "footprint":
        return section_footprint(work, args.quick)
    return section_side_by_side(work, allowance)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny trial counts and durations (plumbing check)")
    ap.add_argument("--out", type=Path, default=ROOT, help="where bench-results.json and bench-results.md go")
    ap.add_argument("--only", type=parse_only, default=list(SECTIONS), metavar="SECTION[,SECTION…]",
                    help=f"run only these sections: {', '.join(SECTIONS)}")
    ap.add_argument("--jobs", type=int, default=4, help="detection trials run at once (default 4)")
    ap.add_argument("--allowance-s", type=float, default=None,
                    help="wall clock each side-by-side contender gets (default 120; 20 with --quick)")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (with --workdir)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    allowance = args.allowance_s if args.allowance_s is not None else (20.0 if args.quick else 120.0)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    t0 = time.monotonic()
    res: dict = {"command": "python scripts/bench.py" + (" " + " ".join(argv if argv is not None else sys.argv[1:])).rstrip(),
                 "quick": args.quick, "machine": machine_info(), "sections": {}, "section_wall_s": {},
                 "section_load_average_1min_at_start": {}}
    base = Path(tempfile.mkdtemp(prefix="hangwatch-bench-", dir=args.workdir))
    failed: list[str] = []
    try:
        for name in args.only:
            work = base / name
            work.mkdir(parents=True)
            s0 = time.monotonic()
            res["section_load_average_1min_at_start"][name] = os.getloadavg()[0]
            print(f"bench: {name} …", file=sys.stderr, flush=True)
            try:
                out = run_section(name, work, args, res, allowance)
            except Exception as exc:  # one broken section must not cost the others their figures
                failed.append(name)
                out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
                print(out["traceback"], file=sys.stderr, flush=True)
            res["sections"][name] = out
            res["section_wall_s"][name] = time.monotonic() - s0
            print(f"bench: {name} done in {res['section_wall_s'][name]:.0f} s", file=sys.stderr, flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    res["workdir"] = str(base) if args.keep else None
    res["wall_s"] = time.monotonic() - t0
    res["machine"]["load_average_end"] = os.getloadavg()
    md = to_markdown(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (args.out / "bench-results.md").write_text(md + "\n")
    print(md)
    if failed:
        print(f"bench: section(s) failed: {', '.join(failed)} (see their error in the table and the JSON)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
