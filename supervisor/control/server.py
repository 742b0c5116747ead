"""The control socket server: non-blocking, driven from the supervisor's loop by `poll(handler)`.

The supervisor has no threads, so `poll` never blocks.  It accepts whoever is waiting, reads what
has arrived, answers every complete line through `handler(request)` and writes as much of the
replies as the peer will take (the rest stays buffered).  A silent, slow or hostile client therefore
costs the loop nothing and never delays the others.  Replies go out in request order.

A handler may return a `Pending` instead of a reply (a `dump` waits for stack files to settle): the
client then waits, its later lines stay queued, and every `poll` asks the pending reply whether it is
ready; the idle timeout still bounds the wait.  The loop never sleeps for a reply.

The server answers by itself — without calling the handler — a line that is not JSON, not an
object or has no "cmd"; a line longer than `max_request_bytes` (and then hangs up, since the rest of
the stream cannot be trusted: conversation.py); and any request from a peer whose SO_PEERCRED uid is
neither ours nor root (nor, with a configured group, a member of it: peer.py).  The socket file itself
is never reachable by others, even for an instant (listener.py).
"""
from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import structlog

from hangwatch.supervisor.control.conversation import Conversation
from hangwatch.supervisor.control.listener import open_listener
from hangwatch.supervisor.control.paths import record_socket_path, socket_path_for
from hangwatch.supervisor.control.peer import PeerPolicy, peer_credentials
from hangwatch.supervisor.control.wire import Handler

IDLE_TIMEOUT_S = 30.0
MAX_CLIENTS = 128
MAX_PENDING_REPLY_BYTES = 8 * 1024 * 1024  # stop reading from a client that does not read its replies

log = structlog.get_logger("hangwatch.control")


@dataclass(eq=False, kw_only=True)
class _Client(Conversation):
    sock: socket.socket
    last_active: float
    lingering: bool = False  # replies out and our side shut: draining the peer's input until it closes


class ControlServer:
    """Non-blocking control socket server, driven by `poll(handler)` from the supervisor loop."""

    def __init__(
        self,
        path: os.PathLike | str,
        *,
        max_request_bytes: int = 65536,
        group: Optional[str] = None,
        run_dir: Optional[os.PathLike | str] = None,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        policy: Optional[PeerPolicy] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(path)
        self.max_request_bytes = max_request_bytes
        self.idle_timeout_s = idle_timeout_s
        self.policy = policy or PeerPolicy.for_group(group)
        self._clock = clock
        self._clients: set[_Client] = set()
        self._sel = selectors.DefaultSelector()
        self._listener = open_listener(self.path, self.policy)
        self._ino = os.stat(self.path).st_ino
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        if run_dir is not None:
            record_socket_path(run_dir, self.path)

    # ---- the loop's entry point --------------------------------------------------------------

    def poll(self, handler: Handler) -> None:
        """Accept, read, answer and write whatever can be done right now; never blocks."""
        now = self._clock()
        for key, mask in self._sel.select(timeout=0):
            if key.data is None:
                self._accept(now, handler)
                continue
            client: _Client = key.data
            if client not in self._clients:
                continue
            if mask & selectors.EVENT_READ:
                self._read(client, now, handler)
            if client in self._clients and mask & selectors.EVENT_WRITE:
                self._flush(client, now)
        for client in list(self._clients):
            if client.pending is not None and client.resolve(now, handler):
                self._flush(client, now)
            if client in self._clients:
                self._settle(client, now)

    @property
    def connected(self) -> int:
        """Clients connected right now (waiting ones included)."""
        return len(self._clients)

    def unsent_bytes(self) -> int:
        """Reply bytes answered but not yet taken by their clients."""
        return sum(len(c.outbuf) for c in tuple(self._clients))

    def close(self) -> None:
        """Hang up on every client and remove the socket file (only if it is still ours)."""
        for client in list(self._clients):
            self._drop(client)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        self._listener.close()
        self._sel.close()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._ino:
                os.unlink(self.path)

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- per connection ------------------------------------------------------------------------

    def _accept(self, now: float, handler: Handler) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: try again on the next pass
                log.warning("control accept failed", error=str(exc))
                return
            sock.setblocking(False)
            try:
                peer = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            client = _Client(peer=peer, max_request_bytes=self.max_request_bytes, sock=sock, last_active=now)
            self._clients.add(client)
            self._sel.register(sock, selectors.EVENT_READ, client)
            refusal = self.policy.refusal(peer)
            if refusal is not None:
                log.warning("control client refused", peer_uid=peer.uid, peer_pid=peer.pid, reason=refusal)
                client.refuse(refusal)
            elif len(self._clients) > MAX_CLIENTS:
                client.refuse(f"busy: more than {MAX_CLIENTS} control clients connected")
            else:
                self._read(client, now, handler)  # a client usually writes at once: answer in this pass

    def _read(self, client: _Client, now: float, handler: Handler) -> None:
        try:
            data = client.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(client)
            return
        if data and not client.hangup:
            client.last_active = now
        client.received(data)
        if client.lingering:
            if client.eof:
                self._drop(client)
            return
        client.process(handler)
        self._flush(client, now)

    def _flush(self, client: _Client, now: float) -> None:
        while client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno not in (errno.EPIPE, errno.ECONNRESET):
                    log.warning("control send failed", error=str(exc))
                self._drop(client)
                return
            del client.outbuf[:sent]
            client.last_active = now
        if client.hangup and not client.outbuf:
            self._linger(client)
            return
        # Stop reading from a client that does not read its replies, or that waits for one: what it
        # sends meanwhile stays in the kernel's buffer, not ours.
        reading = len(client.outbuf) <= MAX_PENDING_REPLY_BYTES and client.pending is None
        self._watch(client, (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0))

    def _settle(self, client: _Client, now: float) -> None:
        """Close finished and idle connections."""
        if client.outbuf:
            self._flush(client, now)
        if client not in self._clients:
            return
        if client.hangup and not client.outbuf:
            self._linger(client)
        if client in self._clients and now - client.last_active > self.idle_timeout_s:
            log.info("control client timed out", peer_uid=client.peer.uid, peer_pid=client.peer.pid,
                     idle_s=round(now - client.last_active, 1), waiting_for=client.pending_cmd or None)
            self._drop(client)

    def _linger(self, client: _Client) -> None:
        """Replies are out: send EOF, then read and discard until the peer closes.

        Closing at once while the peer's unread request sits in our buffer makes the kernel reset
        the connection, and the peer would lose the error reply it was meant to read.
        """
        if client.eof:
            self._drop(client)
            return
        if not client.lingering:
            client.lingering = True
            with contextlib.suppress(OSError):
                client.sock.shutdown(socket.SHUT_WR)
            self._watch(client, selectors.EVENT_READ)

    def _watch(self, client: _Client, events: int) -> None:
        """Select `events` on the client's socket; none at all means not registered (selectors refuse 0)."""
        try:
            current = self._sel.get_key(client.sock).events
        except KeyError:
            current = 0
        if events == current:
            return
        if not events:
            self._sel.unregister(client.sock)
        elif not current:
            self._sel.register(client.sock, events, client)
        else:
            self._sel.modify(client.sock, events, client)

    def _drop(self, client: _Client) -> None:
        self._clients.discard(client)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(client.sock)
        with contextlib.suppress(OSError):
            client.sock.shutdown(socket.SHUT_RDWR)
        client.sock.close()


def make_control(cfg, run_dir: Optional[os.PathLike | str] = None) -> ControlServer:
    """The `control_factory` the supervisor takes: the socket the config asks for."""
    run_dir = cfg.run_dir if run_dir is None else run_dir
    return ControlServer(
        socket_path_for(cfg, run_dir),
        max_request_bytes=cfg.control.max_request_bytes,
        group=cfg.control.group,
        run_dir=run_dir,
    )
