"""How long a run took from a stopping signal to its saved checkpoint and to hangwatch's exit, from its run dir.

    .venv/bin/python scripts/slurm_stop_times.py RUN_DIR [RUN_DIR …]

For each attempt that a signal stopped (a `stop_requested` line in supervisor.log, e.g. the SIGUSR1 of a Slurm
job's `--signal` warning, or scancel's SIGTERM), three moments, in wall-clock time:

  signal       when the signal arrived: the worker's stack dump file (attempts/NNNN/stack-rank0.txt) is written
               by its SIGUSR1 handler at that moment, since Slurm signals every process of the step; else (no
               dump: a SIGTERM) the supervisor's `stop_requested` line, which comes after its `scontrol` query
  checkpoint   the worker's `checkpoint` heartbeat line after the signal (its `t`: the save is complete)
  exit         the supervisor's `supervisor_exit` line

The tests on the real cluster leave their run dirs under pytest's temporary directory, e.g.
`scripts/slurm_stop_times.py /tmp/pytest-of-root/pytest-*/test_the_time_limit_warning*/run`.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

from hangwatch.common.rundir import read_jsonl


def wall(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def stops(run_dir: Path) -> list[dict]:
    """One record per stopping signal: attempt, why, and the three moments (None where not found)."""
    log = read_jsonl(run_dir / "supervisor.log")
    out = []
    attempt = 0
    for i, rec in enumerate(log):
        if rec.get("event") == "state" and rec.get("attempt"):
            attempt = int(rec["attempt"])
        if rec.get("event") != "stop_requested":
            continue
        asked = wall(rec["timestamp"])
        adir = run_dir / "attempts" / f"{attempt:04d}"
        dump = adir / "stack-rank0.txt"
        signal_at = dump.stat().st_mtime if dump.exists() and abs(dump.stat().st_mtime - asked) < 5 else asked
        saved = [b["t"] for b in read_jsonl(adir / "heartbeat-rank0.jsonl") if b.get("event") == "checkpoint"]
        saved_at = next((t for t in saved if t >= signal_at), None)
        exit_at = next((wall(r["timestamp"]) for r in log[i:] if r.get("event") == "supervisor_exit"), None)
        out.append(
            {
                "attempt": attempt,
                "why": rec.get("why"),
                "signal_to_checkpoint_s": None if saved_at is None else round(saved_at - signal_at, 3),
                "signal_to_exit_s": None if exit_at is None else round(exit_at - signal_at, 3),
            }
        )
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 64
    for arg in argv:
        for rec in stops(Path(arg)):
            print(json.dumps({"run_dir": arg, **rec}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
