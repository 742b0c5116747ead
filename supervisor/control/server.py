"""The control socket server: non-blocking, driven from the supervisor's loop by `poll(handler)`.

The supervisor has no threads, so `poll` never blocks.  It accepts whoever is waiting, reads what
has arrived, answers every complete line through `handler(request)` and writes as much of the
replies as the peer will take (the rest stays buffered).  A silent, slow or hostile client therefore
costs the loop nothing and never delays the others.  Replies go out in request order.

A handler may return a `Pending` instead of a reply (a `dump` waits for stack files to settle): the
client then waits, its later lines stay queued, and every `poll` asks the pending reply whether it is
ready; the idle timeout still bounds the wait.  The loop never sleeps for a reply.

The server answers by itself — without calling the handler — an empty line, a line that is not
JSON, not an object or has no "cmd"; a line longer than `max_request_bytes` (and then closes the
connection at once, reading nothing more of it: conversation.py); and any request from a peer whose
SO_PEERCRED uid is neither ours nor root (nor, with a configured group, a member of it: peer.py).
The socket file itself is never reachable by others, even for an instant (listener.py).

The connection table is bounded, overall and per peer process; a newcomer past either bound takes
the place of the oldest idle connection, so a new `status` is answered however many clients sit on
the socket (admission.py).
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import selectors
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import structlog

from hangwatch.supervisor.control.admission import Limits, admit, over_share
from hangwatch.supervisor.control.conversation import Conversation
from hangwatch.supervisor.control.listener import open_listener
from hangwatch.supervisor.control.paths import record_socket_path, socket_path_for
from hangwatch.supervisor.control.peer import PeerPolicy, peer_credentials
from hangwatch.supervisor.control.wire import Handler

IDLE_TIMEOUT_S = 30.0
LINGER_S = 2.0  # how long a connection we hung up on may take to close its end before we close ours
EVICTION_LOG_EVERY_S = 60.0  # evictions come in floods: one line for the first, then a count at most this often
MAX_PENDING_REPLY_BYTES = 8 * 1024 * 1024  # stop reading from a client that does not read its replies

log = structlog.get_logger("hangwatch.control")


@dataclass(eq=False, kw_only=True)
class _Client(Conversation):
    sock: socket.socket
    last_active: float
    accepted: float
    seq: int  # accept order (admission breaks ties with it)
    lingering_since: Optional[float] = None  # replies out and our side shut: draining the peer's input

    @property
    def lingering(self) -> bool:
        return self.lingering_since is not None


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
        limits: Optional[Limits] = None,
        policy: Optional[PeerPolicy] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.path = Path(path)
        self.max_request_bytes = max_request_bytes
        self.idle_timeout_s = idle_timeout_s
        self.limits = limits or Limits.derived()
        self.policy = policy or PeerPolicy.for_group(group)
        self._clock = clock
        self._clients: set[_Client] = set()
        self._seq = itertools.count()
        self._evicted_unlogged = 0
        self._over_share = False  # a process was let past its share while its newest connections arrive
        self._evictions_logged_at = float("-inf")
        self._sel = selectors.DefaultSelector()
        self._listener = open_listener(self.path, self.policy)
        self._ino = os.stat(self.path).st_ino
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        if run_dir is not None:
            record_socket_path(run_dir, self.path)

    # ---- the loop's entry point --------------------------------------------------------------

    def fileno(self) -> int:
        """Readable whenever `poll()` has work (a connection, a request, room to write): the selector's own fd, so
        the supervisor's loop wakes for a request at once instead of on its next deadline."""
        return self._sel.fileno()

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
        if self._over_share:
            self._trim_shares(now)
        self._note_evictions(0, now)

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
        self._note_evictions(0, None)
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
            client = _Client(
                peer=peer,
                max_request_bytes=self.max_request_bytes,
                sock=sock,
                last_active=now,
                accepted=now,
                seq=next(self._seq),
            )
            refusal = self.policy.refusal(peer)
            if refusal is not None:
                log.warning("control client refused", peer_uid=peer.uid, peer_pid=peer.pid, reason=refusal)
                self._admit_refused(client, refusal, now, abandon=False)
                continue
            admission = admit(peer, tuple(self._clients), self.limits, now)
            self._over_share = self._over_share or admission.over_share
            if admission.refusal is not None:
                log.warning("control client refused", peer_uid=peer.uid, peer_pid=peer.pid, reason=admission.refusal)
                # Nobody can make room, so this one takes none: it hears why and is closed in this pass.
                self._admit_refused(client, admission.refusal, now, abandon=True)
                continue
            for victim in admission.evict:
                log.debug(
                    "control client evicted",
                    peer_uid=victim.peer.uid,
                    peer_pid=victim.peer.pid,
                    idle_s=round(now - victim.last_active, 1),
                    for_pid=peer.pid,
                )
                self._drop(victim)
            self._note_evictions(len(admission.evict), now)
            self._clients.add(client)
            self._sel.register(sock, selectors.EVENT_READ, client)
            self._read(client, now, handler)  # a client usually writes at once: answer in this pass

    def _trim_shares(self, now: float) -> None:
        """Give back what a process holds past its share, once its young connections have asked or aged."""
        evict, self._over_share = over_share(tuple(self._clients), self.limits, now)
        for victim in evict:
            log.debug(
                "control client evicted",
                peer_uid=victim.peer.uid,
                peer_pid=victim.peer.pid,
                idle_s=round(now - victim.last_active, 1),
                why="over its process's share",
            )
            self._drop(victim)
        self._note_evictions(len(evict), now)

    def _note_evictions(self, n: int, now: Optional[float]) -> None:
        """Count evictions; say so at once after a quiet spell, then at most every EVICTION_LOG_EVERY_S
        (now=None: say what is left to say)."""
        self._evicted_unlogged += n
        if not self._evicted_unlogged or (now is not None and now - self._evictions_logged_at < EVICTION_LOG_EVERY_S):
            return
        log.info(
            "control clients evicted",
            count=self._evicted_unlogged,
            why="connection table full or a process at its share; the oldest idle ones made room",
            limits=f"{self.limits.max_clients} in all, {self.limits.max_per_peer} per process",
        )
        self._evicted_unlogged = 0
        if now is not None:
            self._evictions_logged_at = now

    def _admit_refused(self, client: _Client, why: str, now: float, *, abandon: bool) -> None:
        """Tell `client` why it is refused; the flush then lingers on it or closes it."""
        self._clients.add(client)
        self._sel.register(client.sock, selectors.EVENT_READ, client)
        client.refuse(why, abandon=abandon)
        self._flush(client, now)

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
            self._linger(client, now)
            return
        # Stop reading from a client that does not read its replies, or that waits for one, or that we
        # are done with: what it sends meanwhile stays in the kernel's buffer, not ours.
        reading = len(client.outbuf) <= MAX_PENDING_REPLY_BYTES and client.pending is None and not client.abandon
        self._watch(client, (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0))

    def _settle(self, client: _Client, now: float) -> None:
        """Close finished and idle connections."""
        if client.outbuf:
            self._flush(client, now)
        if client not in self._clients:
            return
        if client.hangup and not client.outbuf:
            self._linger(client, now)
        if client in self._clients and client.lingering and now - client.lingering_since > LINGER_S:
            self._drop(client)  # it has its replies; a peer that keeps sending gets no more of our time
        if client in self._clients and now - client.last_active > self.idle_timeout_s:
            # A silent client timing out is routine (and comes by the hundred in a flood); one that
            # gave up waiting for a reply is worth a line.
            waiting_for = client.pending_cmd if client.pending is not None else None
            note = log.info if waiting_for else log.debug
            note(
                "control client timed out",
                peer_uid=client.peer.uid,
                peer_pid=client.peer.pid,
                idle_s=round(now - client.last_active, 1),
                waiting_for=waiting_for,
            )
            self._drop(client)

    def _linger(self, client: _Client, now: float) -> None:
        """Replies are out: send EOF, then read and discard until the peer closes (at most LINGER_S).

        Closing while the peer's unsent or unread request is still on its way makes the kernel reset
        the connection; the reply already sent stays readable, but the peer sees a reset, not an end.
        A connection abandoned (a flood) is closed at once all the same: its peer gets the reset.
        """
        if client.eof or client.abandon:
            self._drop(client)
            return
        if not client.lingering:
            client.lingering_since = now
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
