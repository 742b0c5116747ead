"""The control socket under load: the bounded connection table (who is evicted, who is refused), the
per-process cap, over-long lines closed at once, empty lines answered, refused peers let go.

The decisions are table-tested as pure functions; the server's use of them runs against real Unix
sockets, polled from the test's own thread on a fake clock (fixtures.fakes.control_peers)."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Optional

import pytest
import structlog
from fixtures.fakes.control_peers import Deferred, Peer, raw
from fixtures.fakes.polled_server import PolledServer

from hangwatch.supervisor.cli.client import Client, DaemonUnavailable
from hangwatch.supervisor.control import PeerCred, PeerPolicy
from hangwatch.supervisor.control.admission import YOUNG_S, Limits, admit, eviction_key, oldest_idle, over_share
from hangwatch.supervisor.control.conversation import EMPTY_REQUEST
from hangwatch.supervisor.control.server import EVICTION_LOG_EVERY_S, LINGER_S

ME, OTHER = PeerCred(pid=100, uid=1000, gid=1000), PeerCred(pid=200, uid=1000, gid=1000)


@dataclass(eq=False)
class Slot:
    name: str
    last_active: float
    peer: PeerCred = ME
    pending: Optional[object] = None
    outbuf: bytearray = field(default_factory=bytearray)
    inbuf: bytearray = field(default_factory=bytearray)
    hangup: bool = False
    replies: int = 0
    seq: int = 0
    accepted: float = 0.0


def silent(name, t, **kw):
    return Slot(name, t, **kw)


def waiting(name, t, **kw):  # owed a deferred reply
    return Slot(name, t, pending=object(), **kw)


def unsent(name, t, **kw):  # owed reply bytes the peer has not taken yet
    return Slot(name, t, outbuf=bytearray(b"{}\n"), **kw)


def arriving(name, t, **kw):  # accepted at t, has asked nothing yet
    return Slot(name, t, accepted=t, **kw)


NOW = 100.0  # the admission tables' clock: every slot above was accepted long enough ago not to be young


# ---- which idle connection leaves first ------------------------------------------------------------

VICTIMS = [
    # slots, the one that leaves (None: nobody may)
    ([silent("a", 5), silent("b", 1), silent("c", 3)], "b"),  # the longest silent
    ([silent("old", 0), silent("done", 9, hangup=True)], "done"),  # one being let go anyway, whatever its age
    ([silent("asking", 0, inbuf=bytearray(b'{"cmd"')), silent("quiet", 9)], "quiet"),  # half a line leaves last
    ([silent("asking", 0, inbuf=bytearray(b'{"cmd"'))], "asking"),  # ... but it does leave
    ([silent("new", 4), silent("answered", 4, replies=1)], "answered"),  # equal silence: the one served already
    (
        [silent("new", 1), silent("answered", 5, replies=1)],
        "answered",
    ),  # served leaves before not yet asked, however new
    ([silent("a", 5, replies=1), silent("b", 1, replies=2)], "b"),  # among the served: the longest silent
    ([silent("second", 4, seq=2), silent("first", 4, seq=1)], "first"),  # equal in all: accept order
    ([waiting("dump", 0), unsent("slow", 0), silent("idle", 9)], "idle"),  # owed something: never
    ([waiting("dump", 0), unsent("slow", 1)], None),
    ([unsent("refused", 0, hangup=True)], None),  # its refusal is still on its way
]


@pytest.mark.parametrize("slots, victim", VICTIMS, ids=[f"v{i}" for i in range(len(VICTIMS))])
def test_the_oldest_idle_connection_leaves_first(slots, victim):
    chosen = oldest_idle(slots)
    assert (chosen.name if chosen else None) == victim
    assert all((eviction_key(s) is None) == (s.pending is not None or bool(s.outbuf)) for s in slots)


# ---- admission: the table bound, the per-process cap ------------------------------------------------

ADMISSIONS = [
    # limits (table, per process), slots, evicted, refusal
    ((3, 3), [silent("a", 0), silent("b", 1)], [], None),  # room: nobody leaves
    ((3, 3), [silent("a", 1), silent("b", 0, peer=OTHER), silent("c", 2)], ["b"], None),  # full: anyone's
    (
        (9, 2),
        [silent("mine", 5), silent("theirs", 0, peer=OTHER), silent("mine2", 6)],
        ["mine"],
        None,
    ),  # at my cap: mine
    (
        (9, 2),
        [waiting("m1", 0), waiting("m2", 0), silent("theirs", 0, peer=OTHER)],
        [],
        "busy: process 100 already has 2 control connections, all waiting for replies (at most 2 per process)",
    ),
    (
        (3, 3),
        [waiting("a", 0), unsent("b", 0, peer=OTHER), waiting("c", 0)],
        [],
        "busy: all 3 control connections are waiting for replies",
    ),
    (
        (3, 2),
        [silent("theirs", 0, peer=OTHER), silent("m1", 1), silent("m2", 2)],
        ["m1"],
        None,
    ),  # my own place is enough
    # The same pid under another uid is another process (another pid namespace): not mine.
    ((9, 1), [silent("ns", 0, peer=PeerCred(pid=100, uid=2000, gid=2000))], [], None),
    # A burst from one process: its newest, which asked nothing yet, are spared; it may pass its share while the table
    # has room.
    ((9, 2), [arriving("m1", NOW - 1), arriving("m2", NOW - 0.5)], [], None),
    ((9, 2), [arriving("m1", NOW - 1), silent("m0", 0, replies=1), arriving("m2", NOW - 0.5)], ["m0"], None),
    (
        (9, 2),
        [silent("m0", 0), silent("m1", 1), silent("m2", 2), silent("m3", 3)],
        ["m0", "m1", "m2"],
        None,
    ),  # past its share before
    ((9, 2), [arriving("m1", NOW - YOUNG_S - 1), arriving("m2", NOW - 0.5)], ["m1"], None),  # aged: no longer spared
    (
        (9, 2),
        [Slot("m1", NOW - 1, accepted=NOW - 1, inbuf=bytearray(b"{")), arriving("m2", NOW - 0.5)],
        ["m1"],
        None,
    ),  # asking
    (
        (3, 3),
        [arriving("m1", NOW - 1), arriving("t", NOW - 2, peer=OTHER), arriving("m2", NOW - 0.5)],
        ["t"],
        None,
    ),  # a full table spares nobody
]


@pytest.mark.parametrize("limits, slots, evicted, refusal", ADMISSIONS, ids=[f"a{i}" for i in range(len(ADMISSIONS))])
def test_admission(limits, slots, evicted, refusal):
    decision = admit(ME, slots, Limits(*limits), NOW)
    assert [s.name for s in decision.evict] == evicted
    assert decision.refusal == refusal
    own = [s for s in slots if s.peer == ME and s not in decision.evict]
    assert decision.over_share == (refusal is None and len(own) + 1 > limits[1])


SHARES = [
    # per process, slots, evicted, a process still over its share
    (2, [silent("a", 1), silent("b", 2)], [], False),
    (2, [silent("a", 1), silent("b", 2), silent("c", 3, replies=1), silent("t", 0, peer=OTHER)], ["c"], False),
    (2, [silent("a", 1), arriving("b", NOW - 1), arriving("c", NOW - 1)], ["a"], False),
    (1, [arriving("b", NOW - 1), arriving("c", NOW - 1)], [], True),  # both still arriving: wait
    (1, [waiting("d", 0), silent("a", 5)], ["a"], False),
    (1, [waiting("d", 0), unsent("u", 0)], [], True),  # owed something: kept, the process stays over
]


@pytest.mark.parametrize("per_process, slots, evicted, over", SHARES, ids=[f"s{i}" for i in range(len(SHARES))])
def test_a_process_over_its_share_gives_back_its_oldest_idle_once_they_are_not_arriving(
    per_process, slots, evicted, over
):
    chosen, still_over = over_share(slots, Limits(9, per_process), NOW)
    assert sorted(s.name for s in chosen) == sorted(evicted)
    assert still_over == over


@pytest.mark.parametrize(
    "nofile, table, per_process",
    [
        (20000, 256, 64),
        (1024, 256, 64),
        (256, 64, 16),
        (40, 16, 4),
        (8, 16, 4),
    ],
)
def test_limits_derive_from_the_file_descriptor_limit(nofile, table, per_process):
    assert Limits.for_fd_limit(nofile) == Limits(table, per_process)


def test_limits_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match=r"max_per_peer \(5\) <= max_clients \(4\)"):
        Limits(max_clients=4, max_per_peer=5)


# ---- the server -------------------------------------------------------------------------------------


def connect(d: Deferred, *, wait_s: float = 1.0) -> Peer:
    """A new connection, accepted, then `wait_s` of silence on the fake clock."""
    before = d.server.connected
    peer = Peer(d.path)
    d.poll_until(lambda: d.server.connected == before + 1, "the connection to be accepted")
    d.now += wait_s
    return peer


def ask_status(d: Deferred, peer: Peer) -> None:
    peer.send({"cmd": "status"})
    d.poll_until(lambda: peer.replies() == [{"ok": True, "result": "status"}], "the status reply")


@pytest.fixture
def tight(tmp_path):
    """A server whose table holds three connections."""
    d = Deferred(tmp_path / "hw.sock", limits=Limits(max_clients=3, max_per_peer=3))
    yield d
    d.server.close()


def test_a_full_table_makes_room_by_closing_the_oldest_idle_connection(tight):
    oldest, middle, newest = connect(tight), connect(tight), connect(tight)
    with structlog.testing.capture_logs() as logged:
        late = Peer(tight.path)
        ask_status(tight, late)
    assert oldest.hung_up() and not middle.hung_up() and not newest.hung_up()
    assert tight.server.connected == 3
    assert [(e["event"], e["count"]) for e in logged if e["log_level"] == "info"] == [("control clients evicted", 1)]
    # The survivors are still served.
    ask_status(tight, middle)


def test_a_flood_of_evictions_is_one_log_line_then_a_count_at_most_every_minute(tight):
    held = [connect(tight) for _ in range(3)]
    with structlog.testing.capture_logs() as logged:
        for oldest in range(4):  # each newcomer displaces the oldest, and then stays idle itself
            held.append(Peer(tight.path))
            tight.poll_until(held[oldest].hung_up, "the oldest to make room")
            tight.now += 1
        tight.passes(3)
        counts = [e["count"] for e in logged if e["event"] == "control clients evicted"]
        assert counts == [1]  # the first at once, the next three counted
        assert sum(p.hung_up() for p in held) == 4 and tight.server.connected == 3
        tight.now += EVICTION_LOG_EVERY_S
        tight.passes(1)
        counts = [e["count"] for e in logged if e["event"] == "control clients evicted"]
        assert counts == [1, 3]


def test_a_connection_waiting_for_a_deferred_reply_is_not_idle(tight):
    dumping = connect(tight, wait_s=0)
    dumping.send({"cmd": "dump"})
    tight.poll_until(lambda: tight.seen == ["dump"], "the dump request")
    tight.now += 1
    idle1, idle2 = connect(tight), connect(tight)
    late = Peer(tight.path)
    ask_status(tight, late)
    assert idle1.hung_up() and not idle2.hung_up() and not dumping.hung_up()
    tight.now += 5
    tight.poll_until(lambda: dumping.replies() == [{"ok": True, "result": "dumped"}], "the dump reply")


def test_when_every_connection_is_owed_a_reply_a_newcomer_hears_busy(tight):
    owed = [connect(tight, wait_s=0) for _ in range(3)]
    for peer in owed:
        peer.send({"cmd": "dump"})
    tight.poll_until(lambda: tight.seen == ["dump"] * 3, "three dump requests")
    late = Peer(tight.path)
    late.send({"cmd": "status"})
    with structlog.testing.capture_logs():
        tight.poll_until(late.hung_up, "the newcomer to be refused and closed")
    # All four are this test's process, so its cap (3, the whole table) is what refuses.
    assert late.replies() == [
        {
            "ok": False,
            "error": f"busy: process {os.getpid()} already has 3 control "
            f"connections, all waiting for replies (at most 3 per process)",
        }
    ]
    assert tight.server.connected == 3 and tight.seen == ["dump"] * 3
    tight.now += 5
    tight.poll_until(lambda: all(p.replies() == [{"ok": True, "result": "dumped"}] for p in owed), "the dump replies")


def test_one_process_at_its_cap_gives_up_its_own_oldest(tmp_path):
    d = Deferred(tmp_path / "hw.sock", limits=Limits(max_clients=10, max_per_peer=2))
    try:
        first, second = connect(d), connect(d, wait_s=YOUNG_S)
        late = Peer(d.path)
        with structlog.testing.capture_logs():
            ask_status(d, late)
        assert first.hung_up() and not second.hung_up()
        assert d.server.connected == 2  # the table had room: the cap is the process's
    finally:
        d.server.close()


def test_a_burst_from_one_process_past_its_share_is_answered_then_trimmed_to_its_share(tmp_path):
    d = Deferred(tmp_path / "hw.sock", limits=Limits(max_clients=10, max_per_peer=2))
    try:
        burst = [connect(d, wait_s=0.1) for _ in range(5)]  # accepted before any of them writes
        assert d.server.connected == 5 and not any(p.hung_up() for p in burst)
        for peer in burst[:3]:
            ask_status(d, peer)
        held = burst[3:]
        d.now += YOUNG_S
        with structlog.testing.capture_logs():
            d.passes(2)
        # The three answered were let go; the two silent ones are exactly the share.
        assert d.server.connected == 2 and not any(p.hung_up() for p in held)
        late = Peer(d.path)
        d.poll_until(lambda: d.server.connected == 3 or held[0].hung_up(), "the newcomer")
        ask_status(d, late)
        assert held[0].hung_up() and not held[1].hung_up()  # aged: the oldest makes room as before
    finally:
        d.server.close()


def test_an_over_long_line_is_answered_and_closed_at_once(tmp_path):
    """The clock never moves: the close cannot be the idle timeout, and a server that went on
    reading the flood would let the whole of it through, so `sendall` would succeed."""
    d = Deferred(tmp_path / "hw.sock", max_request_bytes=1024)
    try:
        flooder = raw(d.path)
        outcome: list = []

        def flood():
            try:
                flooder.sendall(b"x" * (8 << 20) + b"\n")
                outcome.append("all sent")
            except OSError as exc:
                outcome.append(type(exc).__name__)

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        with structlog.testing.capture_logs() as logged:
            d.poll_until(lambda: not sender.is_alive(), "the flooder's send to end")
        assert outcome in (["BrokenPipeError"], ["ConnectionResetError"])
        assert d.server.connected == 0 and d.seen == []
        assert flooder.recv(200) == b'{"ok":false,"error":"request larger than 1024 bytes; closing connection"}\n'
        assert [e["event"] for e in logged] == ["control request too large"]
        flooder.close()
        other = Peer(d.path)
        ask_status(d, other)
    finally:
        d.server.close()


def test_the_client_reads_the_refusal_of_a_request_too_large_to_send_whole(tmp_path):
    server = PolledServer(tmp_path / "hw.sock", max_request_bytes=1024)
    try:
        with structlog.testing.capture_logs():
            reply = Client(server.path, timeout=10).request({"cmd": "status", "pad": "x" * (4 << 20)})
        assert reply == {"ok": False, "error": "request larger than 1024 bytes; closing connection"}
        assert server.requests == []
    finally:
        server.close()


def test_the_client_waits_for_room_in_a_full_accept_queue(tmp_path):
    path = tmp_path / "queue.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    fillers = []
    while True:  # fill the queue of connections nobody has accepted yet
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except BlockingIOError:
            s.close()
            break
        fillers.append(s)
    try:
        # Nobody accepts: a bounded wait and a clear error, not an instant "Resource temporarily unavailable".
        with pytest.raises(DaemonUnavailable, match=r"did not accept the connection within 0.3s$"):
            Client(path, timeout=0.3).call("status")
        # Someone accepts: the waiting client gets through.
        got: list = []
        asker = threading.Thread(target=lambda: got.append(Client(path, timeout=10).call("status")))
        asker.start()
        listener.settimeout(10)
        served = False
        while not served:
            conn, _ = listener.accept()
            fillers.append(conn)
            conn.settimeout(0.05)
            try:
                served = bool(conn.recv(100))
            except socket.timeout:
                continue  # a filler: it never asks
            conn.sendall(b'{"ok":true,"result":"served"}\n')
        asker.join(10)
        assert got == ["served"]
    finally:
        for s in fillers:
            s.close()
        listener.close()


def test_an_empty_line_gets_an_error_and_the_connection_stays(tight):
    peer = connect(tight, wait_s=0)
    peer.send_raw(b"\n")
    tight.poll_until(lambda: peer.replies() == [{"ok": False, "error": EMPTY_REQUEST}], "the empty-request error")
    assert EMPTY_REQUEST.startswith("empty request")
    peer.send({"cmd": "status"})
    tight.poll_until(lambda: len(peer.replies()) == 2, "the status reply")
    assert peer.replies()[1] == {"ok": True, "result": "status"} and not peer.hung_up()


@dataclass(frozen=True)
class RefuseAll(PeerPolicy):
    def refusal(self, cred: PeerCred) -> Optional[str]:
        return f"unauthorised: uid {cred.uid} (test policy)"


def test_a_refused_peer_that_never_closes_is_let_go_after_the_linger(tmp_path):
    d = Deferred(tmp_path / "hw.sock", policy=RefuseAll(owner_uid=0))
    try:
        peer = Peer(d.path)
        with structlog.testing.capture_logs():
            d.poll_until(lambda: peer.replies() != [], "the refusal")
        assert peer.replies()[0]["error"].startswith("unauthorised: uid")
        d.passes(3)
        assert d.server.connected == 1  # lingering: it may still close its end cleanly
        d.now += LINGER_S + 0.1
        d.passes(1)
        assert d.server.connected == 0 and d.seen == []
        peer.close()
    finally:
        d.server.close()
