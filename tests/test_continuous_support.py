"""Shared pieces of the continuous-mode worker tests (no tests here): an inbox config for the tiny
model, dropping files into an inbox, and reading what the run dir says was trained."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest's helpers, however pytest imports us

from conftest import deep_merge, make_config, synthetic_examples  # noqa: E402
from daemon.inbox_files import Stage, data_files  # noqa: E402


def inbox_config(tmp_path: Path, name: str = "config.yaml", **overrides) -> Path:
    """The tiny model in continuous mode: 4 examples a step, a checkpoint every 2 steps."""
    base = {
        "data": {"train": None, "inbox": True, "max_length": 48, "truncation": "reject", "replay_ratio": 0.25},
        "train": {"max_steps": 1000, "micro_batch_size": 2, "grad_accum": 2, "warmup_steps": 2},
        "checkpoint": {"every_steps": 2, "keep_last": 3, "confirm_steps": 1},
    }
    return make_config(tmp_path, name, **deep_merge(base, overrides))


def lines_of(items: list) -> bytes:
    """Objects as JSONL; str items are written as they are (bad lines)."""
    return b"".join((i if isinstance(i, str) else json.dumps(i)).encode() + b"\n" for i in items)


def good_file(n: int, seed: int) -> bytes:
    return lines_of(synthetic_examples(n, seed=seed))


def drop(run_dir: Path, name: str, data: bytes, mtime: float | None = None) -> Path:
    """Write `inbox/<name>` directly (as a file that arrived while the worker was down); `mtime`
    fixes the arrival order the start-up scan sees."""
    path = Path(run_dir) / "inbox" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def drop_all(run_dir: Path, files: dict[str, bytes]) -> None:
    """Every file, arrived in dict order well before now (settled)."""
    base = time.time() - 600
    for i, (name, data) in enumerate(files.items()):
        drop(run_dir, name, data, base + i)


def sha16(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def example_ids(data: bytes, good_lines: list[int] | None = None) -> list[str]:
    """The stable ids of a file's examples: content digest and 1-based line."""
    n = len(data.splitlines())
    return [f"{sha16(data)}:{line}" for line in (good_lines or range(1, n + 1))]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def ledger(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "done" / "ledger.jsonl")


def replay_log(run_dir: Path) -> list[dict]:
    return read_jsonl(Path(run_dir) / "done" / "replay.jsonl")


def names_in(run_dir: Path, stage: Stage) -> list[str]:
    """The original names of the data files in queue/, processing/ or done/."""
    return sorted(d.name for d in data_files(run_dir, stage))


def leftovers(run_dir: Path) -> dict[str, list[str]]:
    """Data files still in inbox/, queue/ or processing/ (none, once everything is trained)."""
    out = {}
    for stage in (Stage.INBOX, Stage.QUEUED, Stage.PROCESSING):
        d = stage.dir(run_dir)
        names = sorted(n for n in os.listdir(d) if not n.startswith(".")) if d.is_dir() else []
        if names:
            out[stage.value] = names
    return out


def report(run_dir: Path, name: str) -> dict:
    return json.loads((Path(run_dir) / "rejected" / f"{name}.error.json").read_text())
