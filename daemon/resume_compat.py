"""The one rule for "may this run resume that checkpoint": the settings that decide the numbers of the
next step must be the ones the checkpoint was made with.

A checkpoint stores `fingerprint(cfg)` of the run that wrote it (in trainer_state.json); before
resuming, the worker compares it with its own and refuses (a config error, exit 78) on any
difference outside `FINGERPRINT_FREE`.  The standard library and the config only: the check runs
before torch is imported.

The world size (how many ranks trained) is part of it: a checkpoint of a multi-rank run holds one RNG
stream per rank and a step of micro × accumulation × world size examples, so resuming it with another
world size would not continue the same run.  That is refused, with its own message.  A single
process's fingerprint has no `world_size` (it is what it always was), so it counts as 1.
"""

from __future__ import annotations

import os
from typing import Any

from hangwatch.common.config import ConfigError
from hangwatch.daemon import checkpoint as ckpt

# Sections whose every setting matters for exact resume, and the data settings that do.
FINGERPRINT_SECTIONS = ("model", "lora", "train")
FINGERPRINT_DATA = ("max_length", "truncation")
# Settings inside those that change nothing a checkpoint holds, so they may differ on resume.
FINGERPRINT_FREE = {
    ("train", "sleep_per_step_s"),
    ("train", "max_nonfinite_streak"),
    ("model", "gradient_checkpointing"),
}  # recomputes activations: the same numbers, bit for bit
# Settings added after checkpoints were already written: absent from an older fingerprint means the default.
FINGERPRINT_DEFAULTS = {("model", "gradient_checkpointing"): False, ("model", "load_in_4bit"): False}


def fingerprint(cfg: Any, world_size: int = 1) -> dict[str, Any]:
    """Settings that must match for a checkpoint to be resumed bit for bit."""
    d = cfg.model_dump(mode="json")
    fp = {k: d[k] for k in FINGERPRINT_SECTIONS} | {"data": {k: d["data"][k] for k in FINGERPRINT_DATA}}
    if world_size != 1:
        fp["world_size"] = world_size
    return fp


def fingerprint_differences(saved: dict, current: dict, prefix: tuple = ()) -> list[str]:
    """'key: saved → current' for each setting that differs and matters for exact resume."""
    out = []
    for key in sorted(set(saved) | set(current)):
        path = prefix + (key,)
        a, b = saved.get(key, FINGERPRINT_DEFAULTS.get(path)), current.get(key, FINGERPRINT_DEFAULTS.get(path))
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_differences(a, b, path)
        elif a != b and path not in FINGERPRINT_FREE:
            out.append(f"{'.'.join(path)}: {a!r} → {b!r}")
    return out


def check_resume_compatible(cfg: Any, path: os.PathLike | str, world_size: int = 1) -> None:
    """Raise ConfigError when checkpoint `path` was made with settings, or by a number of ranks, that
    differ from this worker's."""
    saved = ckpt.read_state(path).get("fingerprint", {})
    saved_size = saved.get("world_size", 1)
    problems = []
    if saved_size != world_size:
        problems.append(
            f"{path}: this run's checkpoints were made by {saved_size} rank(s) and this worker is one of "
            f"{world_size}; resuming with a different world size is not supported (every rank's RNG stream and data "
            f"share, and the effective batch, would change). Run with worker.nproc_per_node: {saved_size} "
            "again, or use a new run_dir"
        )
    diffs = [d for d in fingerprint_differences(saved, fingerprint(cfg, world_size)) if not d.startswith("world_size:")]
    if diffs:
        problems += [
            f"{path}: this run's checkpoints were made with different settings; resuming would not continue the "
            "same run. Restore the settings or use a new run_dir:"
        ] + [f"  {d}" for d in diffs]
    if problems:
        raise ConfigError(problems)
