"""Section 1, heartbeat cost: step time of the demo model with real heartbeats vs none (same process,
interleaved rounds), what one beat costs on its own, a checkpoint save, and the worker's cold start."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from pathlib import Path

from hangwatch.common import rundir
from hangwatch.common.config import dump_config, load_config
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.heartbeat import Heartbeat, NullHeartbeat

from .harness import DEMO_CONFIG, PY, ROOT, env, first, read_beats_file, summary


def bench_config(run_dir: Path):
    """configs/demo.yaml with faults, evals and artificial sleeps taken out, writing into `run_dir`."""
    cfg = load_config(DEMO_CONFIG, run_dir=str(run_dir))
    cfg.faults = []
    cfg.eval.every_steps = 0
    cfg.train.sleep_per_step_s = 0.0
    cfg.train.max_steps = 10**6
    return cfg


def build_trainer(cfg, hb):
    """An in-process trainer for `cfg` with heartbeat `hb`, seeded and in train mode: the step-time figures
    need both heartbeats in one process on one model, which no subprocess entry point can give."""
    import torch

    # The worker's internals, imported here so that the other sections never load torch.
    from hangwatch.daemon.__main__ import load_data
    from hangwatch.daemon.faults import FaultPlan
    from hangwatch.daemon.model import load_model
    from hangwatch.daemon.signals import StopRequest
    from hangwatch.daemon.trainer.loop import Trainer

    if cfg.model.name_or_path is None and not torch.cuda.is_available():
        torch.set_num_threads(1)  # as the worker does for the tiny model
    bundle = load_model(cfg)
    stop = StopRequest()
    with contextlib.redirect_stdout(io.StringIO()):
        source, eval_examples = load_data(cfg, bundle.tokenizer, NullHeartbeat(), stop)
    trainer = Trainer(
        cfg,
        hb,
        cfg.run_dir,
        bundle,
        source,
        eval_examples,
        FaultPlan([], cfg.run_dir, NullHeartbeat()),
        stop,
        out=io.StringIO(),
    )
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


def interleaved(trainer, real, null, rounds: int, per_round: int) -> tuple[list[float], list[float]]:
    """Step times with `real` and with `null`; which goes first alternates, so drift and cache effects
    fall on both alike."""
    with_hb, without_hb = [], []
    for r in range(rounds):
        order = [(real, with_hb), (null, without_hb)] if r % 2 == 0 else [(null, without_hb), (real, with_hb)]
        for hb, bucket in order:
            trainer.hb = hb
            bucket.extend(timed_steps(trainer, per_round))
    return with_hb, without_hb


def beat_calls(path: Path, calls: int) -> list[float]:
    """What one `step` beat costs on its own: the ratio of step times is the sum of these drowned in noise."""
    probe = Heartbeat(path)
    out = []
    for i in range(calls):
        t0 = time.perf_counter()
        probe.step(i, loss=1.0, lr=1e-3, grad_norm=0.5, tokens_per_s=1234.5, samples=16)
        out.append(time.perf_counter() - t0)
    probe.close()
    return out


def checkpoint_saves(trainer, n: int) -> tuple[list[float], int]:
    """Times of `n` full checkpoint commits (adapter, extras, optimizer, RNG, manifest, fsyncs), one step
    apart, and the size of the last one in bytes."""
    saves = []
    for _ in range(n):
        trainer.after_step(trainer.train_step())
        t0 = time.perf_counter()
        path = ckpt.commit(ckpt.checkpoints_root(trainer.run_dir), trainer.step, trainer.fill_checkpoint)
        saves.append(time.perf_counter() - t0)
    return saves, sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cold_start(run_dir: Path, timeout: float = 300) -> dict:
    """Spawn → `start` beat, → `train` phase and → first `step` beat of a real `python -m hangwatch.daemon`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_path = run_dir / "bench-config.yaml"
    cfg_path.write_text(dump_config(bench_config(run_dir)))
    hb_file = rundir.heartbeat_path(rundir.attempt_dir(run_dir, 1), 0)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [PY, "-m", "hangwatch.daemon", "--config", str(cfg_path), "--run-dir", str(run_dir)],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    found: dict = {}
    try:
        while time.monotonic() - t0 < timeout and "step" not in found and proc.poll() is None:
            beats = read_beats_file(hb_file)
            train = next((b for b in beats if b["event"] == "phase" and b.get("phase") == "train"), None)
            for key, seen in (("start", first(beats, "start")), ("train", train), ("step", first(beats, "step"))):
                if seen is not None and key not in found:
                    found[key] = time.monotonic() - t0
            time.sleep(0.01)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {
        "to_start_s": found.get("start"),
        "to_train_phase_s": found.get("train"),
        "to_first_step_s": found.get("step"),
    }


def section(work: Path, quick: bool) -> dict:
    rounds, per_round, warmup = (2, 3, 2) if quick else (10, 6, 5)
    real = Heartbeat(work / "steps" / "hb" / "heartbeat-rank0.jsonl")
    null = NullHeartbeat()
    trainer = build_trainer(bench_config(work / "steps"), null)
    timed_steps(trainer, warmup)
    with_hb, without_hb = interleaved(trainer, real, null, rounds, per_round)
    real.close()
    lines = real.path.read_bytes().count(b"\n")
    beat_s = beat_calls(work / "steps" / "probe" / "heartbeat-rank0.jsonl", 200 if quick else 2000)
    trainer.hb = null
    saves, ckpt_bytes = checkpoint_saves(trainer, 2 if quick else 5)
    cold = [cold_start(work / f"cold-{i}") for i in range(1 if quick else 3)]
    s_with, s_without = summary(with_hb), summary(without_hb)
    return {
        "method": f"{rounds} interleaved rounds × {per_round} optimizer steps each way after {warmup} warm-up steps, "
        "one process, same model and data stream (configs/demo.yaml, no sleeps, no evals); heartbeat "
        "= hangwatch.daemon.heartbeat.Heartbeat writing to a file vs its NullHeartbeat",
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
