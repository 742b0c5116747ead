"""Straggler ranks: one rank's steps stay slower than the others' for a while.  Recorded, never killed.

A rank is a straggler once its step time has been above `straggler_factor` × the median of the
other ranks' latest step times for `straggler_steps` consecutive steps; it stops being one at its
first step back under that bound.  A rank's step time is the `step_time_s` its step line carries —
its own time, without the wait for its peers, which is what shows a straggler under DDP, where every
rank's step ends with the same all-reduce — else the time between its step lines as the supervisor
read them.  Time in other phases (an eval between two steps) is not a step time.

Pure bookkeeping: every call takes `now`; a fake clock drives it in tests.
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Straggler:
    rank: int
    step: int
    step_time_s: float
    others_median_s: float
    factor: float
    consecutive_steps: int
    since_step: int  # the first of the slow steps in a row

    def as_dict(self) -> dict:
        d = asdict(self)
        d["step_time_s"] = round(self.step_time_s, 4)
        d["others_median_s"] = round(self.others_median_s, 4)
        return d


@dataclass
class StragglerWatch:
    factor: float
    steps: int
    last_time: dict = field(default_factory=dict)  # rank → its latest step time (s)
    last_step_at: dict = field(default_factory=dict)  # rank → when its last step line was read (in train)
    streak: dict = field(default_factory=dict)  # rank → (slow steps in a row, the first of them)
    active: dict = field(default_factory=dict)  # rank → Straggler, while it straggles
    recorded: list = field(default_factory=list)  # every warning raised (for the next incident)
    ordered: list = field(default_factory=list, repr=False)  # `last_time`'s values, sorted (the medians, cheaply)

    @classmethod
    def from_config(cls, wd) -> "StragglerWatch":
        """From `watchdog.straggler_factor` and `watchdog.straggler_steps`."""
        return cls(wd.straggler_factor, wd.straggler_steps)

    def left_train(self, rank: int) -> None:
        """The rank entered another phase: the next interval between its step lines is not a step time."""
        self.last_step_at.pop(rank, None)

    def step(
        self, rank: int, step: int, now: float, reported_s: Optional[float] = None
    ) -> tuple[Optional[str], Optional[Straggler]]:
        """A step line of `rank` read at `now`: ("straggler", record) when the rank just became one,
        ("recovered", its record) when it stopped being one, else (None, None)."""
        previous = self.last_step_at.get(rank)
        self.last_step_at[rank] = now
        took = reported_s if _seconds(reported_s) else (now - previous if previous is not None else None)
        if took is None:
            return None, None
        # `ordered` holds every rank's latest time: without this rank's old one it is the others'.
        old = self.last_time.get(rank)
        if old is not None:
            del self.ordered[bisect.bisect_left(self.ordered, old)]
        others = self.ordered
        median = _median_sorted(others) if others else None
        self.last_time[rank] = took
        bisect.insort(self.ordered, took)
        if median is None:
            return None, None
        if median <= 0 or took <= self.factor * median:
            self.streak.pop(rank, None)
            gone = self.active.pop(rank, None)
            return ("recovered", gone) if gone is not None else (None, None)
        count, first = self.streak.get(rank, (0, step))
        count += 1
        self.streak[rank] = (count, first)
        if count == self.steps and rank not in self.active:
            rec = Straggler(rank, step, took, median, self.factor, count, first)
            self.active[rank] = rec
            self.recorded.append(rec)
            return "straggler", rec
        return None, None

    def status(self) -> dict:
        """rank → the straggler record, for ranks straggling now."""
        return {r: s.as_dict() for r, s in sorted(self.active.items())}


def _median_sorted(s: list[float]) -> float:
    """The median of an already sorted list (statistics.median, without the sort)."""
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def _seconds(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
