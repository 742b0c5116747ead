"""The experiment-tracker runs of a hangwatch run: what the worker's hooks record, what later attempts and the
supervisor's reports read (docs/trackers.md).

A rank that logs to W&B, MLflow or TensorBoard records, in `<run_dir>/trackers/rank<R>.json`, which tracker run
it writes to and the highest step it logged there:

    {"wandb":       {"id", "project", "entity", "root_dir", "mode", "step_key", "last_step", "attempt", "own_id"},
     "mlflow":      {"run_id", "tracking_uri", "experiment_id", "last_step", "attempt", "own_id"},
     "tensorboard": {"log_dirs": [...], "last_step": {log_dir: step}, "attempt"}}

The first attempt's record names the run; every later attempt's hooks join that run (`daemon.trackers.hooks`) and
drop what they log again at a step the run already has (a resumed attempt replays the steps after its checkpoint:
exactly, so the points already on the run are the same ones).  The supervisor reads the records to put its
incidents, the restarts and the run's goodput on the same runs (`supervisor.ops.trackers`, through a helper in the
worker's interpreter: the trackers' libraries never enter the supervisor).

Standard library only: the supervisor, the worker's hooks and the bootstrap all read it.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Mapping, Optional

TRACKERS_DIR = "trackers"
NAMES = ("wandb", "mlflow", "tensorboard")


def record_path(run_dir: os.PathLike | str, rank: int) -> Path:
    return Path(run_dir) / TRACKERS_DIR / f"rank{int(rank)}.json"


def read_rank(run_dir: os.PathLike | str, rank: int) -> dict:
    """One rank's record ({} when there is none or it cannot be read)."""
    try:
        data = json.loads(record_path(run_dir, rank).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_records(run_dir: os.PathLike | str) -> dict:
    """Every tracker of the run, each from the lowest rank that records it (the rank that logs: rank 0 in nearly
    every script)."""
    d = Path(run_dir) / TRACKERS_DIR
    try:
        names = sorted(d.glob("rank*.json"), key=_rank_of)
    except OSError:
        return {}
    merged: dict = {}
    for p in names:
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        for name in NAMES:
            rec = data.get(name)
            if isinstance(rec, dict) and name not in merged:
                merged[name] = rec
    return merged


def write_rank(run_dir: os.PathLike | str, rank: int, records: Mapping[str, dict]) -> None:
    """Replace one rank's record atomically (a reader never sees half a file; a failed write leaves the old one)."""
    path = record_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(dict(records), f, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def last_step(record: Optional[Mapping], key: Optional[str] = None) -> Optional[int]:
    """The highest step a tracker run holds from earlier attempts (for TensorBoard: of log dir `key`)."""
    if not record:
        return None
    value = record.get("last_step")
    if isinstance(value, dict):
        value = (
            value.get(key) if key is not None else max((v for v in value.values() if isinstance(v, int)), default=None)
        )
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _rank_of(p: Path) -> int:
    try:
        return int(p.stem[len("rank") :])
    except ValueError:
        return 1 << 30
