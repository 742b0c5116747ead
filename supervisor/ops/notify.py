"""Telling the outside from the supervisor's loop: systemd (sd_notify), the ops listeners, the off-loop outbox.

`Notifier` speaks systemd's notification protocol with the standard library only; `Fanout` hands the
loop's notifications (ready, status, the once-a-pass `watchdog`, stopping) to several listeners — systemd's
and the operations side's (alerts, dead-man's ping, metrics: `supervisor.app.Ops`); `Outbox` does slow
deliveries (HTTP, a command) on a thread of its own so that the loop never waits for them.

Under a `Type=notify` unit systemd sets `NOTIFY_SOCKET` (a datagram socket path, or an abstract
name written with a leading '@') and, with `WatchdogSec=`, `WATCHDOG_USEC`.  The supervisor says
`READY=1` once its control socket is up, `STATUS=...` as the run moves, `WATCHDOG=1` from its main
loop (so a wedged supervisor is restarted by systemd) and `STOPPING=1` on the way out.  Outside
systemd every call is a no-op.

The variables are removed from `os.environ` when read from it, so the worker (which the supervisor
starts with its own environment) never inherits them and cannot speak for the service.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time
from collections import Counter
from typing import Any, Callable, MutableMapping, Optional

import structlog

log = structlog.get_logger("hangwatch")

NOTIFY_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends sd_notify datagrams to `address`; with no address every method does nothing."""

    def __init__(
        self,
        address: Optional[str] = None,
        *,
        watchdog_usec: Optional[int] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.address = address or None
        # systemd asks for a ping at least every WATCHDOG_USEC; pinging at half of it leaves a margin
        # for one slow loop pass without flooding the manager from a 0.25 s loop.
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec else None
        self._clock = clock
        self._last_watchdog: Optional[float] = None
        self._last_status: Optional[str] = None
        self._sock: Optional[socket.socket] = None
        self.errors = 0
        self.last_error: Optional[str] = None

    @classmethod
    def from_env(cls, environ: Optional[MutableMapping[str, str]] = None, *, unset: bool = True, **kw) -> "Notifier":
        """Read NOTIFY_SOCKET / WATCHDOG_USEC / WATCHDOG_PID (and drop them from the environment)."""
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        usec = _int_or_none(env.get("WATCHDOG_USEC"))
        wd_pid = _int_or_none(env.get("WATCHDOG_PID"))
        if wd_pid is not None and wd_pid != os.getpid():
            usec = None  # the watchdog is meant for another process
        if unset:
            for name in NOTIFY_VARS:
                env.pop(name, None)
        return cls(address, watchdog_usec=usec, **kw)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *assignments: str) -> bool:
        """Send `KEY=value` lines in one datagram; False when not under systemd or the send failed."""
        if self.address is None:
            return False
        payload = ("\n".join(assignments) + "\n").encode()
        addr = "\0" + self.address[1:] if self.address.startswith("@") else self.address
        try:
            if self._sock is None:
                # Non-blocking: with the manager's queue full, sendto would stall the supervisor loop,
                # and the loop must keep watching the worker; a dropped message is the lesser harm.
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._sock.sendto(payload, addr)
            return True
        except OSError as exc:
            # systemd may be busy or restarting (daemon-reexec); a lost notification must never stop the run.
            self.errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False

    def ready(self, status: Optional[str] = None) -> bool:
        lines = ["READY=1", f"MAINPID={os.getpid()}"]
        if status is not None:
            lines.append("STATUS=" + _one_line(status))
            self._last_status = status
        return self.send(*lines)

    def status(self, text: str) -> bool:
        """STATUS=text, sent only when it differs from the last one."""
        if text == self._last_status:
            return False
        self._last_status = text
        return self.send("STATUS=" + _one_line(text))

    def watchdog(self, now: Optional[float] = None) -> bool:
        """WATCHDOG=1, at most once per WATCHDOG_USEC/2; no-op without a watchdog."""
        if self.address is None or self.watchdog_interval_s is None:
            return False
        now = self._clock() if now is None else now
        if self._last_watchdog is not None and now - self._last_watchdog < self.watchdog_interval_s:
            return False
        self._last_watchdog = now
        return self.send("WATCHDOG=1")

    def stopping(self, status: Optional[str] = None) -> bool:
        lines = ["STOPPING=1"]
        if status is not None:
            lines.append("STATUS=" + _one_line(status))
        return self.send(*lines)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class NullNotifier:
    """Outside systemd, or when a caller wants no notifications: the same calls, doing nothing."""

    def ready(self, status: Optional[str] = None) -> bool:
        return False

    def status(self, text: str) -> bool:
        return False

    def watchdog(self, now: Optional[float] = None) -> bool:
        return False

    def stopping(self, status: Optional[str] = None) -> bool:
        return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _int_or_none(value: Optional[str]) -> Optional[int]:
    try:
        return int(value) if value else None
    except ValueError:
        return None


class Fanout:
    """Several notifiers as one: each call reaches every listener, one failing listener never stops the others."""

    def __init__(self, *listeners: Any):
        self.listeners = [x for x in listeners if x is not None]

    def _each(self, what: str, *args) -> bool:
        sent = False
        for x in self.listeners:
            try:
                sent = bool(getattr(x, what)(*args)) or sent
            except Exception:  # a listener is a courtesy: the loop goes on
                log.exception("notify_failed", what=what, listener=type(x).__name__)
        return sent

    def ready(self, status: Optional[str] = None) -> bool:
        return self._each("ready", status)

    def status(self, text: str) -> bool:
        return self._each("status", text)

    def watchdog(self, now: Optional[float] = None) -> bool:
        return self._each("watchdog", now)

    def next_due_s(self, now: float) -> Optional[float]:
        """The soonest a listener wants its next `watchdog` call (a ping, systemd's WatchdogSec), or None."""
        due = []
        for x in self.listeners:
            ask = getattr(x, "next_due_s", None)
            value = ask(now) if callable(ask) else getattr(x, "watchdog_interval_s", None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                due.append(float(value))
        return min(due) if due else None

    def stopping(self, status: Optional[str] = None) -> bool:
        return self._each("stopping", status)


class Stats:
    """Counters several threads add to (alerts sent/failed per sink, pings, dropped deliveries); read by metrics."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: Counter = Counter()

    def add(self, name: str, label: str = "", n: int = 1) -> None:
        with self._lock:
            self._counts[(name, label)] += n

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


_STOP = object()


class Outbox:
    """Slow deliveries off the loop: a daemon thread works through a bounded queue.

    `put` never blocks — a full queue drops the item and counts it (`<name>_dropped`): a dead endpoint
    must cost the loop nothing, not even memory.  `setup` runs first on the thread (a slow import, a
    plugin scan); when it fails, every item is dropped and counted.  `close` lets the thread finish
    what is queued, for at most `timeout_s`: a supervisor never waits longer than that on its way out.
    `batch`: `deliver` is handed a list of everything queued by then (a delivery that costs seconds whatever
    it carries — a tracker report's helper process — carries all that waited).
    """

    def __init__(
        self,
        name: str,
        deliver: Callable[[Any], None],
        *,
        maxsize: int = 64,
        stats: Optional[Stats] = None,
        setup: Optional[Callable[[], Any]] = None,
        batch: bool = False,
    ):
        self.name = name
        self._deliver = deliver
        self._batch = batch
        self._setup = setup
        self._q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.stats = stats if stats is not None else Stats()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hangwatch-{name}", daemon=True)
        self.broken: Optional[str] = None

    def start(self) -> "Outbox":
        self._thread.start()
        return self

    def put(self, item: Any) -> bool:
        try:
            self._q.put_nowait(item)
            return True
        except queue.Full:
            self.stats.add(f"{self.name}_dropped")
            return False

    def idle(self) -> bool:
        """Nothing queued and nothing being delivered (a ping is not queued behind a slow one)."""
        return self._q.empty() and not self._busy.is_set()

    def _run(self) -> None:
        if self._setup is not None:
            try:
                self._setup()
            except Exception as exc:
                self.broken = str(exc)
                log.error("outbox_setup_failed", outbox=self.name, error=str(exc))
        stopping = False
        while not stopping:
            item = self._q.get()
            if item is _STOP:
                return
            if self._batch:
                item = [item]
                while True:
                    try:
                        more = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if more is _STOP:
                        stopping = True  # what came before the stop still goes
                        break
                    item.append(more)
            if self.broken is not None:
                self.stats.add(f"{self.name}_dropped", n=len(item) if self._batch else 1)
                continue
            self._busy.set()
            try:
                self._deliver(item)
            except Exception:  # the deliverer logs its own failures; this is the last net
                log.exception("outbox_delivery_failed", outbox=self.name)
            finally:
                self._busy.clear()

    def close(self, timeout_s: float) -> bool:
        """Stop after what is queued, waiting at most `timeout_s`; True when everything was delivered."""
        if not self._thread.is_alive():
            return self._q.empty()
        deadline = time.monotonic() + timeout_s
        try:
            self._q.put(_STOP, timeout=max(timeout_s, 0.01))
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


# Processes the ops side started (an `alerts.command`): children of the supervisor that belong to no
# worker's tree.  The tree scan must not adopt them as orphans of a worker (supervisor.attempt.adopted).
helper_pids: set[int] = set()
