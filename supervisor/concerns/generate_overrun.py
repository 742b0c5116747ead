"""A runaway `generate()` ended in the worker's own process (`watchdog.generate_overrun: truncate`).

A `generate` phase past its budget while tokens still arrive is ordered to end: `GENERATE_STOP_NAME` in the
attempt's directory, read by the worker's generation hook (`daemon.integrations.generation`), names the token at
which every rank whose generate began before the order stops — a little ahead of the fastest, from the token rate
the ranks' `progress` lines show — and the deadlines grant a grace for it.  Once every rank the order reached has
left its generate, the `generate_truncated` incident says what was cut (nothing restarts); a generate that does not
stop within the grace is escalated as any overdue phase, its incident saying that the order was not obeyed.
A generate that produced no token lately, one already ordered, or an order that cannot be written: escalated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import structlog

from hangwatch.common.protocol import GENERATE_STOP_NAME, TRUNCATED_FIELD
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat

log = structlog.get_logger("hangwatch")

TOKENS_FLOWING_S = 10.0  # a generate whose last token beat is at most this old (or half its budget) still produces
ORDER_LEAD_S = 0.5  # a truncation's token limit lies this far ahead of the fastest rank (time for it to read the order)
TRUNCATE_GRACE_MIN_S = 5.0  # the least time a truncated generate gets to stop before it is treated as stuck


@dataclass
class Truncation:
    """One order, from when it is written until every rank it reached left its generate."""

    attempt: int
    issued_at: float
    order: int
    limit: int
    ranks: list[int]
    grace_s: float
    budget_s: float
    elapsed_s: float
    rank: Optional[int]
    step: Optional[int]
    budget_source: str
    reports: dict[int, dict] = field(default_factory=dict)  # rank → what it said of its truncation
    left: set[int] = field(default_factory=set)  # ranks that left their generate since the order


def token_limit(ranks, points: dict[int, list], now: float) -> tuple[int, float]:
    """The token at which every rank in `ranks` (trackers in `generate`) is told to stop, and the longest interval
    between two of a rank's progress points (the grace scales with it).  `points`: rank → its last two
    (time, tokens) progress points in this generate."""
    limit, interval = 1, 1.0
    for r in ranks:
        pts = points.get(r.rank) or []
        if not pts:
            continue
        at, tokens = pts[-1]
        if len(pts) == 2 and at > pts[0][0]:
            interval = max(interval, at - pts[0][0])
            rate = (tokens - pts[0][1]) / (at - pts[0][0])
        else:
            rate = tokens / (at - r.phase_since) if at > r.phase_since else 0.0
        limit = max(limit, tokens + int(math.ceil(max(rate, 0.0) * (now - at + ORDER_LEAD_S))) + 1)
    return limit, interval


class GenerateOverrun(Concern):
    def __post_init__(self) -> None:
        self.name = "generate_overrun"
        self.pending: Optional[Truncation] = None
        self.orders = 0  # orders written by this supervisor
        self.points: dict[int, list] = {}  # rank → its last two (time, tokens) progress points in `generate`

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.pending, self.points = None, {}

    def on_beat(self, ev: Beat) -> None:
        tr, rec, left, at = ev.track, ev.rec, ev.left, ev.at
        ev = rec["event"]
        if ev == "phase" and tr.phase == "generate":
            self.points[tr.rank] = []
        elif ev == "progress" and tr.phase == "generate" and isinstance(rec.get("tokens"), int):
            pts = self.points.setdefault(tr.rank, [])
            pts[:] = (pts + [(at, int(rec["tokens"]))])[-2:]
        t = self.pending
        if t is None:
            return
        if ev == "progress" and isinstance(rec.get(TRUNCATED_FIELD), dict):
            t.reports[tr.rank] = rec[TRUNCATED_FIELD]
        if left == "generate" and tr.phase != "generate":
            t.left.add(tr.rank)

    def overdue(self, attempt, expired, now: float) -> bool:
        """Order the runaway generate to end (True), or leave the deadline to escalate (False)."""
        if expired.name != "phase" or expired.phase != "generate":
            return False
        deadlines = self.run.deadlines
        tr = deadlines.ranks.get(expired.rank)
        t = self.pending
        if tr is None or (t is not None and t.attempt == attempt.number and tr.phase_since <= t.issued_at):
            return False  # already ordered: it did not stop
        age = expired.last_progress_age_s
        if not expired.progress_lines or age is None or age > max(expired.budget_s / 2, TOKENS_FLOWING_S):
            return False  # no token lately: stuck, not running away
        ranks = [r for r in deadlines.ranks.values() if r.phase == "generate" and not r.stopped]
        limit, interval = token_limit(ranks, self.points, now)
        self.orders += 1
        order = {"order": self.orders, "tokens": limit, "issued_unix": round(time.time(), 3)}
        order["budget_s"] = round(expired.budget_s, 3)
        try:
            self.run.fs.write_json(attempt.dir / GENERATE_STOP_NAME, order, durable=False)
        except OSError as exc:
            log.warning("generate_order_failed", error=str(exc), note="the runaway generate is escalated instead")
            return False
        grace = max(TRUNCATE_GRACE_MIN_S, 4 * interval)
        deadlines.grant_grace(now, grace)
        self.pending = Truncation(
            attempt=attempt.number,
            issued_at=now,
            order=self.orders,
            limit=limit,
            ranks=sorted(r.rank for r in ranks),
            grace_s=grace,
            budget_s=round(expired.budget_s, 3),
            elapsed_s=round(expired.elapsed_s, 3),
            rank=expired.rank,
            step=tr.step,
            budget_source=expired.source,
        )
        log.warning(
            "generate_overrun",
            attempt=attempt.number,
            rank=expired.rank,
            budget_s=round(expired.budget_s, 3),
            elapsed_s=round(expired.elapsed_s, 3),
            limit=limit,
            ranks=self.pending.ranks,
            grace_s=round(grace, 3),
            note="tokens still arrive: ending the generation in the worker's process",
        )
        return True

    def while_running(self, attempt, now: float) -> Optional[str]:
        """Once every rank the order reached has left its generate: the `generate_truncated` incident, or, when
        none of them reports a truncation (each generate ended by itself meanwhile), a note."""
        t = self.pending
        if t is None:
            return None
        if t.attempt != attempt.number:
            self.pending = None
            return None
        ranks = self.run.deadlines.ranks
        for rank in t.ranks:
            tr = ranks.get(rank)
            if tr is not None and not tr.stopped and rank not in t.left and tr.phase == "generate":
                return None
        self.pending = None
        if not t.reports:
            log.info("generate_ended_before_order", attempt=t.attempt, ranks=t.ranks)
            return None
        self._truncated(t, now, several=len(ranks) > 1)
        return None

    def _truncated(self, t: Truncation, now: float, several: bool) -> None:
        reports = t.reports
        first = reports[min(reports)]
        tokens = {str(r): rep.get("tokens") for r, rep in sorted(reports.items())}
        where = f"rank {t.rank}" if several else "the worker"
        stopped_at = sorted({v for v in tokens.values() if v is not None})
        at = (
            f"token {stopped_at[0]}"
            if len(stopped_at) == 1
            else "tokens " + ", ".join(f"{v} (rank {r})" for r, v in tokens.items())
        )
        summary = (
            f"generate() on {where} ran past its {t.budget_s:g} s budget while still producing tokens; ended at "
            f"{at} in the worker's own process after {now - t.issued_at + t.elapsed_s:.1f} s — nothing "
            "restarted, training went on"
        )
        inc = self.run.incidents.open_for_run(
            "generate_truncated",
            self.run.facts,
            attempt=t.attempt,
            phase="generate",
            step=t.step,
            classification="runaway generate",
            summary=summary,
            status="final",
            ranks=t.ranks,
            tokens=tokens,
            limit=t.limit,
            order=t.order,
            prompt=first.get("prompt"),
            prompt_ids=first.get("prompt_ids"),
            prompt_tokens=first.get("prompt_tokens"),
            output_tail=first.get("output_tail"),
            budget_s=t.budget_s,
            budget_source=t.budget_source,
            elapsed_s=t.elapsed_s,
            reports={str(r): v for r, v in sorted(reports.items())},
        )
        log.warning(
            "generate_truncated",
            incident=inc.id,
            attempt=t.attempt,
            step=t.step,
            tokens=tokens,
            limit=t.limit,
            text=summary,
        )

    def episode_opened(self, attempt, episode, intent, now: float) -> dict[str, Any]:
        """A stall while an order was under way: the generate did not stop; its incident says so."""
        if episode.expired is None and episode.kind != "manual":
            return {}  # an exit or a stop: the order is dropped with the attempt
        t, self.pending = self.pending, None
        if t is None or episode.incident is None:
            return {}
        return {
            "truncation_ordered": {
                "limit": t.limit,
                "order": t.order,
                "ranks": t.ranks,
                "grace_s": round(t.grace_s, 3),
                "ordered_s_ago": round(now - t.issued_at, 3),
                "reports": {str(r): v for r, v in t.reports.items()},
                "note": f"the generate was ordered to stop at token {t.limit} and did not within {t.grace_s:.1f} s",
            }
        }
