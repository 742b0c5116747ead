"""A fake launcher for benchmarks: N rank processes beating at a fixed rate, standard library only.

    python scripts/baselines/synthetic_ranks.py --ranks 8 --hz 20 --seconds 60

Each rank writes `start`, enters `train` and emits one `step` beat per period for `--seconds`, then
`stop finished`. It stands in for `torchrun --nproc-per-node=8 train.py` when measuring what the
supervisor itself costs, without the ranks' own training work skewing the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from hangwatch.daemon.heartbeat import Heartbeat  # installed with hangwatch: no path set-up here


def rank_main(hz: float, seconds: float) -> int:
    hb = Heartbeat.from_env()
    hb.start()
    period = 1.0 / hz
    end = time.monotonic() + seconds
    step = 0
    asked: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: asked.append(signum))  # stop at the next step, as a trainer
    with hb.phase("train"):
        nxt = time.monotonic()
        while time.monotonic() < end and not asked:
            step += 1
            hb.step(step, loss=1.0 / step, tokens_per_s=1000.0)
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    hb.stop("terminated" if asked else "finished")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--hz", type=float, default=20.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_child:
        return rank_main(a.hz, a.seconds)
    procs = []
    for r in range(a.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.ranks))
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--rank-child", "--hz", str(a.hz), "--seconds", str(a.seconds)], env=env
            )
        )
    # SIGTERM to the launcher reaches every rank, as torchrun passes it on: each stops at its next step and exits 0
    signal.signal(signal.SIGTERM, lambda signum, frame: [p.send_signal(signum) for p in procs])
    codes = [p.wait() for p in procs]
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
