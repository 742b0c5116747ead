"""Alerts: which of the supervisor's events tell a person, when (storm control), and in which words.

    supervisor log events ──tap──▶ AlertDesk.feed (loop thread, at the end of each pass, `now` given)
                                      │  Throttle: one alert per storm, the rest counted into a summary
                                      ▼
                                   Notice ──Outbox (notify.py: a thread, bounded queue)──▶ Courier.deliver
                                                  reads incident.json, words the message, sends it through
                                                  apprise (one URL at a time) and/or `alerts.command`,
                                                  each with a timeout and retries; failures logged and counted

Events (`alerts.on`): `incident` once the failure is handled (tree gone: what fired, the culprit and its
frame, the step, what hangwatch did and how long it took, where the incident is); `recovered` when training
goes past the step where the incident hit; `failed`, `crash_loop`, `no_progress` when the run ends failed
(one of the three, the most specific); `lost_peer` when a multi-node supervisor logs `peer_lost`;
`resume_diverged` when the resume audit finds a replayed step that differs from the same step before the
restart; `generate_truncated` when a runaway generate() was ended at a token limit (nothing restarted);
`unkillable` when processes of the worker's tree outlived SIGKILL (a reboot or a GPU reset may be needed).

Storm control (`Throttle`, pure): the first incident is sent; while it is not recovered, and for
`alerts.min_interval_s` after an incident alert, later incidents are held and counted.  What is held
goes out with the next alert (recovered, or the run's end) or, at the latest, as one summary after
`min_interval_s`.  A crash loop is therefore one incident alert plus the crash-loop alert that
summarises the rest.  Nothing here blocks: the desk runs on the loop and only decides; the courier
does the slow part on its own thread.

Three events stand apart from the incidents' storm control.  `resume_diverged` is sent at once, always: it
happens at most once per resumed attempt, and held or summarised it would let a run spend its GPU time on
training that is no longer the run it replaced.  `unkillable` too: a person has to act (nothing hangwatch
can do ends the process), and it happens at most once per failure.  `generate_truncated` is a warning
with a throttle of its own: the first of the run is sent; a model that lost its EOS truncates at every
eval, so the later ones are held and go out with the next alert, or as one summary at most every
`min_interval_s` — never delaying, and never delayed by, an incident alert.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.rundir import INCIDENTS, read_json
from hangwatch.supervisor.incidents import frame_str
from hangwatch.supervisor.incidents.store import RECORD_NAME
from hangwatch.supervisor.ops.notify import helper_pids

log = structlog.get_logger("hangwatch")

TERMINAL = ("crash_loop", "no_progress", "failed")  # most specific first
# Log events the desk reads (the tap hands over only these).
EVENTS = frozenset(
    {
        "stall_detected",
        "restart_now",
        "worker_failed",
        "stack_dumped",
        "tree_gone",
        "crash_loop",
        "no_progress",
        "state",
        "peer_lost",
        "resume_diverged",
        "resume_verified",
        "generate_truncated",
        "unkillable",
    }
)
LEVEL = {
    "incident": "failure",
    "crash_loop": "failure",
    "no_progress": "failure",
    "failed": "failure",
    "resume_diverged": "failure",
    "unkillable": "failure",
    "lost_peer": "warning",
    "generate_truncated": "warning",
    "summary": "warning",
    "recovered": "success",
    "resume_verified": "success",
}
WARNINGS = frozenset({"generate_truncated"})  # throttled by `Throttle.warning`, apart from the incidents


@dataclass
class Notice:
    """One alert decided on the loop: what happened, and the facts the courier words it from."""

    event: str  # incident | recovered | failed | crash_loop | no_progress | lost_peer | resume_diverged |
    # generate_truncated | summary
    facts: dict = field(default_factory=dict)
    held: list = field(default_factory=list)  # incidents not sent one by one: [{"id", "kind", "step"}]
    wall: float = field(default_factory=time.time)


class Throttle:
    """Storm control, pure: `incident`, `recovered`, `terminal`, `tick` return the notices to send now."""

    def __init__(self, min_interval_s: float):
        self.min_interval_s = min_interval_s
        self.open = False  # an incident was alerted and training has not gone past it since
        self.last_sent_at: Optional[float] = None
        self.held: list[dict] = []
        self.suppressed = 0  # incidents held in all (a metric)
        self.warned: set[str] = set()  # warning kinds already alerted in this run
        self.warned_at: Optional[float] = None  # the last warning alert, or summary of held warnings

    def _quiet(self, now: float) -> bool:
        return self.last_sent_at is None or now - self.last_sent_at >= self.min_interval_s

    def _quiet_warnings(self, now: float) -> bool:
        return self.warned_at is None or now - self.warned_at >= self.min_interval_s

    def incident(self, notice: Notice, now: float) -> list[Notice]:
        if not self.open and self._quiet(now):
            self.open, self.last_sent_at = True, now
            notice.held, self.held = self.held, []
            return [notice]
        self.held.append({k: notice.facts.get(k) for k in ("id", "kind", "step")})
        self.suppressed += 1
        return []

    def warning(self, notice: Notice, now: float) -> list[Notice]:
        """The first warning of its kind in the run is sent; the rest are held.  Neither opens the incidents' storm
        window: a stall after a truncation is alerted as if the truncation had not been."""
        if notice.event not in self.warned:
            self.warned.add(notice.event)
            self.warned_at = now
            return [notice]
        self.held.append({k: notice.facts.get(k) for k in ("id", "kind", "step")})
        self.suppressed += 1
        return []

    def recovered(self, notice: Notice, now: float) -> list[Notice]:
        if not self.open:
            return []  # nobody was told of trouble: no all-clear either
        self.open = False
        notice.held, self.held = self.held, []
        return [notice]

    def terminal(self, notice: Notice, now: float) -> list[Notice]:
        self.open = False
        notice.held, self.held = self.held, []
        return [notice]

    def tick(self, now: float) -> list[Notice]:
        """Incidents held for `min_interval_s` since the last incident alert (and the last warning alert or summary,
        when warnings are held) go out as one summary.  A summary of warnings alone leaves the incidents' window
        shut."""
        warnings = any(h.get("kind") in WARNINGS for h in self.held)
        if self.held and self._quiet(now) and (not warnings or self._quiet_warnings(now)):
            if any(h.get("kind") not in WARNINGS for h in self.held):
                self.last_sent_at = now
            if warnings:
                self.warned_at = now
            notice = Notice("summary", {})
            notice.held, self.held = self.held, []
            return [notice]
        return []


class AlertDesk:
    """Reads the supervisor's events (loop thread), decides the notices; `send` hands them to the courier."""

    def __init__(self, enabled: set[str], min_interval_s: float, send: Callable[[Notice], Any]):
        self.enabled = enabled
        self.throttle = Throttle(min_interval_s)
        self.send = send
        self.pending: dict[str, dict] = {}  # incident id → what the log said of it, until its tree is gone
        self.current: Optional[str] = None  # the incident being handled
        self.ending: dict[str, dict] = {}  # crash_loop / no_progress: why the run is about to end
        self.top_step = -1  # the highest step seen in the run
        self.hit: Optional[dict] = None  # the last alerted-or-held incident: {"id", "step", "attempt"}
        self.failed: Optional[dict] = None  # the run ended failed: {"why", "attempt"} until the alert is out
        self.failed_sent = False

    def _out(self, notices: list[Notice]) -> None:
        for n in notices:
            if n.event in self.enabled or n.event == "summary":
                self.send(n)

    # ---- inputs ------------------------------------------------------------------------------

    def feed(self, ev: dict, now: float) -> None:
        name = ev.get("event")
        inc = ev.get("incident")
        if name in ("stall_detected", "restart_now", "worker_failed") and inc:
            ident = str(inc)
            self.pending[ident] = {
                "id": ident,
                "kind": ev.get("kind"),
                "step": ev.get("step"),
                "attempt": ev.get("attempt"),
                "detected_at": now,
                "deadline": ev.get("deadline"),
                "elapsed_s": ev.get("elapsed_s"),
                "classification": ev.get("classification"),
                "phase": ev.get("phase"),
            }
            self.current = ident
        elif name == "stack_dumped" and inc in self.pending:
            self.pending[inc].update(stuck=ev.get("stuck"), classification=ev.get("classification"))
        elif name == "tree_gone" and self.current in self.pending:
            facts = self.pending.pop(self.current)
            self.current = None
            facts.update(
                next=ev.get("next"),
                why=ev.get("why"),
                handled_s=round(now - facts.pop("detected_at"), 3),
                step=facts.get("step") if facts.get("step") is not None else max(self.top_step, 0),
            )
            if facts["kind"] == "manual" or ev.get("next") in ("stopped", "paused", "starting"):
                return  # an operator's restart or stop: they know
            # Recovered means past the furthest step any still-unrecovered incident hit: a later attempt that dies
            # earlier (a crash loop) must not make stepping past *its* step count as recovery.
            furthest = max(facts["step"] or 0, (self.hit or {}).get("step") or 0)
            self.hit = {"id": facts["id"], "step": furthest, "attempt": ev.get("attempt")}
            if "incident" in self.enabled:
                self._out(self.throttle.incident(Notice("incident", facts), now))
        elif name == "recovered_in_process" and self.current in self.pending:
            # A stall ended in the worker's own process: handled, nothing killed — a person still hears of it.
            facts = self.pending.pop(self.current)
            self.current = None
            facts.update(
                next="recovered_in_process",
                why=ev.get("text"),
                handled_s=round(now - facts.pop("detected_at"), 3),
                step=facts.get("step") if facts.get("step") is not None else max(self.top_step, 0),
            )
            furthest = max(facts["step"] or 0, (self.hit or {}).get("step") or 0)
            self.hit = {"id": facts["id"], "step": furthest, "attempt": ev.get("attempt")}
            if "incident" in self.enabled:
                self._out(self.throttle.incident(Notice("incident", facts), now))
        elif name in ("oom_adapted", "nonfinite_rolled_back") and inc and "incident" in self.enabled:
            # What the worker recovered from by itself, in its process: one incident alert each (storm-controlled).
            facts = {
                "id": str(inc),
                "kind": ev.get("kind"),
                "step": ev.get("step"),
                "attempt": ev.get("attempt"),
                "next": "recovered_in_process",
                "why": ev.get("text"),
                "handled_s": 0.0,
            }
            self._out(self.throttle.incident(Notice("incident", facts), now))
        elif name in ("crash_loop", "no_progress"):
            self.ending[name] = {"id": inc, "reason": ev.get("reason")}
        elif name == "state" and ev.get("to") == "failed" and self.failed is None:
            self.failed = {
                "why": ev.get("why"),
                "attempt": ev.get("attempt"),
            }  # sent by `tick`, after the pass's events
        elif name == "peer_lost" and "lost_peer" in self.enabled:
            self._out([Notice("lost_peer", {k: v for k, v in ev.items() if k not in ("timestamp", "level", "logger")})])
        elif name == "resume_diverged" and "resume_diverged" in self.enabled:
            self._out([Notice(name, _facts(ev, "figure", "now", "before", "text", "on_divergence"))])  # never held
        elif name == "resume_verified" and "resume_verified" in self.enabled:  # the trackers' desk: not an alert
            self._out([Notice(name, _facts(ev, "text"))])
        elif name == "unkillable" and "unkillable" in self.enabled:
            self._out([Notice(name, _facts(ev, "pids", "on_unkillable", "text"))])  # never held: a person must act
        elif name == "generate_truncated" and "generate_truncated" in self.enabled:
            self._out(self.throttle.warning(Notice(name, _facts(ev, "tokens", "limit", "text")), now))

    def observe(self, attempt: int, step: Optional[int], now: float) -> None:
        """Once a pass: the current attempt and its step (recovered: past the step the incident hit)."""
        if step is None:
            return
        hit = self.hit
        if hit is not None and attempt > (hit.get("attempt") or 0) and step > (hit.get("step") or 0):
            self.hit = None
            if "recovered" in self.enabled:
                self._out(
                    self.throttle.recovered(
                        Notice(
                            "recovered",
                            {"id": hit["id"], "step": step, "attempt": attempt, "hit_step": hit.get("step")},
                        ),
                        now,
                    )
                )
            else:
                self.throttle.open = False
        self.top_step = max(self.top_step, step)

    def tick(self, now: float) -> None:
        """At the end of a pass, after its events: the run's end (with the most specific reason the pass gave:
        the crash loop or no-progress incident is recorded after the state changed), then held incidents."""
        if self.failed is not None and not self.failed_sent:
            self.failed_sent = True
            specific = next((k for k in ("crash_loop", "no_progress") if k in self.ending), None)
            kind = specific if specific in self.enabled else ("failed" if "failed" in self.enabled else None)
            if kind is not None:
                self._out(self.throttle.terminal(Notice(kind, {**self.failed, **self.ending.get(kind, {})}), now))
        self._out(self.throttle.tick(now))


def _facts(ev: dict, *keys: str) -> dict:
    """What an event of an incident that restarts nothing says: its id, kind, attempt, step and `keys`."""
    inc = ev.get("incident")
    return {
        "id": str(inc) if inc else None,
        "kind": ev.get("event"),
        "attempt": ev.get("attempt"),
        "step": ev.get("step"),
        **{k: ev.get(k) for k in keys},
    }


# ================================================================================ the courier's side


def incident_record(run_dir: Path, ident: Optional[str]) -> tuple[dict, Optional[Path]]:
    """incident.json of incident `ident` and its directory ({} and None when it cannot be read)."""
    if not ident:
        return {}, None
    for d in sorted((run_dir / INCIDENTS).glob(f"{str(ident).zfill(4)}-*")):
        return read_json(d / RECORD_NAME) or {}, d
    return {}, None


def compose(notice: Notice, run_dir: Path, host: str) -> dict:
    """The alert as a person reads it (`title`, `body`) and as a program does (the rest)."""
    f, run = notice.facts, run_dir.name
    rec, where = incident_record(run_dir, f.get("id"))
    out = {
        "event": notice.event,
        "run": run,
        "run_dir": str(run_dir.resolve()),
        "host": host,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(notice.wall)),
        "incident": f.get("id"),
        "incident_dir": str(where.resolve()) if where else None,
        "held": notice.held,
    }
    if notice.event == "incident":
        kind = rec.get("kind") or f.get("kind")
        culprit = _culprit(rec, f)
        frame = frame_str(rec.get("stuck_frame")) if rec.get("stuck_frame") else (f.get("stuck") or "unknown")
        step = rec.get("step", f.get("step"))
        did = _what_was_done(rec, f)
        timings = rec.get("timings") or {}
        deadline = rec.get("deadline") or {}
        took = f"handled {f.get('handled_s')} s after detection"
        if deadline.get("elapsed_s") is not None:
            took = (
                f"detected {deadline['elapsed_s']} s after the last sign of progress ({deadline.get('name')} deadline "
                f"{deadline.get('budget_s')} s); " + took
            )
        if timings.get("detection_to_gone_s") is not None:
            took += f"; tree gone {timings['detection_to_gone_s']} s after detection"
        out.update(
            kind=kind,
            culprit=culprit,
            frame=frame,
            step=step,
            attempt=rec.get("attempt", f.get("attempt")),
            done=did,
            took=took,
            summary=rec.get("summary"),
            last_good_checkpoint=rec.get("last_good_checkpoint"),
        )
        title = f"hangwatch {run}: {kind} at step {step} — {_next_words(f.get('next'))}"
        lines = [
            f"run: {run} ({out['run_dir']}) on {host}, attempt {out['attempt']}",
            f"kind: {kind}",
            f"culprit: {culprit}",
            f"frame: {frame}",
            f"step: {step}",
            f"done: {did}",
            f"took: {took}",
            f"incident: {out['incident_dir'] or f.get('id')}",
        ]
        if rec.get("summary"):
            lines.append(f"summary: {rec['summary']}")
    elif notice.event == "recovered":
        title = f"hangwatch {run}: recovered — step {f.get('step')} (past step {f.get('hit_step')})"
        lines = [
            f"run: {run} ({out['run_dir']}) on {host}",
            f"attempt {f.get('attempt')} is training again: step "
            f"{f.get('step')}, past step {f.get('hit_step')} where incident {f.get('id')} hit",
        ]
        out.update(step=f.get("step"), attempt=f.get("attempt"))
    elif notice.event == "resume_diverged":
        audit = rec.get("resume_audit") if isinstance(rec.get("resume_audit"), dict) else rec
        diff = audit.get("difference") if isinstance(audit.get("difference"), dict) else {}
        step = f.get("step") if f.get("step") is not None else diff.get("step")
        figure = f.get("figure") or diff.get("figure") or "a figure"
        text = f.get("text") or audit.get("text") or rec.get("summary") or "a replayed step differs"
        attempt = f.get("attempt") if f.get("attempt") is not None else audit.get("attempt")
        title = f"hangwatch {run}: resume DIVERGED at step {step} — {figure} differs from before the restart"
        lines = [f"run: {run} ({out['run_dir']}) on {host}, attempt {attempt}", f"audit: {text}"]
        if diff:
            lines.append(
                f"difference: step {diff.get('step')}, rank {diff.get('rank')}: {diff.get('figure')} "
                f"{diff.get('now')} now, {diff.get('before')} before"
            )
        then = f.get("on_divergence") or rec.get("on_divergence")
        if then:
            lines.append(
                "then: "
                + (
                    "the run ends failed (watchdog.resume_audit.on_divergence: stop)"
                    if then == "stop"
                    else "training goes on (watchdog.resume_audit.on_divergence: warn)"
                )
            )
        lines.append(f"incident: {out['incident_dir'] or f.get('id')}")
        out.update(
            kind="resume_diverged",
            step=step,
            attempt=attempt,
            figure=figure,
            text=text,
            difference=diff or None,
            on_divergence=then,
        )
    elif notice.event == "resume_verified":
        attempt = f.get("attempt")
        title = f"hangwatch {run}: resume verified — attempt {attempt} retraced the steps before the restart"
        lines = [f"run: {run} ({out['run_dir']}) on {host}, attempt {attempt}", f"audit: {f.get('text')}"]
        out.update(kind="resume_verified", attempt=attempt, step=f.get("step"), text=f.get("text"))
    elif notice.event == "unkillable":
        survivors = rec.get("survivors") if isinstance(rec.get("survivors"), list) else []
        pids = f.get("pids") or [s.get("pid") for s in survivors]
        attempt = f.get("attempt") if f.get("attempt") is not None else rec.get("attempt")
        title = f"hangwatch {run}: processes {pids} survive SIGKILL — a reboot or a GPU reset may be needed"
        lines = [
            f"run: {run} ({out['run_dir']}) on {host}, attempt {attempt}",
            f"what: {f.get('text') or rec.get('summary') or 'processes of the worker outlived SIGKILL'}",
        ]
        for sv in survivors:
            lines.append(
                f"pid {sv.get('pid')}: state {sv.get('state')}, kernel wait {sv.get('wchan') or 'unknown'}"
                + (f", {' '.join(map(str, sv.get('cmdline') or []))[:120]}" if sv.get("cmdline") else "")
            )
        mode = f.get("on_unkillable") or rec.get("on_unkillable")
        lines.append(
            "then: "
            + (
                "no new attempt starts until they are gone (restart.on_unkillable: wait)"
                if mode == "wait"
                else "the run ends failed (restart.on_unkillable: fail)"
            )
        )
        lines.append(f"incident: {out['incident_dir'] or f.get('id')}")
        out.update(kind="unkillable", attempt=attempt, pids=pids, on_unkillable=mode)
    elif notice.event == "generate_truncated":
        step = rec.get("step", f.get("step"))
        tokens = f.get("tokens") if f.get("tokens") is not None else rec.get("tokens")
        limit = f.get("limit") if f.get("limit") is not None else rec.get("limit")
        attempt = f.get("attempt") if f.get("attempt") is not None else rec.get("attempt")
        text = f.get("text") or rec.get("summary") or "a generate phase overran its budget while tokens still arrived"
        title = f"hangwatch {run}: generate truncated at step {step} — {_tokens(tokens)}"
        lines = [f"run: {run} ({out['run_dir']}) on {host}, attempt {attempt}", f"what: {text}"]
        if rec.get("elapsed_s") is not None or rec.get("budget_s") is not None:
            lines.append(
                f"took: {rec.get('elapsed_s')} s in phase {rec.get('phase') or 'generate'}, budget "
                f"{rec.get('budget_s')} s; ended at {_tokens(tokens)} (limit {limit})"
                + (f" on rank(s) {', '.join(str(r) for r in rec['ranks'])}" if rec.get("ranks") else "")
            )
        if rec.get("prompt"):
            lines.append(f"prompt: {_clip(rec['prompt'])}")
        if rec.get("output_tail"):
            lines.append(f"output ends: {_clip(rec['output_tail'], tail=True)}")
        lines += [
            "done: nothing restarted; the generation returned what it had and training goes on",
            f"incident: {out['incident_dir'] or f.get('id')}",
        ]
        out.update(kind="generate_truncated", step=step, attempt=attempt, tokens=tokens, limit=limit, text=text)
    elif notice.event == "summary":
        title = f"hangwatch {run}: {len(notice.held)} more incident(s) not sent one by one"
        lines = [f"run: {run} ({out['run_dir']}) on {host}"]
    else:  # the run's end: failed, crash_loop, no_progress; lost_peer
        what = {
            "crash_loop": "crash loop",
            "no_progress": "no progress",
            "failed": "failed",
            "lost_peer": "a peer node is missing",
        }.get(notice.event, notice.event)
        title = f"hangwatch {run}: run FAILED — {what}" if notice.event in TERMINAL else f"hangwatch {run}: {what}"
        lines = [f"run: {run} ({out['run_dir']}) on {host}", f"why: {f.get('reason') or f.get('why')}"]
        if where:
            lines.append(f"incident: {out['incident_dir']}")
        out.update(why=f.get("reason") or f.get("why"))
    if notice.held:
        kinds: dict[str, int] = {}
        for h in notice.held:
            kinds[h.get("kind") or "?"] = kinds.get(h.get("kind") or "?", 0) + 1
        lines.append(
            f"also {len(notice.held)} incident(s) not sent one by one: "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + " ("
            + ", ".join(str(h.get("id")) for h in notice.held)
            + ")"
        )
    out.update(title=title, body="\n".join(lines), level=LEVEL.get(notice.event, "info"))
    return out


def _tokens(tokens: Any) -> str:
    """ "512 tokens"; per rank ({"0": 512, "1": 498}) only where the ranks stopped at different counts."""
    if isinstance(tokens, dict):
        counts = {str(r): n for r, n in tokens.items() if n is not None}
        if len(set(counts.values())) > 1:
            return ", ".join(f"{n} tokens (rank {r})" for r, n in counts.items())
        tokens = next(iter(counts.values()), None)
    return f"{tokens} tokens" if tokens is not None else "an unknown number of tokens"


def _clip(text: Any, n: int = 200, tail: bool = False) -> str:
    """One line of at most `n` characters (the end of it with `tail`): a chat message, not a transcript."""
    s = " ".join(str(text).split())
    if len(s) <= n:
        return s
    return "…" + s[-(n - 1) :] if tail else s[: n - 1] + "…"


def _culprit(rec: dict, f: dict) -> str:
    rank = rec.get("culprit_rank", rec.get("dump_rank"))
    cls = rec.get("classification") or f.get("classification") or "unknown"
    return f"rank {rank}: {cls}" if rank is not None else cls


def _next_words(nxt: Optional[str]) -> str:
    return {"backoff": "restarting", "starting": "restarted", "failed": "run failed"}.get(nxt or "", nxt or "handled")


def _what_was_done(rec: dict, f: dict) -> str:
    parts = []
    if rec.get("dumps"):
        parts.append(f"dumped the stacks of rank(s) {', '.join(str(r) for r in rec['dumps'])}")
    t = rec.get("timings") or {}
    if t.get("sigkill_after_s") is not None:
        parts.append("stopped the process tree (SIGTERM, then SIGKILL)")
    elif t.get("sigterm_sent"):
        parts.append("stopped the process tree (SIGTERM)")
    elif rec.get("exit"):
        parts.append("reaped what was left of the tree")
    why = f.get("why") or (rec.get("decision") or {}).get("reason") or ""
    if f.get("next") == "recovered_in_process":
        parts.append(
            f"recovered in the worker's process, nothing restarted: {why}" if why else "recovered in the process"
        )
    elif f.get("next") == "backoff":
        rb = rec.get("last_good_checkpoint")
        parts.append(
            "restarting"
            + (f" from {rb} (step {rec.get('last_good_step')})" if rb else " from scratch (no good checkpoint)")
            + (f"; {why.rsplit('; ', 1)[-1]}" if ("next attempt" in why or "restarting at once" in why) else "")
        )
    elif f.get("next") == "failed":
        parts.append(f"ended the run failed: {why}")
    elif f.get("next"):
        parts.append(f"then {f['next']}")
    return "; ".join(parts) or "recorded the incident"


# ---- sinks ---------------------------------------------------------------------------------------


class AppriseSink:
    """One apprise URL.  Loaded on the courier's thread (apprise's plugin scan takes ~0.5 s)."""

    def __init__(self, url: str, timeout_s: float):
        import apprise  # noqa: PLC0415  (only where alerts are configured)

        self.apprise = apprise
        self.name = url.split("://", 1)[0]
        # The plugin itself, called on the courier's own (daemon) thread: `Apprise.notify` dispatches through a
        # thread pool that the interpreter joins at exit, so a hung endpoint would hold the supervisor's exit
        # for its whole read timeout.
        self.plugin = apprise.Apprise.instantiate(url)
        if self.plugin is None:
            raise ValueError(f"apprise does not understand the alert URL {self.private(url)!r}")
        self.plugin.socket_read_timeout = self.plugin.socket_connect_timeout = float(timeout_s)

    @staticmethod
    def private(url: str) -> str:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://{rest[:3]}…" if rest else url

    def __call__(self, msg: dict) -> None:
        level = {
            "failure": self.apprise.NotifyType.FAILURE,
            "warning": self.apprise.NotifyType.WARNING,
            "success": self.apprise.NotifyType.SUCCESS,
        }.get(msg["level"], self.apprise.NotifyType.INFO)
        if not self.plugin.notify(body=msg["body"], title=msg["title"], notify_type=level):
            raise OSError(f"{self.name}: apprise could not deliver (see the endpoint's answer in apprise's log)")


class CommandSink:
    """`alerts.command`: the alert as one JSON object on stdin; exit 0 is a delivery."""

    name = "command"

    def __init__(self, argv: list[str], timeout_s: float):
        self.argv, self.timeout_s = list(argv), timeout_s

    def __call__(self, msg: dict) -> None:
        # Its own session: a terminal's ^C or a signal to the supervisor's group is not meant for it.  Listed in
        # helper_pids while it runs: the supervisor's child, but no worker's orphan.
        with subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        ) as p:
            helper_pids.add(p.pid)
            try:
                _, err = p.communicate(json.dumps(msg).encode(), timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                raise OSError(f"{self.argv[0]} did not finish within {self.timeout_s:g}s") from None
            finally:
                helper_pids.discard(p.pid)
        if p.returncode != 0:
            raise OSError(f"{self.argv[0]} exited {p.returncode}: {err.decode(errors='replace').strip()[-300:]}")


class Courier:
    """The courier thread's work: word each notice and hand it to every sink, retrying failures."""

    def __init__(
        self,
        run_dir: Path,
        sinks: list[Callable[[dict], None]],
        retries: int,
        stats: Any,
        sleep: Callable[[float], None] = time.sleep,
        host: Optional[str] = None,
    ):
        self.run_dir, self.sinks, self.retries, self.stats, self.sleep = Path(run_dir), sinks, retries, stats, sleep
        self.host = host or socket.gethostname()

    def deliver(self, notice: Notice) -> None:
        msg = compose(notice, self.run_dir, self.host)
        for sink in self.sinks:
            name = getattr(sink, "name", type(sink).__name__)
            for attempt in range(self.retries + 1):
                try:
                    sink(msg)
                except Exception as exc:  # any failure of a sink is a failed delivery, never the supervisor's end
                    if attempt < self.retries:
                        self.sleep(2.0**attempt)
                        continue
                    self.stats.add("alerts_failed", name)
                    log.warning(
                        "alert_failed",
                        sink=name,
                        alert=notice.event,
                        incident=notice.facts.get("id"),
                        tries=attempt + 1,
                        error=str(exc),
                    )
                else:
                    self.stats.add("alerts_sent", name)
                    log.info(
                        "alert_sent", sink=name, alert=notice.event, incident=notice.facts.get("id"), tries=attempt + 1
                    )
                break
