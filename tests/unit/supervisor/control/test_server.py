"""The control socket server and client against real Unix sockets: bad input, many and silent
clients, slow readers, replies answered in a later pass (`Pending`), permissions (mode, SO_PEERCRED
from another uid), stale and live sockets."""

from __future__ import annotations

import grp
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import structlog
from fixtures.fakes.control_peers import Deferred, Later, Peer, raw
from fixtures.fakes.polled_server import PolledServer
from fixtures.fakes.sup_harness import wait_for

from hangwatch.supervisor.cli.client import Client, DaemonUnavailable, RequestFailed, resolve_socket
from hangwatch.supervisor.control import (
    SOCKET_PATH_FILE,
    ControlServer,
    ControlSocketError,
    PeerCred,
    PeerPolicy,
    socket_path_for,
    socket_path_in,
)
from hangwatch.supervisor.control.conversation import EMPTY_REQUEST, Conversation


class FakeSupervisor(PolledServer):
    """The control server under test, with a handler that records and answers a few commands."""

    def handler(self, req: dict) -> dict:
        self.requests.append(req)
        cmd = req["cmd"]
        if cmd == "status":
            return {"ok": True, "result": {"state": "running", "step": 7, "loss": float("nan")}}
        if cmd == "big":
            return {"ok": True, "result": "x" * (4 * 1024 * 1024)}
        if cmd == "boom":
            raise RuntimeError("handler bug")
        if cmd == "notadict":
            return ["not", "a", "reply"]
        return {"ok": False, "error": f"unknown command {cmd!r}"}


@pytest.fixture
def sup(tmp_path):
    s = FakeSupervisor(tmp_path / "hw.sock")
    yield s
    s.close()


def read_replies(s: socket.socket, n: int) -> list[dict]:
    buf = b""
    while buf.count(b"\n") < n:
        chunk = s.recv(65536)
        assert chunk, f"connection closed before {n} replies arrived: {buf!r}"
        buf += chunk
    return [json.loads(line) for line in buf.split(b"\n")[:n]]


def nothing_arrives(s: socket.socket, wait: float = 0.4) -> bool:
    s.settimeout(wait)
    try:
        data = s.recv(100)
    except socket.timeout:
        return True
    finally:
        s.settimeout(10)
    return data == b""  # closed counts as "no reply" only for the caller to tell apart


def test_status_round_trip_and_nan_is_strict_json(sup):
    reply = Client(sup.path).request({"cmd": "status"})
    assert reply == {"ok": True, "result": {"state": "running", "step": 7, "loss": "NaN"}}
    assert sup.requests == [{"cmd": "status"}]


def test_malformed_requests_get_json_errors_and_the_server_carries_on(sup):
    s = raw(sup.path)
    s.sendall(b'this is not json\n[1, 2]\n{"nocmd": 1}\n{"cmd": 5}\n\xff\xfe\n{"cmd": "status"}\n')
    replies = read_replies(s, 6)
    assert [r["ok"] for r in replies] == [False, False, False, False, False, True]
    assert "not valid JSON" in replies[0]["error"]
    assert "must be a JSON object, got list" in replies[1]["error"]
    assert 'no "cmd"' in replies[2]["error"]
    assert '"cmd" must be a string' in replies[3]["error"]
    assert "not UTF-8" in replies[4]["error"] or "not valid JSON" in replies[4]["error"]
    assert replies[5]["result"]["state"] == "running"
    assert sup.requests == [{"cmd": "status"}]  # the handler never saw the bad ones
    s.close()


def test_partial_json_waits_for_the_rest_of_the_line(sup):
    s = raw(sup.path)
    s.sendall(b'{"cmd": "sta')
    assert nothing_arrives(s)
    assert sup.requests == []
    s.sendall(b'tus"}\n')
    assert read_replies(s, 1)[0]["ok"] is True
    s.close()


def test_end_of_input_ends_the_last_line(sup):
    s = raw(sup.path)
    s.sendall(b'{"cmd": "status"}')
    s.shutdown(socket.SHUT_WR)
    assert read_replies(s, 1)[0]["ok"] is True
    assert s.recv(10) == b""  # and then the server hangs up
    s.close()


def test_unknown_command_and_handler_failures_are_replies_not_crashes(sup):
    c = Client(sup.path)
    with pytest.raises(RequestFailed, match="frobnicate: unknown command 'frobnicate'"):
        c.call("frobnicate")
    reply = c.request({"cmd": "boom"})
    assert reply["ok"] is False and "internal error" in reply["error"] and "handler bug" in reply["error"]
    reply = c.request({"cmd": "notadict"})
    assert reply["ok"] is False and "internal error" in reply["error"]
    assert c.call("status")["step"] == 7


@pytest.mark.parametrize("newline", [False, True])
def test_oversized_request_is_refused_and_that_client_closed(tmp_path, newline):
    s_ = FakeSupervisor(tmp_path / "hw.sock", max_request_bytes=1024)
    try:
        s = raw(s_.path)
        payload = json.dumps({"cmd": "status", "pad": "x" * 3000}).encode() + (b"\n" if newline else b"")
        s.sendall(payload)
        reply = read_replies(s, 1)[0]
        assert reply == {"ok": False, "error": "request larger than 1024 bytes; closing connection"}
        s.settimeout(10)
        try:
            rest = s.recv(100)
        except ConnectionResetError:  # closed at once, with the rest of the line unread
            rest = b""
        assert rest == b""
        s.close()
        assert s_.requests == []
        assert Client(s_.path).call("status")["state"] == "running"  # others still served
    finally:
        s_.close()


def test_a_silent_client_blocks_nobody_and_is_timed_out(tmp_path):
    s_ = FakeSupervisor(tmp_path / "hw.sock", idle_timeout_s=1.0)
    try:
        silent = raw(s_.path)
        c = Client(s_.path, timeout=5)
        for _ in range(20):
            assert c.call("status")["state"] == "running"
        silent.settimeout(15)
        assert silent.recv(10) == b""  # the server hung up on it
        silent.close()
        assert c.call("status")["state"] == "running"
    finally:
        s_.close()


def test_many_clients_at_once(sup):
    clients = [raw(sup.path) for _ in range(60)]
    for i, s in enumerate(clients):
        s.sendall(json.dumps({"cmd": "status", "n": i}).encode() + b"\n")
    for s in clients:
        assert read_replies(s, 1)[0]["result"]["state"] == "running"
        s.close()
    assert sorted(r["n"] for r in sup.requests) == list(range(60))


def test_pipelined_requests_are_answered_in_order(sup):
    s = raw(sup.path)
    s.sendall(b"".join(json.dumps({"cmd": c}).encode() + b"\n" for c in ["status", "nope", "status"]))
    replies = read_replies(s, 3)
    assert [r["ok"] for r in replies] == [True, False, True]
    s.close()


def test_a_client_that_does_not_read_its_big_reply_blocks_nobody(sup):
    slow = raw(sup.path)
    slow.sendall(b'{"cmd": "big"}\n')
    # The server has answered, and what the full socket buffer could not take waits in the server's.
    wait_for(lambda: sup.server.unsent_bytes() > 0, 10, "the big reply to back up in the server")
    c = Client(sup.path, timeout=5)
    for _ in range(5):
        assert c.call("status")["state"] == "running"
    reply = read_replies(slow, 1)[0]  # now read it all: nothing was lost
    assert reply["ok"] is True and len(reply["result"]) == 4 * 1024 * 1024
    slow.close()


# ---- replies answered in a later pass (Pending) -------------------------------------------------
# Driven from the test's own thread with a fake clock, as the supervisor loop drives it: every
# `poll()` is one loop pass, and nothing happens between passes.


@pytest.fixture
def deferred(tmp_path):
    d = Deferred(tmp_path / "hw.sock")
    yield d
    d.server.close()


def test_a_pending_reply_is_sent_in_the_first_pass_that_finds_it_ready(deferred):
    waiting = Peer(deferred.path)
    waiting.send({"cmd": "dump"})
    deferred.poll_until(lambda: deferred.seen == ["dump"], "the dump request")
    asked = deferred.later.asked
    deferred.passes(3)
    assert waiting.replies() == [] and deferred.later.asked == asked + 3  # asked again on every poll
    other = Peer(deferred.path)  # meanwhile others are served
    other.send({"cmd": "status"})
    deferred.poll_until(lambda: other.replies() == [{"ok": True, "result": "status"}], "the status reply")
    assert waiting.replies() == []
    deferred.now += 5
    deferred.passes(1)  # one pass: the reply is ready and written
    assert waiting.replies() == [{"ok": True, "result": "dumped"}]


def test_lines_behind_a_pending_reply_wait_for_it_and_keep_their_order(deferred):
    peer = Peer(deferred.path)
    peer.send({"cmd": "dump"}, {"cmd": "status"}, {"cmd": "pause"})
    deferred.poll_until(lambda: deferred.seen == ["dump"], "the dump request")
    deferred.passes(3)
    assert deferred.seen == ["dump"] and peer.replies() == []  # the others were not even handled yet
    deferred.now += 5
    deferred.poll_until(lambda: len(peer.replies()) == 3, "three replies")
    assert [r["result"] for r in peer.replies()] == ["dumped", "status", "pause"]
    assert deferred.seen == ["dump", "status", "pause"]


def test_end_of_input_after_a_pending_request_still_gets_the_reply(deferred):
    peer = Peer(deferred.path)
    peer.send({"cmd": "dump"})
    peer.sock.shutdown(socket.SHUT_WR)  # `printf '{"cmd":"dump"}' | nc -U`
    deferred.poll_until(lambda: deferred.seen == ["dump"], "the dump request")
    deferred.passes(3)
    assert peer.replies() == [] and not peer.hung_up()
    deferred.now += 5
    deferred.poll_until(peer.hung_up, "the server to hang up after the reply")
    assert peer.replies() == [{"ok": True, "result": "dumped"}]
    assert deferred.server.connected == 0


def test_a_client_gone_while_waiting_is_dropped_cleanly(deferred):
    peer = Peer(deferred.path)
    peer.send({"cmd": "dump"})
    deferred.poll_until(lambda: deferred.seen == ["dump"], "the dump request")
    peer.sock.close()
    deferred.now += 5
    with structlog.testing.capture_logs() as logged:
        deferred.poll_until(lambda: deferred.server.connected == 0, "the gone client to be dropped")
    assert [e for e in logged if e["log_level"] in ("warning", "error")] == []
    other = Peer(deferred.path)
    other.send({"cmd": "status"})
    deferred.poll_until(lambda: other.replies() == [{"ok": True, "result": "status"}], "the next client's reply")


def test_the_idle_timeout_bounds_the_wait(tmp_path):
    d = Deferred(tmp_path / "hw.sock", idle_timeout_s=30)
    d.later = Later(float("inf"))  # never ready
    try:
        peer = Peer(d.path)
        peer.send({"cmd": "dump"})
        d.poll_until(lambda: d.seen == ["dump"], "the dump request")
        d.now += 29
        d.passes(3)
        assert d.server.connected == 1 and not peer.replies() and not peer.hung_up()
        d.now += 2
        with structlog.testing.capture_logs() as logged:
            d.passes(1)
        assert d.server.connected == 0
        assert peer.replies() == [] and peer.hung_up()
        assert [(e["event"], e["waiting_for"]) for e in logged] == [("control client timed out", "dump")]
    finally:
        d.server.close()


class Broken(Later):
    def __init__(self, where: str):
        super().__init__(0)
        self.where = where

    def ready(self, now):
        if self.where == "ready":
            raise RuntimeError("ready bug")
        return True

    def reply(self):
        if self.where == "reply":
            raise RuntimeError("reply bug")
        return ["not", "a", "reply"]


@pytest.mark.parametrize(
    "where, error",
    [
        ("ready", "internal error while handling 'dump': RuntimeError: ready bug"),
        ("reply", "internal error while handling 'dump': RuntimeError: reply bug"),
        ("shape", "internal error: handler returned list, not a reply"),
    ],
)
def test_a_broken_pending_reply_is_an_error_reply_not_a_crash(deferred, where, error):
    deferred.later = Broken(where)
    peer = Peer(deferred.path)
    peer.send({"cmd": "dump"}, {"cmd": "status"})
    with structlog.testing.capture_logs():
        deferred.poll_until(lambda: len(peer.replies()) == 2, "both replies")
    assert peer.replies() == [{"ok": False, "error": error}, {"ok": True, "result": "status"}]


# ---- permissions ------------------------------------------------------------------------------


def test_socket_is_created_0600_and_removed_on_close(tmp_path):
    path = tmp_path / "hw.sock"
    server = ControlServer(path)
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    server.close()
    assert not path.exists()


def test_with_a_group_the_socket_is_0660_and_group_owned(tmp_path):
    group = grp.getgrgid(65534).gr_name if _has_gid(65534) else grp.getgrgid(os.getgid()).gr_name
    if os.geteuid() != 0 and group != grp.getgrgid(os.getgid()).gr_name:
        pytest.skip("chown to another group needs root")
    path = tmp_path / "hw.sock"
    with ControlServer(path, group=group):
        st = os.stat(path)
        assert stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == grp.getgrnam(group).gr_gid


def test_an_unknown_group_is_a_clear_error(tmp_path):
    with pytest.raises(ControlSocketError, match="control.group: no such group 'no-such-group-hw'"):
        ControlServer(tmp_path / "hw.sock", group="no-such-group-hw")


def test_peer_policy_checks_uid_and_group():
    policy = PeerPolicy(owner_uid=1000)
    assert policy.refusal(PeerCred(pid=1, uid=1000, gid=1000)) is None
    assert policy.refusal(PeerCred(pid=1, uid=0, gid=0)) is None
    assert policy.refusal(PeerCred(pid=1, uid=1001, gid=1000)) == "unauthorised: uid 1001 is not uid 1000"
    grouped = PeerPolicy(owner_uid=1000, group_gid=500, group_members=frozenset({"nobody"}))
    assert grouped.refusal(PeerCred(pid=1, uid=1002, gid=500)) is None  # primary group
    nobody = 65534 if _has_uid(65534) else None
    if nobody is not None:
        assert grouped.refusal(PeerCred(pid=1, uid=nobody, gid=4242)) is None  # supplementary member
    assert "nor in the control group" in grouped.refusal(PeerCred(pid=1, uid=1003, gid=4242))


PEER_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
try:
    s.connect(sys.argv[1])
except PermissionError:
    print("EACCES"); sys.exit(0)
s.sendall(b'{"cmd": "status"}\n')
if "--shut" in sys.argv:
    s.shutdown(socket.SHUT_WR)
buf = b""
while b"\n" not in buf:
    chunk = s.recv(4096)
    if not chunk:
        break
    buf += chunk
print(buf.decode().strip())
print("closed" if s.recv(10) == b"" else "open")
"""


@pytest.fixture
def shared_dir():
    """A directory another uid can traverse (pytest's tmp_path is 0700)."""
    d = Path(tempfile.mkdtemp(prefix="hw-ops-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _as_nobody(path: Path, *flags: str) -> list[str]:
    out = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", PEER_CLIENT, str(path), *flags],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def _has_uid(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _has_gid(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
        return True
    except KeyError:
        return False


def _skip_unless_root_and_nobody():
    if os.geteuid() != 0:
        pytest.skip("running a client as another uid needs root (PeerPolicy is tested with fake credentials)")
    if not (_has_uid(65534) and _has_gid(65534) and Path("/usr/bin/python3").exists()):
        pytest.skip("needs uid/gid 65534 and /usr/bin/python3")


def test_a_peer_with_another_uid_is_refused(shared_dir):
    _skip_unless_root_and_nobody()
    path = shared_dir / "hw.sock"
    s_ = FakeSupervisor(path)
    try:
        # Mode 0600 keeps another uid out at the file system already ...
        assert _as_nobody(path) == ["EACCES"]
        # ... and should the mode be widened, SO_PEERCRED still refuses it.
        os.chmod(path, 0o666)
        lines = _as_nobody(path)
        assert json.loads(lines[0]) == {"ok": False, "error": "unauthorised: uid 65534 is not uid 0"}
        assert lines[1] == "closed"
        assert s_.requests == []
        assert Client(path).call("status")["state"] == "running"  # the owner still is served
    finally:
        s_.close()


def test_a_member_of_the_configured_group_is_served(shared_dir):
    _skip_unless_root_and_nobody()
    path = shared_dir / "hw.sock"
    s_ = FakeSupervisor(path, group=grp.getgrgid(65534).gr_name)
    try:
        lines = _as_nobody(path, "--shut")
        assert json.loads(lines[0])["ok"] is True
        assert s_.requests == [{"cmd": "status"}]
    finally:
        s_.close()


# ---- where the socket lives; stale and live sockets ------------------------------------------


def test_a_stale_socket_is_replaced(tmp_path):
    path = tmp_path / "hw.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens: what a killed supervisor leaves behind
    with pytest.raises(DaemonUnavailable, match=r"no hangwatch running at .*hw.sock \(connection refused\)"):
        Client(path).call("status")
    s_ = FakeSupervisor(path)
    try:
        assert Client(path).call("status")["state"] == "running"
    finally:
        s_.close()


def test_a_live_socket_makes_a_second_server_refuse_to_start(sup):
    with pytest.raises(ControlSocketError, match="another hangwatch is already running on .*hw.sock"):
        ControlServer(sup.path)
    assert Client(sup.path).call("status")["state"] == "running"  # the first one is untouched


def test_a_regular_file_in_the_way_is_never_deleted(tmp_path):
    path = tmp_path / "hw.sock"
    path.write_text("precious")
    with pytest.raises(ControlSocketError, match="exists and is not a socket"):
        ControlServer(path)
    assert path.read_text() == "precious"


def test_close_leaves_a_socket_that_another_server_now_owns(tmp_path):
    path = tmp_path / "hw.sock"
    first = ControlServer(path)
    os.unlink(path)
    second = ControlServer(path)
    first.close()
    assert path.exists()
    second.close()
    assert not path.exists()


def test_paths_longer_than_sun_path_work(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    path = deep / "hangwatch.sock"
    assert len(str(path)) > 108
    s_ = FakeSupervisor(path)
    try:
        assert Client(path).call("status")["state"] == "running"
    finally:
        s_.close()


def _cfg(socket_path=None, run_dir="/nonexistent"):
    return SimpleNamespace(
        run_dir=run_dir, control=SimpleNamespace(socket=socket_path, group=None, max_request_bytes=65536)
    )


def test_socket_path_defaults(tmp_path):
    assert socket_path_for(_cfg(), tmp_path, environ={}) == tmp_path / "hangwatch.sock"
    assert socket_path_for(_cfg(), tmp_path, environ={"RUNTIME_DIRECTORY": "/run/hangwatch/x"}) == Path(
        "/run/hangwatch/x/hangwatch.sock"
    )
    assert socket_path_for(_cfg("/srv/hw.sock"), tmp_path, environ={"RUNTIME_DIRECTORY": "/run/x"}) == Path(
        "/srv/hw.sock"
    )


def test_a_socket_outside_the_run_dir_is_recorded_there(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "rt"
    elsewhere.mkdir()
    server = ControlServer(elsewhere / "hw.sock", run_dir=run_dir)
    try:
        assert (run_dir / SOCKET_PATH_FILE).read_text().strip() == str((elsewhere / "hw.sock").resolve())
        assert resolve_socket(run_dir=run_dir) == (elsewhere / "hw.sock").resolve()
    finally:
        server.close()
    # The same run dir later served from inside: the record goes, the default applies.
    server = ControlServer(run_dir / "hangwatch.sock", run_dir=run_dir)
    try:
        assert not (run_dir / SOCKET_PATH_FILE).exists()
        assert socket_path_in(run_dir) == run_dir / "hangwatch.sock"
    finally:
        server.close()


def test_client_errors_are_one_clear_line(tmp_path):
    with pytest.raises(DaemonUnavailable, match=r"^no hangwatch running at .*nope.sock \(no such socket\)$"):
        Client(tmp_path / "nope.sock").call("status")
    with pytest.raises(DaemonUnavailable, match=r"^no run directory at "):
        resolve_socket(run_dir=tmp_path / "missing")
    # A listener that accepts and never answers: a timeout, not a hang.
    path = tmp_path / "mute.sock"
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(path))
    mute.listen()
    try:
        with pytest.raises(DaemonUnavailable, match=r"did not answer within 0.5s"):
            Client(path, timeout=0.5).call("status")
    finally:
        mute.close()


# ---- one conversation, without a socket ---------------------------------------------------------


def _talk(chunks: list[bytes], limit: int = 64) -> tuple[list[dict], list[str], bool]:
    """Feed `chunks` (b"": end of input) to a Conversation; (replies, commands handled, hung up)."""
    handled: list[str] = []

    def handler(req):
        handled.append(req["cmd"])
        return {"ok": True, "result": req["cmd"]}

    conv = Conversation(peer=PeerCred(pid=1, uid=0, gid=0), max_request_bytes=limit)
    for chunk in chunks:
        conv.received(chunk)
        conv.process(handler)
    replies = [json.loads(line) for line in bytes(conv.outbuf).split(b"\n")[:-1]]
    return replies, handled, conv.hangup


CONVERSATIONS = [
    # chunks, results (or errors), commands handled, hung up
    ([b'{"cmd":"a"}\n{"cmd":"b"}\n'], ["a", "b"], ["a", "b"], False),
    ([b'{"cmd":', b'"a"}', b"\n"], ["a"], ["a"], False),  # a line split across reads
    ([b'{"cmd":"a"}', b""], ["a"], ["a"], True),  # end of input ends the last line
    ([b"\n  \n", b'{"cmd":"a"}\n'], [EMPTY_REQUEST, EMPTY_REQUEST, "a"], ["a"], False),  # an empty line is answered
    ([b'{"cmd":"a"}\n', b"  ", b""], ["a"], ["a"], True),  # bare whitespace before the end is no line
    (
        [b'{"cmd":"a","pad":"' + b"x" * 80 + b'"}\n{"cmd":"b"}\n'],
        ["request larger than 64 bytes; closing connection"],
        [],
        True,
    ),
    ([b"x" * 65], ["request larger than 64 bytes; closing connection"], [], True),  # no newline yet, already too long
    (
        [b"x" * 65, b'{"cmd":"b"}\n'],
        ["request larger than 64 bytes; closing connection"],
        [],
        True,
    ),  # the rest is dropped
    ([b'{"cmd":"a"}\n', b"", b'{"cmd":"b"}\n'], ["a"], ["a"], True),  # nothing after end of input
]


@pytest.mark.parametrize(
    "chunks, results, handled, hung_up", CONVERSATIONS, ids=[f"c{i}" for i in range(len(CONVERSATIONS))]
)
def test_conversation_framing(chunks, results, handled, hung_up):
    replies, seen, hangup = _talk(chunks)
    assert [r.get("result", r.get("error")) for r in replies] == results
    assert (seen, hangup) == (handled, hung_up)
