"""The peer link helper as the supervisors run it: real `python -m hangwatch.daemon.peerlink` processes, a real
TCPStore on 127.0.0.1, two "nodes" on this one box (one hosts the store, the other finds the port taken and
connects as a client).  Waits are generous ("within N s"); nothing asserts on timing beyond them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
from fixtures.fakes.sup_harness import ROOT, env
from fixtures.fakes.workers import PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

WAIT_S = 30  # torch imports in two processes on two shared cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def argv(port: int, node: str, *extra: str, endpoint: Optional[str] = None) -> list[str]:
    return [
        PYTHON,
        "-m",
        "hangwatch.daemon.peerlink",
        "--endpoint",
        endpoint or f"127.0.0.1:{port}",
        "--rdzv-id",
        "job1",
        "--node",
        node,
        "--nnodes",
        "2",
        "--beat-s",
        "0.2",
        *extra,
    ]


class Helper:
    """One helper process: commands to its stdin, its events collected from stdout by a thread."""

    def __init__(self, tmp_path: Path, port: int, node: str, *extra: str):
        self.node, self.events, self.cond = node, [], threading.Condition()
        self.err_path = tmp_path / f"peerlink-{node}.err"
        self.proc = subprocess.Popen(
            argv(port, node, *extra),
            cwd=ROOT,
            env=env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err_path.open("w"),
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            with self.cond:
                self.events.append(json.loads(line))
                self.cond.notify_all()

    def send(self, cmd) -> None:
        self.proc.stdin.write((cmd if isinstance(cmd, str) else json.dumps(cmd)) + "\n")
        self.proc.stdin.flush()

    def wait(self, pred: Callable[[dict], bool], what: str, after: int = 0, timeout: float = WAIT_S) -> dict:
        """The first event from index `after` on that satisfies pred."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events[after:]:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self.cond.wait(0.2)):
                    raise AssertionError(
                        f"{self.node}: no {what} within {timeout}s (rc={self.proc.poll()});\n"
                        f"events: {self.events[-15:]}\nstderr: {self.err_path.read_text()[-2000:]}"
                    )
                self.cond.wait(min(left, 0.5))

    def mark(self) -> int:
        with self.cond:
            return len(self.events)

    def reply(self, ev: str, cid) -> dict:
        return self.wait(lambda e: e["ev"] == ev and e.get("id") == cid, f"{ev} reply {cid}")

    def gen_event(self, gen: int, after: int = 0) -> dict:
        return self.wait(lambda e: e["ev"] == "gen" and e["gen"] == gen, f"gen event {gen}", after)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def spawn(tmp_path):
    helpers = []

    def start(port: int, node: str, *extra: str) -> Helper:
        helpers.append(Helper(tmp_path, port, node, *extra))
        return helpers[-1]

    yield start
    for h in helpers:
        with_cont(h)
        h.stop()


def with_cont(h: Helper):
    if h.proc.poll() is None:
        os.kill(h.proc.pid, signal.SIGCONT)


@pytest.fixture
def pair(spawn):
    """A hosts (started first), B is the client."""
    port = free_port()
    a = spawn(port, "A")
    assert a.wait(lambda e: e["ev"] == "store", "store event")["role"] == "host"
    b = spawn(port, "B")
    return a, b


def test_host_and_client_agree_on_generations_and_resume(pair):
    a, b = pair
    sb = b.wait(lambda e: e["ev"] == "store", "store event")
    assert sb == {"ev": "store", "ok": True, "role": "client", "endpoint": sb["endpoint"]}
    assert a.gen_event(0)["notice"] is None and b.gen_event(0)["notice"] is None

    a.send({"op": "status", "record": {"state": "train", "step": 7}})
    a.send({"op": "bump", "id": "a1", "from": 0, "notice": {"reason": "stall", "node": "A"}})
    assert a.reply("bumped", "a1") == {
        "ev": "bumped",
        "id": "a1",
        "from": 0,
        "gen": 1,
        "mine": True,
        "notice": {"reason": "stall", "node": "A"},
    }
    assert b.gen_event(1)["notice"] == {"reason": "stall", "node": "A"}
    b.send({"op": "bump", "id": "b1", "from": 0, "notice": {"reason": "late"}})  # a stale bump
    assert b.reply("bumped", "b1") == {
        "ev": "bumped",
        "id": "b1",
        "from": 0,
        "gen": 1,
        "mine": False,
        "notice": {"reason": "stall", "node": "A"},
    }

    a.send({"op": "agree_resume", "id": "r1", "gen": 1, "proposal": {"path": "/ck/step-00000010", "step": 10}})
    won = a.reply("resume", "r1")["choice"]
    assert won == {"path": "/ck/step-00000010", "step": 10, "by": "A"}
    b.send({"op": "agree_resume", "id": "r2", "gen": 1, "proposal": {"path": "/ck/step-00000020", "step": 20}})
    assert b.reply("resume", "r2")["choice"] == won

    peers = b.wait(
        lambda e: e["ev"] == "peers" and e["nodes"].get("A", {}).get("record", {}).get("step") == 7,
        "peers with A's status",
    )["nodes"]
    assert set(peers) == {"A", "B"} and peers["B"]["age_s"] == 0.0
    assert {"seq", "node", "pid", "host", "state"} <= set(peers["A"]["record"])
    assert peers["A"]["record"]["pid"] == a.proc.pid

    b.send("this is not json")
    b.send({"op": "fly", "id": 9})
    assert "unparseable" in b.wait(lambda e: e["ev"] == "error", "error event")["error"]
    assert b.reply("error", 9)["error"].startswith("unknown op")
    b.send({"op": "agree_resume", "id": "r3", "gen": 1, "proposal": None})  # still answering
    assert b.reply("resume", "r3")["choice"] == won

    b.proc.stdin.close()  # the supervisor is gone: EOF
    assert b.proc.wait(10) == 0
    a.send({"op": "quit"})
    assert a.proc.wait(10) == 0


def test_a_bump_race_has_exactly_one_winner(pair):
    a, b = pair
    a.gen_event(0), b.gen_event(0)
    for g in range(3):
        for h in (a, b):  # back to back: both read gen g before either bumps, as often as not
            h.send({"op": "bump", "id": f"{h.node}{g}", "from": g, "notice": {"by": h.node, "g": g}})
        ra, rb = a.reply("bumped", f"A{g}"), b.reply("bumped", f"B{g}")
        assert sorted([ra["mine"], rb["mine"]]) == [False, True], (ra, rb)
        assert ra["gen"] == rb["gen"] == g + 1 and ra["notice"] == rb["notice"]
        winner = "A" if ra["mine"] else "B"
        assert ra["notice"] == {"by": winner, "g": g}
        for h in (a, b):
            assert h.gen_event(g + 1)["notice"] == ra["notice"]


def test_a_stopped_peer_ages_and_recovers(pair):
    a, b = pair
    a.wait(lambda e: e["ev"] == "peers" and "B" in e["nodes"], "peers with B")
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        m = a.mark()
        a.wait(lambda e: e["ev"] == "peers" and e["nodes"]["B"]["age_s"] >= 1.5, "B aging", after=m)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    m = a.mark()
    a.wait(lambda e: e["ev"] == "peers" and e["nodes"]["B"]["age_s"] < 1.0, "B fresh again", after=m)


def test_the_client_rehosts_when_the_host_is_killed(pair, spawn):
    a, b = pair
    b.gen_event(0)
    a.send({"op": "bump", "id": 1, "from": 0, "notice": {"reason": "first"}})
    b.gen_event(1)
    m = b.mark()
    a.proc.kill()  # SIGKILL: the store goes with it
    b.wait(lambda e: e["ev"] == "store" and e["ok"] is False, "outage", after=m)
    back = b.wait(lambda e: e["ev"] == "store" and e["ok"] is True, "re-host", after=m)
    assert back["role"] == "host"
    assert [e["ok"] for e in b.events[m:] if e["ev"] == "store"] == [False, True]  # one report per outage
    assert b.gen_event(1, after=m)["notice"] == {"reason": "first"}  # not back to 0
    assert not [e for e in b.events[m:] if e["ev"] == "gen" and e["gen"] < 1]
    b.send({"op": "bump", "id": 2, "from": 1, "notice": {"reason": "second"}})
    assert b.reply("bumped", 2)["mine"] is True and b.reply("bumped", 2)["gen"] == 2

    c = spawn(int(back["endpoint"].rsplit(":", 1)[1]), "C")  # a newcomer finds the re-hosted store
    assert c.wait(lambda e: e["ev"] == "store", "store event")["role"] == "client"
    assert c.gen_event(2)["notice"] == {"reason": "second"}
    peers = c.wait(lambda e: e["ev"] == "peers" and "B" in e["nodes"], "peers with B")["nodes"]
    assert "A" not in peers  # A's record died with the old store


def test_a_frozen_host_does_not_wedge_the_client(pair):
    """A SIGSTOPped host keeps its port and accepts connections but never answers: the client's store calls
    must give up (bounded), report the outage, keep answering commands, and reconnect once the host thaws."""
    a, b = pair
    b.gen_event(0)
    m = b.mark()
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        b.wait(lambda e: e["ev"] == "store" and e["ok"] is False, "outage", after=m, timeout=15)
        b.send({"op": "agree_resume", "id": "f1", "gen": 0, "proposal": None})
        assert "unavailable" in b.wait(lambda e: e.get("id") == "f1", "an answer while frozen", timeout=15)["error"]
        b.wait(lambda e: e["ev"] == "peers", "still beating", after=b.mark(), timeout=15)
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    back = b.wait(lambda e: e["ev"] == "store" and e["ok"] is True, "reconnect", after=m)
    assert back["role"] == "client"
    b.send({"op": "bump", "id": "f2", "from": 0, "notice": {"after": "thaw"}})
    assert b.reply("bumped", "f2")["mine"] is True
    assert a.gen_event(1)["notice"] == {"after": "thaw"}


def test_a_client_only_helper_waits_for_the_store(spawn):
    port = free_port()
    b = spawn(port, "B", "--host", "never")
    b.wait(lambda e: e["ev"] == "store" and e["ok"] is False, "outage report")
    b.wait(lambda e: e["ev"] == "peers", "peers while down")  # still beating
    a = spawn(port, "A")
    assert a.wait(lambda e: e["ev"] == "store", "store event")["role"] == "host"
    assert b.wait(lambda e: e["ev"] == "store" and e["ok"], "connect")["role"] == "client"
    assert [e["ok"] for e in b.events if e["ev"] == "store"] == [False, True]
    b.gen_event(0)


def test_it_dies_with_its_parent(tmp_path):
    """PR_SET_PDEATHSIG: the parent is SIGKILLed while its stdin stays open (we hold the pipe)."""
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen({argv(free_port(), 'A', '--host', 'always')!r}, stdout=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\ntime.sleep(120)\n"
    )
    parent = subprocess.Popen(
        [PYTHON, "-c", code], cwd=ROOT, env=env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        child = int(parent.stdout.readline())
        time.sleep(1.0)  # past the prctl (it runs before anything slow)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the helper outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--endpoint", "no-port-here"], "'no-port-here'"),
        (["--endpoint", "h:99999"], "'h:99999'"),
        (["--nnodes", "0"], "--nnodes 0"),
        (["--host", "sometimes"], "sometimes"),
    ],
)
def test_a_bad_command_line_exits_78_naming_the_value(extra, needle):
    args = argv(1, "A")
    for flag, value in zip(extra[::2], extra[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    p = subprocess.run(args, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert p.returncode == 78, p.stderr
    assert needle in p.stderr and p.stdout == ""
