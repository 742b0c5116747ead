"""What the idle wait does after a quiet spell: the pure decision behind `InboxFeed`'s idle loop.

"Quiet" is the time since the last sign of new data: the wait began, a file was taken in (queued
or rejected), or a file was still arriving.  Two things can come due:

    flush   after `data.flush_after_s` quiet: the examples in hand are handed out as a partial
            step, so the trainer trains them, writes the checkpoint that covers them (their file
            reaches done/) and settles it (see `daemon.trainer.confirmation`).  Once per quiet
            spell: after a flush nothing more is to be made durable until new examples are handed
            out.
    idle    after `data.idle_exit_s` quiet (when set): the run ends, reason `idle`.

The ending wins when both are due: `Trainer.finish` trains and checkpoints what is in hand too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

FLUSH = "flush"
IDLE = "idle"


@dataclass(frozen=True)
class IdlePolicy:
    flush_after_s: float
    idle_exit_s: Optional[float] = None

    def decide(self, quiet_s: float, flushed: bool) -> Optional[str]:
        """FLUSH, IDLE or None (keep waiting) after `quiet_s` without new data; `flushed`: this
        quiet spell was flushed already."""
        if self.idle_exit_s is not None and quiet_s >= self.idle_exit_s:
            return IDLE
        if not flushed and quiet_s >= self.flush_after_s:
            return FLUSH
        return None

    def wait_s(self, quiet_s: float, flushed: bool, beat_every_s: float) -> float:
        """How long the idle loop may block now: until the next beat is owed or the next decision
        comes due, whichever is first (so a flush happens on time, not up to a beat late)."""
        due = [] if flushed else [self.flush_after_s]
        if self.idle_exit_s is not None:
            due.append(self.idle_exit_s)
        return max(0.0, min([beat_every_s] + [d - quiet_s for d in due]))
