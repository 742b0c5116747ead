"""What a pass tells the outside once it settled: systemd (READY once, the watchdog ping, the status line when it
says something new), state.json (`state_file`), and the listeners (the ops side), all from the one read model the
pass built.  Each is a courtesy the run must survive: a failing notifier or listener is logged, never raised."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional

import structlog

from hangwatch.supervisor.read_model import view as views

if TYPE_CHECKING:
    from hangwatch.supervisor.read_model.view import View

    from .state_file import StateFile

log = structlog.get_logger("hangwatch")

STATUS_NOTE_S = 10.0  # the status line is sent when it says something new, and at least this often
_STEP = re.compile(r"step \d+(/\d+)?")


class Outward:
    def __init__(self, notifier: Any, listeners: tuple, state: "StateFile"):
        self.notifier, self.listeners, self.state = notifier, listeners, state
        self._ready_sent = False
        self._note: Optional[str] = None  # the status line last sent, its step left out
        self._note_at = float("-inf")

    def notify(self, what: str, *args) -> None:
        try:
            getattr(self.notifier, what)(*args)
        except Exception:  # systemd notification is a courtesy: never fatal
            log.exception("notify_failed", what=what)

    def ready(self) -> None:
        """systemd hears READY once (the first worker runs)."""
        if not self._ready_sent:
            self._ready_sent = True
            self.notify("ready")

    def pass_settled(self, v: "View", why: Optional[str], now: float, final: bool = False) -> None:
        """The pass's end: ping, the status line, state.json, the listeners."""
        if not final:
            self.notify("watchdog", now)
        line = views.status_line(v)
        key = _STEP.sub("step", line)
        if key != self._note or now - self._note_at >= STATUS_NOTE_S:
            self._note, self._note_at = key, now
            self.notify("status", line)
        self.state.keep(v, why, now, force=final)
        for listener in self.listeners:
            try:
                listener.pass_done(v, now)
            except Exception:  # an observer must never take the loop down
                log.exception("listener_failed", listener=type(listener).__name__)

    def next_due_s(self, now: float) -> Optional[float]:
        """Seconds until the notifier wants its next `watchdog` call (systemd's WatchdogSec, a ping), if it says."""
        due = getattr(self.notifier, "next_due_s", None)
        try:
            value = due(now) if callable(due) else getattr(self.notifier, "watchdog_interval_s", None)
        except Exception:  # a courtesy: never a reason to stop the loop
            return None
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
