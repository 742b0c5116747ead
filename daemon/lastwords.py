"""Last words: `attempts/NNNN/exit.json`, written before the worker exits on a failure.

The supervisor reads it to name the incident (`crash`, `oom`, `nan`, `config_error`,
`data_error`) without parsing logs.  Written atomically (temp file, fsync, rename) so a reader never
sees half a file (hangwatch.common.durable); a death by signal leaves none, which is itself evidence.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from hangwatch.common.durable import write_json_atomic
from hangwatch.common.durable import disk_error
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_FAILED, EXIT_IOERR, EXIT_TEMPFAIL
from hangwatch.common.rundir import exit_path
from hangwatch.daemon.errors import CheckpointSaveError, DataError, NonFiniteStreak


def classify(exc: BaseException) -> tuple[str, int]:
    """(kind, exit code) for an exception that ends the worker."""
    from hangwatch.common.config import ConfigError

    if isinstance(exc, ConfigError):
        return "config_error", EXIT_CONFIG
    if isinstance(exc, DataError):
        return "data_error", EXIT_DATAERR
    if isinstance(exc, NonFiniteStreak):
        return "nan", EXIT_TEMPFAIL
    if isinstance(exc, CheckpointSaveError):
        return "checkpoint_failed", EXIT_IOERR if disk_error(exc.cause) else EXIT_FAILED
    if disk_error(exc):  # another write the disk refused (evolution log, final export, …)
        return "disk", EXIT_IOERR
    # By name, so classifying never imports torch (torch.OutOfMemoryError / torch.cuda.OutOfMemoryError).
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return "oom", EXIT_FAILED
    return "crash", EXIT_FAILED


def write_last_words(
    run_dir: os.PathLike | str,
    attempt: int,
    kind: str,
    message: str,
    tb: Optional[str] = None,
    **extra: Any,
) -> Path:
    """Atomically write exit.json for `attempt`; returns its path."""
    path = exit_path(run_dir, attempt)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"kind": kind, "message": message, "traceback": tb, "pid": os.getpid(), "attempt": attempt, "t": time.time()}
    record.update(extra)
    return write_json_atomic(path, record, indent=2)


def last_words_for(exc: BaseException, run_dir: os.PathLike | str, attempt: int, **extra: Any) -> tuple[str, int, Path]:
    """Classify `exc`, write its exit.json, return (kind, exit code, path)."""
    kind, code = classify(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    problems = getattr(exc, "problems", None)
    if problems:
        extra.setdefault("problems", list(problems))
    try:
        path = write_last_words(run_dir, attempt, kind, f"{type(exc).__name__}: {exc}", tb, exit_code=code, **extra)
    except OSError as write_exc:  # a full disk takes the last words too: the exit code and stderr still speak
        path = exit_path(run_dir, attempt)
        print(f"hangwatch worker: last words not written to {path} ({write_exc}); {kind}: {exc}", file=sys.stderr,
              flush=True)
    return kind, code, path
