"""The evidence of each rank of a stalled attempt, gathered for the verdict (`incidents.verdict.decide`).

Per announced rank, from its own process and files only: its snapshot record (state, CPU), the main
thread of its faulthandler dump (else of its py-spy dump, which is also preferred when faulthandler cut
the stack at its 100-frame limit: the landmark reading wants the whole stack), py-spy's native frames, the source line
of its innermost frame, its step, phase and progress beats as the deadlines saw them, and the last
collective its NCCL flight recorder enqueued.  Never another rank's figures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Optional

from hangwatch.supervisor.incidents import main_stack
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread
from hangwatch.supervisor.incidents.verdict import RankEvidence
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.watch.deadlines import Deadlines

ReadLine = Callable[[str, int], Optional[str]]
MAX_SOURCE_BYTES = 4 << 20


def source_line(path: str, lineno: int, cwd: Optional[str] = None) -> Optional[str]:
    """Line `lineno` of the source file `path` (relative paths against the worker's `cwd`), or None."""
    p = Path(path)
    if not p.is_absolute():
        p = Path(cwd or os.getcwd()) / p
    try:
        with open(p, "rb") as f:
            for n, raw in enumerate(f, 1):
                if n == lineno:
                    return raw.decode("utf-8", "replace").strip()
                if f.tell() > MAX_SOURCE_BYTES:
                    return None
    except OSError:
        return None
    return None


def gather(
    attempt: Attempt,
    deadlines: Deadlines,
    procs: list[dict],
    texts: dict[int, str],
    py_spy: dict[int, str],
    flight: dict[int, dict],
    now: float,
    read_line: Optional[ReadLine] = None,
) -> list[RankEvidence]:
    """One `RankEvidence` per announced rank, by rank."""
    by_pid = {p["pid"]: p for p in procs}
    read = read_line or (lambda path, n: source_line(path, n, attempt.cwd))
    out = []
    for rank, a in sorted(attempt.announced.items()):
        pid = a.ref.pid if a.ref else None
        stack, truncated = main_stack(texts.get(rank, ""))
        spy_python, native = py_spy_main_thread(py_spy.get(rank, ""))
        if spy_python and (not stack or truncated):  # no faulthandler dump (it never handled SIGUSR1), or a cut one
            stack, truncated = spy_python, False
        line = read(stack[0]["file"], stack[0]["line"]) if stack and isinstance(stack[0].get("line"), int) else None
        tr = deadlines.ranks.get(rank)
        out.append(
            RankEvidence(
                rank=rank,
                pid=pid,
                proc=by_pid.get(pid),
                stack=stack,
                native=native,
                source_line=line,
                step=tr.step if tr else None,
                phase=tr.phase if tr else None,
                progress_lines=tr.progress_since_step if tr else 0,
                livelock=_livelocked(deadlines, tr, now),
                collective_seq=(flight.get(rank) or {}).get("last_enqueued"),
                truncated=truncated,
            )
        )
    return out


def _livelocked(deadlines: Deadlines, tr, now: float) -> bool:
    """Still beating `progress` in the second half of its window, without a step (as `Expired.livelock`)."""
    if tr is None or not tr.progress_since_step or tr.last_progress_at is None:
        return False
    budget = deadlines.step_budget()[0] if tr.phase == "train" else tr.phase_budget
    return budget is not None and now - tr.last_progress_at <= budget / 2
