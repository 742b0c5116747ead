"""Twenty stack dumps of a real transformers model in the middle of a `generate()` that never returns, taken at
random moments: every one reads `generate`, called from the script's `on_evaluate` — wherever the sample landed
(the model's forward, attention, a logits processor, the stopping criterion's heartbeat write, the streamer's
tokenizer decode).  One subprocess (tests/fixtures/workers/landmark_generate.py, a LoRA-wrapped tiny Llama) is signalled
20 times; each dump is read from the bytes it appended, once they stop growing, by the supervisor's own code."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from fixtures.fakes.sup_harness import PY, ROOT, env

from hangwatch.supervisor.incidents import main_stack
from hangwatch.supervisor.incidents.landmarks import read_stack

FIXTURE = ROOT / "tests" / "fixtures" / "workers" / "landmark_generate.py"
SAMPLES = 20

pytestmark = pytest.mark.slow


def _ready_line(p: subprocess.Popen, timeout_s: float) -> str:
    """The fixture's `generating <dump path>` line (its other output is passed over)."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        if p.poll() is not None:
            break
        if select.select([p.stdout], [], [], 0.5)[0]:
            line = p.stdout.readline()
            seen.append(line)
            if line.startswith("generating "):
                return line.split(" ", 1)[1].strip()
    raise AssertionError(f"the fixture never started generating (rc {p.poll()}):\n{''.join(seen)[-3000:]}")


def _next_dump(path: Path, offset: int, timeout_s: float = 10.0) -> bytes:
    """What the dump file gained after `offset`, once it stopped growing."""
    deadline = time.monotonic() + timeout_s
    size, still_since = offset, None
    while time.monotonic() < deadline:
        now = path.stat().st_size
        if now != size:
            size, still_since = now, time.monotonic()
        elif size > offset and time.monotonic() - still_since >= 0.15:
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(size - offset)
        time.sleep(0.02)
    raise AssertionError(f"no dump appended to {path} within {timeout_s}s")


def test_twenty_random_samples_of_a_generating_model_all_read_generate(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    e = {**env(), "HANGWATCH_RUN_DIR": str(tmp_path / "run"), "HANGWATCH_ATTEMPT": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [PY, str(FIXTURE)], cwd=tmp_path, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        dump = Path(_ready_line(p, timeout_s=120))
        offset = dump.stat().st_size
        readings, innermost = [], Counter()
        for i in range(SAMPLES):
            time.sleep(rng.uniform(0.05, 0.6))
            assert p.poll() is None, f"the fixture ended (rc {p.returncode}) before sample {i + 1}"
            os.kill(p.pid, signal.SIGUSR1)
            data = _next_dump(dump, offset)
            offset += len(data)
            frames, truncated = main_stack(data.decode("utf-8", "replace"))
            r = read_stack(frames, truncated=truncated)
            readings.append((r, data))
            innermost[frames[0]["function"] if frames else None] += 1
    finally:
        p.kill()
        p.wait()
    where = f"seed {seed}; innermost frames sampled: {dict(innermost)}"
    not_generate = [
        (r.summary(), d.decode()[-2500:]) for r, d in readings if not r.landmark or r.landmark["name"] != "generate"
    ]
    assert not not_generate, (
        f"{len(not_generate)} of {SAMPLES} samples did not read generate ({where}): {not_generate[0]}"
    )
    for r, _ in readings:
        assert r.landmark["kind"] == "generate" and r.caller_frame["function"] == "on_evaluate", (r, where)
        assert r.summary().startswith("in generate(), called from on_evaluate (landmark_generate.py:"), (
            r.summary(),
            where,
        )
        assert r.user_outermost_frame["function"] == "<module>" and not r.truncated, (r, where)
