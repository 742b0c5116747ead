#!/usr/bin/env python3
"""Supervisor benchmark: how fast a hang is caught, cleared, and the run back at work.

    .venv/bin/python scripts/bench_supervisor.py [--trials 5] [--budget 2] [--builtin] [--json-out FILE]

Per trial a real supervisor runs a worker that hangs on its first attempt and behaves on its
second (tests/fixtures/hbworker.py, or with --builtin the real training daemon with a `block_c`
fault).  Measured from files, with wall-clock times of two processes on one machine:

* detection latency beyond the budget — incident time − (the last step line's time + budget):
  what the poll period, file events and the loop add to the deadline itself;
* detection → process tree gone — the supervisor's own timing (snapshot, dump, SIGTERM grace,
  SIGKILL, reap);
* detection → first step of the next attempt, beside the worker's cold start (the same worker
  started alone: spawn → first step): the difference is what recovery costs on top of starting over.

Prints a table and a JSON object.  Figures are for reading, never for pass/fail.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import signal
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
HBWORKER = ROOT / "tests" / "fixtures" / "hbworker.py"
PY = sys.executable


def percentile(values: list[float], q: float) -> float:
    vals = sorted(values)
    return vals[max(0, math.ceil(q / 100 * len(vals)) - 1)]


def summarize(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 50), 3), "p95": round(percentile(values, 95), 3),
            "max": round(max(values), 3)}


def fixture_config(tmp: Path, mode: str, budget: float) -> tuple[Path, Path]:
    run_dir = tmp / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {"command": [PY, str(HBWORKER), mode, "--steps", "6", "--step-s", "0.05"]},
        "watchdog": {"startup_timeout_s": 10, "silence_timeout_s": budget + 10, "step_timeout_s": budget,
                     "dump_grace_s": 2, "term_grace_s": 1, "poll_interval_s": 0.25, "py_spy": False},
        "restart": {"backoff_initial_s": 0},
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def builtin_config(tmp: Path, budget: float) -> tuple[Path, Path]:
    cfg = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    run_dir = tmp / "run"
    cfg.update(
        run_dir=str(run_dir),
        data={"train": str(ROOT / "configs/data/train.jsonl"), "eval": str(ROOT / "configs/data/eval.jsonl"), "max_length": 64},
        faults=[{"kind": "block_c", "at_step": 4}],
        watchdog={"startup_timeout_s": 120, "silence_timeout_s": budget + 10, "step_timeout_s": budget, "dump_grace_s": 2,
                  "term_grace_s": 3, "py_spy": False, "phase_budgets_s": {"eval": 60, "generate": 30, "checkpoint": 60, "load": 120}},
        restart={"backoff_initial_s": 0},
    )
    cfg["train"].update(max_steps=6, sleep_per_step_s=0.0)
    cfg["eval"].update(every_steps=0)
    cfg["checkpoint"].update(every_steps=2, confirm_steps=1)
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def beats(run_dir: Path, attempt: int) -> list[dict]:
    f = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def cold_start(cfg_path: Path, run_dir: Path, builtin: bool) -> float:
    """The worker alone, as the supervisor would start it: spawn → its first step line (wall clock)."""
    cfg = yaml.safe_load(cfg_path.read_text())
    argv = ([PY, "-m", "hangwatch.daemon", "--config", str(cfg_path), "--run-dir", str(run_dir)] if builtin
            else cfg["worker"]["command"])
    hb_dir = run_dir / "attempts" / "0001"
    hb_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HANGWATCH_RUN_DIR": str(run_dir), "HANGWATCH_ATTEMPT": "1",
           "HANGWATCH_HEARTBEAT_DIR": str(hb_dir)}
    t0 = time.time()
    p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         start_new_session=True)
    try:
        while True:
            f = hb_dir / "heartbeat-rank0.jsonl"
            if f.exists():
                steps = [json.loads(x) for x in f.read_text().splitlines() if '"event":"step"' in x]
                if steps:
                    return steps[0]["t"] - t0
            if p.poll() is not None:
                raise RuntimeError(f"worker exited {p.returncode} before its first step")
            time.sleep(0.01)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def run_trial(mode: str = "block_c", budget: float = 2.0, builtin: bool = False) -> dict:
    with tempfile.TemporaryDirectory(prefix="hw-bench-") as d:
        tmp = Path(d)
        cfg_path, run_dir = builtin_config(tmp, budget) if builtin else fixture_config(tmp, mode, budget)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([PY, "-m", "hangwatch.supervisor", "run", str(cfg_path)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"supervisor exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
        inc_dir = next((run_dir / "incidents").iterdir())
        inc = json.loads((inc_dir / "incident.json").read_text())
        first = beats(run_dir, 1)
        second = beats(run_dir, 2)
        last_step = max(b["t"] for b in first if b["event"] in ("step", "phase") and b["phase"] == "train")
        step2 = next(b["t"] for b in second if b["event"] == "step")
        cold = cold_start(cfg_path, tmp / "cold", builtin)
        return {
            "detection_latency_s": inc["time_unix"] - (last_step + inc["deadline"]["budget_s"]),
            "detection_to_gone_s": inc["timings"]["detection_to_gone_s"],
            "detection_to_next_step_s": step2 - inc["time_unix"],
            "cold_start_s": cold,
            "classification": inc["classification"],
        }


def bench(trials: int = 5, budget: float = 2.0, builtin: bool = False, modes=("block_c", "busy")) -> dict:
    results = {}
    for mode in (["builtin:block_c"] if builtin else list(modes)):
        rows = [run_trial(mode, budget, builtin) for _ in range(trials)]
        results[mode] = {key: summarize([r[key] for r in rows]) for key in
                         ("detection_latency_s", "detection_to_gone_s", "detection_to_next_step_s", "cold_start_s")}
        results[mode]["classification"] = rows[-1]["classification"]
    return {"trials": trials, "budget_s": budget, "results": results}


def table(report: dict) -> str:
    lines = [f"budget {report['budget_s']} s, {report['trials']} trial(s) per worker",
             f"{'worker':<16} {'measure':<28} {'p50':>8} {'p95':>8} {'max':>8}"]
    for mode, res in report["results"].items():
        for key in ("detection_latency_s", "detection_to_gone_s", "detection_to_next_step_s", "cold_start_s"):
            s = res[key]
            lines.append(f"{mode:<16} {key:<28} {s['p50']:>8.3f} {s['p95']:>8.3f} {s['max']:>8.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--budget", type=float, default=2.0, help="step deadline of the hanging attempt (s)")
    ap.add_argument("--builtin", action="store_true", help="use the training daemon (block_c fault) instead of the fixture")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args(argv)
    report = bench(args.trials, args.budget, args.builtin)
    print(table(report))
    print(json.dumps(report, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
