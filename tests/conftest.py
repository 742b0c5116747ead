"""Shared test helpers: the venv's python, a tiny fast training config, running and reading the worker.

`make_config(tmp_path, **overrides)` writes small synthetic data and a config for the tiny model
into `tmp_path` and returns the config's path; overrides are nested dicts merged into the defaults
(`make_config(tmp_path, train={"max_steps": 5}, faults=[{"kind": "crash", "at_step": 2}])`).
"""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
PYTHON = str(VENV_PYTHON) if VENV_PYTHON.exists() else sys.executable

WORDS = ("cat dog sun map red box cup pen hat owl fox bee ant elk yak cow pig hen ram bat jam ink oak gem "
         "kit log mud net orb pad sky tin van web zip axe bus car fan gum").split()
OPS = {"upper": str.upper, "reverse": lambda w: w[::-1], "double": lambda w: w + w}


def synthetic_examples(n: int, seed: int = 0) -> list[dict]:
    """Word transformations (upper, reverse, double) as prompt/completion objects."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        op = rng.choice(sorted(OPS))
        w = rng.choice(WORDS)
        out.append({"prompt": f"{op}: {w}", "completion": OPS[op](w)})
    return out


def write_jsonl(path: Path, items: list) -> Path:
    """Write objects (dicts) or raw strings (written as-is: for bad lines) one per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for item in items:
            f.write((item if isinstance(item, str) else json.dumps(item)) + "\n")
    return path


def deep_merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def tiny_config_dict(tmp_path: Path) -> dict:
    """Defaults of make_config: tiny model, ~10 ms steps, no eval, checkpoints every 4 steps."""
    data_dir = tmp_path / "data"
    train = data_dir / "train.jsonl"
    evalf = data_dir / "eval.jsonl"
    if not train.exists():
        write_jsonl(train, synthetic_examples(64, seed=1))
    if not evalf.exists():
        write_jsonl(evalf, synthetic_examples(8, seed=2))
    return {
        "run_dir": str(tmp_path / "run"),
        "watchdog": {"startup_timeout_s": 60, "silence_timeout_s": 30, "phase_budgets_s": {"eval": 60, "generate": 30, "checkpoint": 60}},
        "model": {"tiny": {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                           "num_kv_heads": 2, "max_position": 64, "extra_head": True}, "device": "cpu"},
        "lora": {"r": 4, "alpha": 8, "dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "modules_to_save": []},
        "data": {"train": str(train), "eval": str(evalf), "max_length": 48},
        "train": {"max_steps": 12, "micro_batch_size": 4, "grad_accum": 2, "lr": 5e-3, "warmup_steps": 2, "seed": 0},
        "eval": {"every_steps": 0, "max_new_tokens": 4, "progress_every_tokens": 2, "prompts": ["upper: cat"]},
        "checkpoint": {"every_steps": 4, "keep_last": 3, "confirm_steps": 1},
        "faults": [],
    }


def make_config(tmp_path: Path, _name: str = "config.yaml", **overrides: Any) -> Path:
    """Write data and a tiny config (defaults merged with `overrides`) into tmp_path; return its path."""
    tmp_path = Path(tmp_path)
    cfg = deep_merge(tiny_config_dict(tmp_path), overrides)
    path = tmp_path / _name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def worker_env(extra: Optional[dict] = None) -> dict:
    """Environment for a worker subprocess: the repo importable, no inherited HANGWATCH_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def start_worker(config: Path, run_dir: Optional[Path] = None, env: Optional[dict] = None, log: Optional[Path] = None) -> subprocess.Popen:
    """`python -m daemon --config CONFIG [--run-dir DIR]` as the supervisor would start it."""
    argv = [PYTHON, "-m", "daemon", "--config", str(config)]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        return subprocess.Popen(argv, cwd=str(ROOT), env=worker_env(env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    finally:
        if log is not None:
            out.close()


def run_worker(config: Path, run_dir: Optional[Path] = None, env: Optional[dict] = None, timeout: float = 120,
               log: Optional[Path] = None) -> int:
    proc = start_worker(config, run_dir, env, log)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def read_beats(run_dir: Path, attempt: Optional[int] = None) -> list[dict]:
    """Decoded heartbeat lines of one attempt (or of all attempts, in order)."""
    from daemon.heartbeat import decode_line

    base = Path(run_dir) / "attempts"
    dirs = [base / f"{attempt:04d}"] if attempt is not None else sorted(base.glob("[0-9]" * 4))
    beats = []
    for d in dirs:
        p = d / "heartbeat-rank0.jsonl"
        if p.exists():
            for line in p.read_bytes().splitlines():
                rec = decode_line(line)
                if rec is not None:
                    beats.append(rec)
    return beats


def wait_for_beat(run_dir: Path, attempt: int, match: Callable[[dict], bool], proc: Optional[subprocess.Popen] = None,
                  timeout: float = 90, poll: float = 0.005) -> dict:
    """Poll the attempt's heartbeat file until a line matches; fails if the worker exits first."""
    from daemon.heartbeat import decode_line

    path = Path(run_dir) / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    deadline = time.monotonic() + timeout
    offset = 0
    buf = b""
    while time.monotonic() < deadline:
        if path.exists():
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                rec = decode_line(line)
                if rec is not None and match(rec):
                    return rec
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode} before the awaited heartbeat")
        time.sleep(poll)
    raise AssertionError(f"no matching heartbeat in {path} within {timeout}s")


def run_in_process(config: Path, run_dir: Optional[Path] = None, environ: Optional[dict] = None) -> int:
    """The worker's main() inside the test process (no subprocess, no torch import per run)."""
    from daemon.__main__ import main

    argv = ["--config", str(config)] + (["--run-dir", str(run_dir)] if run_dir is not None else [])
    return main(argv, environ=dict(environ or {}))


@pytest.fixture
def python_exe() -> str:
    return PYTHON


@pytest.fixture
def config_factory(tmp_path):
    """make_config bound to this test's tmp_path."""
    return lambda **overrides: make_config(tmp_path, **overrides)


def safetensors_raw(path: Path) -> dict:
    """safetensors file → {name: (dtype, shape, raw bytes)}, metadata ignored, no torch needed:
    equal raw bytes is the strictest equality there is (bitwise, NaN payloads included)."""
    import struct

    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    return {k: (v["dtype"], tuple(v["shape"]), body[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}
