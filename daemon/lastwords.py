"""Last words: `attempts/NNNN/exit.json`, written before the worker exits on a failure.

The supervisor reads it to name the incident (`crash`, `oom`, `nan`, `config_error`,
`data_error`) without parsing logs.  In a multi-rank run every rank leaves its own: rank 0 in
`exit.json`, rank R in `exit-rank<R>.json`, each with its `rank`; a rank that failed because a
collective failed (a peer died or broke the connection) says so with `collective_error: true`, which
marks it a victim rather than the culprit.  Written atomically (temp file, fsync, rename) so a reader never
sees half a file (hangwatch.common.durable); a death by signal leaves none, which is itself evidence.
An out-of-memory failure's last words carry a `memory` object (`daemon.trainer.memory`): the figures the
supervisor picks the next micro-batch from.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from hangwatch.common.durable import disk_error, write_json_atomic
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_FAILED, EXIT_IOERR, EXIT_TEMPFAIL
from hangwatch.common.rundir import rank_exit_path
from hangwatch.daemon.trainer import memory_evidence
from hangwatch.daemon.worker_errors import CheckpointSaveError, DataError, DoesNotFit, NonFiniteStreak


def classify(exc: BaseException) -> tuple[str, int]:
    """(kind, exit code) for an exception that ends the worker."""
    from hangwatch.common.config import ConfigError

    if isinstance(exc, ConfigError):
        return "config_error", EXIT_CONFIG
    if isinstance(exc, DataError):
        return "data_error", EXIT_DATAERR
    if isinstance(exc, NonFiniteStreak):
        return "nan", EXIT_TEMPFAIL
    if isinstance(exc, DoesNotFit):
        return "oom", EXIT_CONFIG  # while loading: the same model onto the same device would not fit either
    if isinstance(exc, CheckpointSaveError):
        return "checkpoint_failed", EXIT_IOERR if disk_error(exc.cause) else EXIT_FAILED
    if disk_error(exc):  # another write the disk refused (evolution log, final export, …)
        return "disk", EXIT_IOERR
    # By name, so classifying never imports torch (torch.OutOfMemoryError / torch.cuda.OutOfMemoryError).
    if any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__):
        return "oom", EXIT_FAILED
    return "crash", EXIT_FAILED


# torch.distributed's errors, by name so that classifying never imports torch: a collective that failed
# because another rank went away or broke it.  gloo reports a peer that died ("Connection reset by peer")
# as a plain RuntimeError raised inside torch.distributed, hence the other two marks.
COLLECTIVE_ERRORS = ("DistError", "DistBackendError", "DistNetworkError", "DistStoreError")
DISTRIBUTED_SOURCE = os.sep + os.path.join("torch", "distributed") + os.sep
GLOO_TRANSPORT = "gloo/transport"


def is_collective_error(exc: BaseException) -> bool:
    """Whether `exc` is a collective's failure: torch.distributed's own error type, an exception raised
    from torch.distributed's code, or gloo's transport naming a broken connection."""
    if any(cls.__name__ in COLLECTIVE_ERRORS for cls in type(exc).__mro__):
        return True
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None and DISTRIBUTED_SOURCE in tb.tb_frame.f_code.co_filename:
        return True
    return GLOO_TRANSPORT in str(exc)


def write_last_words(
    run_dir: os.PathLike | str,
    attempt: int,
    kind: str,
    message: str,
    tb: Optional[str] = None,
    rank: int = 0,
    **extra: Any,
) -> Path:
    """Atomically write rank `rank`'s last words for `attempt`; returns their path."""
    path = rank_exit_path(run_dir, attempt, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "kind": kind,
        "message": message,
        "traceback": tb,
        "pid": os.getpid(),
        "attempt": attempt,
        "t": time.time(),
    }
    if rank:
        record["rank"] = rank
    record.update(extra)
    return write_json_atomic(path, record, indent=2)


def last_words_for(
    exc: BaseException, run_dir: os.PathLike | str, attempt: int, rank: int = 0, **extra: Any
) -> tuple[str, int, Path]:
    """Classify `exc`, write rank `rank`'s last words, return (kind, exit code, path)."""
    kind, code = classify(exc)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    problems = getattr(exc, "problems", None)
    if problems:
        extra.setdefault("problems", list(problems))
    if is_collective_error(exc):
        extra.setdefault("collective_error", True)
    if kind == "oom" and (figures := memory_evidence.evidence()) is not None:
        extra["memory"] = figures  # the micro-batch in force, the weights' share, the device's figures (never raises)
    try:
        path = write_last_words(
            run_dir, attempt, kind, f"{type(exc).__name__}: {exc}", tb, rank=rank, exit_code=code, **extra
        )
    except OSError as write_exc:  # a full disk takes the last words too: the exit code and stderr still speak
        path = rank_exit_path(run_dir, attempt, rank)
        print(
            f"hangwatch worker: last words not written to {path} ({write_exc}); {kind}: {exc}",
            file=sys.stderr,
            flush=True,
        )
    return kind, code, path
