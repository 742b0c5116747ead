"""Self-healing's records in the run dir, read and written, nothing decided:

* `remediation.json`: the setting the built-in worker's next attempt runs with after out-of-memory failures
  (what goes in it is decided by `rules.oom_remediation`; the worker reads it at start, `daemon.trainer.remediation`);
* `quarantine.jsonl`: the training examples the built-in worker set aside after a non-finite streak (written by
  the worker, `daemon.trainer.quarantine`; one JSON object a line: id, reason, step, attempt, t), read for `status`,
  state.json and the `nan` incident;
* `state_fields`: what state.json and `status` show of both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import QUARANTINE_NAME, read_json, read_jsonl
from hangwatch.supervisor.rules.answer import Write
from hangwatch.supervisor.rules.oom_remediation import record_summary

REMEDIATION_NAME = "remediation.json"
MAX_IDS_SHOWN = 20  # quarantined ids shown in status and state.json


# ---- remediation.json


def path_for(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / REMEDIATION_NAME


def load(run_dir: os.PathLike | str) -> Optional[dict]:
    """The run's remediation record, or None (none yet, or unreadable: then the config's setting holds)."""
    return read_json(path_for(run_dir))


def write(run_dir: os.PathLike | str, record: dict) -> Write:
    """The record as the file holds it (indented by 2, as it always was), for whoever writes it."""
    return Write.json(path_for(run_dir), record)


def save(run_dir: os.PathLike | str, record: dict, fs: Optional[FsOps] = None) -> Path:
    """Durably, through `fs` (the run's write seam): the next attempt, possibly started by another supervisor, must
    find it."""
    w = write(run_dir, record)
    (fs or FsOps()).write_file(w.path, w.data)
    return w.path


def file_summary(run_dir: os.PathLike | str) -> Optional[dict]:
    """The setting in force from the file alone (`rules.oom_remediation.record_summary`), for state.json and
    `status`, which have no config at hand: what the next attempt runs with when it is not the config's, else None."""
    return record_summary(load(run_dir))


def state_fields(run_dir: os.PathLike | str) -> dict:
    """state.json's and `status`'s self-healing fields: `remediation` (the setting in force after OOMs) and
    `quarantine` (the examples kept out after non-finite losses); None each when there is nothing."""

    return {"remediation": file_summary(run_dir), "quarantine": quarantine_summary(read_quarantine(run_dir))}


# ---- quarantine.jsonl


def read_quarantine(run_dir: os.PathLike | str) -> list[dict]:
    """Every well-formed record (a torn last line is skipped)."""
    return [r for r in read_jsonl(Path(run_dir) / QUARANTINE_NAME) if isinstance(r.get("id"), str)]


def quarantined_by(records: list[dict], attempt: int) -> list[dict]:
    """The records an attempt added (the `nan` incident of that attempt lists them)."""
    return [r for r in records if r.get("attempt") == attempt]


def quarantine_summary(records: list[dict]) -> Optional[dict]:
    """For `status` and state.json: how many, which (the first `MAX_IDS_SHOWN`), None when none."""
    if not records:
        return None
    ids = [r["id"] for r in records]
    return {
        "count": len(ids),
        "ids": ids[:MAX_IDS_SHOWN],
        "more": max(0, len(ids) - MAX_IDS_SHOWN),
        "file": QUARANTINE_NAME,
    }


def quarantine_fields(run_dir: os.PathLike | str, attempt: int) -> dict:
    """The `quarantined` field of attempt `attempt`'s incident (nothing when it quarantined nothing)."""
    mine = quarantined_by(read_quarantine(run_dir), attempt)
    return {"quarantined": [{k: r.get(k) for k in ("id", "reason", "step")} for r in mine]} if mine else {}
