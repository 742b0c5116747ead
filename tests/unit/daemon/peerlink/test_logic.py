"""The peer link's pure parts (hangwatch.daemon.peerlink) against a dict-backed store and a fake clock.

The fake store answers compare_set exactly as torch 2.13's TCPStore does (see the module docstring), quirk
included: on a missing key with a non-empty expected value it sets nothing and returns the expected value.
No torch, no subprocess.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from hangwatch.daemon import peerlink as pl
from hangwatch.daemon.peerlink import KV, Ages, Peerlink
from hangwatch.daemon.peerlink import connect as plc


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.dead = False

    def _alive(self):
        if self.dead:
            raise RuntimeError("Connection was likely closed")

    def check(self, keys):
        self._alive()
        return all(k in self.data for k in keys)

    def get(self, key):
        self._alive()
        if key not in self.data:
            raise RuntimeError(f"wait timeout after 2000ms, keys: /{key}")
        return self.data[key]

    def set(self, key, value):
        self._alive()
        self.data[key] = value.encode()

    def compare_set(self, key, expected, desired):
        self._alive()
        if key not in self.data:
            if expected == "":
                self.data[key] = desired.encode()
                return desired.encode()
            return expected.encode()
        if self.data[key] == expected.encode():
            self.data[key] = desired.encode()
        return self.data[key]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture
def kv():
    return KV(FakeStore(), "hangwatch/r/")


def make_link(store_box: list, node: str, clock=None, events=None):
    """A Peerlink whose connect() hands out store_box[0] (None: connection refused)."""
    events = [] if events is None else events

    def connect():
        if store_box[0] is None or store_box[0].dead:
            raise ConnectionRefusedError("refused")
        return store_box[0], "client"

    link = Peerlink("r", node, connect, events.append, clock=clock or Clock(), endpoint="h:1", pid=7, hostname="box")
    return link, events


def of(events, ev):
    return [e for e in events if e["ev"] == ev]


# ---------------------------------------------------------------- endpoint and hosting decision


@pytest.mark.parametrize(
    "text,want",
    [
        ("127.0.0.1:29500", ("127.0.0.1", 29500)),
        ("node-1:1", ("node-1", 1)),
        ("[::1]:65535", ("::1", 65535)),
        (" h:80 ", ("h", 80)),
    ],
)
def test_endpoints_parse(text, want):
    assert pl.parse_endpoint(text) == want


@pytest.mark.parametrize("text", ["nohost", ":29500", "h:", "h:0", "h:65536", "h:port", "::1:29500", ""])
def test_bad_endpoints_are_refused_naming_the_value(text):
    with pytest.raises(ValueError, match="endpoint") as e:
        pl.parse_endpoint(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize(
    "host,resolved,want",
    [
        ("localhost", [], True),
        ("BOX", [], True),
        ("127.0.0.1", [], True),
        ("127.3.2.1", [], True),
        ("::1", [], True),
        ("10.0.0.5", [], True),  # an address of one of our interfaces
        ("fe80::1%eth0", [], True),
        ("other", ["10.0.0.5"], True),  # a name that resolves to one of ours
        ("other", ["127.0.1.1"], True),
        ("10.0.0.6", [], False),
        ("other", ["10.0.0.6"], False),
        ("other", [], False),
    ],
)
def test_the_hosting_decision(host, resolved, want):
    assert pl.is_local(host, "box", {"10.0.0.5", "fe80::1"}, resolved) is want


# ---------------------------------------------------------------- compare-set building blocks


def test_gen_is_created_once_and_never_lowered(kv):
    assert pl.ensure_gen_at_least(kv, 0) == 0
    assert kv.read("gen") == "0"
    kv.write("gen", "4")
    assert pl.ensure_gen_at_least(kv, 2) == 4  # a higher store gen stays
    assert pl.ensure_gen_at_least(kv, 9) == 9  # a lower one is raised to what we knew
    assert kv.read("gen") == "9"


def test_a_fresh_store_is_seeded_with_the_known_gen(kv):
    assert pl.ensure_gen_at_least(kv, 5) == 5 and kv.read("gen") == "5"


def test_members_append_keeps_everyone(kv):
    assert pl.join_members(kv, "a") == ["a"]
    assert pl.join_members(kv, "b") == ["a", "b"]
    assert pl.join_members(kv, "a") == ["a", "b"]  # joining again adds nothing


def test_members_append_retries_when_the_list_changed_under_it(kv):
    real = kv.cas
    raced = []

    def cas(key, expected, desired):
        if key == "members" and expected != "" and not raced:  # another node appends in between
            raced.append(1)
            real("members", expected, json.dumps(json.loads(expected) + ["c"]))
        return real(key, expected, desired)

    pl.join_members(kv, "a")
    kv.cas = cas
    assert pl.join_members(kv, "b") == ["a", "c", "b"]


def test_bump_from_the_current_gen_wins_and_writes_the_notice(kv):
    pl.ensure_gen_at_least(kv, 0)
    mine, gen, notice = pl.bump(kv, 0, {"why": "stall"}, {"by": "a"})
    assert (mine, gen, notice) == (True, 1, {"why": "stall"})
    assert kv.read("gen") == "1" and json.loads(kv.read("notice/1")) == {"why": "stall"}


def test_a_stale_bump_loses_and_learns_the_current_notice(kv):
    pl.ensure_gen_at_least(kv, 0)
    pl.bump(kv, 0, {"why": "a"}, {"by": "a"})
    assert pl.bump(kv, 0, {"why": "b"}, {"by": "b"}) == (False, 1, {"why": "a"})
    assert json.loads(kv.read("notice/1")) == {"why": "a"}  # the loser's notice is written nowhere


def test_the_race_compare_set_alone_would_lose(kv):
    """Both read gen 0; a compare_set 0→1 returns "1" to both, so the claim key decides."""
    pl.ensure_gen_at_least(kv, 0)
    assert kv.cas("gen", "0", "1") == "1" and kv.cas("gen", "0", "1") == "1"  # why a bare compare_set won't do
    kv.write("gen", "0")
    real_read = kv.read
    kv.read = lambda key: "0" if key == "gen" else real_read(key)  # both saw gen 0 before either claimed
    results = [pl.bump(kv, 0, {"why": n}, {"by": n}) for n in "ab"]
    assert [r[0] for r in results] == [True, False]
    assert [r[1:] for r in results] == [(1, {"why": "a"})] * 2


def test_a_claimed_bump_whose_winner_died_is_finished_by_the_next_bumper(kv):
    pl.ensure_gen_at_least(kv, 0)
    pl.create_once(kv, "bump/0", json.dumps({"by": "a", "nonce": "x", "notice": {"why": "a"}}))  # then a died
    assert kv.read("gen") == "0"
    assert pl.bump(kv, 0, {"why": "b"}, {"by": "b"}) == (False, 1, {"why": "a"})


def test_a_beat_rolls_a_half_finished_bump_forward(kv):
    pl.ensure_gen_at_least(kv, 3)
    assert pl.roll_forward(kv, 3) == 3  # nothing claimed
    pl.create_once(kv, "bump/3", json.dumps({"by": "a", "nonce": "x", "notice": {"n": 1}}))
    assert pl.roll_forward(kv, 3) == 4 and json.loads(kv.read("notice/4")) == {"n": 1}


def test_resume_first_proposal_wins(kv):
    first = pl.agree_resume(kv, 2, {"path": "/ck/step-10", "step": 10}, "a")
    assert first == {"path": "/ck/step-10", "step": 10, "by": "a"}
    assert pl.agree_resume(kv, 2, {"path": "/ck/step-20", "step": 20}, "b") == first
    assert pl.agree_resume(kv, 2, None, "b") == first
    assert pl.agree_resume(kv, 3, None, "b") == {"path": None, "step": None, "by": "b"}  # per generation


# ---------------------------------------------------------------- ages


def test_age_counts_from_the_last_seq_change():
    clock = Clock()
    ages = Ages(clock)
    ages.saw("b", {"seq": 1})
    clock.t += 2
    ages.saw("b", {"seq": 1})
    assert ages.table("a", {"seq": 9})["b"]["age_s"] == 2.0
    ages.saw("b", {"seq": 2})
    clock.t += 0.5
    t = ages.table("a", {"seq": 9})
    assert t["b"] == {"age_s": 0.5, "record": {"seq": 2}} and t["a"] == {"age_s": 0.0, "record": {"seq": 9}}
    ages.saw("b", {"seq": 1})  # a restarted helper counts again from 1: a change too
    assert ages.table("a", None)["b"]["age_s"] == 0.0 and "a" not in ages.table("a", None)


# ---------------------------------------------------------------- the whole link on a fake store


def test_two_links_agree_through_one_store():
    box, clock = [FakeStore()], Clock()
    a, ea = make_link(box, "a", clock)
    b, eb = make_link(box, "b", clock)
    a.beat(), b.beat()
    assert of(ea, "store")[0] == {"ev": "store", "ok": True, "role": "client", "endpoint": "h:1"}
    assert of(ea, "gen") == [{"ev": "gen", "gen": 0, "notice": None}] == of(eb, "gen")
    a.handle(json.dumps({"op": "status", "record": {"state": "train", "seq": -1}}))
    a.handle(json.dumps({"op": "bump", "id": "x", "from": 0, "notice": {"why": "stall"}}))
    assert of(ea, "bumped") == [
        {"ev": "bumped", "id": "x", "from": 0, "gen": 1, "mine": True, "notice": {"why": "stall"}}
    ]
    b.handle(json.dumps({"op": "bump", "id": "y", "from": 0, "notice": {"why": "other"}}))
    assert of(eb, "bumped")[0]["mine"] is False and of(eb, "bumped")[0]["notice"] == {"why": "stall"}
    a.beat()
    clock.t += 3
    b.beat()
    peers = of(eb, "peers")[-1]["nodes"]
    assert peers["a"]["record"]["state"] == "train" and peers["a"]["record"]["seq"] > 0  # seq is ours, not theirs
    assert peers["b"]["age_s"] == 0.0 and peers["a"]["age_s"] == 0.0
    clock.t += 3
    b.beat()  # a did not beat
    assert of(eb, "peers")[-1]["nodes"]["a"]["age_s"] == 3.0
    assert json.loads(box[0].data["hangwatch/r/members"]) == ["a", "b"]


def test_an_outage_is_reported_once_and_a_new_store_is_seeded():
    box, clock = [FakeStore()], Clock()
    b, eb = make_link(box, "b", clock)
    b.beat()
    b.handle(json.dumps({"op": "bump", "id": 1, "from": 0, "notice": {"why": "n1"}}))
    box[0].dead = True
    for _ in range(3):
        b.beat()
    assert [e["ok"] for e in of(eb, "store")] == [True, False]
    b.handle(json.dumps({"op": "agree_resume", "id": 2, "gen": 1, "proposal": None}))
    assert eb[-1] == {"ev": "error", "id": 2, "op": "agree_resume", "error": "store unavailable; retry"}
    box[0] = FakeStore()  # re-hosted, empty
    b.beat()
    assert [e["ok"] for e in of(eb, "store")] == [True, False, True]
    assert of(eb, "gen")[-1] == {"ev": "gen", "gen": 1, "notice": {"why": "n1"}}  # not back to 0, notice kept
    assert box[0].data["hangwatch/r/gen"] == b"1" and json.loads(box[0].data["hangwatch/r/members"]) == ["b"]
    b.handle(json.dumps({"op": "bump", "id": 3, "from": 1, "notice": {}}))
    assert of(eb, "bumped")[-1]["mine"] is True and of(eb, "bumped")[-1]["gen"] == 2


def test_a_store_with_a_lower_gen_is_raised():
    box = [FakeStore()]
    b, eb = make_link(box, "b")
    b.beat()
    b.handle(json.dumps({"op": "bump", "id": 1, "from": 0, "notice": {"k": 1}}))
    box[0].data["hangwatch/r/gen"] = b"0"  # someone who knew less re-hosted it (same connection, for the test)
    b.beat()
    assert box[0].data["hangwatch/r/gen"] == b"1" and [e["gen"] for e in of(eb, "gen")] == [0, 1]


@pytest.mark.parametrize(
    "line,needle",
    [
        ("garbage", "unparseable"),
        ("[1, 2]", "unparseable"),
        ('{"op": "fly"}', "unknown op"),
        ('{"op": "bump", "id": 1}', "from"),
        ('{"op": "bump", "from": 0}', "id"),
        ('{"op": "bump", "id": 1, "from": "0"}', "from"),
        ('{"op": "agree_resume", "id": 1}', "gen"),
        ('{"op": "agree_resume", "id": 1, "gen": 0, "proposal": "x"}', "proposal"),
        ('{"op": "status"}', "record"),
    ],
)
def test_bad_commands_answer_an_error_and_keep_going(line, needle):
    box = [FakeStore()]
    a, ea = make_link(box, "a")
    assert a.handle(line) is True
    assert ea[-1]["ev"] == "error" and needle in ea[-1]["error"]
    assert a.handle('{"op": "quit"}') is False


# ---------------------------------------------------------------- bounded calls (no torch: a store that hangs)


class HangingStore(FakeStore):
    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def compare_set(self, key, expected, desired):
        self.release.wait(30)  # a frozen host: no answer
        return super().compare_set(key, expected, desired)


def test_a_store_call_that_gets_no_answer_gives_up_and_poisons_the_connection():
    store = HangingStore()
    bounded = plc.Bounded(store, 0.2)
    bounded.set("k", "v")
    assert bounded.get("k") == b"v"
    with pytest.raises(TimeoutError, match="compare_set"):
        bounded.compare_set("k", "v", "w")
    with pytest.raises(TimeoutError):  # a late answer must not be read as the next call's
        bounded.get("k")
    store.release.set()


def test_store_errors_pass_through_bounded_calls():
    store = FakeStore()
    store.dead = True
    with pytest.raises(RuntimeError, match="closed"):
        plc.Bounded(store, 1.0).check(["k"])


def test_connecting_runs_in_the_background_and_is_not_an_outage_while_it_runs():
    go, store = threading.Event(), FakeStore()

    def slow_connect():
        go.wait(30)
        return store, "client"

    events = []
    link = Peerlink("r", "a", plc.AsyncConnect(slow_connect, 1.0), events.append, clock=Clock())
    link.beat()
    link.handle(json.dumps({"op": "bump", "id": 1, "from": 0, "notice": None}))  # answered at once, no store yet
    assert [e["ev"] for e in events] == ["peers", "error"]
    go.set()
    deadline = time.monotonic() + 10
    while not of(events, "store") and time.monotonic() < deadline:
        time.sleep(0.02)
        link.beat()
    assert of(events, "store")[0]["ok"] is True and of(events, "gen")[0]["gen"] == 0
    assert isinstance(link.kv.store, plc.Bounded)
