"""ContinuousSource: training order, stable ids, position/restore, replay, commit, rollback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from fixtures.fakes.inbox_support import jsonl, validator, write  # noqa: E402

from hangwatch.common.inbox_layout import Stage, data_files, queue_status
from hangwatch.daemon.inbox.intake import Inbox
from hangwatch.daemon.inbox.position import PositionError
from hangwatch.daemon.inbox.source import ContinuousSource


def queue_files(run: Path, files: dict[str, str], on_bad_lines: str = "reject_file") -> dict[str, str]:
    """Intake `files` (name → content) in order; returns name → sha16."""
    inbox = Inbox(run, validator, on_bad_lines=on_bad_lines, settle_s=0)
    out = {}
    for name, content in files.items():
        write(run / "inbox" / name, content)
        result = inbox.intake(name)
        assert result.outcome == "queued", result.assessment.summary()
        out[name] = result.assessment.sha16
    return out


def drain(src: ContinuousSource, limit: int = 10_000) -> list:
    items = []
    while (item := src.next_example()) is not None:
        items.append(item)
        assert len(items) < limit
    return items


def ledger(run: Path) -> list[dict]:
    path = run / "done" / "ledger.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_examples_come_in_queue_order_with_stable_ids(tmp_path):
    run = tmp_path / "run"
    sha = queue_files(run, {"a.jsonl": jsonl(2, "a"), "b.jsonl": "\n" + jsonl(2, "b")})
    src = ContinuousSource(run, validator)
    src.restore(None, 0)
    items = drain(src)
    assert [i.id for i in items] == [
        f"{sha['a.jsonl']}:1",
        f"{sha['a.jsonl']}:2",
        f"{sha['b.jsonl']}:2",
        f"{sha['b.jsonl']}:3",
    ]
    assert items[2].example == {"line": 2, "prompt": "b q0", "completion": "b a0"}
    assert not any(i.replay for i in items)
    # both taken, in take order, and still in processing/: no checkpoint covers them yet
    assert [(d.number, d.name) for d in data_files(run, Stage.PROCESSING)] == [(1, "a.jsonl"), (2, "b.jsonl")]
    assert data_files(run, Stage.QUEUED) == [] and ledger(run) == []


def test_restore_continues_mid_file_exactly_where_the_checkpoint_was(tmp_path):
    run = tmp_path / "run"
    queue_files(run, {"a.jsonl": jsonl(5, "a"), "b.jsonl": jsonl(3, "b")})
    reference = tmp_path / "ref"
    queue_files(reference, {"a.jsonl": jsonl(5, "a"), "b.jsonl": jsonl(3, "b")})
    ref = ContinuousSource(reference, validator, replay_ratio=0.4, seed=3)
    ref.restore(None, 0)
    expected = [(i.id, i.replay) for i in drain(ref)]

    src = ContinuousSource(run, validator, replay_ratio=0.4, seed=3)
    src.restore(None, 0)
    first = [src.next_example() for _ in range(4)]
    pos = json.loads(json.dumps(src.position(step=2)))  # as stored in a checkpoint
    assert pos["file"].endswith("-a.jsonl") and pos["digest"] == pos["file"][9:25]
    lost = [src.next_example() for _ in range(3)]  # trained after the checkpoint, then the process dies
    assert all(lost)

    resumed = ContinuousSource(run, validator, replay_ratio=0.4, seed=3)
    resumed.restore(pos)  # the step comes from the position
    rest = drain(resumed)
    assert [(i.id, i.replay) for i in first + rest] == expected
    # the ledger was brought up to the checkpoint: exactly its fresh examples, each once
    assert [e["id"] for e in ledger(run)] == [i.id for i in first if not i.replay]
    assert {e["step"] for e in ledger(run)} == {2}


def test_replay_draws_only_finished_files_and_is_deterministic(tmp_path):
    run = tmp_path / "run"
    sha = queue_files(run, {"old.jsonl": jsonl(10, "o"), "new.jsonl": jsonl(200, "n")})
    src = ContinuousSource(run, validator, replay_ratio=0.3, seed=7)
    src.restore(None, 0)
    items = drain(src)
    fresh = [i for i in items if not i.replay]
    replays = [i for i in items if i.replay]
    assert len(fresh) == 210 and len({i.id for i in fresh}) == 210
    # none while the first file trains (nothing finished yet); then from old.jsonl only
    assert all(not i.replay for i in items[:10])
    assert replays and all(i.id.startswith(sha["old.jsonl"]) for i in replays)
    assert 0.15 < len(replays) / len(items[10:]) < 0.45
    assert replays[0].example["prompt"].startswith("o q")

    other = tmp_path / "other"
    queue_files(other, {"old.jsonl": jsonl(10, "o"), "new.jsonl": jsonl(200, "n")})
    again = ContinuousSource(other, validator, replay_ratio=0.3, seed=7)
    again.restore(None, 0)
    assert [(i.id, i.replay) for i in drain(again)] == [(i.id, i.replay) for i in items]


def test_commit_records_the_ledger_and_completes_files_only_when_covered(tmp_path):
    run = tmp_path / "run"
    sha = queue_files(run, {"a.jsonl": jsonl(3, "a"), "b.jsonl": jsonl(3, "b")})
    src = ContinuousSource(run, validator, replay_ratio=0.5, seed=11)
    src.restore(None, 0)
    fresh = []
    while len(fresh) < 3:  # all of a.jsonl
        item = src.next_example()
        fresh += [item] if not item.replay else []
    pos = src.position()
    assert pos["next"] == 3 and pos["line"] is None  # a.jsonl finished, b.jsonl not opened yet
    assert src.commit(pos, 10)["completed"] == [f"00000001-{sha['a.jsonl']}-a.jsonl"]
    assert [(e["id"], e["file"], e["line"], e["step"]) for e in ledger(run)] == [
        (f"{sha['a.jsonl']}:{n}", f"00000001-{sha['a.jsonl']}-a.jsonl", n, 10) for n in (1, 2, 3)
    ]

    while (item := src.next_example()) is not None and item.replay:
        pass
    pos = src.position()  # one example into b.jsonl
    again = src.commit(pos, 11)
    assert again["completed"] == [] and again["ledger_added"] == 1
    assert [d.name for d in data_files(run, Stage.PROCESSING)] == ["b.jsonl"]
    assert src.commit(pos, 11) == {"ledger_added": 0, "replay_added": 0, "completed": []}  # idempotent
    status = queue_status(run)
    assert status["current_file"] == f"00000002-{sha['b.jsonl']}-b.jsonl"
    assert status["current_progress"] == {"index": 1, "total": 3}
    assert (status["waiting"], status["processing"], status["done"], status["ledger_examples"]) == (0, 1, 1, 4)

    drain(src)
    src.commit(src.position(), 12)
    assert [d.name for d in data_files(run, Stage.DONE)] == ["a.jsonl", "b.jsonl"]
    ids = [e["id"] for e in ledger(run)]
    assert len(ids) == len(set(ids)) == 6
    replay_lines = [json.loads(x) for x in (run / "done" / "replay.jsonl").read_text().splitlines()]
    assert [r["n"] for r in replay_lines] == list(range(1, len(replay_lines) + 1))
    assert all(r["id"].startswith(sha["a.jsonl"]) for r in replay_lines)
    assert queue_status(run)["current_file"] is None


def test_resuming_an_older_checkpoint_undoes_the_ledger_and_reopens_done_files(tmp_path):
    run = tmp_path / "run"
    queue_files(run, {"a.jsonl": jsonl(2, "a"), "b.jsonl": jsonl(2, "b"), "c.jsonl": jsonl(2, "c")})
    src = ContinuousSource(run, validator)
    src.restore(None, 0)
    src.next_example()
    old = src.position()  # mid a.jsonl, step 1
    src.commit(old, 1)
    later = drain(src)
    src.commit(src.position(), 5)  # a, b and c done
    assert len(ledger(run)) == 6 and len(data_files(run, Stage.DONE)) == 3

    # Step 5's checkpoint turned out bad: the worker resumes step 1's.
    back = ContinuousSource(run, validator)
    summary = back.restore(old, 1)
    assert summary["ledger_trimmed"] == 5 and len(summary["reopened"]) == 3
    assert [(e["file"][-7:], e["line"], e["step"]) for e in ledger(run)] == [("a.jsonl", 1, 1)]
    assert len(data_files(run, Stage.PROCESSING)) == 3 and data_files(run, Stage.DONE) == []
    again = drain(back)
    assert [i.id for i in again] == [i.id for i in later]  # the same examples, in the same order
    back.commit(back.position(), 9)
    ids = [e["id"] for e in ledger(run)]
    assert len(ids) == len(set(ids)) == 6
    assert [e["step"] for e in ledger(run)] == [1, 9, 9, 9, 9, 9]


def test_a_torn_ledger_line_is_cut_off_and_rewritten(tmp_path):
    run = tmp_path / "run"
    queue_files(run, {"a.jsonl": jsonl(3, "a")})
    src = ContinuousSource(run, validator)
    src.restore(None, 0)
    src.next_example()
    src.commit(src.position(), 1)
    src.next_example()
    pos = src.position()
    with open(run / "done" / "ledger.jsonl", "ab") as f:  # the kill landed mid-append
        f.write(b'{"id":"abc')
    ContinuousSource(run, validator).restore(pos, 2)
    assert [(e["line"], e["step"]) for e in ledger(run)] == [(1, 1), (2, 2)]


def test_a_file_that_cannot_be_loaded_at_training_time_is_rejected_and_training_goes_on(tmp_path):
    run = tmp_path / "run"
    queue_files(run, {"a.jsonl": jsonl(2, "a"), "b.jsonl": jsonl(2, "b")})

    def flaky(path):
        if path.name.endswith("-a.jsonl"):
            raise OSError("disk error")
        return validator(path)

    src = ContinuousSource(run, flaky)
    src.restore(None, 0)
    assert [i.line for i in drain(src)] == [1, 2]
    [name] = [n for n in os.listdir(run / "rejected") if not n.endswith(".json")]
    report = json.loads((run / "rejected" / f"{name}.error.json").read_text())
    assert report["reasons"] == [
        {"code": "load_failed", "message": "could not be loaded for training: OSError: disk error"}
    ]
    assert src.warnings and "moved to rejected/" in src.warnings[0]


def test_skipped_lines_keep_their_original_line_numbers(tmp_path):
    run = tmp_path / "run"
    sha = queue_files(run, {"m.jsonl": jsonl(1, "a") + "junk\n" + jsonl(1, "b")}, on_bad_lines="skip_lines")
    src = ContinuousSource(run, validator)
    src.restore(None, 0)
    assert [i.id for i in drain(src)] == [f"{sha['m.jsonl']}:1", f"{sha['m.jsonl']}:3"]


def test_a_position_that_is_not_one_is_refused_with_the_reason(tmp_path):
    src = ContinuousSource(tmp_path / "run", validator)
    with pytest.raises(PositionError, match="kind inbox, version 1"):
        src.restore({"kind": "shuffled_epochs", "epoch": 0, "index": 3, "size": 10}, 0)
    with pytest.raises(PositionError, match="next must be a non-negative integer"):
        src.restore({"kind": "inbox", "v": 1, "take": 1, "next": -1, "rng": 0, "replay_n": 0}, 0)
    with pytest.raises(RuntimeError, match="restore"):
        ContinuousSource(tmp_path / "run", validator).next_example()
