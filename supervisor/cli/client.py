"""Talking to a running supervisor over its control socket (what the CLI uses).

One connection per request: connect, send one JSON line, read one JSON line.  Every failure becomes
a `ClientError` whose message is one line a person can act on, and whose `exit_code` the CLI uses.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import struct
from pathlib import Path
from typing import Any, Callable, Optional

from hangwatch.common.exitcodes import EX_SOFTWARE, EX_UNAVAILABLE, EX_USAGE, EXIT_FAILED
from hangwatch.supervisor.control.paths import socket_path_in, unix_address

MAX_REPLY_BYTES = 256 * 1024 * 1024


class ClientError(Exception):
    """A request that could not be made or was refused; `str()` is the one-line explanation."""

    exit_code = EXIT_FAILED


class DaemonUnavailable(ClientError):
    exit_code = EX_UNAVAILABLE


class BadReply(ClientError):
    exit_code = EX_SOFTWARE


class RequestFailed(ClientError):
    """The daemon answered {"ok": false, "error": ...}."""

    exit_code = EXIT_FAILED


def resolve_socket(
    *, run_dir: Optional[os.PathLike | str] = None, socket_path: Optional[os.PathLike | str] = None
) -> Path:
    """--socket wins; else the run dir's socket (or the one its `socket-path` records)."""
    if socket_path:
        return Path(socket_path)
    if run_dir:
        rd = Path(run_dir)
        if not rd.is_dir():
            raise DaemonUnavailable(f"no run directory at {rd}")
        return socket_path_in(rd)
    err = ClientError("say which daemon: --run-dir DIR or --socket PATH (or set HANGWATCH_RUN_DIR / HANGWATCH_SOCKET)")
    err.exit_code = EX_USAGE
    raise err


class Client:
    def __init__(self, path: os.PathLike | str, *, timeout: float = 30.0):
        self.path = Path(path)
        self.timeout = timeout

    def request(
        self, req: dict, *, timeout: Optional[float] = None, meanwhile: Optional[Callable[[], Any]] = None
    ) -> dict:
        """Send one request, return the raw reply object.  `meanwhile()`, when given, runs once the request
        is sent and before the reply is read: work the caller needs anyway (importing what will show the
        answer) then overlaps with the daemon's time to answer."""
        timeout = self.timeout if timeout is None else timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            self._connect(sock, timeout)
            sock.settimeout(timeout)
            try:
                try:
                    sock.sendall(json.dumps(req).encode() + b"\n")
                except (BrokenPipeError, ConnectionResetError):
                    pass  # it hung up mid-request (one too large): its reply, still readable, says why
                if meanwhile is not None:
                    meanwhile()
                raw = self._read_line(sock)
            except socket.timeout:
                raise DaemonUnavailable(f"hangwatch at {self.path} did not answer within {timeout:g}s") from None
            except (BrokenPipeError, ConnectionResetError):
                raise DaemonUnavailable(f"hangwatch at {self.path} closed the connection") from None
        finally:
            sock.close()
        if raw is None:
            raise DaemonUnavailable(f"hangwatch at {self.path} closed the connection without answering")
        try:
            reply = json.loads(raw)
        except ValueError:
            raise BadReply(f"hangwatch at {self.path} sent something that is not JSON: {raw[:80]!r}") from None
        if not isinstance(reply, dict) or "ok" not in reply:
            raise BadReply(f'hangwatch at {self.path} sent a reply without "ok": {raw[:80]!r}')
        return reply

    def call(
        self, cmd: str, *, timeout: Optional[float] = None, meanwhile: Optional[Callable[[], Any]] = None, **fields: Any
    ) -> Any:
        """Send `{"cmd": cmd, **fields}`; return the result or raise RequestFailed with the daemon's error.
        `meanwhile` as for `request`."""
        reply = self.request({"cmd": cmd, **fields}, timeout=timeout, meanwhile=meanwhile)
        if not reply["ok"]:
            raise RequestFailed(f"{cmd}: {reply.get('error', 'failed (no reason given)')}")
        return reply.get("result")

    def _connect(self, sock: socket.socket, timeout: float) -> None:
        """Connect, waiting at most `timeout` for room when the supervisor's queue of new connections is full.

        A socket with a Python timeout is non-blocking, and a non-blocking Unix connect to a full queue
        fails at once with EAGAIN; a blocking one with SO_SNDTIMEO waits in the kernel until the
        supervisor's next pass accepts, or the time is up.
        """
        where = self.path
        seconds = max(timeout, 0.001)
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int((seconds % 1) * 1_000_000))
        )
        try:
            with unix_address(where) as addr:
                sock.connect(addr)
        except FileNotFoundError:
            raise DaemonUnavailable(f"no hangwatch running at {where} (no such socket)") from None
        except ConnectionRefusedError:
            raise DaemonUnavailable(f"no hangwatch running at {where} (connection refused)") from None
        except PermissionError:
            raise DaemonUnavailable(
                f"not allowed to use {where} (permission denied; the socket belongs to {_owner(where)})"
            ) from None
        except (socket.timeout, BlockingIOError):
            raise DaemonUnavailable(f"hangwatch at {where} did not accept the connection within {timeout:g}s") from None
        except OSError as exc:
            raise DaemonUnavailable(f"cannot connect to {where}: {exc.strerror or exc}") from None

    @staticmethod
    def _read_line(sock: socket.socket) -> Optional[bytes]:
        buf = bytearray()
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except ConnectionResetError:  # closed with our request unread: what came before still counts
                chunk = b""
            if not chunk:
                return bytes(buf) if buf else None
            buf += chunk
            nl = buf.find(b"\n")
            if nl >= 0:
                return bytes(buf[:nl])
            if len(buf) > MAX_REPLY_BYTES:
                raise BadReply(f"reply larger than {MAX_REPLY_BYTES} bytes")


def _owner(path: Path) -> str:
    try:
        st = path.stat()
    except OSError:
        return "another user"
    try:
        return f"user {pwd.getpwuid(st.st_uid).pw_name}"
    except KeyError:
        return f"uid {st.st_uid}"
