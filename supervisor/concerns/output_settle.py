"""The command's last output before its end is read: an ended worker's streams are waited for until they close.

The relay (`processes.streams`) copies the command's stdout and stderr into worker.log on a thread of its own, so
when the loop sees the worker's exit (or its tree gone) the last lines — a traceback, the words a stop was
answered with — may still be in the pipe.  Both moments that read them wait here: the exit is read (classified,
quoted in the incident) and the teardown ends only once every stream closed, or after OUTPUT_SETTLE_S (a descendant
that left the tree may hold a stream open for ever).  A worker without a relay (the service's, whose output goes
to its log file directly) has nothing open: no wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import AttemptStarted

OUTPUT_SETTLE_S = 2.0  # the longest an ended tree's output streams are waited for
LOOK_AGAIN_S = 0.1  # how soon the loop looks again while it waits


@dataclass
class OutputSettle(Concern):
    def __post_init__(self) -> None:
        self.name = "output_settle"
        self.since: Optional[float] = None  # the streams were still open after the end, since
        self.waiting = False

    def _settling(self, attempt, now: float) -> bool:
        if not attempt.worker.output_open():
            self.since, self.waiting = None, False
            return False
        self.since = self.since if self.since is not None else now
        self.waiting = now - self.since < OUTPUT_SETTLE_S
        return self.waiting

    def hold_exit(self, attempt, now: float) -> bool:
        return self._settling(attempt, now)

    def hold_teardown(self, attempt, episode, intent, now: float) -> bool:
        return self._settling(attempt, now)

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.since, self.waiting = None, False

    def next_due_s(self, now: float) -> Optional[float]:
        return LOOK_AGAIN_S if self.waiting else None
