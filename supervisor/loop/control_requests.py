"""The control-socket requests: dispatch, the `dump` in flight, the incidents query.

A request is handled while the loop drains its events, by the `Supervisor`'s own handler for it (the
loop's state has one owner), so it only *records* what was asked — the stop, pause or restart intent,
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
from hangwatch.supervisor.processes.attempt import DumpTarget
from hangwatch.supervisor.processes.process import ProcessTable

if TYPE_CHECKING:
    from hangwatch.supervisor.escalation.episode import Episode

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
