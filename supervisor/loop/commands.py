"""The control-socket commands, one handler each, and the `status` view.

A handler runs while the loop drains its events, so it only *records* what was asked — the stop,
pause or restart intent, a pending `restart now`, a pending `dump` — and the loop's reconcile step
acts on it in the same pass.  Most handlers answer at once.  `dump` is answered later: it returns
a `DumpRequest`, which the control server holds (it has `ready(now)` and `reply()`) while the loop
signals the ranks and waits, pass by pass, for their dump files to settle; the loop never sleeps
for it.  During a stall the request shares the episode's own dumps instead of signalling again.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import structlog

from hangwatch.common.inbox_layout import queue_status
from hangwatch.supervisor.records import remediation
from hangwatch.supervisor.episode.escalation import DumpCollector, DumpTarget
from hangwatch.supervisor.loop.outcome import Intent
from hangwatch.supervisor.processes.process import ProcessTable
from hangwatch.supervisor.loop.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.episode.episode import Episode
    from hangwatch.supervisor.loop.supervisor import Supervisor

log = structlog.get_logger("hangwatch")

ESCALATING = (State.STALLED, State.DUMPING, State.KILLING)
MIN_DUMP_GRACE_S = 0.5  # an operator's dump waits at least this long for the files to settle


class DumpRequest:
    """A `dump` in flight: answered once the dump files have settled (the server polls `ready`)."""

    def __init__(self, table: ProcessTable, grace_s: float, targets: list[DumpTarget] = (),
                 episode: Optional["Episode"] = None):
        self.episode = episode  # share a stall's dumps instead of signalling the ranks a second time
        self.collector = None if episode is not None else DumpCollector(list(targets), grace_s=grace_s, table=table,
                                                                         py_spy=False)
        self.began = False
        self.answer: Optional[dict] = None

    def ready(self, now: float) -> bool:
        return self.answer is not None

    def reply(self) -> dict:
        return self.answer

    def advance(self, now: float, episode: Optional["Episode"]) -> bool:
        """One loop pass (reconcile step); True once answered.  `episode`: the one being handled now."""
        if self.episode is not None:
            dc = self.episode.dumps
            if dc is not None and dc.done:
                self._answer(dc)
            elif episode is not self.episode:
                self.answer = {"ok": False, "error": "the worker's tree ended before its stacks were dumped"}
            return self.answer is not None
        if not self.began:
            self.began = True
            self.collector.begin(now)
        if self.collector.advance(now):
            self._answer(self.collector)
        return self.answer is not None

    def _answer(self, dc: DumpCollector) -> None:
        self.answer = {"ok": True, "result": {"dumps": {str(r): t for r, t in dc.texts().items()},
                                              "signalled": {str(r): ok for r, ok in dc.signalled.items()}}}


Reply = Union[dict, DumpRequest]


class Commands:
    """`handle(request, now)`: a reply, or a `DumpRequest` to be answered in a later pass.  Never raises."""

    def __init__(self, sup: "Supervisor"):
        self.sup = sup
        self.handlers: dict[str, Callable[[dict, float], Reply]] = {
            "status": self.status, "restart": self.restart, "stop": self.stop, "pause": self.pause,
            "resume": self.resume, "dump": self.dump, "incidents": self.incidents,
        }

    def handle(self, req: Any, now: float) -> Reply:
        if not isinstance(req, dict):
            return {"ok": False, "error": f"request must be a JSON object, got {type(req).__name__}"}
        cmd = req.get("cmd")
        handler = self.handlers.get(cmd) if isinstance(cmd, str) else None
        if handler is None:
            return {"ok": False, "error": f"unknown command {cmd!r} (known: {', '.join(self.handlers)})"}
        try:
            return handler(req, now)
        except Exception as exc:  # a bad request must never take the supervisor down
            log.exception("request_failed", cmd=cmd)
            return {"ok": False, "error": f"{cmd} failed: {type(exc).__name__}: {exc}"}

    def _busy(self) -> Optional[str]:
        st = self.sup.lifecycle.state
        if st.final:
            return f"the run is over (state {st.value})"
        if self.sup.after_teardown is Intent.EXIT:
            return "the supervisor is stopping"
        return None

    def status(self, req: dict, now: float) -> dict:
        return {"ok": True, "result": status_view(self.sup, now)}

    def restart(self, req: dict, now: float) -> dict:
        mode = req.get("mode", "graceful")
        if mode not in ("graceful", "now"):
            return {"ok": False, "error": f"restart mode must be 'graceful' or 'now', got {mode!r}"}
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        sup, st = self.sup, self.sup.lifecycle.state
        sup.after_teardown = Intent.RESTART
        if st in ESCALATING:
            return {"ok": True, "result": {"accepted": "restart", "mode": mode, "note": f"restarting after the current {st.value}"}}
        if st in (State.BACKOFF, State.PAUSED) or not sup.worker_alive():
            return {"ok": True, "result": {"accepted": "restart", "mode": mode, "note": f"starting a worker now (was {st.value})"}}
        if mode == "now":
            sup.escalate_now = True  # the loop dumps and kills; a graceful restart asks the worker to stop
        return {"ok": True, "result": {"accepted": "restart", "mode": mode, "attempt": sup.attempt}}

    def stop(self, req: dict, now: float) -> dict:
        st = self.sup.lifecycle.state
        if st.final:
            return {"ok": False, "error": f"the run is over (state {st.value})"}
        self.sup.request_stop("control request")
        return {"ok": True, "result": {"accepted": "stop", "state": st.value}}

    def pause(self, req: dict, now: float) -> dict:
        busy = self._busy()
        if busy:
            return {"ok": False, "error": busy}
        if self.sup.lifecycle.state is State.PAUSED:
            return {"ok": True, "result": {"accepted": "pause", "note": "already paused"}}
        self.sup.after_teardown = Intent.PAUSE
        self.sup.write_state(now, force=True)  # the pause must survive this supervisor from now on
        return {"ok": True, "result": {"accepted": "pause", "state": self.sup.lifecycle.state.value}}

    def resume(self, req: dict, now: float) -> dict:
        st = self.sup.lifecycle.state
        if st is not State.PAUSED and self.sup.after_teardown is not Intent.PAUSE:
            return {"ok": False, "error": f"not paused (state {st.value})"}
        # paused, or a pause still under way: either way a worker runs again once nothing is left of the old one
        self.sup.after_teardown = Intent.RESTART
        self.sup.write_state(now, force=True)
        return {"ok": True, "result": {"accepted": "resume"}}

    def dump(self, req: dict, now: float) -> Reply:
        sup = self.sup
        grace_s = max(sup.watchdog_cfg.dump_grace_s, MIN_DUMP_GRACE_S)
        ep = sup.episode
        if sup.lifecycle.state in (State.STALLED, State.DUMPING) and ep is not None and ep.incident is not None:
            pending = DumpRequest(sup.table, grace_s, episode=ep)
        else:
            targets = sup.current.dump_targets() if sup.worker_alive() else []
            if not targets:
                return {"ok": False, "error": f"no running worker process announced a dump signal (state {sup.lifecycle.state.value})"}
            pending = DumpRequest(sup.table, grace_s, targets)
        sup.dump_requests.append(pending)
        return pending

    def incidents(self, req: dict, now: float) -> dict:
        store = self.sup.incidents
        ident = req.get("id")
        if ident is None:
            return {"ok": True, "result": store.list()}
        found = store.get(str(ident))
        if found is None:
            known = ", ".join(i["id"] for i in store.list()) or "none yet"
            return {"ok": False, "error": f"no incident {ident!r} (known: {known})"}
        return {"ok": True, "result": found}


def max_steps(sup: "Supervisor") -> Optional[int]:
    """The run's length: what the worker's step lines say, else the built-in worker's config."""
    last = sup.facts.last_step
    if isinstance(last.get("max_steps"), int):
        return last["max_steps"]
    return sup.cfg.train.max_steps if sup.cfg.worker.command is None else None


def status_line(sup: "Supervisor") -> str:
    """The one-line status systemd shows (`systemctl status`)."""
    tr = sup.deadlines.ranks.get(sup.deadlines.main_rank())
    parts = [f"{sup.lifecycle.state.value} attempt {sup.attempt}"]
    if tr is not None:
        mx = max_steps(sup)
        parts += [f"step {tr.step}" + (f"/{mx}" if mx else ""), f"phase {tr.phase}"]
    if sup.facts.last_incident:
        parts.append(f"incidents {sup.incidents.count()}")
    return ", ".join(parts)


def status_view(sup: "Supervisor", now: float) -> dict:
    st, facts, dl, cur = sup.lifecycle.state, sup.facts, sup.deadlines, sup.current
    tr = dl.ranks.get(dl.main_rank())
    last_line = max((t.last_line_at for t in dl.ranks.values()), default=None)
    watching = st in (State.STARTING, State.RUNNING, State.STOPPING) and sup.worker_alive()
    budget, source = dl.step_budget()
    return {
        "state": st.value,
        "attempt": sup.attempt,
        "pid": cur.worker.pid if sup.worker_alive() else None,
        "pids": {str(r): ref.pid for r, ref in cur.announced_refs().items()} if cur else {},
        "phase": tr.phase if tr else None,
        "phase_age_s": round(now - tr.phase_since, 3) if tr else None,
        "phase_budget_s": tr.phase_budget if tr else None,
        "step": tr.step if tr else None,
        "max_steps": max_steps(sup),
        "loss": facts.last_step.get("loss"),
        "tokens_per_s": facts.last_step.get("tokens_per_s"),
        "lr": facts.last_step.get("lr"),
        "last_beat_age_s": round(now - last_line, 3) if last_line is not None else None,
        "last_good_checkpoint": facts.last_good_checkpoint,
        "last_good_step": facts.last_good_step,
        "restarts": facts.restarts,
        "incidents": sup.incidents.count(),
        "last_incident": facts.last_incident,
        "deadlines": dl.active(now) if watching else [],
        "ranks": rank_rows(sup, now, watching),
        "stragglers": {str(r): rec for r, rec in cur.stragglers.status().items()} if cur else {},
        "backoff_remaining_s": round(max(0.0, sup.backoff_until - now), 3)
        if sup.backoff_until is not None and st is State.BACKOFF else None,
        "intent": sup.after_teardown.value,
        "gpu": sup.gpu.summary(now),
        "run_dir": str(sup.run_dir),
        "config": str(sup.cfg._source or sup.config_path),
        "supervisor_pid": os.getpid(),
        "uptime_s": round(now - sup.started_at, 3),
        "torn_lines": facts.torn_lines,
        "calibration": {"step_budget_s": budget, "source": source, "samples": len(sup.calibration.step_samples)},
        "queue": queue_status(sup.run_dir) if sup.cfg.data.inbox else None,
        **remediation.state_fields(sup.run_dir),  # self-healing: the micro-batch after OOMs, quarantined examples
        "nodes": sup.nodes.status() if sup.nodes is not None else None,  # multi-node: generation, peers, torchrun rounds
    }


def rank_rows(sup: "Supervisor", now: float, watching: bool) -> list[dict]:
    """Every rank that spoke in this attempt: its pid, phase, step, last beat age, deadlines, straggling."""
    dl, cur = sup.deadlines, sup.current
    active = dl.active(now) if watching else []
    pids = cur.announced_refs() if cur else {}
    stragglers = cur.stragglers.status() if cur else {}
    return [{"rank": r, "pid": pids[r].pid if r in pids else tr.pid, "phase": tr.phase,
             "phase_age_s": round(now - tr.phase_since, 3), "phase_budget_s": tr.phase_budget, "step": tr.step,
             "last_beat_age_s": round(now - tr.last_line_at, 3), "stopped": tr.stopped,
             "deadlines": [d for d in active if d["rank"] == r], "straggler": stragglers.get(r)}
            for r, tr in sorted(dl.ranks.items())]
