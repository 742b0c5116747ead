"""A light worker that breaks one deadline on demand, for the detection-latency benchmark (stdlib only).

    python scripts/baselines/stall_worker.py MODE [--phase-budget S] [--steps N] [--step-s S]

On its first attempt (HANGWATCH_ATTEMPT 1) it misbehaves according to MODE, then blocks in C (a read
on a pipe nobody writes: CPU idle, no more lines), which is what a collective or a dead data loader
looks like; later attempts run `--steps` steps and exit 0 after `stop finished`.

  nostart  never sends `start`                      → the startup deadline
  block    start, `train`, two steps, then blocks   → silence or step (whichever the config makes short)
  phase    start, `train`, two steps, enters `eval` with `budget_s` = --phase-budget, then blocks → phase

SIGTERM is only recorded, as the real worker does while it is stuck: the read goes on, so the
supervisor has to escalate to SIGKILL.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from hangwatch.daemon.heartbeat import Heartbeat  # installed with hangwatch: no path set-up here

terminated = []


def block_in_c() -> None:
    r, _w = os.pipe()
    os.read(r, 1)  # nobody writes: blocked in read(2); EINTR from a signal is retried (PEP 475)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("nostart", "block", "phase"))
    ap.add_argument("--phase-budget", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-s", type=float, default=0.05)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: terminated.append(signum))
    bad = int(os.environ.get("HANGWATCH_ATTEMPT", "1")) <= 1
    hb = Heartbeat.from_env()
    if bad and a.mode == "nostart":
        block_in_c()
    hb.start()
    with hb.phase("train"):
        for step in range(1, a.steps + 1):
            if bad and step == 3:
                if a.mode == "phase":
                    hb.enter_phase("eval", budget_s=a.phase_budget)
                block_in_c()
            time.sleep(a.step_s)
            hb.step(step, loss=1.0 / step)
            if terminated:
                hb.stop("terminated")
                return 0
    hb.stop("finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
