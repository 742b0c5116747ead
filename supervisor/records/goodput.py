"""The goodput ledger: every second of the run accounted to one category, the categories adding up to
the run's wall time.

    training         optimizer steps that were kept (a step beyond every step any attempt reached before)
    redone           steps done again after a restart (a step some earlier attempt had already reached)
    eval             evaluation and generation (phases eval, predict, generate)
    checkpoint       writing checkpoints (phase checkpoint)
    startup          a worker starting up and loading (spawn → its first step) on the first attempt, after an
                     operator's restart or a resume
    detection        a failure's lost time before it was caught: the last progress → the detection (a
                     deadline, the worker's exit)
    dumps            detection → the stacks read (snapshot, SIGUSR1, py-spy)
    abandon          the stuck step being abandoned in the worker's own process (`restart.in_process`) until it
                     answers (or the kill, when it does not)
    kill             the tree being ended (SIGTERM, SIGKILL, until it is gone)
    gpu_release      the tree gone → its GPU memory freed
    restart_startup  a worker after a failure starting up and loading, until its first step
    backoff          the restart policy's wait between attempts
    paused           an operator's pause
    idle             continuous mode waiting for data (phase idle)
    other            anything else the worker did that none of the above names (its own phases, `wait`,
                     a graceful stop's way out)

How time is attributed (`Goodput`, pure: every call takes the supervisor's monotonic `now`).  The loop tells
the ledger what is happening (`state`: which supervisor state, which phase the main rank is in) and when the
worker proved progress (`progress`: a step, a phase change, a checkpoint, a start, progress in its output).
Time while a worker runs is held *pending* under the category it looked like, and committed to that category
at the next proof of progress; a detection turns everything pending into `detection` (the time between the
last progress and the detection was lost, whatever it looked like).  A step's pending time is `training` or
`redone` by the step it ended on.  Every interval goes to exactly one category, so the categories add up to
the wall time by construction; `check_sum` proves it against the wall clock.

Persisted as `<run_dir>/goodput.json` (`GOODPUT_NAME`): the totals, the top step and the timeline (coalesced
segments in unix time, at most MAX_SEGMENTS: the oldest short ones merge into their neighbours).  A
supervisor that starts on the run dir goes on from there; the time no supervisor ran is not the run's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Optional

CATEGORIES = (
    "training",
    "redone",
    "eval",
    "checkpoint",
    "startup",
    "detection",
    "dumps",
    "abandon",
    "kill",
    "gpu_release",
    "restart_startup",
    "backoff",
    "paused",
    "idle",
    "other",
)
RECOVERY = ("dumps", "abandon", "kill", "gpu_release", "restart_startup")  # detection → the next attempt's first step
LOST = ("detection", *RECOVERY, "redone", "backoff")  # what failures cost
LABELS = {
    "training": "training (kept steps)",
    "redone": "redone steps",
    "eval": "evaluation and generation",
    "checkpoint": "checkpointing",
    "startup": "start-up and loading",
    "detection": "waiting for detection",
    "dumps": "recovery: stack dumps",
    "abandon": "recovery: abandoning the step in the process",
    "kill": "recovery: ending the tree",
    "gpu_release": "recovery: GPU release",
    "restart_startup": "recovery: restart and loading",
    "backoff": "backoff",
    "paused": "paused",
    "idle": "idle (waiting for data)",
    "other": "other",
}
GOODPUT_NAME = "goodput.json"
FORMAT_VERSION = 1
MAX_SEGMENTS = 2000
PHASE_CATEGORY = {
    "eval": "eval",
    "predict": "eval",
    "generate": "eval",
    "checkpoint": "checkpoint",
    "idle": "idle",
    "load": "startup",
    "init": "startup",
}


def short(seconds: float) -> str:
    """40 s, 3 min, 2.5 h: the goodput line's durations."""
    s = float(seconds)
    if s < 90:
        return f"{s:.0f} s" if s >= 10 or s == 0 else f"{s:.1f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def goodput_line(snap: Optional[dict]) -> str:
    """ "goodput 93.1 % — lost 6 min: 2 hangs (detection 40 s, recovery 3 min), redone steps 2 min"."""
    if not snap or not snap.get("wall_s"):
        return "goodput: nothing run yet"
    cats = snap.get("categories") or {}
    pct = snap.get("goodput_pct")
    head = f"goodput {pct:.1f} %" if isinstance(pct, (int, float)) else "goodput —"
    lost = sum(float(cats.get(c) or 0.0) for c in LOST)
    if lost <= 0:
        return f"{head} — nothing lost"
    n = int(snap.get("failures") or 0)
    parts = []
    recovery = sum(float(cats.get(c) or 0.0) for c in RECOVERY)
    if n or cats.get("detection") or recovery:
        what = f"{n} failure{'s' if n != 1 else ''}"
        parts.append(f"{what} (detection {short(cats.get('detection') or 0)}, recovery {short(recovery)})")
    if cats.get("redone"):
        parts.append(f"redone steps {short(cats['redone'])}")
    if cats.get("backoff"):
        parts.append(f"backoff {short(cats['backoff'])}")
    return f"{head} — lost {short(lost)}: " + ", ".join(parts)


def read_goodput(run_dir) -> Optional[dict]:
    """goodput.json of `run_dir`, or None (no file, unreadable, not the format)."""
    try:
        data = json.loads((Path(run_dir) / GOODPUT_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("categories"), dict):
        return None
    return data


def activity(
    state: str,
    *,
    phase: Optional[str],
    stepped: bool,
    after_failure: bool,
    failing: bool = True,
    tree_gone: bool = False,
) -> Optional[tuple[str, bool]]:
    """What the time from now on is, as (category, provisional): pure, table-tested.

    `state`: the supervisor's state (its value); `phase`: the main rank's phase (None before any line);
    `stepped`: this attempt has beaten a step; `after_failure`: this attempt follows a failure (its start-up is
    recovery); `failing`: the episode being handled is a failure (an incident; a clean end's teardown is no
    recovery); `tree_gone`: the episode's tree is gone (waiting for the GPU memory).  None: a final state (the
    run's time is over).  Provisional time waits for the next proof of progress (`Goodput.progress`) or a
    detection (`Goodput.detected`) to say what it was."""
    if state in ("finished", "failed", "stopped"):
        return None
    if state == "backoff":
        return "backoff", False
    if state == "paused":
        return "paused", False
    if state in ("stalled", "dumping"):
        return "dumps", False
    if state == "recovering":
        return "abandon", False
    if state == "killing":
        if not failing:
            return "other", False
        return ("gpu_release" if tree_gone else "kill"), False
    # starting, running, stopping: what the worker does
    if not stepped and phase in (None, "init", "load", "train"):
        return ("restart_startup" if after_failure else "startup"), True
    if phase in (None, "train"):  # no phase: a worker that does not beat, whose output shows its steps
        return "training", True
    return PHASE_CATEGORY.get(phase or "", "other"), True


class Goodput:
    """The ledger (see the module docstring).  `now`: the supervisor's monotonic clock; `wall`: unix time, read
    only to date the timeline and to check the sum."""

    def __init__(self, now: float, *, wall: Callable[[], float] = time.time, previous: Optional[dict] = None):
        self._wall = wall
        self.offset = wall() - now  # monotonic → unix, for the timeline
        self.start = now
        self.last = now
        self.current: Optional[tuple[str, bool]] = ("startup", True)
        self.totals = {c: 0.0 for c in CATEGORIES}
        self.pending: list[list] = []  # [start, end, category] since the last proof of progress
        self.segments: list[list] = []  # committed [start_unix, end_unix, category], coalesced
        self.failures = 0
        self.top_step = 0  # the highest step any attempt reached: a step at or below it is redone
        self.started_unix = self.offset + now
        if previous:
            self._adopt(previous)

    def _adopt(self, prev: dict) -> None:
        cats = prev.get("categories") or {}
        for c in CATEGORIES:
            v = cats.get(c)
            if isinstance(v, (int, float)) and v >= 0:
                self.totals[c] = float(v)
        self.failures = int(prev.get("failures") or 0)
        self.top_step = int(prev.get("top_step") or 0)
        if isinstance(prev.get("started_unix"), (int, float)):
            self.started_unix = float(prev["started_unix"])
        segs = prev.get("segments")
        if isinstance(segs, list):
            self.segments = [list(s) for s in segs if isinstance(s, list) and len(s) == 3 and s[2] in self.totals]

    # ---- inputs ------------------------------------------------------------------------

    def tick(self, now: float, current: Optional[tuple[str, bool]]) -> None:
        """Account the time up to `now` to what was going on; from `now` on, `current` (`activity`'s answer)."""
        self._account(now)
        self.current = current

    def progress(self, now: float, step: Optional[int] = None) -> None:
        """The worker proved progress at `now` (a step — `step` — a phase change, a checkpoint, a start, output
        progress): what is pending was what it looked like; a step's training time is `redone` when some attempt
        had reached that step before."""
        self._account(now)
        redone = step is not None and step <= self.top_step
        for start, end, cat in self.pending:
            self._commit(start, end, "redone" if cat == "training" and redone else cat)
        self.pending = []
        if step is not None:
            self.top_step = max(self.top_step, int(step))

    def detected(self, now: float) -> None:
        """A failure was caught at `now` (a deadline, a death): everything since the last proof of progress was lost."""
        self._account(now)
        for start, end, _ in self.pending:
            self._commit(start, end, "detection")
        self.pending = []
        self.failures += 1

    # ---- accounting ----------------------------------------------------------------------

    def _account(self, now: float) -> None:
        if now <= self.last:
            return
        start, self.last = self.last, now
        if self.current is None:
            return  # the run is over: no category, and no wall time either (see `wall_s`)
        cat, provisional = self.current
        if provisional:
            if self.pending and self.pending[-1][2] == cat and self.pending[-1][1] == start:
                self.pending[-1][1] = now
            else:
                self.pending.append([start, now, cat])
        else:
            self._commit(start, now, cat)

    def _commit(self, start: float, end: float, cat: str) -> None:
        self.totals[cat] += end - start
        a, b = start + self.offset, end + self.offset
        segs = self.segments
        if segs and segs[-1][2] == cat and abs(segs[-1][1] - a) < 1e-6:
            segs[-1][1] = b
        else:
            segs.append([a, b, cat])
            if len(segs) > MAX_SEGMENTS:
                self._thin()

    def _thin(self) -> None:
        """Too many segments: the oldest half is merged in pairs (the longer one's category wins)."""
        half = len(self.segments) // 2
        old, keep = self.segments[:half], self.segments[half:]
        merged = []
        for i in range(0, len(old), 2):
            pair = old[i : i + 2]
            longest = max(pair, key=lambda s: s[1] - s[0])
            merged.append([pair[0][0], pair[-1][1], longest[2]])
        self.segments = merged + keep

    # ---- outputs -------------------------------------------------------------------------

    def categories(self) -> dict:
        """Seconds per category, pending time counted under what it looks like so far."""
        out = dict(self.totals)
        for start, end, cat in self.pending:
            out[cat] += end - start
        return out

    def snapshot(self, now: Optional[float] = None) -> dict:
        """The status / metrics view (no timeline); `now` first accounts the time up to it."""
        if now is not None:
            self._account(now)
        cats = self.categories()
        wall = sum(cats.values())
        snap = {
            "version": FORMAT_VERSION,
            "started_unix": round(self.started_unix, 3),
            "updated_unix": round(self.last + self.offset, 3),
            "wall_s": round(wall, 3),
            "categories": {c: round(v, 3) for c, v in cats.items()},
            "goodput_pct": round(100.0 * cats["training"] / wall, 2) if wall > 0 else None,
            "lost_s": round(sum(cats[c] for c in LOST), 3),
            "failures": self.failures,
            # Only what is settled: never taken back, so a Prometheus counter of it only grows.
            "settled": {c: round(v, 3) for c, v in self.totals.items()},
        }
        snap["line"] = goodput_line(snap)
        return snap

    def record(self, now: Optional[float] = None) -> dict:
        """goodput.json: the snapshot, the top step and the timeline (pending time as it looks so far)."""
        snap = self.snapshot(now)
        pend = [[s + self.offset, e + self.offset, c] for s, e, c in self.pending]
        return {
            **snap,
            "top_step": self.top_step,
            "segments": [[round(a, 3), round(b, 3), c] for a, b, c in self.segments + pend],
        }
