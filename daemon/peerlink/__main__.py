"""`python -m hangwatch.daemon.peerlink …`: the helper process (see the package's docstring for the protocol)."""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time
from typing import Optional

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_OK
from hangwatch.daemon.peerlink import Peerlink, is_local, parse_endpoint
from hangwatch.daemon.peerlink import __doc__ as PROTOCOL
from hangwatch.daemon.peerlink.connect import local_addresses, make_connect, resolve


def die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM): never outlive the supervisor (Linux, best effort)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except Exception:  # noqa: BLE001
        pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # usage errors are configuration errors here: exit 78, not 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_CONFIG, f"peerlink: {message}\n")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = _Parser(prog="python -m hangwatch.daemon.peerlink", description=PROTOCOL.splitlines()[0])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--rdzv-id", required=True)
    p.add_argument("--node", required=True)
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--host", choices=["auto", "always", "never"], default="auto")
    p.add_argument("--beat-s", type=float, default=0.5)
    p.add_argument("--connect-timeout-s", type=float, default=2.0)
    a = p.parse_args(argv)
    try:
        a.host_name, a.port = parse_endpoint(a.endpoint)
    except ValueError as e:
        p.exit(EXIT_CONFIG, f"peerlink: {e}\n")
    for bad, what in [
        (a.nnodes < 1, f"--nnodes {a.nnodes}"),
        (not a.beat_s > 0, f"--beat-s {a.beat_s}"),
        (not a.connect_timeout_s > 0, f"--connect-timeout-s {a.connect_timeout_s}"),
        (not a.node.strip(), f"--node {a.node!r}"),
        (not a.rdzv_id.strip(), f"--rdzv-id {a.rdzv_id!r}"),
    ]:
        if bad:
            p.exit(EXIT_CONFIG, f"peerlink: {what} is not valid\n")
    return a


def main(argv: Optional[list[str]] = None) -> int:
    a = parse_args(argv)
    die_with_parent()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # no C++ stack trace on stderr for every lost connection
    signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_OK))
    eligible = is_local(a.host_name, socket.gethostname(), local_addresses(), resolve(a.host_name))

    def emit(ev: dict) -> None:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()

    link = Peerlink(
        a.rdzv_id,
        a.node,
        make_connect(a.host_name, a.port, a.host, eligible, a.connect_timeout_s),
        emit,
        endpoint=a.endpoint,
    )
    buf, next_beat = b"", time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if now >= next_beat:
                link.beat()
                next_beat = max(next_beat + a.beat_s, time.monotonic())
            ready, _, _ = select.select([0], [], [], max(0.0, next_beat - time.monotonic()))
            if ready:
                data = os.read(0, 65536)
                if not data:
                    return EXIT_OK  # stdin EOF: the supervisor is gone
                buf += data
                *lines, buf = buf.split(b"\n")
                if len(buf) > 1 << 20:  # a "line" without an end: drop it rather than grow without bound
                    link.emit({"ev": "error", "error": f"line longer than 1 MiB dropped ({buf[:60]!r}…)"})
                    buf = b""
                for raw in lines:
                    if raw.strip() and not link.handle(raw.decode("utf-8", "replace")):
                        return EXIT_OK
    except (BrokenPipeError, KeyboardInterrupt):
        return EXIT_OK


if __name__ == "__main__":
    code = main()
    try:
        sys.stdout.flush()
    except OSError:
        pass
    os._exit(code)  # no interpreter teardown: a thread abandoned in a store call must not hold the exit up
