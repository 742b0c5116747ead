"""Which run a client command means when it is not told (`--run-dir`, `--socket`, or their variables).

`hangwatch run` puts a run in `./runs/<name>` unless told otherwise, so that is where a client looks: the run
directories under `./runs/` (each holds a `state.json`).  The only one whose supervisor is alive is the one meant;
with none alive, the most recently updated one (the command says which it took); with several alive, the client
must say which — the error lists them.  A supervisor is alive as `status` judges a recorded one
(`recorded.supervisor_gone`: its pid and start time).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hangwatch.common.exitcodes import EX_USAGE
from hangwatch.common.rundir import STATE_NAME

RUNS = Path("runs")
FINAL_STATES = ("finished", "failed", "stopped")


class NoRunFound(Exception):
    """The client must say which run: none, or more than one, could be meant."""

    exit_code = EX_USAGE


@dataclass(frozen=True)
class Candidate:
    run_dir: Path
    state: Optional[str]
    updated: float  # state.json's own `updated_wall`, else its modification time
    alive: bool  # its supervisor still runs


def candidates(base: Path = RUNS) -> list[Candidate]:
    """Every run directory directly under `base` that holds a readable state.json."""
    from hangwatch.supervisor.cli.recorded import supervisor_gone
    from hangwatch.supervisor.records import run_state

    out = []
    try:
        entries = sorted(p for p in base.iterdir() if p.is_dir())
    except OSError:
        return []
    for d in entries:
        path = d / STATE_NAME
        rec, _ = run_state.read(path)
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        if rec is None:
            continue
        state = rec.get("state") if isinstance(rec.get("state"), str) else None
        wall = rec.get("updated_wall")
        updated = float(wall) if isinstance(wall, (int, float)) and not isinstance(wall, bool) else mtime
        alive = state not in FINAL_STATES and supervisor_gone(rec) is False
        out.append(Candidate(d, state, updated, alive))
    return out


def choose(found: list[Candidate], base: Path = RUNS) -> tuple[Path, str]:
    """(the run directory meant, the words that say how it was chosen); NoRunFound when it cannot be told."""
    alive = [c for c in found if c.alive]
    if len(alive) == 1:
        return alive[0].run_dir, f"the run under ./{base}/ that is running: {alive[0].run_dir}"
    if len(alive) > 1:
        names = ", ".join(str(c.run_dir) for c in alive)
        raise NoRunFound(f"{len(alive)} runs under ./{base}/ are running ({names}): say which with --run-dir DIR")
    if not found:
        raise NoRunFound(
            f"no run under ./{base}/ here ({Path.cwd()}): say which with --run-dir DIR (or --socket PATH, or set "
            "HANGWATCH_RUN_DIR)"
        )
    latest = max(found, key=lambda c: c.updated)
    return latest.run_dir, f"the most recent run under ./{base}/ (none is running): {latest.run_dir} ({latest.state})"


def find_run(base: Path = RUNS) -> tuple[Path, str]:
    return choose(candidates(base), base)
