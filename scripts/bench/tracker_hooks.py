"""Section `trackers`: what hangwatch's tracker hooks (daemon/trackers/hooks.py) cost a script per logging call, with
the real libraries: the same script logging N steps to W&B (offline, `run.log(..., step=)`) and to TensorBoard
(`SummaryWriter.add_scalar`), timed in the process, bare and under the automatic instrumentation (a hangwatch run's
environment, attempt 1: every call a new highest step, the record handed to the hooks' writer thread); then an
attempt 2 whose first half replays steps the run already has (dropped)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from hangwatch.common.instrumentation import instrument_env
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_RUN_DIR

from .harness import PY, env, summary

SCRIPT = r"""
import json, sys, time
n, first = int(sys.argv[1]), int(sys.argv[2])
import wandb
from torch.utils.tensorboard import SummaryWriter
run = wandb.init(project="bench", mode="offline", dir=sys.argv[3])
w = SummaryWriter(sys.argv[3] + "/tb")
def timed(f):
    t = time.perf_counter()
    for s in range(first, first + n):
        f(s)
    return (time.perf_counter() - t) / n * 1e6
out = {"wandb_us": timed(lambda s: run.log({"loss": 1.0 / s}, step=s)),
       "tensorboard_us": timed(lambda s: w.add_scalar("loss", 1.0 / s, s))}
run.finish(); w.close()
print(json.dumps(out))
"""


def one(work: Path, n: int, first: int, hooked: bool, attempt: int = 1) -> dict:
    e = env()
    if hooked:
        e.update(instrument_env(e, None))
        e[ENV_RUN_DIR] = str(work / "run")
        e[ENV_ATTEMPT] = str(attempt)
    r = subprocess.run(
        [PY, "-c", SCRIPT, str(n), str(first), str(work)], env=e, capture_output=True, text=True, timeout=600
    )
    if r.returncode != 0:
        raise RuntimeError(f"the tracker script failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def section(work: Path, quick: bool) -> dict:
    try:
        import tensorboard  # noqa: F401
        import wandb  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"a tracker library is missing here ({exc}); install hangwatch[trackers]"}
    n, rounds = (1000, 2) if quick else (3000, 5)
    bare, hooked, replay = [], [], []
    for i in range(rounds):
        with tempfile.TemporaryDirectory(dir=work) as d:
            bare.append(one(Path(d), n, 1, False))
        with tempfile.TemporaryDirectory(dir=work) as d:
            hooked.append(one(Path(d), n, 1, True))
            # attempt 2 of the same run, starting n/2 steps back: its first n/2 calls are replayed steps, dropped
            replay.append(one(Path(d), n, n // 2 + 1, True, attempt=2))
    out = {"calls_per_round": n, "rounds": rounds}
    for name in ("wandb_us", "tensorboard_us"):
        out[name] = {
            "bare": summary([r[name] for r in bare]),
            "hooked": summary([r[name] for r in hooked]),
            "hooked_half_replayed": summary([r[name] for r in replay]),
        }
    out["method"] = (
        f"{n} calls per round, {rounds} rounds, each round a fresh process bare and one under the automatic "
        "instrumentation (attempt 1), then its attempt 2 starting half the calls back; per-call µs = wall time of "
        "the loop / calls, in the process (time.perf_counter)."
    )
    return out
