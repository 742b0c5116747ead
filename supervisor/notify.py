"""systemd notification protocol (sd_notify) with the standard library only.

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
import socket
import time
from typing import Callable, MutableMapping, Optional

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
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
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

