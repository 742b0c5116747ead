#!/usr/bin/env python
"""Worker benchmarks on the demo model: heartbeat overhead per step, cold start, checkpoint save.

    .venv/bin/python scripts/bench_worker.py [--config configs/demo.yaml] [--json out.json]

Prints a small table and one JSON object.  The pieces are functions (`build_trainer`,
`bench_step_overhead`, `bench_cold_start`, `bench_checkpoint_save`, `run_all`) so other benchmarks
can import them.  Timings are for information; nothing here passes or fails.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "configs" / "demo.yaml"


def bench_config(config: os.PathLike | str, run_dir: os.PathLike | str):
    """The config with faults, evals and artificial sleeps taken out, writing into `run_dir`."""
    from hangwatch.common.config import load_config

    cfg = load_config(config, run_dir=str(run_dir))
    cfg.faults = []
    cfg.eval.every_steps = 0
    cfg.train.sleep_per_step_s = 0.0
    cfg.train.max_steps = 10**6
    return cfg


def build_trainer(cfg, hb):
    """An in-process Trainer for `cfg` with heartbeat `hb` (a Heartbeat or a NullHeartbeat)."""
    import torch

    from hangwatch.daemon.__main__ import load_data
    from hangwatch.daemon.faults import FaultPlan
    from hangwatch.daemon.model import load_model
    from hangwatch.daemon.signals import StopRequest
    from hangwatch.daemon.train import NullHeartbeat, Trainer

    if cfg.model.name_or_path is None and not torch.cuda.is_available():
        torch.set_num_threads(1)  # as the worker does for the tiny model
    bundle = load_model(cfg)
    stop = StopRequest()
    with contextlib.redirect_stdout(io.StringIO()):
        source, eval_examples = load_data(cfg, bundle.tokenizer, NullHeartbeat(), stop)
    trainer = Trainer(cfg, hb, cfg.run_dir, bundle, source, eval_examples, FaultPlan([], cfg.run_dir, NullHeartbeat()),
                      stop, out=io.StringIO())
    trainer.seed_fresh()
    bundle.model.train()
    return trainer


def timed_steps(trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        trainer.after_step(trainer.train_step())
        times.append(time.perf_counter() - t0)
    return times


def bench_step_overhead(cfg, rounds: int = 8, steps_per_round: int = 5, warmup: int = 3) -> dict:
    """Median step time with real heartbeats vs none, interleaved in one process (same model, same data)."""
    from hangwatch.daemon.heartbeat import Heartbeat
    from hangwatch.daemon.train import NullHeartbeat

    hb_dir = Path(cfg.run_dir) / "bench-heartbeat"
    real = Heartbeat(hb_dir / "heartbeat-rank0.jsonl")
    null = NullHeartbeat()
    trainer = build_trainer(cfg, null)
    timed_steps(trainer, warmup)
    with_hb, without_hb = [], []
    for r in range(rounds):
        order = [(real, with_hb), (null, without_hb)] if r % 2 == 0 else [(null, without_hb), (real, with_hb)]
        for hb, bucket in order:
            trainer.hb = hb
            bucket.extend(timed_steps(trainer, steps_per_round))
    real.close()
    med_with, med_without = statistics.median(with_hb), statistics.median(without_hb)
    return {
        "steps_each": len(with_hb),
        "step_s_with_heartbeat": med_with,
        "step_s_without_heartbeat": med_without,
        "ratio": med_with / med_without,
        "heartbeat_lines": sum(1 for _ in open(hb_dir / "heartbeat-rank0.jsonl", "rb")),
    }


def bench_cold_start(config: os.PathLike | str, run_dir: os.PathLike | str, timeout: float = 300) -> dict:
    """Spawn → `start` beat and spawn → first `step` beat of a real `python -m hangwatch.daemon`."""
    from hangwatch.common.protocol import decode_line

    run_dir = Path(run_dir)
    cfg = bench_config(config, run_dir)
    cfg_path = run_dir / "bench-config.yaml"
    from hangwatch.common.config import dump_config

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(dump_config(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env["PYTHONPATH"] = str(ROOT)
    hb_file = run_dir / "attempts" / "0001" / "heartbeat-rank0.jsonl"
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "hangwatch.daemon", "--config", str(cfg_path), "--run-dir", str(run_dir)],
                            cwd=str(ROOT), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    found: dict = {}
    try:
        while time.monotonic() - t0 < timeout and "step" not in found:
            if hb_file.exists():
                for line in hb_file.read_bytes().splitlines():
                    rec = decode_line(line)
                    if rec is not None and rec["event"] in ("start", "step") and rec["event"] not in found:
                        found[rec["event"]] = time.monotonic() - t0
                    if rec is not None and rec["event"] == "phase" and rec["phase"] == "train" and "train" not in found:
                        found["train"] = time.monotonic() - t0
            if proc.poll() is not None:
                break
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"to_start_s": found.get("start"), "to_train_phase_s": found.get("train"), "to_first_step_s": found.get("step")}


def bench_checkpoint_save(trainer, n: int = 5) -> dict:
    """Median time of a full checkpoint commit (adapter, extras, optimizer, RNG, manifest, fsyncs)."""
    from hangwatch.daemon import checkpoint as ckpt

    times, size = [], 0
    for _ in range(n):
        trainer.after_step(trainer.train_step())
        t0 = time.perf_counter()
        path = ckpt.commit(ckpt.checkpoints_root(trainer.run_dir), trainer.step, trainer._fill)
        times.append(time.perf_counter() - t0)
        size = sum(p.stat().st_size for p in path.iterdir())
    return {"saves": n, "save_s_median": statistics.median(times), "save_s_max": max(times), "checkpoint_bytes": size}


def run_all(config: os.PathLike | str = DEFAULT_CONFIG, workdir: os.PathLike | str | None = None) -> dict:
    from hangwatch.daemon.train import NullHeartbeat

    with tempfile.TemporaryDirectory(prefix="hangwatch-bench-", dir=workdir) as tmp:
        tmp = Path(tmp)
        cold = bench_cold_start(config, tmp / "cold")
        cfg = bench_config(config, tmp / "steps")
        overhead = bench_step_overhead(cfg)
        saver = build_trainer(bench_config(config, tmp / "save"), NullHeartbeat())
        save = bench_checkpoint_save(saver)
    return {"config": str(config), "step_overhead": overhead, "cold_start": cold, "checkpoint_save": save}


def format_table(results: dict) -> str:
    o, c, s = results["step_overhead"], results["cold_start"], results["checkpoint_save"]

    def ms(x):
        return "-" if x is None else f"{x * 1000:.1f} ms"

    def sec(x):
        return "-" if x is None else f"{x:.2f} s"

    rows = [
        ("step, with heartbeats (median)", ms(o["step_s_with_heartbeat"])),
        ("step, without heartbeats (median)", ms(o["step_s_without_heartbeat"])),
        ("heartbeat overhead ratio", f"{o['ratio']:.3f}"),
        ("spawn → start beat", sec(c["to_start_s"])),
        ("spawn → train phase", sec(c["to_train_phase_s"])),
        ("spawn → first step", sec(c["to_first_step_s"])),
        ("checkpoint save (median)", ms(s["save_s_median"])),
        ("checkpoint size", f"{s['checkpoint_bytes'] / 1024:.0f} KiB"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = run_all(args.config)
    print(format_table(results))
    print(json.dumps(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
