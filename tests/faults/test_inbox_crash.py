"""Crash consistency: a real child process SIGKILLs itself before (or in the middle of) each file
operation of intake and of training/commit; after every kill each file is in exactly one stage,
and recovery reaches the same end state as a run that was never killed, with every ledger id
recorded exactly once."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from fixtures.fakes.inbox_support import CountingOps, jsonl, sim_intake, sim_train, validator, where, write  # noqa: E402

from hangwatch.common.inbox_layout import Stage
from hangwatch.daemon.inbox.intake import Inbox

SUPPORT = Path(__file__).resolve().parents[1] / "fixtures" / "fakes" / "inbox_support.py"


def run_child(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SUPPORT), *args], capture_output=True, text=True, timeout=120)


def listing(run: Path) -> dict[str, list[str]]:
    return {s.value: sorted(n for n in os.listdir(s.dir(run)) if n != ".current.json") for s in Stage}


def assert_one_place_each(run: Path, contents: list[str]) -> None:
    """Each of the files with these contents is in exactly one stage (no copy, none lost)."""
    places = where(run)
    for content, copies in collections.Counter(c[:40] for c in contents).items():
        assert len(places.get(content, [])) == copies, f"{content!r} is in {places.get(content)}"


def kill_points(kinds: list[str], torn: tuple[str, ...]) -> list[tuple[int, str]]:
    """Before every operation; and mid-way through every operation of the `torn` kinds."""
    points = [(k, "before") for k in range(1, len(kinds) + 1)]
    points += [(k, "torn") for k, kind in enumerate(kinds, 1) if kind in torn]
    return points


# --------------------------------------------------------------------------------------------


def test_intake_killed_at_any_point_leaves_each_file_in_one_place_and_recovers(tmp_path):
    base = tmp_path / "base"
    files = {
        "bad.jsonl": "not json\n{}\n",  # no usable line: rejected even with skip_lines
        "dup.jsonl": jsonl(3, "g"),
        "good.jsonl": jsonl(3, "g"),  # same bytes as dup.jsonl: rejected as a duplicate
        "mixed.jsonl": jsonl(2, "m") + "{broken\n",
        "other.jsonl": jsonl(2, "o"),
    }
    for name, content in files.items():
        write(base / "inbox" / name, content)
    contents = list(files.values())

    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    ops = CountingOps()
    sim_intake(clean, ops, "skip_lines")
    expected = listing(clean)
    assert expected["queue"] == sorted(expected["queue"]) and len(expected["queue"]) == 3
    assert len(ops.kinds) >= 6

    for k, mode in kill_points(ops.kinds, torn=("write_file",)):  # reports: a torn temporary
        run = tmp_path / f"kill-{k}-{mode}"
        shutil.copytree(base, run)
        child = run_child("intake", str(run), str(k), mode, "skip_lines")
        assert child.returncode == -signal.SIGKILL, (k, mode, child.stderr)
        assert_one_place_each(run, contents)
        inbox = Inbox(run, validator, on_bad_lines="skip_lines", settle_s=0)
        inbox.recover()  # what start() does before it watches
        inbox.poll()
        assert listing(run) == expected, (k, mode)
        assert_one_place_each(run, contents)
        for report in (Stage.REJECTED.dir(run)).glob("*.json"):
            assert json.loads(report.read_text())["problems_total"] >= 0  # complete JSON, not torn


def test_training_killed_at_any_point_resumes_with_every_example_recorded_once(tmp_path):
    base = tmp_path / "base"
    files = {"a.jsonl": jsonl(3, "a"), "b.jsonl": jsonl(2, "b"), "c.jsonl": jsonl(3, "c")}
    inbox = Inbox(base, validator, settle_s=0)
    for name, content in files.items():
        write(base / "inbox" / name, content)
        assert inbox.intake(name).outcome == "queued"

    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    ops = CountingOps()
    reference = sim_train(clean, ops)
    expected = listing(clean)
    fresh = [i for i, replay in reference["trained"] if not replay]
    replays = [i for i, replay in reference["trained"] if replay]
    assert len(fresh) == 8 and replays  # the scenario exercises replay too

    for k, mode in kill_points(ops.kinds, torn=("append",)):  # ledger and replay log: a torn line
        run = tmp_path / f"kill-{k}-{mode}"
        shutil.copytree(base, run)
        child = run_child("train", str(run), str(k), mode)
        assert child.returncode == -signal.SIGKILL, (k, mode, child.stderr)
        assert_one_place_each(run, list(files.values()))
        final = sim_train(run, CountingOps())  # the restarted worker, resuming its last checkpoint
        # Same training as if never killed: same examples, same order, same replay draws.
        assert final["trained"] == reference["trained"], (k, mode)
        ledger = [json.loads(x) for x in (run / "done" / "ledger.jsonl").read_text().splitlines()]
        assert [e["id"] for e in ledger] == fresh, (k, mode)
        replay_log = [json.loads(x) for x in (run / "done" / "replay.jsonl").read_text().splitlines()]
        assert [(r["n"], r["id"]) for r in replay_log] == list(enumerate(replays, 1)), (k, mode)
        assert listing(run) == expected, (k, mode)


def test_repeated_kills_including_during_recovery_still_converge(tmp_path):
    run = tmp_path / "run"
    files = {"a.jsonl": jsonl(4, "a"), "b.jsonl": jsonl(3, "b")}
    inbox = Inbox(run, validator, settle_s=0)
    for name, content in files.items():
        write(run / "inbox" / name, content)
        inbox.intake(name)
    reference_dir = tmp_path / "ref"
    shutil.copytree(run, reference_dir)
    reference = sim_train(reference_dir, CountingOps())

    # Every restart restores first, so early kill points land in restore's own repairs.
    kills = 0
    for k in (2, 1, 3, 2, 4, 1, 5, 3, 6, 2, 7):
        child = run_child("train", str(run), str(k), "torn" if k % 2 else "before")
        if child.returncode == 0:
            break
        assert child.returncode == -signal.SIGKILL, child.stderr
        kills += 1
        assert_one_place_each(run, list(files.values()))
    assert kills >= 5
    final = sim_train(run, CountingOps())
    assert final["trained"] == reference["trained"]
    ids = [json.loads(x)["id"] for x in (run / "done" / "ledger.jsonl").read_text().splitlines()]
    assert ids == [i for i, replay in reference["trained"] if not replay]
