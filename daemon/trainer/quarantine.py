"""NaN quarantine: the examples of a non-finite streak are identified by id and kept out of later attempts.

When the trainer's non-finite guard gives up (`max_nonfinite_streak` skipped steps in a row → exit 75, the
supervisor restarts from the last good checkpoint) the worker first appends the culprits to
`<run_dir>/quarantine.jsonl`, one durable line each: `{"id", "reason", "step", "attempt", "t"}`.  The next
attempt's data order (`data.ShuffledEpochs`, `skip`) passes over them and is otherwise unchanged: the same
seeded permutation per epoch, the same position, so it is still deterministic and a resume is still exact.

Who the culprits are (`culprits`, pure and table-tested).  Every streak is recorded in
`<run_dir>/nonfinite-streaks.jsonl` (`{"steps", "attempt", "own", "examples", "t"}`), so that a later one
knows whether it fails at the same optimizer steps again.
  - a step whose loss is non-finite is looked at example by example (`ModelBundle.compute_loss_rows`: each
    example's own loss, read from the forward that was done anyway): the examples whose own loss is
    non-finite are the culprits, and only they are quarantined — the precise case, e.g. one corrupt example;
  - a streak that cannot be pinned on single examples (each example's loss finite, the step's total or its
    gradient norm not: a diverging model, an LR too high) quarantines nothing the first time: the rollback
    alone may cure it, and the data is not to blame on no evidence;
  - widening: a second rollback over the same optimizer steps (a streak at a step an earlier streak failed
    at) quarantines every example of the streak's steps.  Widening was chosen over bisection: bisection needs
    several more rollbacks, each a restart, to find what widening removes in one, and the examples it
    removes are few (one streak's); what keeps failing after that is the model's, and the supervisor's
    no-progress stop (`restart.no_progress_restarts`) ends the run.
Multi-rank: each rank looks at its own share of the step; rank 0 gathers and writes (`trainer.loop`).
Continuous mode (the inbox) has no quarantine: its files are accepted or rejected whole at intake.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hangwatch.common.durable import append_durable
from hangwatch.common.rundir import QUARANTINE_NAME, read_jsonl

MAX_IDS_IN_BEAT = 64  # a step beat lists its examples' ids up to this many (always their digest)
STREAKS_NAME = "nonfinite-streaks.jsonl"
OWN_LOSS = "its own loss was non-finite"
AGAIN = "in an optimizer step that was non-finite again after a rollback (quarantine widened to the whole step)"


@dataclass
class BadStep:
    """One skipped (non-finite) step of a streak: the optimizer step it was to be, its examples, and those
    whose own loss was non-finite."""

    step: int
    ids: list[str]
    own: list[str] = field(default_factory=list)


def path_for(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / QUARANTINE_NAME


def read(run_dir: os.PathLike | str) -> list[dict]:
    """The quarantine records."""
    return [r for r in read_jsonl(path_for(run_dir)) if isinstance(r.get("id"), str)]


def read_streaks(run_dir: os.PathLike | str) -> list[dict]:
    return read_jsonl(Path(run_dir) / STREAKS_NAME)


def quarantined_ids(run_dir: os.PathLike | str) -> frozenset[str]:
    return frozenset(r["id"] for r in read(run_dir))


def culprits(streak: list[BadStep], earlier: list[dict], streaks: list[dict]) -> list[tuple[str, str, int]]:
    """(id, reason, step) of each example to quarantine for `streak`, in order, each once; `earlier`: the records
    already in quarantine.jsonl (their ids are never repeated); `streaks`: the earlier streaks' records."""
    done = {r["id"] for r in earlier}
    failed_before = {step for r in streaks for step in r.get("steps", [])}
    if any(s.step in failed_before for s in streak):
        picked = [(i, AGAIN, s.step) for s in streak for i in s.ids]
    else:
        picked = [(i, OWN_LOSS, s.step) for s in streak for i in s.own]
    out, seen = [], set(done)
    for i, reason, step in picked:
        if i not in seen:
            seen.add(i)
            out.append((i, reason, step))
    return out


def record(run_dir: os.PathLike | str, streak: list[BadStep], attempt: int, now: Optional[float] = None) -> list[dict]:
    """Append the culprits of `streak` to quarantine.jsonl (durably, before the worker exits); returns the new
    records."""
    t = time.time() if now is None else now
    new = [
        {"id": i, "reason": reason, "step": step, "attempt": attempt, "t": t}
        for i, reason, step in culprits(streak, read(run_dir), read_streaks(run_dir))
    ]
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if new:
        append_durable(path_for(run_dir), "".join(json.dumps(r) + "\n" for r in new).encode("utf-8"))
    seen = {
        "steps": sorted({s.step for s in streak}),
        "attempt": attempt,
        "own": [i for s in streak for i in s.own],
        "examples": sum(len(s.ids) for s in streak),
        "quarantined": len(new),
        "t": t,
    }
    append_durable(Path(run_dir) / STREAKS_NAME, (json.dumps(seen) + "\n").encode("utf-8"))
    return new


def report(new: list[dict], hb, log) -> None:
    """Say what was just quarantined: a warning beat (`quarantined`: the ids) and a log line."""
    if not new:
        return
    ids = [r["id"] for r in new]
    hb.warn(
        f"quarantined {len(ids)} training example(s): {', '.join(ids[:10])}" + (" …" if len(ids) > 10 else ""),
        quarantined=ids,
        reason=new[0]["reason"],
        step=new[0]["step"],
    )
    log(
        f"quarantine: {len(ids)} example(s) ({new[0]['reason']}) will be skipped from the next attempt on: "
        + ", ".join(ids)
    )


def examples_digest(ids: list[str]) -> str:
    """A short digest of a step's example ids, in order (every step beat carries it): equal digests, equal steps."""
    import hashlib

    return hashlib.sha256("\n".join(ids).encode("utf-8")).hexdigest()[:16]
