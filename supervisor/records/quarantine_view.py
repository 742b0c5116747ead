"""The supervisor's read of `<run_dir>/quarantine.jsonl`: the training examples the built-in worker quarantined
after a non-finite streak (written by the worker, `daemon.trainer.quarantine`; one JSON object a line: id,
reason, step, attempt, t), for `status`, state.json and the `nan` incident.  Standard library only: the
supervisor never imports the worker."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from hangwatch.common.rundir import QUARANTINE_NAME, read_jsonl

MAX_IDS_SHOWN = 20


def read(run_dir: os.PathLike | str) -> list[dict]:
    """Every well-formed record (a torn last line is skipped)."""
    return [r for r in read_jsonl(Path(run_dir) / QUARANTINE_NAME) if isinstance(r.get("id"), str)]


def of_attempt(records: list[dict], attempt: int) -> list[dict]:
    """The records an attempt added (the `nan` incident of that attempt lists them)."""
    return [r for r in records if r.get("attempt") == attempt]


def summary(records: list[dict]) -> Optional[dict]:
    """For `status` and state.json: how many, which (the first `MAX_IDS_SHOWN`), None when none."""
    if not records:
        return None
    ids = [r["id"] for r in records]
    return {"count": len(ids), "ids": ids[:MAX_IDS_SHOWN], "more": max(0, len(ids) - MAX_IDS_SHOWN),
            "file": QUARANTINE_NAME}


def incident_fields(run_dir: os.PathLike | str, attempt: int) -> dict:
    """The `quarantined` field of attempt `attempt`'s incident (nothing when it quarantined nothing)."""
    mine = of_attempt(read(run_dir), attempt)
    return {"quarantined": [{k: r.get(k) for k in ("id", "reason", "step")} for r in mine]} if mine else {}
