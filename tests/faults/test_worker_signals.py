"""Signals: SIGUSR1 dumps every thread's stack and training goes on; a second SIGTERM ends the
worker at once (the first asks for a graceful stop, covered by the resume test)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from fixtures.fakes.workers import make_config, read_beats, start_worker, wait_for_beat


@pytest.mark.slow
def sigterm_caught(pid: int) -> bool:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_usr1_dumps_and_training_continues_then_second_sigterm_exits_at_once(tmp_path):
    config = make_config(tmp_path, train={"max_steps": 200, "sleep_per_step_s": 1.0})
    run = tmp_path / "run"
    p = start_worker(config, log=tmp_path / "worker.log")
    try:
        start = wait_for_beat(run, 1, lambda b: b["event"] == "start", p)
        assert start["dump_signal"] == "SIGUSR1"
        wait_for_beat(run, 1, lambda b: b["event"] == "step", p)
        os.kill(p.pid, signal.SIGUSR1)
        step = wait_for_beat(run, 1, lambda b: b["event"] == "step" and b["step"] >= 2, p)
        dump = open(start["dump_path"]).read()
        assert "Current thread" in dump and "daemon/trainer/loop.py" in dump and "in train_step" in dump
        assert step["loss"] > 0

        os.kill(p.pid, signal.SIGTERM)
        # A separate second signal, not one coalesced with the first: the handler, once it ran, puts
        # the default disposition back, which /proc shows as SIGTERM leaving the caught set.
        deadline = time.monotonic() + 60
        while sigterm_caught(p.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=30) == -signal.SIGTERM
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert not [b for b in read_beats(run, 1) if b["event"] == "stop"]
