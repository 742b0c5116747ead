"""Continuous mode going quiet, under SIGKILLs at random moments (the real worker, `python -m
hangwatch.daemon`, restarted by this test after each kill, as the supervisor would).

Four files are published one after another while the worker runs; none fills a whole number of
steps, and nothing comes after the last one.  The kills land: around the first flush (the quiet
wait, the partial step, its checkpoint, the ledger commit, the settling eval); at a random step
while a file trains; in the work of a later flush (just after the worker decided it); and at a
random moment of the quiet that follows the last file.  Throughout: no restart goes back further
than the newest checkpoint the killed worker had announced (so never to step 0 once one existed),
the ledger never holds an example twice, and after the last file `processing/` is empty within
`data.flush_after_s` + one step of its arrival.  At the end every example is in the ledger exactly
once, every file in done/, and the newest checkpoint was confirmed good on its held-out loss.

The kill moments come from a seed printed at the start; HANGWATCH_TEST_SEED=N replays it."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
from fixtures.fakes.continuous_support import (
    example_ids,
    good_file,
    inbox_config,
    ledger,
    leftovers,
    names_in,
    replay_log,
)
from fixtures.fakes.workers import read_beats, start_worker, wait_for_beat

from hangwatch.common.inbox_layout import Stage
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.inbox.publish import publish

pytestmark = pytest.mark.slow

FLUSH_AFTER_S = 2.0
# Intake, the idle loop waking, the ledger commit and this test's polling, on two busy cores: the
# part of "flush_after_s + one step" that is neither the quiet wait nor the step and its checkpoint.
ALLOWANCE_S = 3.0
WAIT_S = 240  # for any one awaited event (a cold start imports torch)
FILES = {"f1.jsonl": (7, 201), "f2.jsonl": (10, 202), "f3.jsonl": (5, 203), "f4.jsonl": (3, 204)}  # a step is 4


class Worker:
    """One attempt of the worker, and what its heartbeats say."""

    def __init__(self, config: Path, run: Path, attempt: int, log: Path):
        self.run, self.attempt = run, attempt
        self.proc = start_worker(config, log=log)
        self.start = self.wait(lambda b: b["event"] == "start")

    def wait(self, match, timeout: float = WAIT_S) -> dict:
        return wait_for_beat(self.run, self.attempt, match, self.proc, timeout=timeout)

    def beats(self) -> list[dict]:
        return read_beats(self.run, self.attempt)

    def kill(self) -> str:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        last = self.beats()[-1]
        return (
            f"attempt {self.attempt} killed in phase {last['phase']} at step {last['step']} "
            f"(last beat: {last['event']})"
        )


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def kill_around_the_flush(w: Worker, rng: random.Random) -> str:
    """From the moment the worker went idle, kill it at a random moment from just before its flush is
    due to well after it: the quiet wait, the partial step, its checkpoint, the ledger, the eval."""
    idle = w.wait(lambda b: b["event"] == "phase" and b["phase"] == "idle")
    sleep_until(idle["t"] + FLUSH_AFTER_S + rng.uniform(-0.15, 0.35))
    return w.kill()


def test_quiet_continuous_run_under_random_kills_strands_nothing_and_never_restarts_from_scratch(tmp_path):
    seed = int(os.environ.get("HANGWATCH_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"kill timing seed {seed} (HANGWATCH_TEST_SEED to repeat)")
    run = tmp_path / "run"
    data = {name: good_file(n, s) for name, (n, s) in FILES.items()}
    for name, content in data.items():
        (tmp_path / name).write_bytes(content)
    config = inbox_config(
        tmp_path,
        data={"flush_after_s": FLUSH_AFTER_S},
        checkpoint={"every_steps": 2, "keep_last": 3, "confirm_steps": 1},
        train={"sleep_per_step_s": 0.05},
    )
    expected = [i for content in data.values() for i in example_ids(content)]
    attempts: list[Worker] = []
    story: list[str] = []

    def start() -> Worker:
        w = Worker(config, run, len(attempts) + 1, tmp_path / "worker.log")
        if attempts:
            announced = [b["step"] for a in attempts for b in a.beats() if b["event"] == "checkpoint"]
            # A kill loses at most the work since the newest checkpoint announced: never back to 0 once one existed.
            assert w.start["resumed_step"] >= max(announced, default=0), story
            story.append(f"resumed at step {w.start['resumed_step']} (newest announced {max(announced, default=None)})")
        attempts.append(w)
        return w

    def killed(description: str) -> None:
        story.append(description)
        ids = [e["id"] for e in ledger(run)]
        assert ids == expected[: len(ids)], story  # each example once, in the order the files came

    try:
        w = start()
        publish(tmp_path / "f1.jsonl", run)
        killed(kill_around_the_flush(w, rng))

        w = start()
        publish(tmp_path / "f2.jsonl", run)
        target = w.start["resumed_step"] + rng.randint(1, 2)
        w.wait(lambda b: b["event"] == "step" and b["step"] >= target)
        time.sleep(rng.uniform(0.0, 0.1))
        killed(w.kill())

        w = start()
        publish(tmp_path / "f3.jsonl", run)
        w.wait(lambda b: b.get("decision") == "flush")
        time.sleep(rng.uniform(0.0, 0.12))  # the partial step (if any), its checkpoint, the ledger, the eval
        killed(w.kill())

        # Whatever that kill left is trained again and flushed; then the last file comes, to a running worker.
        w = start()
        w.wait(lambda b: b["event"] == "phase" and b["phase"] == "idle")
        deadline = time.monotonic() + WAIT_S
        while leftovers(run) or names_in(run, Stage.DONE) != ["f1.jsonl", "f2.jsonl", "f3.jsonl"]:
            assert time.monotonic() < deadline and w.proc.poll() is None, (leftovers(run), story)
            time.sleep(0.05)
        published = time.monotonic()
        publish(tmp_path / "f4.jsonl", run)
        while leftovers(run) or "f4.jsonl" not in names_in(run, Stage.DONE):
            assert time.monotonic() - published < WAIT_S and w.proc.poll() is None, (leftovers(run), story)
            time.sleep(0.02)
        stranded_s = time.monotonic() - published
        beats = w.beats()
        last_step = [b for b in beats if b["event"] == "step"][-1]
        covering = [b for b in beats if b["event"] == "checkpoint" and b["step"] == last_step["step"] and not b["good"]]
        assert last_step["partial"] and last_step["examples"] == 3 and covering, beats[-12:]
        one_step_s = last_step["step_s"] + covering[0]["save_s"]
        story.append(f"f4 published → processing/ empty in {stranded_s:.2f}s (one step {one_step_s:.2f}s)")
        assert stranded_s <= FLUSH_AFTER_S + one_step_s + ALLOWANCE_S, story

        time.sleep(rng.uniform(0.0, 1.5))  # in the quiet after the last file
        killed(w.kill())

        # Nothing is left to train: the next attempt resumes at the newest checkpoint and only waits.
        w = start()
        w.wait(lambda b: b["event"] == "progress" and b["phase"] == "idle" and b["idle_s"] >= FLUSH_AFTER_S + 0.5)
        assert not [b for b in w.beats() if b["event"] == "step"], story
        os.kill(w.proc.pid, signal.SIGTERM)
        assert w.proc.wait(timeout=60) == 0
    finally:
        for a in attempts:
            if a.proc.poll() is None:
                os.killpg(a.proc.pid, signal.SIGKILL)
                a.proc.wait()
    print("\n".join(story))

    assert [e["id"] for e in ledger(run)] == expected, story
    replays = replay_log(run)
    assert [r["n"] for r in replays] == list(range(1, len(replays) + 1))
    assert set(r["id"] for r in replays) <= set(expected)
    assert leftovers(run) == {}
    assert names_in(run, Stage.DONE) == sorted(FILES)
    newest = ckpt.list_checkpoints(ckpt.checkpoints_root(run))[0]
    assert ckpt.is_good(newest) and ckpt.step_of(newest) == attempts[-1].start["resumed_step"]
    assert "held-out loss" in (newest / ckpt.GOOD).read_text()  # confirmed while idle (data.eval is set)
