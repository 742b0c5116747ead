"""Learned budgets: steps, phases and a generate's tokens, from what the run took, persisted.

**Steps.** Once `calibrate_after` step intervals were seen (2 by default: steps 2 → 3 → 4, the interval after a
rank's first step being warm-up and no sample — `deadlines.py` keeps it out), the step budget is
`calibration_factor × p99` of them, clamped to `[step_timeout_min_s, step_timeout_max_s]`, and it is refined with
every interval after (a window of the last MAX_SAMPLES).  Under 100 samples the nearest-rank p99 is the longest, so
early on the budget is a multiple of the longest step seen — as a phase's is — and past 100 a single outlier (a
recompile) no longer holds it up.  Until then, `first_steps_timeout_s`.

**Phases** without a configured budget are learned from what they took once a few of them have completed
(`phase_budget`: a multiple of the longest).

**Tokens.** A generate's progress beats carry the longest gap between two of its new tokens since the previous beat
(`token_s`, measured in the generating thread); `token_budget` is what a beat of `d` tokens may take:
`token_timeout_factor × d ×` the p99 of those gaps, at least `token_timeout_min_s` — with no gap seen yet, the
floor alone.

The samples live in `<run_dir>/calibration.json`, so the next attempt — or the next supervisor — starts with what
this one learned instead of generous again.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Optional

import structlog

from hangwatch.common.config import WatchdogCfg
from hangwatch.common.durable import FsOps

log = structlog.get_logger("hangwatch")

MAX_SAMPLES = 1000  # recent behaviour matters; an old warm-up should age out
FORMAT_VERSION = 1


def p99(samples: Iterable[float]) -> float:
    """Nearest-rank 99th percentile."""
    values = sorted(samples)
    if not values:
        raise ValueError("p99 of no samples")
    return values[max(0, math.ceil(0.99 * len(values)) - 1)]


class Calibration:
    def __init__(self, wd: WatchdogCfg, path: Optional[Path] = None, fs: Optional[FsOps] = None):
        self.wd = wd
        self.path = Path(path) if path is not None else None
        self.fs = fs or FsOps()
        self._last_persist = float("-inf")
        self.step_samples: deque[float] = deque(maxlen=MAX_SAMPLES)
        self.phase_samples: dict[str, deque[float]] = {}
        self.token_samples: deque[float] = deque(maxlen=MAX_SAMPLES)  # longest token gap of each beat, seconds
        self._dirty = 0

    # ---- samples --------------------------------------------------------------------------

    def add_step(self, duration_s: float) -> None:
        if duration_s >= 0 and math.isfinite(duration_s):
            self.step_samples.append(float(duration_s))
            self._dirty += 1

    def add_phase(self, name: str, duration_s: float) -> None:
        if duration_s >= 0 and math.isfinite(duration_s):
            self.phase_samples.setdefault(name, deque(maxlen=MAX_SAMPLES)).append(float(duration_s))
            self._dirty += 1

    def add_token_gap(self, gap_s: float) -> None:
        if gap_s >= 0 and math.isfinite(gap_s):
            self.token_samples.append(float(gap_s))
            self._dirty += 1

    # ---- budgets --------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return len(self.step_samples) >= self.wd.calibrate_after

    def _clamped(self, samples) -> float:
        return min(
            max(self.wd.calibration_factor * p99(samples), self.wd.step_timeout_min_s), self.wd.step_timeout_max_s
        )

    def step_budget(self) -> Optional[float]:
        """The learned step budget, or None while too few step intervals were seen."""
        return self._clamped(self.step_samples) if self.ready else None

    def step_source(self) -> str:
        """How the learned step budget was made (for `status` and incidents): `learned: 5 × p99 0.31s of 12 steps,
        at least 10s`; `first_steps` before it is learned."""
        if not self.ready:
            return "first_steps"
        high = p99(self.step_samples)
        raw = self.wd.calibration_factor * high
        clamp = (
            f", at least {self.wd.step_timeout_min_s:g}s"
            if raw < self.wd.step_timeout_min_s
            else f", at most {self.wd.step_timeout_max_s:g}s"
            if raw > self.wd.step_timeout_max_s
            else ""
        )
        return f"learned: {self.wd.calibration_factor:g} × p99 {high:.3g}s of {len(self.step_samples)} steps{clamp}"

    def phase_budget(self, name: str) -> Optional[float]:
        """The learned budget of phase `name`: `phase_learn_factor` × the longest it took, at least
        `phase_learn_floor_s`; None while it completed fewer than `phase_learn_after` times."""
        samples = self.phase_samples.get(name)
        if not samples or len(samples) < self.wd.phase_learn_after:
            return None
        return max(self.wd.phase_learn_factor * max(samples), self.wd.phase_learn_floor_s)

    def phase_longest(self, name: str) -> Optional[float]:
        samples = self.phase_samples.get(name)
        return max(samples) if samples else None

    def token_gap(self) -> Optional[float]:
        """The p99 of the token gaps seen (each the longest of one beat), None before any."""
        return p99(self.token_samples) if self.token_samples else None

    def token_budget(self, tokens_per_beat: int = 1, gap: Optional[float] = None) -> float:
        """What a beat of `tokens_per_beat` new tokens may take: `token_timeout_factor × tokens_per_beat × gap`
        (default: `token_gap()`), at least `token_timeout_min_s` — the floor alone before any gap was seen."""
        if gap is None:
            gap = self.token_gap()
        floor = float(self.wd.token_timeout_min_s)
        if gap is None:
            return floor
        return max(self.wd.token_timeout_factor * max(1, tokens_per_beat) * gap, floor)

    # ---- persistence ----------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "version": FORMAT_VERSION,
            "updated": time.time(),
            "calibrate_after": self.wd.calibrate_after,
            "factor": self.wd.calibration_factor,
            "clamp_s": [self.wd.step_timeout_min_s, self.wd.step_timeout_max_s],
            "steps": {
                "count": len(self.step_samples),
                "p99_s": p99(self.step_samples) if self.step_samples else None,
                "budget_s": self.step_budget(),
                "samples_s": [round(x, 6) for x in self.step_samples],
            },
            "phases": {
                name: {
                    "count": len(s),
                    "p99_s": p99(s),
                    "budget_s": self.phase_budget(name),
                    "samples_s": [round(x, 6) for x in s],
                }
                for name, s in self.phase_samples.items()
                if s
            },
            "tokens": {
                "count": len(self.token_samples),
                "p99_gap_s": self.token_gap(),  # (the budget depends on the tokens a beat stands for: `token_budget`)
                "samples_s": [round(x, 6) for x in self.token_samples],
            },
        }

    def save(self, path: Optional[Path] = None) -> Path:
        target = Path(path) if path is not None else self.path
        if target is None:
            raise ValueError("no calibration path")
        # Not fsynced: losing the newest samples to a crash costs only a less calibrated next attempt.
        self.fs.write_json(target, self.to_dict(), durable=False)
        self._dirty = 0
        return target

    def persist(self, only_if_changed: bool = False, now: Optional[float] = None, every_s: float = 30.0) -> None:
        """The supervisor's save: in full (every attempt's end), or — after reading lines, at `now` — when samples
        were added, at most every `every_s`: at hundreds of steps a second a save per pass would be most of the
        loop's work.  A failed write is only a less calibrated next attempt: logged, never raised."""
        if only_if_changed and now is not None:
            if now - self._last_persist < every_s:
                return
            self._last_persist = now
        try:
            if only_if_changed:
                self.save_if_changed()
            else:
                self.save()
        except OSError as exc:
            log.warning("calibration_not_saved", error=str(exc))

    def save_if_changed(self, every: int = 10) -> bool:
        """Persist after `every` new samples (and at attempt ends, via `save`)."""
        if self.path is not None and self._dirty >= every:
            self.save()
            return True
        return False

    def reload(self) -> Optional[str]:
        """Read the samples back from `path` (budgets are recomputed, so a changed factor or clamp applies).

        Returns the problem when the file is unreadable (the calibration then stays empty); None otherwise.
        """
        if self.path is None or not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
            steps = data["steps"]["samples_s"]
            phases = {k: v["samples_s"] for k, v in data.get("phases", {}).items()}
            tokens = (data.get("tokens") or {}).get("samples_s") or []  # a file from before tokens were learned: none
            if not all(isinstance(x, (int, float)) for x in steps):
                raise ValueError("steps.samples_s must be numbers")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return f"{self.path}: ignored unreadable calibration ({type(exc).__name__}: {exc})"
        for x in steps:
            self.add_step(float(x))
        for name, samples in phases.items():
            for x in samples:
                if isinstance(x, (int, float)):
                    self.add_phase(str(name), float(x))
        for x in tokens if isinstance(tokens, list) else ():
            if isinstance(x, (int, float)):
                self.add_token_gap(float(x))
        self._dirty = 0
        return None

    @classmethod
    def load(cls, wd: WatchdogCfg, path: Path) -> tuple["Calibration", Optional[str]]:
        """A calibration read back from `path`, and the problem if the file was unreadable."""
        cal = cls(wd, path)
        return cal, cal.reload()
