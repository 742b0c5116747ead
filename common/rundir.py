"""The run directory's layout (docs/run-directory.md) and the small readers both sides use.

<run_dir>/config.yaml state.json calibration.json checkpoints.json supervisor.log
          attempts/NNNN/{worker.log, heartbeat-rank<R>.jsonl, stack-rank<R>.txt, exit.json}
          checkpoints/step-NNNNNNNN/   incidents/NNNN-<kind>/
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

CONFIG_NAME = "config.yaml"
STATE_NAME = "state.json"
CALIBRATION_NAME = "calibration.json"
QUARANTINE_NAME = "quarantine.jsonl"  # examples the built-in worker kept out after non-finite losses
CHECKPOINT_LEDGER_NAME = (
    "checkpoints.json"  # the supervisor's record of announced checkpoints (supervisor.checkpoint_ledger)
)
SUPERVISOR_LOG_NAME = "supervisor.log"
WORKER_LOG_NAME = "worker.log"
EXIT_NAME = "exit.json"
# A standby's word that its preload is over (`restart.prewarm`): {pid, attempt, preload_s, error}, written by the
# standby (daemon.prewarm), read for `status` and removed with the standby by the supervisor (processes.prewarm).
STANDBY_READY_NAME = "standby.json"
# The batch an unedited HF / TRL / Lightning script trains with after out-of-memory failures: written by the
# supervisor (supervisor.concerns.framework_oom), read and applied by the instrumentation
# (daemon.autoinstrument.oom_batch)
FRAMEWORK_REMEDIATION_NAME = "framework-remediation.json"
SOCKET_PATH_FILE = "socket-path"  # in the run dir, when the socket lives elsewhere
ATTEMPTS = "attempts"
CHECKPOINTS = "checkpoints"
INCIDENTS = "incidents"


def attempt_dir(run_dir: os.PathLike | str, attempt: int) -> Path:
    return Path(run_dir) / ATTEMPTS / f"{attempt:04d}"


def heartbeat_path(directory: os.PathLike | str, rank: int) -> Path:
    return Path(directory) / f"heartbeat-rank{rank}.jsonl"


def dump_path_for(directory: os.PathLike | str, rank: int) -> Path:
    return Path(directory) / f"stack-rank{rank}.txt"


def forked_dump_path(dump_path: os.PathLike | str, pid: int) -> Path:
    """Where a process forked from a rank (a DataLoader worker) dumps: `stack-rank<R>-pid<PID>.txt` next to the
    rank's `stack-rank<R>.txt`.  The heartbeat's at-fork hook writes it; the supervisor signals a fork only when
    this file exists for its pid."""
    p = Path(dump_path)
    return p.with_name(f"{p.stem}-pid{pid}{p.suffix}")


def exit_path(run_dir: os.PathLike | str, attempt: int) -> Path:
    return attempt_dir(run_dir, attempt) / EXIT_NAME


def rank_exit_name(rank: int = 0) -> str:
    """Rank `rank`'s last words: exit.json for rank 0 (and a single process), exit-rank<R>.json otherwise."""
    if rank == 0:
        return EXIT_NAME
    stem, dot, ext = EXIT_NAME.rpartition(".")
    return f"{stem}-rank{rank}{dot}{ext}"


def rank_exit_path(run_dir: os.PathLike | str, attempt: int, rank: int = 0) -> Path:
    return attempt_dir(run_dir, attempt) / rank_exit_name(rank)


def framework_setting_name(rank: int = 0) -> str:
    """What rank `rank`'s framework Trainer trained with in an attempt (`attempts/NNNN/framework-rank<R>.json`): the
    per-device batch and accumulation it asked for, what it ran with, whether hangwatch could change them."""
    return f"framework-rank{rank}.json"


def standby_ready_path(run_dir: os.PathLike | str) -> Path:
    """A standby's `standby.json` (STANDBY_READY_NAME): written by the standby once loaded, read for `status`."""
    return Path(run_dir) / STANDBY_READY_NAME


def worker_log_path(run_dir: os.PathLike | str, attempt: int) -> Path:
    return attempt_dir(run_dir, attempt) / WORKER_LOG_NAME


def attempt_numbers(run_dir: os.PathLike | str) -> list[int]:
    base = Path(run_dir) / ATTEMPTS
    if not base.is_dir():
        return []
    return sorted(int(p.name) for p in base.glob("[0-9]" * 4) if p.is_dir())


def next_attempt(run_dir: os.PathLike | str) -> int:
    """The attempt number a worker started by hand takes: one past the highest on disk."""
    return max(attempt_numbers(run_dir), default=0) + 1


def read_jsonl(path: os.PathLike | str) -> list[dict]:
    """Every JSON-object line of an append-only file (a torn last line, from a crash mid-append, is skipped);
    [] when the file is not there."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_json(path: os.PathLike | str) -> Optional[dict]:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def tail_text(path: os.PathLike | str, max_lines: int = 200, max_bytes: int = 64 * 1024) -> str:
    """The last lines of a text file (at most `max_bytes` read); "" when it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first is probably cut
    return "\n".join(lines[-max_lines:]) + ("\n" if lines else "")
