"""One client's side of the protocol, without the socket: request bytes in, reply bytes out, in order.

The server feeds it what `recv` returned and sends what it has queued; everything between — framing,
the request size limit, empty lines, handler calls and their failures, replies that are answered
later (`Pending`) and the lines that wait behind them — happens here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import structlog

from hangwatch.supervisor.control.peer import PeerCred
from hangwatch.supervisor.control.wire import Handler, Pending, encode_reply, error_reply, parse_request

QUIET_COMMANDS = ("status", "incidents")  # read-only: not worth an audit line each
EMPTY_REQUEST = 'empty request: send one JSON object per line, e.g. {"cmd":"status"}'

log = structlog.get_logger("hangwatch.control")


@dataclass(eq=False, kw_only=True)
class Conversation:
    peer: PeerCred
    max_request_bytes: int
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    pending: Optional[Pending] = None  # the reply being waited for; later lines wait in inbuf
    pending_cmd: str = ""
    eof: bool = False  # the peer finished sending
    hangup: bool = False  # answer nothing more; close once the replies are out
    abandon: bool = False  # with hangup: read nothing more either, and close without waiting for the peer
    replies: int = 0  # replies queued so far

    def received(self, data: bytes) -> None:
        """Take what `recv` returned (b"": end of input)."""
        if not data:
            self.eof = True
        elif not self.hangup:  # after a hang-up decision further input is discarded
            self.inbuf += data

    def refuse(self, message: str, *, abandon: bool = False) -> None:
        """Answer `message` as an error and nothing more; `abandon`: and stop reading at once."""
        self.reply(error_reply(message))
        self.hangup = True
        self.abandon = abandon

    def process(self, handler: Handler) -> None:
        """Answer the complete lines received, in order, up to one whose reply is pending."""
        self._answer_lines(handler)
        if self.eof and self.pending is None and not self.hangup:
            line = bytes(self.inbuf)
            self.inbuf.clear()
            if line.strip():
                # End of input ends the last line too: `printf '{"cmd":"status"}' | nc -U` works.
                # Bare whitespace before the end is no line at all, so it gets no reply.
                self._answer(line, handler)
            if self.pending is None:
                self.hangup = True

    def resolve(self, now: float, handler: Handler) -> bool:
        """Queue the pending reply if it is ready, then answer the lines behind it; False: not yet."""
        try:
            if not self.pending.ready(now):
                return False
            reply = self.pending.reply()
        except Exception as exc:  # as for handlers: one broken command must not take the loop down
            log.exception("control pending reply failed", cmd=self.pending_cmd)
            reply = _internal_error(self.pending_cmd, exc)
        self.pending = None
        self.reply(reply)
        self.process(handler)
        return True

    def reply(self, reply: Any) -> None:
        if not isinstance(reply, dict) or "ok" not in reply:
            reply = error_reply(f"internal error: handler returned {type(reply).__name__}, not a reply")
        try:
            data = encode_reply(reply)
        except (TypeError, ValueError) as exc:
            data = encode_reply(error_reply(f"internal error: reply not serialisable: {exc}"))
        self.outbuf += data
        self.replies += 1

    def _answer_lines(self, handler: Handler) -> None:
        while not self.hangup and self.pending is None:
            nl = self.inbuf.find(b"\n")
            if nl < 0:
                if len(self.inbuf) > self.max_request_bytes:
                    self._oversized()
                return
            line = bytes(self.inbuf[:nl])
            del self.inbuf[: nl + 1]
            if len(line) > self.max_request_bytes:
                self._oversized()
                return
            self._answer(line, handler)

    def _oversized(self) -> None:
        # The rest of the stream cannot be trusted to start at a line boundary, and reading megabytes
        # of it only to throw them away is what a flood wants: answer, then close without reading on.
        log.warning(
            "control request too large", peer_uid=self.peer.uid, peer_pid=self.peer.pid, limit=self.max_request_bytes
        )
        self.inbuf.clear()
        self.refuse(f"request larger than {self.max_request_bytes} bytes; closing connection", abandon=True)

    def _answer(self, line: bytes, handler: Handler) -> None:
        if not line.strip():
            self.reply(error_reply(EMPTY_REQUEST))  # a client waiting for a reply must not wait forever
            return
        req, problem = parse_request(line)
        if problem is not None:
            self.reply(error_reply(problem))
            return
        cmd = req["cmd"]
        if cmd not in QUIET_COMMANDS:
            # Anything that changes the run is worth a line saying who asked for it.
            log.info("control request", cmd=cmd, peer_uid=self.peer.uid, peer_pid=self.peer.pid)
        try:
            reply = handler(req)
        except Exception as exc:  # a bug in one command must not take the supervisor down
            log.exception("control handler failed", cmd=cmd)
            reply = _internal_error(cmd, exc)
        if not isinstance(reply, dict) and isinstance(reply, Pending):
            self.pending, self.pending_cmd = reply, cmd
            return
        self.reply(reply)


def _internal_error(cmd: str, exc: Exception) -> dict:
    return error_reply(f"internal error while handling {cmd!r}: {type(exc).__name__}: {exc}")
