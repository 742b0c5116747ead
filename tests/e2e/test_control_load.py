"""The control socket of a real `hangwatch run` under load: idle connections by the hundred, a full connection
table, 200 requests at once and 8 MB lines; `status` is answered throughout, each time within STATUS_BOUND_S."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time

import pytest
from fixtures.fakes.sup_harness import PY, env, start_supervisor, wait_for, wait_no_strays, write_config

from hangwatch.supervisor.cli.client import Client, ClientError
from hangwatch.supervisor.control import socket_path_in
from hangwatch.supervisor.control.admission import Limits

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STATUS_BOUND_S = 2.0  # the most a `hangwatch status` may take under this load, and the most dropping an 8 MB line may


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, "-m", "hangwatch.supervisor", *args], capture_output=True, text=True, timeout=timeout, env=env()
    )


def training(sock) -> bool:
    try:
        return Client(sock, timeout=5).call("status")["state"] == "running"
    except ClientError:
        return False


@pytest.fixture
def running(tmp_path):
    """A supervisor training an endless worker; (run dir, its control socket); stopped afterwards."""
    cfg, run_dir = write_config(tmp_path, "ok", "--steps", "100000", "--step-s", "0.05")
    proc = start_supervisor(cfg)
    lines: list[str] = []
    # Read its stderr as it comes: a full pipe would stall the supervisor, not the socket under test.
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        sock = socket_path_in(run_dir)
        wait_for(lambda: training(sock), 30, "the run to be training")
        yield run_dir, sock
    finally:
        stop = cli("stop", "--run-dir", str(run_dir))
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(10)
        out = "".join(lines)[-3000:]
        assert proc.returncode == 0, f"the supervisor did not stop cleanly ({stop.stderr.strip()}):\n{out}"
        assert wait_no_strays(str(run_dir)) == []


def connect(sock) -> socket.socket:
    """A raw client as `nc -U` is one: a blocking connect waits for room in the accept queue."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock))
    s.settimeout(30)
    return s


def timed_status(run_dir) -> float:
    """`hangwatch status --run-dir DIR --json` as a user runs it; returns its wall time."""
    started = time.monotonic()
    done = cli("status", "--run-dir", str(run_dir), "--json")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["state"] == "running"
    return took


def closed_by_server(held: list[socket.socket]) -> int:
    """How many of `held` the server has closed (readable with nothing to read)."""
    readable, _, _ = select.select(held, [], [], 0)
    n = 0
    for s in readable:
        try:
            n += s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except ConnectionResetError:
            n += 1
    return n


def test_150_idle_connections_do_not_lock_out_status(running):
    run_dir, sock = running
    held = [connect(sock) for _ in range(150)]  # connect() returns once the server has them or its backlog does
    try:
        assert timed_status(run_dir) < STATUS_BOUND_S
        # One process holds at most its share of the table: the server let go of its oldest ones.
        share = Limits.derived().max_per_peer  # the supervisor inherited this process's descriptor limit
        wait_for(
            lambda: closed_by_server(held) >= len(held) - share,
            10,
            f"the server to close all but {share} of this process's idle connections",
        )
        assert timed_status(run_dir) < STATUS_BOUND_S
    finally:
        for s in held:
            s.close()


HOLDER = """
import socket, sys
path, n = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    held.append(s)
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


def test_a_full_table_of_idle_connections_from_many_processes_does_not_lock_out_status(running):
    run_dir, sock = running
    limits = Limits.derived()
    holders = [
        subprocess.Popen(
            [PY, "-c", HOLDER, str(sock), str(limits.max_per_peer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(limits.max_clients // limits.max_per_peer + 1)
    ]
    try:
        for h in holders:  # more idle connections than the table holds, none over its process's share
            assert h.stdout.readline().strip() == "held"
        assert timed_status(run_dir) < STATUS_BOUND_S
        assert timed_status(run_dir) < STATUS_BOUND_S
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(timeout=30)


def test_200_simultaneous_status_requests_are_all_answered(running):
    _, sock = running
    n = 200
    start = threading.Barrier(n)
    replies: list = [None] * n

    def ask(i: int) -> None:
        try:
            start.wait(timeout=30)
            with connect(sock) as s:
                s.sendall(b'{"cmd":"status"}\n')
                buf = b""
                while not buf.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    buf += chunk
            replies[i] = json.loads(buf) if buf else "closed without a reply"
        except Exception as exc:  # recorded, so that the assertion names what went wrong
            replies[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    bad = [r for r in replies if not (isinstance(r, dict) and r.get("ok") is True)]
    assert bad == [], f"{len(bad)} of {n} not answered ok, e.g. {bad[:3]}"


def test_8mb_lines_are_dropped_at_once_while_others_are_served(running):
    _, sock = running
    outcomes: list = []

    def flood() -> None:
        s = connect(sock)
        started = time.monotonic()
        try:
            s.sendall(b'{"cmd":"status","pad":"' + b"x" * (8 << 20) + b'"}\n')
            how = "all 8 MB sent"
        except (BrokenPipeError, ConnectionResetError) as exc:
            how = type(exc).__name__
        took = time.monotonic() - started
        try:
            reply = s.recv(4096)
        except ConnectionResetError:
            reply = b""
        s.close()
        outcomes.append((how, took, reply))

    flooders = [threading.Thread(target=flood) for _ in range(3)]
    for t in flooders:
        t.start()
    served = 0
    while any(t.is_alive() for t in flooders) or served == 0:
        assert Client(sock, timeout=5).call("status")["state"] == "running"
        served += 1
    for t in flooders:
        t.join(30)
    assert len(outcomes) == 3, outcomes
    for how, took, reply in outcomes:
        assert how in ("BrokenPipeError", "ConnectionResetError"), f"the server read the whole line: {outcomes}"
        assert took < STATUS_BOUND_S, outcomes
        error = json.loads(reply)["error"]
        assert error.startswith("request larger than") and error.endswith("bytes; closing connection"), error
