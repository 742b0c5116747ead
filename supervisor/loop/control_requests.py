"""The control-socket requests: the desk that answers them, the `dump` in flight, the incidents query.

A request is handled while the loop drains its events, by the `Desk` (which reads the loop's situation and
writes only the `Intents` record), so it only *records* what was asked — the stop, pause or restart intent,
a pending `restart now`, a pending `dump` — and the loop's reconcile step acts on it in the same pass.
Most requests are answered at once.  `dump` is answered later: its handler returns a `DumpRequest`,
which the control server holds (it has `ready(now)` and `reply()`) while the loop signals the ranks and
waits, pass by pass, for their dump files to settle; the loop never sleeps for it.  During a stall the
request shares the episode's own dumps instead of signalling again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import structlog

from hangwatch.supervisor.escalation.dump_collector import DumpCollector
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import DumpTarget, alive
from hangwatch.supervisor.processes.process import ProcessTable
from hangwatch.supervisor.read_model import view as views
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.states import State

from .intents import Intents

if TYPE_CHECKING:
    from hangwatch.supervisor.concerns import PassState
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.read_model.view import View

log = structlog.get_logger("hangwatch")

MIN_DUMP_GRACE_S = 0.5  # an operator's dump waits at least this long for the files to settle


class DumpRequest:
    """A `dump` in flight: answered once the dump files have settled (the server polls `ready`)."""

    def __init__(
        self, table: ProcessTable, grace_s: float, targets: list[DumpTarget] = (), episode: Optional["Episode"] = None
    ):
        self.episode = episode  # share a stall's dumps instead of signalling the ranks a second time
        self.collector = (
            None if episode is not None else DumpCollector(list(targets), grace_s=grace_s, table=table, py_spy=False)
        )
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
        self.answer = {
            "ok": True,
            "result": {
                "dumps": {str(r): t for r, t in dc.texts().items()},
                "signalled": {str(r): ok for r, ok in dc.signalled.items()},
            },
        }


Reply = Union[dict, DumpRequest]
Handler = Callable[[dict, float], Reply]


def dispatch(req: Any, handlers: dict[str, Handler], now: float) -> Reply:
    """`req` to the handler its `cmd` names: a reply, or a `DumpRequest` to be answered in a later pass.
    Never raises: a bad request gets an error reply, a failing handler too."""
    if not isinstance(req, dict):
        return {"ok": False, "error": f"request must be a JSON object, got {type(req).__name__}"}
    cmd = req.get("cmd")
    handler = handlers.get(cmd) if isinstance(cmd, str) else None
    if handler is None:
        return {"ok": False, "error": f"unknown command {cmd!r} (known: {', '.join(handlers)})"}
    try:
        return handler(req, now)
    except Exception as exc:  # a bad request must never take the supervisor down
        log.exception("request_failed", cmd=cmd)
        return {"ok": False, "error": f"{cmd} failed: {type(exc).__name__}: {exc}"}


def incidents_reply(store: IncidentStore, ident: Any) -> dict:
    """`incidents`: the list, or the one `id` names."""
    if ident is None:
        return {"ok": True, "result": store.list()}
    found = store.get(str(ident))
    if found is None:
        known = ", ".join(i["id"] for i in store.list()) or "none yet"
        return {"ok": False, "error": f"no incident {ident!r} (known: {known})"}
    return {"ok": True, "result": found}


class Desk:
    """The handler of each control request.  `where()`: the loop's situation now; `view(now)`: the read model, built
    for the reply; `persist(now)`: state.json written at once (a pause must outlive this supervisor from the moment
    it is accepted); `attempt()`: the current attempt's number."""

    def __init__(
        self,
        intents: Intents,
        table: ProcessTable,
        incidents: IncidentStore,
        dump_grace_s: float,
        *,
        where: Callable[[], "PassState"],
        view: Callable[[float], "View"],
        persist: Callable[[float], None],
        attempt: Callable[[], int],
        ask_stop: Callable[[str], None],
    ):
        self.intents = intents
        self.table = table
        self.incidents = incidents
        self.dump_grace_s = dump_grace_s
        self.where, self.view, self.persist, self.attempt, self.ask_stop = where, view, persist, attempt, ask_stop
        self.dumps: list[DumpRequest] = []  # `dump`s in flight, advanced by the loop once a pass
        self.handlers: dict[str, Handler] = {
            "status": self.status,
            "restart": self.restart,
            "stop": self.stop_run,
            "pause": self.pause,
            "resume": self.resume,
            "dump": self.dump,
            "incidents": self.incidents_query,
        }

    def handle(self, req: Any, now: float) -> Reply:
        return dispatch(req, self.handlers, now)

    def advance(self, now: float, episode: Optional["Episode"]) -> None:
        """The loop's pass: the dumps in flight move on; those answered are dropped."""
        self.dumps = [r for r in self.dumps if not r.advance(now, episode)]

    def status(self, req: dict, now: float) -> dict:
        return {"ok": True, "result": views.status_reply(self.view(now))}

    def restart(self, req: dict, now: float) -> dict:
        mode = req.get("mode", "graceful")
        if mode not in ("graceful", "now"):
            return {"ok": False, "error": f"restart mode must be 'graceful' or 'now', got {mode!r}"}
        at = self.where()
        busy = self.intents.busy(at.state)
        if busy:
            return {"ok": False, "error": busy}
        st = at.state
        self.intents.after_teardown = Intent.RESTART
        if st.escalating:
            return {
                "ok": True,
                "result": {"accepted": "restart", "mode": mode, "note": f"restarting after the current {st.value}"},
            }
        if st in (State.BACKOFF, State.PAUSED) or not alive(at.attempt):
            return {
                "ok": True,
                "result": {"accepted": "restart", "mode": mode, "note": f"starting a worker now (was {st.value})"},
            }
        if mode == "now":
            self.intents.escalate_now = True  # the loop dumps and kills; a graceful restart asks the worker to stop
        return {"ok": True, "result": {"accepted": "restart", "mode": mode, "attempt": self.attempt()}}

    def stop_run(self, req: dict, now: float) -> dict:
        st = self.where().state
        if st.final:
            return {"ok": False, "error": f"the run is over (state {st.value})"}
        self.ask_stop("control request")
        return {"ok": True, "result": {"accepted": "stop", "state": st.value}}

    def pause(self, req: dict, now: float) -> dict:
        st = self.where().state
        busy = self.intents.busy(st)
        if busy:
            return {"ok": False, "error": busy}
        if st is State.PAUSED:
            return {"ok": True, "result": {"accepted": "pause", "note": "already paused"}}
        self.intents.after_teardown = Intent.PAUSE
        self.persist(now)  # the pause must survive this supervisor from now on
        return {"ok": True, "result": {"accepted": "pause", "state": st.value}}

    def resume(self, req: dict, now: float) -> dict:
        st = self.where().state
        if st is not State.PAUSED and self.intents.after_teardown is not Intent.PAUSE:
            return {"ok": False, "error": f"not paused (state {st.value})"}
        # paused, or a pause still under way: either way a worker runs again once nothing is left of the old one
        self.intents.after_teardown = Intent.RESTART
        self.persist(now)
        return {"ok": True, "result": {"accepted": "resume"}}

    def dump(self, req: dict, now: float) -> Reply:
        grace_s = max(self.dump_grace_s, MIN_DUMP_GRACE_S)
        at = self.where()
        ep = at.episode
        if at.state in (State.STALLED, State.DUMPING) and ep is not None and ep.incident is not None:
            pending = DumpRequest(self.table, grace_s, episode=ep)
        else:
            targets = at.attempt.dump_targets() if alive(at.attempt) else []
            if not targets:
                return {
                    "ok": False,
                    "error": f"no running worker process announced a dump signal (state {at.state.value})",
                }
            pending = DumpRequest(self.table, grace_s, targets)
        self.dumps.append(pending)
        return pending

    def incidents_query(self, req: dict, now: float) -> dict:
        return incidents_reply(self.incidents, req.get("id"))
