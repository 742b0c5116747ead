"""The resume audit: does an attempt that resumed replay the steps before the failure as they were?

After a restart the next attempt goes over the steps between the checkpoint it resumed from and the point the
failure hit; the attempts before it already beat those steps' loss (and learning rate, gradient norm).  A resume
that restored everything beats the same figures again — bitwise on a deterministic worker, within a tolerance
where GPU kernels are nondeterministic.  A difference names what was not restored: the learning rate → the
schedule; the loss (the learning rate equal) → the data order, the accumulation, the weights; the gradient norm
alone → the model or optimizer state.

`earlier_beats` reads what the earlier attempts beat (their heartbeat files, from the end, only the steps after
the resume point: the replay window, however long the files); `ReplayAudit` compares the new attempt's step
lines as they arrive and says, once: diverged (the first difference), verified (the window replayed), or, when
the attempt ends first, partial.  Pure but for `earlier_beats`' reads; no clock.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hangwatch.common.rundir import attempt_dir

FIGURES = ("loss", "lr", "grad_norm")
LR_RTOL = 1e-6  # the learning rate is computed, not measured: a schedule restored gives the same number
FOREIGN_RTOL = 0.01  # `watchdog.resume_audit.rtol: null` for a worker.command (GPU kernels' nondeterminism)
REBATCHED_RTOL = 1e-3  # at least, when the OOM remediation changed the micro-batch: the same sums in another order
MAX_EARLIER_ATTEMPTS = 16
READ_BLOCK = 1 << 16
AUDITS_NAME = "resume-audit.json"


def default_rtol(rtol: Optional[float], own_command: bool) -> float:
    if rtol is not None:
        return float(rtol)
    return FOREIGN_RTOL if own_command else 0.0


def _num(v) -> Optional[float]:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def figures_of(rec: dict) -> dict:
    """The comparable figures of a step line."""
    return {k: v for k in FIGURES if (v := _num(rec.get(k))) is not None}


def same(a: float, b: float, rtol: float) -> bool:
    """Equal within `rtol` (0: the same float); two non-finite values of one kind are the same."""
    if a == b:
        return True
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.isnan(a) and math.isnan(b)
    return rtol > 0 and abs(a - b) <= rtol * max(abs(a), abs(b))


def differences(now: dict, before: dict, rtol: float) -> list[tuple[str, float, float]]:
    """(figure, now, before) for each figure both carry that differs."""
    out = []
    for k in FIGURES:
        if k in now and k in before and not same(now[k], before[k], min(rtol, LR_RTOL) if k == "lr" else rtol):
            out.append((k, now[k], before[k]))
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3g}"


def explain(step: int, diffs: list[tuple[str, float, float]], rank: Optional[int] = None) -> str:
    """ "step 31: loss 2.31 vs 2.447 before the restart; lr 0.00012 vs 0.0002 — the learning-rate schedule
    was not restored"."""
    figures = "; ".join(f"{k} {_fmt(a)} vs {_fmt(b)}" for k, a, b in diffs)
    names = {k for k, _, _ in diffs}
    if "lr" in names:
        why = "the learning-rate schedule was not restored"
    elif "loss" in names:
        why = "the data or the model state differs (data order, gradient accumulation, weights not restored)"
    else:
        why = "the gradients differ (the data, the model or the optimizer state not as before)"
    on = f" on rank {rank}" if rank is not None else ""
    return f"step {step}{on}: {figures} before the restart — {why}"


def earlier_beats(run_dir, attempt: int, after_step: int) -> dict[tuple[int, int], tuple[int, dict]]:
    """(rank, step) → (attempt, figures) for every step beyond `after_step` that an attempt before `attempt` beat,
    the newest attempt's beat where several did.  Each file is read from its end until it reaches a step at or
    before `after_step` (the replay window; steps only grow within an attempt)."""
    out: dict[tuple[int, int], tuple[int, dict]] = {}
    for number in range(attempt - 1, max(0, attempt - 1 - MAX_EARLIER_ATTEMPTS), -1):
        d = attempt_dir(run_dir, number)
        try:
            files = sorted(d.glob("heartbeat-rank*.jsonl"))
        except OSError:
            continue
        for path in files:
            for rec in _tail_steps(path, after_step):
                key = (rec.get("rank") if isinstance(rec.get("rank"), int) else 0, rec["step"])
                if key not in out:
                    figs = figures_of(rec)
                    if figs:
                        out[key] = (number, figs)
    return out


def _tail_steps(path: Path, after_step: int) -> list[dict]:
    """The step lines of `path` with a step beyond `after_step`, read backwards block by block."""
    found: list[dict] = []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos = f.tell()
            rest = b""
            while pos > 0:
                n = min(READ_BLOCK, pos)
                pos -= n
                f.seek(pos)
                chunk = f.read(n) + rest
                lines = chunk.split(b"\n")
                rest = lines[0] if pos > 0 else b""
                body = lines[1:] if pos > 0 else lines
                reached = False
                for raw in reversed(body):
                    rec = _step_line(raw)
                    if rec is None:
                        continue
                    if rec["step"] <= after_step:
                        reached = True
                        break
                    found.append(rec)
                if reached:
                    break
    except OSError:
        return found
    return found


def _step_line(raw: bytes) -> Optional[dict]:
    if b'"step"' not in raw or b'"event": "step"' not in raw and b'"event":"step"' not in raw:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(rec, dict) or rec.get("event") != "step" or not isinstance(rec.get("step"), int):
        return None
    return rec


@dataclass
class ReplayAudit:
    """One resumed attempt's audit against the beats of the attempts before it."""

    attempt: int
    resumed_step: int  # the checkpoint's step (0: a start from scratch replays from step 1)
    before: dict  # earlier_beats' answer
    rtol: float
    incident: Optional[str] = None  # the failure whose restart this is
    verdict: str = "pending"
    compared: dict = field(default_factory=dict)  # figure → how many comparisons
    first: Optional[int] = None
    last: Optional[int] = None
    steps: set = field(default_factory=set)
    difference: Optional[dict] = None
    text: str = ""
    note: str = ""  # what was left out of the comparison, and why
    cutoff: Optional[int] = None  # the first step whose earlier beat was not finite: it and the rest are not compared

    def __post_init__(self) -> None:
        # A non-finite loss or gradient norm before the restart was the failure (or the step it skipped), not a
        # reference: from that step on the earlier attempt trained something else, so the window ends before it.
        bad = [
            s
            for (_, s), (_, figs) in self.before.items()
            if any(not math.isfinite(figs[k]) for k in ("loss", "grad_norm") if k in figs)
        ]
        if bad:
            self.cutoff = min(bad)
            self.before = {k: v for k, v in self.before.items() if k[1] < self.cutoff}
            why = f"steps from {self.cutoff} on not compared: not finite before the restart"
            self.note = f"{self.note}; {why}" if self.note else why

    @property
    def window(self) -> Optional[tuple[int, int]]:
        steps = [s for _, s in self.before]
        return (min(steps), max(steps)) if steps else None

    @property
    def previous_attempt(self) -> Optional[int]:
        return max((a for a, _ in self.before.values()), default=None)

    @property
    def open(self) -> bool:
        return self.verdict == "pending"

    def observe(self, rank: int, step: int, rec: dict) -> Optional[str]:
        """A step line of the resumed attempt: 'diverged' at the first difference, 'verified' once the window is
        replayed (by the main rank: `rank` 0 or the lowest), else None."""
        if not self.open:
            return None
        hit = self.before.get((rank, step))
        if hit is not None:
            now = figures_of(rec)
            diffs = differences(now, hit[1], self.rtol)
            for k in FIGURES:
                if k in now and k in hit[1]:
                    self.compared[k] = self.compared.get(k, 0) + 1
            if any(k in now and k in hit[1] for k in FIGURES):
                self.steps.add(step)
                self.first = step if self.first is None else min(self.first, step)
                self.last = step if self.last is None else max(self.last, step)
            if diffs:
                self.verdict = "diverged"
                ranks = {r for r, _ in self.before}
                self.difference = {
                    "step": step,
                    "rank": rank,
                    "attempt_before": hit[0],
                    **{"figure": diffs[0][0], "now": diffs[0][1], "before": diffs[0][2]},
                    "figures": [{"figure": k, "now": a, "before": b} for k, a, b in diffs],
                }
                self.text = explain(step, diffs, rank if len(ranks) > 1 else None)
                return "diverged"
        window = self.window
        if window is not None and step >= window[1] and rank == min(r for r, _ in self.before):
            self._conclude("verified")
            return self.verdict
        return None

    def not_resumed(self, text: str) -> None:
        """The attempt did not resume from its checkpoint (the script started again from scratch): nothing to audit;
        `text` says why (the verdict `not_resumed` blames no figure)."""
        if self.open:
            self.verdict, self.text = "not_resumed", text

    def ended(self) -> Optional[str]:
        """The attempt ended while the audit was open: what it did compare (None when it had nothing to)."""
        if not self.open:
            return None
        if self.window is None:
            self._conclude("verified")
        else:
            self._conclude("partial")
        return self.verdict

    def _conclude(self, verdict: str) -> None:
        window = self.window
        if window is None:
            self.verdict = "unverifiable"
            self.text = (
                "resume not audited: no step after the resume point was beaten before the restart (nothing replayed)"
                if self.cutoff is None
                else f"resume not audited: step {self.cutoff}, the first replayed one, was not finite before the "
                "restart (nothing to compare with)"
            )
            return
        if not self.compared:
            self.verdict = "unverifiable"
            self.text = (
                f"resume not audited: steps {window[0]}–{window[1]} replayed, but the beats carry no loss, "
                "lr or grad_norm to compare"
            )
            return
        how = "bitwise equal" if self.rtol == 0 else f"within rtol {self.rtol:g}"
        names = " and ".join(k for k in FIGURES if k in self.compared)
        extra = f" ({self.note})" if self.note else ""
        if verdict == "verified":
            self.verdict = "verified"
            self.text = f"resume verified: steps {self.first}–{self.last} replayed, {names} {how}{extra}"
        else:
            self.verdict = "partial"
            self.text = (
                f"resume partly verified: steps {self.first}–{self.last} of {window[0]}–{window[1]} replayed "
                f"before the attempt ended, {names} {how}{extra}"
            )

    def record(self) -> dict:
        window = self.window
        return {
            "attempt": self.attempt,
            "previous_attempt": self.previous_attempt,
            "resumed_step": self.resumed_step,
            "replayed": list(window) if window else None,
            "compared": [self.first, self.last] if self.first is not None else None,
            "steps_compared": len(self.steps),
            "figures": [k for k in FIGURES if k in self.compared],
            "rtol": self.rtol,
            "verdict": self.verdict,
            "text": self.text or "resume audit under way",
            "difference": self.difference,
            "incident": self.incident,
            **({"note": self.note} if self.note else {}),
        }
