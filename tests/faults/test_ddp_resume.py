"""Exact resume at two ranks: the built-in worker under torchrun (CPU, gloo), SIGKILLed one rank at a
time at three moments — between two micro-batches of a step, right after a checkpoint commit, and at a
random moment — then SIGTERMed on one rank only (both ranks stop at the same step boundary), and
restarted each time as a new attempt, ends bit for bit where the uninterrupted run of the same config
ends, with every step's loss after each resume the uninterrupted one's.  A checkpoint of one world size
is refused by another (exit 78, on every rank)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from fixtures.fakes.workers import (
    end_torchrun,
    losses_by_step,
    make_config,
    rank_pids,
    read_beats,
    run_worker,
    safetensors_raw,
    seeded_rng,
    start_torchrun_worker,
    wait_for_beat,
)

NPROC = 2
MAX_STEPS = 16


def ddp_config(tmp_path: Path) -> Path:
    return make_config(
        tmp_path,
        lora={"dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
        train={
            "max_steps": MAX_STEPS,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "warmup_steps": 3,
            "sleep_per_step_s": 0.06,
        },
        eval={"every_steps": 8, "max_new_tokens": 4},
        checkpoint={"every_steps": 4, "keep_last": 3, "confirm_steps": 1},
    )


@pytest.mark.slow
def test_two_ranks_sigkilled_one_at_a_time_resume_bit_for_bit(tmp_path):
    rng = seeded_rng()
    config = ddp_config(tmp_path)
    clean_dir, killed_dir = tmp_path / "clean", tmp_path / "killed"
    log = tmp_path / "killed.log"
    clean = start_torchrun_worker(config, clean_dir, NPROC, 1, log=tmp_path / "clean.log")  # alongside the killed run
    victims = [rng.randrange(NPROC)]
    victims += [1 - victims[0], rng.randrange(NPROC)]  # each rank killed at least once
    killed = []

    def attempt(number: int, moment) -> None:
        """Start attempt `number`, wait for `moment` (a beat of the victim's or rank 0's), SIGKILL the victim."""
        proc = start_torchrun_worker(config, killed_dir, NPROC, number, log=log)
        pids = rank_pids(killed_dir, number, NPROC, proc)
        victim = victims[number - 1]
        moment(number, proc, victim)
        os.kill(pids[victim], signal.SIGKILL)
        killed.append((number, victim))
        end_torchrun(proc, pids)

    def mid_accumulation(number, proc, victim):
        # Between the two micro-batches of a step after step 4's checkpoint is confirmed good.
        target = rng.randint(6, 8)
        wait_for_beat(
            killed_dir,
            number,
            lambda b: b["event"] == "progress" and b.get("micro_step") == 1 and b["step"] >= target - 1,
            proc,
            rank=victim,
        )

    def after_commit(number, proc, victim):
        # Right after rank 0 committed step 8's checkpoint, before anything could confirm it.
        wait_for_beat(
            killed_dir, number, lambda b: b["event"] == "checkpoint" and not b["good"] and b["step"] >= 8, proc
        )

    def random_moment(number, proc, victim):
        target = rng.randint(9, 13)
        wait_for_beat(killed_dir, number, lambda b: b["event"] == "step" and b["step"] >= target, proc, rank=victim)
        time.sleep(rng.uniform(0.0, 0.15))

    attempt(1, mid_accumulation)
    attempt(2, after_commit)
    attempt(3, random_moment)
    # Attempt 4: SIGTERM to one rank only; the other learns of it at the next step boundary and both stop
    # there: checkpoint (provisional), `stop terminated`, exit 0, and torchrun with them.
    stopped = rng.randrange(NPROC)
    proc = start_torchrun_worker(config, killed_dir, NPROC, 4, log=log)
    pids = rank_pids(killed_dir, 4, NPROC, proc)
    wait_for_beat(killed_dir, 4, lambda b: b["event"] == "step" and b["step"] >= 10, proc, rank=stopped)
    os.kill(pids[stopped], signal.SIGTERM)
    assert proc.wait(timeout=90) == 0, log.read_text()[-4000:]
    stops = [read_beats(killed_dir, 4, rank=r)[-1] for r in range(NPROC)]
    assert [(b["event"], b["reason"]) for b in stops] == [("stop", "terminated")] * NPROC
    assert len({b["step"] for b in stops}) == 1
    final = start_torchrun_worker(config, killed_dir, NPROC, 5, log=log)
    assert final.wait(timeout=180) == 0, log.read_text()[-4000:]
    assert clean.wait(timeout=180) == 0, (tmp_path / "clean.log").read_text()[-4000:]
    print(f"killed (attempt, rank): {killed}")

    reference = losses_by_step(read_beats(clean_dir))
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    assert losses_by_step(read_beats(clean_dir, rank=1)) == reference  # the world's loss, alike on every rank
    seen = set()
    for number in range(1, 6):
        for rank in range(NPROC):
            beats = read_beats(killed_dir, number, rank=rank)
            start = beats[0]
            assert start["event"] == "start" and start["world_size"] == NPROC
            assert start["effective_batch"] == 2 * 2 * NPROC
            if number > 1:
                assert start["resumed_from"] is not None, f"attempt {number} rank {rank} started from scratch"
            for step, loss in losses_by_step(beats).items():
                assert loss == reference[step], (
                    f"attempt {number}, rank {rank}, step {step}: {loss} != {reference[step]}"
                )
                seen.add(step)
        # Every rank resumed from the one checkpoint rank 0 chose.
        assert len({read_beats(killed_dir, number, rank=r)[0]["resumed_from"] for r in range(NPROC)}) == 1
    assert seen == set(range(1, MAX_STEPS + 1))
    assert read_beats(killed_dir, 5)[-1]["reason"] == "finished"
    # The graceful stop lost no step: attempt 5 resumed from the checkpoint the stop wrote.
    assert read_beats(killed_dir, 5)[0]["resumed_from"].endswith(f"step-{stops[0]['step']:08d}")

    for name in ("adapter_model.safetensors", "extra_modules.safetensors"):
        a = safetensors_raw(clean_dir / "final" / name)
        b = safetensors_raw(killed_dir / "final" / name)
        assert a.keys() == b.keys()
        assert any("lm_head" in k for k in a) or name != "adapter_model.safetensors"
        for key in a:
            assert a[key] == b[key], f"{name}: {key} differs"
    # Written once, by rank 0: every checkpoint holds each rank's RNG states and data position.
    last = killed_dir / "checkpoints" / f"step-{MAX_STEPS:08d}"
    assert (last / "rng.pt").is_file() and (last / "rng-rank1.pt").is_file()
    assert not [p for p in (killed_dir / "checkpoints").iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_a_checkpoint_is_resumed_by_its_own_world_size_only(tmp_path):
    config = make_config(tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2, "confirm_steps": 0})
    run = tmp_path / "run"
    assert run_worker(config, run, log=tmp_path / "one.log") == 0  # one process: a checkpoint of world size 1
    log = tmp_path / "two.log"
    proc = start_torchrun_worker(config, run, NPROC, 2, log=log)
    assert proc.wait(timeout=120) != 0, log.read_text()[-3000:]
    adir = run / "attempts" / "0002"
    # Every rank refuses before it loads anything.  The first refusal ends torchrun's launch: it SIGTERMs the
    # other rank, which may be stopped before it reaches its own check — then it leaves no last words at all
    # (a death by signal writes none), and in no case does it train a step.
    words = {
        name: json.loads((adir / name).read_text())
        for name in ("exit.json", "exit-rank1.json")
        if (adir / name).exists()
    }
    assert words, log.read_text()[-3000:]
    for name, w in words.items():
        assert (w["kind"], w["exit_code"]) == ("config_error", 78), (name, w)
        assert "made by 1 rank(s)" in w["problems"][0] and "one of 2" in w["problems"][0]
    for beats in adir.glob("heartbeat-rank*.jsonl"):
        assert '"event": "step"' not in beats.read_text() and '"event":"step"' not in beats.read_text(), beats
