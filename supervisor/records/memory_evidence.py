"""The memory evidence an out-of-memory failure of the built-in worker left in the run dir (`gather`): the failing
rank's last words (their message and `memory` object, written by `daemon.trainer.memory_evidence`) and the peak its
step beats report.  Read only, never raises on a bad file; what the evidence says is `rules.oom_evidence`.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from hangwatch.common.rundir import attempt_dir, heartbeat_path, rank_exit_path, read_json, tail_text
from hangwatch.supervisor.rules.oom_evidence import Evidence, figure

BEATS_TAIL_BYTES = 256 * 1024  # the steps' peak is cumulative: the last step beats hold it


def gather(run_dir: os.PathLike | str, attempt: int, rank: int = 0) -> Evidence:
    """Rank `rank`'s evidence of attempt `attempt` (what is missing stays None; never raises on a bad file)."""
    words = read_json(rank_exit_path(run_dir, attempt, rank)) or {}
    message = words.get("message") if isinstance(words.get("message"), str) else None
    memory = words.get("memory") if isinstance(words.get("memory"), dict) else None
    phase = words.get("phase") if isinstance(words.get("phase"), str) else None
    return Evidence(rank, message, memory, steps_peak(run_dir, attempt, rank), phase)


def steps_peak(run_dir: os.PathLike | str, attempt: int, rank: int = 0) -> Optional[float]:
    """The largest `max_mem_allocated_mb` of the attempt's step beats (the tail of its heartbeat file), or None."""
    text = tail_text(
        heartbeat_path(attempt_dir(run_dir, attempt), rank), max_lines=100_000, max_bytes=BEATS_TAIL_BYTES
    )  # "" when it cannot be read
    peaks = []
    for line in text.splitlines():
        try:
            beat = json.loads(line)
        except ValueError:
            continue
        value = beat.get("max_mem_allocated_mb") if isinstance(beat, dict) and beat.get("event") == "step" else None
        if figure(value) is not None:
            peaks.append(float(value))
    return max(peaks) if peaks else None
