"""The inbox's small pure parts, table-tested: the frontier of a position, counter-based replay
draws and the pool they pick from, the ledger's cut/record (torn tail included), the status line counter."""

from __future__ import annotations

import json

import pytest

from hangwatch.common.durable import FsOps
from hangwatch.common.inbox_layout import DataName, LineCounter, Stage, queue_status, with_priority
from hangwatch.daemon.inbox.ledger import Ledger, read_jsonl
from hangwatch.daemon.inbox.position import INF_LINE, PositionError, check_position, covers_file, frontier
from hangwatch.daemon.inbox.publish import free_name, unique_names
from hangwatch.daemon.inbox.replay import Replay, ReplayPool, uniform

DN = DataName(3, "0123456789abcdef", "a.jsonl")


def pos(**kw):
    base = {"kind": "inbox", "v": 1, "take": 0, "next": 0, "rng": 0, "replay_n": 0, "file": None, "line": None}
    return {**base, **kw}


@pytest.mark.parametrize(
    "position,front",
    [
        (None, (0, 0)),
        (pos(), (0, 0)),  # fresh: nothing trained
        (pos(take=4), (4, INF_LINE)),  # no current file: everything up to take 4 is done
        (pos(take=3, file=DN.filename, line=7), (3, 7)),
        (pos(take=3, file=DN.filename, line=None), (3, INF_LINE)),  # the file's last example was taken
    ],
)
def test_frontier(position, front):
    assert frontier(position) == front


@pytest.mark.parametrize(
    "front,covered", [((3, INF_LINE), True), ((4, 0), True), ((3, 7), False), ((2, INF_LINE), False)]
)
def test_a_file_is_covered_only_when_its_last_example_is_below_the_frontier(front, covered):
    assert covers_file(front, DN) is covered


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "shuffled_epochs", "epoch": 0},
        pos(v=2),
        pos(take=-1),
        pos(rng="3"),
        pos(file="not-a-data-name.jsonl"),
    ],
)
def test_a_foreign_or_damaged_position_is_refused(bad):
    with pytest.raises(PositionError):
        check_position(bad)


def test_draws_depend_only_on_seed_and_counter():
    assert uniform(1, 5) == uniform(1, 5)
    assert uniform(1, 5) != uniform(2, 5) and uniform(1, 5) != uniform(1, 6)
    assert all(0 <= uniform(0, k) < 1 for k in range(200))


def test_pool_locates_examples_across_files():
    pool = ReplayPool()
    pool.add("a", 2)
    pool.add("empty", 0)  # never drawn
    pool.add("b", 3)
    assert pool.total == 5
    assert [pool.locate(r) for r in range(5)] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]


def test_replay_spends_one_draw_per_coin_and_one_per_pick():
    r = Replay(0.5, seed=7)
    assert r.coin() is False and r.draws == 1  # empty pool: never a replay, but the draw is spent
    r.pool.add("a", 4)
    coins = [r.coin() for _ in range(40)]
    assert r.draws == 41 and any(coins) and not all(coins)
    r.pick()
    assert r.draws == 42
    r.record("id:1", "a", 1)
    r.record("id:2", "a", 2)
    r.forget_logged(1)
    assert r.count == 2 and r.unlogged == [[2, "id:2", "a", 2]]
    assert Replay(0.0, seed=7).coin() is False


def test_replay_ratio_must_be_below_one():
    with pytest.raises(ValueError):
        Replay(1.0, seed=0)


def test_ledger_cut_and_record(tmp_path):
    Stage.DONE.dir(tmp_path).mkdir(parents=True)
    ledger = Ledger(tmp_path, FsOps())
    a, b = DataName(1, "a" * 16, "a.jsonl"), DataName(2, "b" * 16, "b.jsonl")
    assert ledger.record([(a, 1), (a, 2), (b, 1)], step=1) == 3
    assert ledger.last_key == (2, 1)
    ledger.reset()
    trimmed, counts = ledger.cut((2, 0))  # resume before b's first example
    assert trimmed == 1 and counts == {a.filename: 2} and ledger.last_key == (1, 2)
    assert [obj["id"] for _, obj in read_jsonl(ledger.examples_path, FsOps())] == ["a" * 16 + ":1", "a" * 16 + ":2"]


def test_a_torn_last_line_is_cut_off_but_a_bad_middle_line_is_left(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"n": 1}\nnot json\n{"n": 2}\n{"n": 3')
    assert [obj["n"] for _, obj in read_jsonl(path, FsOps())] == [1, 2]
    assert path.read_bytes() == b'{"n": 1}\nnot json\n{"n": 2}\n'


def test_ledger_replays_log_only_new_draws_up_to_the_position(tmp_path):
    Stage.DONE.dir(tmp_path).mkdir(parents=True)
    ledger = Ledger(tmp_path, FsOps())
    draws = [[1, "x:1", "f", 1], [2, "x:2", "f", 2], [3, "x:3", "f", 3]]
    assert ledger.record_replays(draws, upto_n=2, step=5) == 2
    assert ledger.record_replays(draws, upto_n=3, step=6) == 1  # 1 and 2 are logged already
    ledger.reset()
    assert ledger.cut_replays(1) == 2 and ledger.replays_logged == 1


def test_line_counter_reads_only_what_was_appended(tmp_path):
    path = tmp_path / "ledger.jsonl"
    counter = LineCounter()
    assert counter.count(path) == 0
    path.write_bytes(b"a\nb\n")
    assert counter.count(path) == 2
    with open(path, "ab") as f:
        f.write(b"c\n")
    assert counter.count(path) == 3
    path.write_bytes(b"x\n")  # truncated (a rollback): counted again from the start
    assert counter.count(path) == 1


def test_queue_status_counts_the_ledger_with_or_without_a_counter(tmp_path):
    done = Stage.DONE.dir(tmp_path)
    done.mkdir(parents=True)
    (done / "ledger.jsonl").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(3)))
    counter = LineCounter()
    assert queue_status(tmp_path, counter)["ledger_examples"] == 3
    assert queue_status(tmp_path)["ledger_examples"] == 3


@pytest.mark.parametrize("name,priority,out", [("a.jsonl", 5, "p5-a.jsonl"), ("p1-a.jsonl", 9, "p9-a.jsonl")])
def test_with_priority_sets_or_replaces_the_prefix(name, priority, out):
    assert with_priority(name, priority) == out


def test_free_name_skips_taken_names(tmp_path):
    (tmp_path / "d.jsonl").write_text("")
    (tmp_path / "d-2.jsonl").write_text("")
    assert free_name(tmp_path, "d.jsonl") == "d-3.jsonl"
    names = unique_names("noext")
    assert [next(names) for _ in range(3)] == ["noext", "noext-2", "noext-3"]
