"""The control socket: a Unix stream socket speaking newline-delimited JSON.

One request per line, one reply per request, in order:

    → {"cmd": "status"}
    ← {"ok": true, "result": {...}}
    ← {"ok": false, "error": "..."}

The supervisor has no threads, so the server is driven from its main loop: `poll(handler)` never
blocks.  It accepts whoever is waiting, reads what has arrived, answers every complete line through
`handler(request) -> reply` and writes as much of the replies as the peer will take (the rest stays
buffered).  A silent, slow or hostile client therefore costs the loop nothing and never delays the
others.

The server answers by itself — without calling the handler — a line that is not JSON, not an
object or has no "cmd"; a line longer than `max_request_bytes` (and then hangs up, since the rest of
the stream cannot be trusted); and any request from a peer whose SO_PEERCRED uid is neither ours nor
root (nor, with a configured group, a member of it).  The socket is created mode 0600 (0660 with a
group) under a restrictive umask, so it is never reachable by others even for an instant.

Requests are JSON only: nothing a client sends is ever unpickled or evaluated.
"""
from __future__ import annotations

import contextlib
import errno
import grp
import json
import math
import os
import pwd
import selectors
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

import structlog

DEFAULT_SOCKET_NAME = "hangwatch.sock"
SOCKET_PATH_FILE = "socket-path"  # in the run dir, when the socket lives elsewhere
IDLE_TIMEOUT_S = 30.0
MAX_CLIENTS = 128
MAX_PENDING_REPLY_BYTES = 8 * 1024 * 1024  # stop reading from a client that does not read its replies
_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL

Handler = Callable[[dict], dict]
log = structlog.get_logger("hangwatch.control")


class ControlSocketError(OSError):
    """The control socket cannot be set up (in use by a live supervisor, not a socket, …).

    An OSError, so that whoever opens the control socket treats it like any other failure to bind.
    """


# --------------------------------------------------------------------------------------------
# Where the socket lives


def socket_path_for(cfg, run_dir: Optional[os.PathLike | str] = None, environ: Optional[Mapping[str, str]] = None) -> Path:
    """control.socket when configured; else $RUNTIME_DIRECTORY/hangwatch.sock under systemd; else the run dir's."""
    env = os.environ if environ is None else environ
    if cfg.control.socket:
        return Path(cfg.control.socket)
    runtime = env.get("RUNTIME_DIRECTORY")
    if runtime:
        return Path(runtime.split(":")[0]) / DEFAULT_SOCKET_NAME
    return Path(run_dir if run_dir is not None else cfg.run_dir) / DEFAULT_SOCKET_NAME


def socket_path_in(run_dir: os.PathLike | str) -> Path:
    """The socket of the supervisor that owns `run_dir`: recorded in `socket-path`, else the default."""
    record = Path(run_dir) / SOCKET_PATH_FILE
    try:
        recorded = record.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        recorded = ""
    return Path(recorded) if recorded else Path(run_dir) / DEFAULT_SOCKET_NAME


@contextlib.contextmanager
def unix_address(path: os.PathLike | str) -> Iterator[str]:
    """An address for bind/connect; long paths go through /proc/self/fd so the 107-byte limit never bites."""
    path = str(path)
    if len(os.fsencode(path)) <= _SUN_PATH_MAX:
        yield path
        return
    parent, name = os.path.split(path)
    fd = os.open(parent or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{name}"
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------
# Who may talk to us


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return PeerCred(*struct.unpack("3i", raw))


@dataclass(frozen=True)
class PeerPolicy:
    """Our own uid and root always; with a group, its members (primary or supplementary) too."""

    owner_uid: int
    group_gid: Optional[int] = None
    group_members: frozenset[str] = frozenset()

    @classmethod
    def for_group(cls, group: Optional[str], owner_uid: Optional[int] = None) -> "PeerPolicy":
        owner = os.geteuid() if owner_uid is None else owner_uid
        if group is None:
            return cls(owner)
        try:
            entry = grp.getgrnam(group)
        except KeyError:
            raise ControlSocketError(f"control.group: no such group {group!r}") from None
        return cls(owner, entry.gr_gid, frozenset(entry.gr_mem))

    def refusal(self, cred: PeerCred) -> Optional[str]:
        """None when `cred` may use the socket, else why not."""
        if cred.uid in (0, self.owner_uid):
            return None
        if self.group_gid is not None:
            if cred.gid == self.group_gid:
                return None
            try:
                name = pwd.getpwuid(cred.uid).pw_name
            except KeyError:
                name = None
            if name is not None and name in self.group_members:
                return None
            return f"unauthorised: uid {cred.uid} is neither uid {self.owner_uid} nor in the control group"
        return f"unauthorised: uid {cred.uid} is not uid {self.owner_uid}"


# --------------------------------------------------------------------------------------------
# Wire format


def encode_reply(reply: Any) -> bytes:
    """One JSON line; non-finite floats (a NaN loss) become the strings "NaN"/"Infinity" so strict parsers cope."""
    return (json.dumps(_finite(reply), separators=(",", ":"), default=str, allow_nan=False) + "\n").encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def error_reply(message: str) -> dict:
    return {"ok": False, "error": message}


def parse_request(line: bytes) -> tuple[Optional[dict], Optional[str]]:
    """(request, None) or (None, why it is not one)."""
    try:
        req = json.loads(line)
    except UnicodeDecodeError:
        return None, "request is not UTF-8"
    except ValueError as exc:
        return None, f"request is not valid JSON: {exc}"
    if not isinstance(req, dict):
        return None, f"request must be a JSON object, got {type(req).__name__}"
    cmd = req.get("cmd")
    if cmd is None:
        return None, 'request has no "cmd"'
    if not isinstance(cmd, str):
        return None, '"cmd" must be a string'
    return req, None


# --------------------------------------------------------------------------------------------
# The server


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    peer: PeerCred
    last_active: float
    refusal: Optional[str] = None
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    eof: bool = False  # the peer finished sending
    hangup: bool = False  # answer nothing more; close once the replies are out
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
        self._listener = self._bind()
        self._ino = os.stat(self.path).st_ino
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        if run_dir is not None:
            self._record_path(Path(run_dir))

    # ---- setup -----------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._replace_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # The umask makes bind() create the file 0600: a chmod afterwards would leave a window.
        old = os.umask(0o177)
        try:
            with unix_address(self.path) as addr:
                sock.bind(addr)
        except OSError as exc:
            sock.close()
            raise ControlSocketError(f"cannot create control socket {self.path}: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
        try:
            if self.policy.group_gid is not None:
                os.chown(self.path, -1, self.policy.group_gid)
                os.chmod(self.path, 0o660)
            else:
                os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            raise ControlSocketError(f"cannot set up control socket {self.path}: {exc.strerror or exc}") from None
        return sock

    def _replace_stale(self) -> None:
        """Remove a socket left by a dead supervisor; refuse to start beside a live one."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ControlSocketError(f"{self.path} exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        probe.settimeout(2.0)
        try:
            with unix_address(self.path) as addr:
                probe.connect(addr)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            log.info("stale control socket replaced", path=str(self.path))
            return
        except OSError as exc:
            raise ControlSocketError(f"cannot tell whether {self.path} is in use: {exc.strerror or exc}") from None
        finally:
            probe.close()
        raise ControlSocketError(
            f"another hangwatch is already running on {self.path} (it accepted a connection); "
            f"stop it first: hangwatch stop --socket {self.path}"
        )

    def _record_path(self, run_dir: Path) -> None:
        """Clients given only --run-dir find a socket that lives elsewhere through `socket-path`."""
        record = run_dir / SOCKET_PATH_FILE
        if self.path.parent.resolve() == run_dir.resolve():
            with contextlib.suppress(FileNotFoundError):
                record.unlink()
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(str(self.path.resolve()) + "\n")
        os.replace(tmp, record)

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
            self._settle(client, now)

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

    # ---- per client ----------------------------------------------------------------------------

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
            client = _Client(sock, peer, now, refusal=self.policy.refusal(peer))
            self._clients.add(client)
            self._sel.register(sock, selectors.EVENT_READ, client)
            if client.refusal is not None:
                log.warning("control client refused", peer_uid=peer.uid, peer_pid=peer.pid, reason=client.refusal)
                self._reply(client, error_reply(client.refusal))
                client.hangup = True
            elif len(self._clients) > MAX_CLIENTS:
                self._reply(client, error_reply(f"busy: more than {MAX_CLIENTS} control clients connected"))
                client.hangup = True
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
        if not data:
            client.eof = True
        elif not client.hangup:  # after a hang-up decision further input is discarded
            client.last_active = now
            client.inbuf += data
        if client.lingering:
            if client.eof:
                self._drop(client)
            return
        self._answer_lines(client, handler)
        if client.eof and client.inbuf and not client.hangup:
            # End of input ends the last line too: `printf '{"cmd":"status"}' | nc -U` works.
            line = bytes(client.inbuf)
            client.inbuf.clear()
            self._answer(client, line, handler)
        if client.eof:
            client.hangup = True
        self._flush(client, now)

    def _answer_lines(self, client: _Client, handler: Handler) -> None:
        while not client.hangup:
            nl = client.inbuf.find(b"\n")
            if nl < 0:
                if len(client.inbuf) > self.max_request_bytes:
                    self._oversized(client)
                return
            line = bytes(client.inbuf[:nl])
            del client.inbuf[: nl + 1]
            if len(line) > self.max_request_bytes:
                self._oversized(client)
                return
            self._answer(client, line, handler)

    def _oversized(self, client: _Client) -> None:
        log.warning("control request too large", peer_uid=client.peer.uid, limit=self.max_request_bytes)
        self._reply(client, error_reply(f"request larger than {self.max_request_bytes} bytes; closing connection"))
        client.inbuf.clear()
        client.hangup = True

    def _answer(self, client: _Client, line: bytes, handler: Handler) -> None:
        if not line.strip():
            return
        req, problem = parse_request(line)
        if problem is not None:
            self._reply(client, error_reply(problem))
            return
        if req["cmd"] not in ("status", "incidents"):
            # Anything that changes the run is worth a line saying who asked for it.
            log.info("control request", cmd=req["cmd"], peer_uid=client.peer.uid, peer_pid=client.peer.pid)
        try:
            reply = handler(req)
        except Exception as exc:  # a bug in one command must not take the supervisor down
            log.exception("control handler failed", cmd=req["cmd"])
            reply = error_reply(f"internal error while handling {req['cmd']!r}: {type(exc).__name__}: {exc}")
        if not isinstance(reply, dict) or "ok" not in reply:
            reply = error_reply(f"internal error: handler returned {type(reply).__name__}, not a reply")
        self._reply(client, reply)

    def _reply(self, client: _Client, reply: dict) -> None:
        try:
            data = encode_reply(reply)
        except (TypeError, ValueError) as exc:
            data = encode_reply(error_reply(f"internal error: reply not serialisable: {exc}"))
        client.outbuf += data

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
        # Stop reading from a client that does not read its replies.
        reading = len(client.outbuf) <= MAX_PENDING_REPLY_BYTES
        events = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0)
        if self._sel.get_key(client.sock).events != events:
            self._sel.modify(client.sock, events, client)

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
                     idle_s=round(now - client.last_active, 1))
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
            self._sel.modify(client.sock, selectors.EVENT_READ, client)

    def _drop(self, client: _Client) -> None:
        self._clients.discard(client)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(client.sock)
        with contextlib.suppress(OSError):
            client.sock.shutdown(socket.SHUT_RDWR)
        client.sock.close()


def make_control(cfg, run_dir: Optional[os.PathLike | str] = None) -> ControlServer:
    """The `control_factory` the supervisor runner takes: the socket the config asks for."""
    run_dir = cfg.run_dir if run_dir is None else run_dir
    return ControlServer(
        socket_path_for(cfg, run_dir),
        max_request_bytes=cfg.control.max_request_bytes,
        group=cfg.control.group,
        run_dir=run_dir,
    )
