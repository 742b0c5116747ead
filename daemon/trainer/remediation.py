"""The worker's side of OOM remediation: train with the setting the supervisor chose after an out-of-memory
failure, read from `<run_dir>/remediation.json` at start (`supervisor.remediation` decides and writes it;
this module only reads it, with the standard library, before torch is imported).

The setting regroups each optimizer step's examples and nothing else: the step still takes
micro_batch_size × grad_accum × world size examples from the one data order, so the same examples land in the
same optimizer steps and the LR schedule (in optimizer steps) is unchanged.  The config file is not rewritten:
the worker trains with a copy of its config carrying the remedied `train.micro_batch_size`, `train.grad_accum`
and `model.gradient_checkpointing`, and checkpoints keep the fingerprint of the config as written
(`Trainer(configured=...)`), so that a checkpoint written before or after a remedy resumes under either.
A record made for another config (the user changed the batch since) or one whose product is not the
config's effective batch is ignored, with a warning.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from hangwatch.common.rundir import read_json

REMEDIATION_NAME = "remediation.json"  # supervisor.remediation.REMEDIATION_NAME (the worker may not import it)
FORMAT_VERSION = 1
KEYS = ("micro_batch_size", "grad_accum", "gradient_checkpointing")


def configured(cfg) -> dict:
    return {
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.grad_accum,
        "gradient_checkpointing": bool(cfg.model.gradient_checkpointing),
    }


def read(run_dir: os.PathLike | str, cfg) -> tuple[Optional[dict], Optional[str]]:
    """(the setting to train with, or None: the config's; a warning when a record is there but does not apply)."""
    record = read_json(Path(run_dir) / REMEDIATION_NAME)
    if record is None:
        return None, None
    base = configured(cfg)
    try:
        setting = {k: record[k] for k in KEYS}
        ok = (
            record.get("version") == FORMAT_VERSION
            and record.get("configured") == base
            and int(setting["micro_batch_size"]) >= 1
            and int(setting["grad_accum"]) >= 1
            and setting["micro_batch_size"] * setting["grad_accum"] == base["micro_batch_size"] * base["grad_accum"]
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        return None, (
            f"{REMEDIATION_NAME} does not apply to this config (made for {record.get('configured')}, the config "
            f"has {base}): training with the config's setting"
        )
    if setting == base:
        return None, None
    probe = record.get("probe") if isinstance(record.get("probe"), dict) else None
    return {
        **setting,
        "configured": base,
        "oom_restarts": len(record.get("history", [])),
        **({"probe": probe} if probe else {}),
    }, None


def apply(cfg, setting: Optional[dict]):
    """A copy of `cfg` training with `setting` (`cfg` itself when there is none)."""
    if setting is None:
        return cfg
    train = cfg.train.model_copy(
        update={"micro_batch_size": int(setting["micro_batch_size"]), "grad_accum": int(setting["grad_accum"])}
    )
    model = cfg.model.model_copy(update={"gradient_checkpointing": bool(setting["gradient_checkpointing"])})
    return cfg.model_copy(update={"train": train, "model": model})


def words(setting: dict) -> str:
    """The start line's words."""
    c = setting["configured"]
    gc = ", gradient checkpointing on" if setting["gradient_checkpointing"] and not c["gradient_checkpointing"] else ""
    return (
        f"OOM remediation in force ({setting['oom_restarts']} out-of-memory restart(s)): micro_batch_size "
        f"{setting['micro_batch_size']} × grad_accum {setting['grad_accum']}{gc} (configured "
        f"{c['micro_batch_size']} × {c['grad_accum']}; the same effective batch and examples per optimizer step)"
    )


def beat_fields(setting: Optional[dict]) -> dict:
    """For the start beat."""
    if setting is None:
        return {}
    return {"remediation": {k: setting[k] for k in (*KEYS, "configured", "oom_restarts")}}
