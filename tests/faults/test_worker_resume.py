"""Exact resume: a run SIGKILLed at several moments and restarted ends bit for bit where an
uninterrupted run of the same config ends, and every step's loss after each resume is the same."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from fixtures.fakes.workers import make_config, read_beats, start_worker, wait_for_beat
from safetensors.torch import load_file

MAX_STEPS = 36


def resume_config(tmp_path: Path) -> Path:
    return make_config(
        tmp_path,
        lora={"dropout": 0.1, "target_modules": ["q_proj", "v_proj", "o_proj"], "modules_to_save": ["lm_head"]},
        train={
            "max_steps": MAX_STEPS,
            "micro_batch_size": 3,
            "grad_accum": 3,
            "warmup_steps": 4,
            "sleep_per_step_s": 0.06,
        },
        eval={"every_steps": 12, "max_new_tokens": 4},
        checkpoint={"every_steps": 5, "keep_last": 3, "confirm_steps": 1},
    )


def losses_by_step(beats: list[dict]) -> dict[int, float]:
    return {b["step"]: b["loss"] for b in beats if b["event"] == "step"}


def kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_sigkilled_run_resumes_bit_for_bit(tmp_path):
    seed = int(os.environ.get("HANGWATCH_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"kill timing seed {seed} (HANGWATCH_TEST_SEED to repeat)")
    config = resume_config(tmp_path)
    clean_dir, killed_dir = tmp_path / "clean", tmp_path / "killed"

    clean = start_worker(config, clean_dir, log=tmp_path / "clean.log")  # runs alongside the killed one

    # Attempt 1: SIGKILL between two micro-batches of one optimizer step.
    target = rng.randint(7, 9)  # after step 5's checkpoint was confirmed, so the next attempt resumes
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    wait_for_beat(
        killed_dir, 1, lambda b: b["event"] == "progress" and b.get("micro_step") == 1 and b["step"] >= target - 1, p
    )
    kill(p)

    # Attempt 2: SIGKILL right after a checkpoint commit (before it could be confirmed good).
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    wait_for_beat(killed_dir, 2, lambda b: b["event"] == "checkpoint" and not b["good"] and b["step"] >= 10, p)
    kill(p)

    # Attempt 3: SIGKILL at a random moment some steps further on.
    target = rng.randint(14, 20)
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    wait_for_beat(killed_dir, 3, lambda b: b["event"] == "step" and b["step"] >= target, p)
    time.sleep(rng.uniform(0.0, 0.15))
    kill(p)

    # Attempt 4: SIGKILL while a checkpoint is being written.
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    wait_for_beat(killed_dir, 4, lambda b: b["event"] == "phase" and b["phase"] == "checkpoint" and b["step"] >= 20, p)
    time.sleep(rng.uniform(0.0, 0.03))
    kill(p)

    # Attempt 5: SIGTERM — finishes its step, checkpoints, says `terminated`, exits 0.
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    wait_for_beat(killed_dir, 5, lambda b: b["event"] == "step" and b["step"] >= 27, p)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=60) == 0
    beats5 = read_beats(killed_dir, 5)
    assert beats5[-1]["event"] == "stop" and beats5[-1]["reason"] == "terminated"
    assert any(b["event"] == "checkpoint" and b["step"] == beats5[-1]["step"] for b in beats5)

    # Attempt 6: runs to the end.
    p = start_worker(config, killed_dir, log=tmp_path / "killed.log")
    assert p.wait(timeout=120) == 0, (tmp_path / "killed.log").read_text()[-3000:]
    assert clean.wait(timeout=120) == 0, (tmp_path / "clean.log").read_text()[-3000:]

    reference = losses_by_step(read_beats(clean_dir))
    assert sorted(reference) == list(range(1, MAX_STEPS + 1))
    seen = set()
    for attempt in range(1, 7):
        beats = read_beats(killed_dir, attempt)
        start = beats[0]
        assert start["event"] == "start"
        if attempt > 1:
            assert start["resumed_from"] is not None, f"attempt {attempt} started from scratch"
        for step, loss in losses_by_step(beats).items():
            assert loss == reference[step], f"attempt {attempt}, step {step}: loss {loss} != {reference[step]}"
            seen.add(step)
    assert seen == set(range(1, MAX_STEPS + 1))
    assert read_beats(killed_dir, 6)[-1]["reason"] == "finished"
    # The graceful stop lost no step: attempt 6 resumed from the (provisional) checkpoint SIGTERM wrote.
    assert read_beats(killed_dir, 6)[0]["resumed_from"].endswith(f"step-{beats5[-1]['step']:08d}")

    for name in ("adapter_model.safetensors", "extra_modules.safetensors"):
        a = load_file(str(clean_dir / "final" / name))
        b = load_file(str(killed_dir / "final" / name))
        assert sorted(a) == sorted(b)
        assert any("lm_head" in k for k in a) or name != "adapter_model.safetensors"
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key} differs"
    # Nothing of the interrupted saves is left behind.
    assert not [p for p in (killed_dir / "checkpoints").iterdir() if p.name.startswith(".")]
