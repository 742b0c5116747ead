"""The peer link's way to the store: TCPStore on a thread of its own, every call bounded in time.

Hosting when the endpoint is this machine's (the first helper to bind the port hosts; another one on the same
machine becomes a client), else a client; `AsyncConnect` keeps the command loop from ever waiting for the torch
import or a handshake, `Bounded` keeps a frozen host from wedging a call (see `Bounded`).
"""

from __future__ import annotations

import socket
import threading
from typing import Any, Callable

from hangwatch.daemon.peerlink import Pending


def call_bounded(fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """fn() on a thread of its own, waited for at most timeout_s (TimeoutError after; the thread is abandoned)."""
    box: dict = {}

    def run():
        try:
            box["v"] = fn()
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            box["e"] = e

    t = threading.Thread(target=run, daemon=True, name=f"peerlink-{what}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"store {what} got no answer within {timeout_s:g}s")
    if "e" in box:
        raise box["e"]
    return box["v"]


class Bounded:
    """A store whose every call returns within timeout_s.  A TCPStore client's compare_set/get on a host that
    is frozen (SIGSTOP, a partition) waits forever (torch 2.13: its timeout does not cover them), so each call
    runs on its own thread; after one call timed out the connection is unusable (a late answer would be read
    as the next call's), so every later call fails at once and the caller reconnects."""

    def __init__(self, store: Any, timeout_s: float):
        self.store, self.timeout_s, self.broken = store, timeout_s, None

    def __getattr__(self, name: str) -> Callable:
        fn = getattr(self.store, name)

        def call(*args):
            if self.broken:
                raise TimeoutError(self.broken)
            try:
                return call_bounded(lambda: fn(*args), self.timeout_s, name)
            except TimeoutError as e:
                self.broken = str(e)
                raise

        return call


def local_addresses() -> set[str]:
    try:
        import psutil

        return {
            a.address.split("%")[0]
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)
        }
    except Exception:  # noqa: BLE001 — best effort; loopback and names still count
        return set()


def resolve(host: str) -> list[str]:
    try:
        return sorted({ai[4][0] for ai in socket.getaddrinfo(host, None)})
    except OSError:
        return []


def make_connect(host: str, port: int, mode: str, eligible: bool, timeout_s: float) -> Callable[[], tuple[Any, str]]:
    def connect() -> tuple[Any, str]:
        import datetime

        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=timeout_s)
        if mode == "always" or (mode == "auto" and eligible):
            try:  # binding fails at once when another process (a node on this machine) hosts it
                return TCPStore(
                    host, port, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timeout
                ), "host"
            except Exception:  # noqa: BLE001
                if mode == "always":
                    raise
        # a plain connect first: refused fails at once, where TCPStore would retry for seconds
        socket.create_connection((host, port), timeout=timeout_s).close()
        return TCPStore(host, port, is_master=False, timeout=timeout), "client"

    return AsyncConnect(connect, timeout_s)


class AsyncConnect:
    """connect() on a thread of its own, so that the command loop never waits for it (the torch import, a
    handshake with a frozen host that waits out TCPStore's retries).  Each call picks up a finished attempt
    (its store wrapped in Bounded) or starts one and raises Pending while it runs."""

    def __init__(self, connect: Callable[[], tuple[Any, str]], timeout_s: float):
        self.connect, self.timeout_s, self.thread, self.box = connect, timeout_s, None, {}

    def _run(self, box: dict) -> None:
        try:
            box["v"] = self.connect()
        except BaseException as e:  # noqa: BLE001 — handed to the caller
            box["e"] = e

    def __call__(self) -> tuple[Any, str]:
        if self.thread is None:
            self.box = {}
            self.thread = threading.Thread(target=self._run, args=(self.box,), daemon=True, name="peerlink-connect")
            self.thread.start()
            self.thread.join(0.05)  # hosting, or a live host, answers in milliseconds
        if self.thread.is_alive():
            raise Pending("connecting")
        self.thread = None
        if "e" in self.box:
            raise self.box["e"]
        store, role = self.box["v"]
        return Bounded(store, self.timeout_s), role
