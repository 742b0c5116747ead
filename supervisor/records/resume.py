"""What the next attempt resumes from: the newest good checkpoint of the ledger that is still on disk."""
from __future__ import annotations

import os
from typing import Optional

import structlog

from hangwatch.supervisor.records.checkpoint_ledger import CheckpointLedger, resolve

log = structlog.get_logger("hangwatch")


def resume_choice(book: CheckpointLedger, cwd: Optional[str], attempt: int) -> tuple[str, Optional[int]]:
    """What the attempt about to start resumes from (HANGWATCH_RESUME_FROM): (the newest good checkpoint still on
    disk as an absolute path — relative ones are the worker's, its cwd —, its step); ("", None) for none.  Good ones
    that were deleted since are skipped, and said so."""
    chosen, skipped = book.resume_point(lambda e: os.path.exists(resolve(e.path, cwd)))
    for e in skipped:
        log.warning("good_checkpoint_missing", path=e.path, step=e.step, resolved=resolve(e.path, cwd),
                    note="no longer on disk: skipped")
    if chosen is None:
        log.info("resume_from", attempt=attempt, path=None, checkpoints=book.counts(),
                 note="no good checkpoint on disk: HANGWATCH_RESUME_FROM is empty")
        return "", None
    path = resolve(chosen.path, cwd)
    log.info("resume_from", attempt=attempt, path=path, step=chosen.step, why=chosen.why)
    return path, chosen.step
