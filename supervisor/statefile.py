"""`<run_dir>/state.json`: the supervisor's state, replaced atomically so a reader never sees half.

It records enough for the next supervisor to find what this one leaves behind if it dies:
its own pid and start time, the worker's pid, process group, session and start time, the pids
each rank announced and the descendants seen, each with its start time.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

FORMAT_VERSION = 1


def write(path: Path, data: dict) -> None:
    """Write to a temporary file in the same directory, fsync, rename over `path`, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    payload = json.dumps({"version": FORMAT_VERSION, **data}, indent=1, default=str) + "\n"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, payload.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    try:
        dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(state, problem): (None, None) when there is no file; an unreadable one is reported, not fatal."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{path}: unreadable ({exc})"
    try:
        data = json.loads(text)
    except ValueError as exc:
        return None, f"{path}: not JSON ({exc})"
    if not isinstance(data, dict):
        return None, f"{path}: expected an object, got {type(data).__name__}"
    return data, None
