"""What `hangwatch run` does with a run directory that already holds a finished run.

The same run — the same command and arguments, the same config — finished already: nothing starts, and the exit
status says so (79, `EXIT_ALREADY_FINISHED`), with the command that would start it afresh elsewhere.  Another run
(other arguments, another command or config) goes to a run directory of its own: the next of `<dir>-2`, `<dir>-3`,
… that is free or holds that same run (whose own state then decides: resume it, or it is finished too).  A run dir
whose run did not finish (failed, stopped, killed) is resumed as always.  "The same" is the effective config as the
run dir's `config.yaml` recorded it, `run_dir` aside.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hangwatch.common.rundir import CONFIG_NAME, STATE_NAME, read_json

SHOWN_DIFFERENCES = 3


@dataclass
class Plan:
    run_dir: str  # where the run goes
    lines: list[str] = field(default_factory=list)  # what to tell the user first
    finished: bool = False  # the same run already finished there: start nothing


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def differences(effective: dict, run_dir: Path) -> Optional[list[str]]:
    """The dotted keys in which `effective` (a config's `model_dump(mode="json")`) differs from the run recorded in
    `run_dir`'s config.yaml; None when it recorded none (or it cannot be read)."""
    import yaml

    try:
        recorded = yaml.safe_load((run_dir / CONFIG_NAME).read_text())
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(recorded, dict):
        return None
    mine, theirs = (
        _flat({k: v for k, v in effective.items() if k != "run_dir"}),
        _flat({k: v for k, v in recorded.items() if k != "run_dir"}),
    )
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


def shown(path: os.PathLike | str) -> str:
    """A path as a person would type it here: relative when below the working directory."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def _state(run_dir: Path) -> Optional[str]:
    rec = read_json(run_dir / STATE_NAME)
    return rec.get("state") if isinstance(rec, dict) else None


def _words(keys: list[str]) -> str:
    if any(k.startswith("worker.command") for k in keys):
        return "another command or other arguments"
    more = len(keys) - SHOWN_DIFFERENCES
    return f"another config ({', '.join(keys[:SHOWN_DIFFERENCES])}{f' and {more} more' if more > 0 else ''})"


def plan(effective: dict, run_dir: str, again: list[str], continuous: bool = False) -> Plan:
    """Where this run goes, from its effective config and the run dir it was given.  `again`: the `hangwatch run`
    arguments that started it (config and `-- CMD…`), for the hint.  `continuous`: an inbox run — new files are new
    work, so a finished one is started again as always."""
    base = Path(run_dir)
    if continuous or _state(base) != "finished":
        return Plan(run_dir)
    diff = differences(effective, base)
    if not diff:  # the same run (or one that recorded no config: treated as this one, as before)
        return Plan(run_dir, finished_lines(base, again), finished=True)
    why = _words(diff)
    n = 2
    while True:
        candidate = base.with_name(f"{base.name}-{n}")
        if _state(candidate) is None and not (candidate / CONFIG_NAME).exists():
            note = f"hangwatch: {shown(base)} holds a finished run of {why}: this run goes to {shown(candidate)}"
            return Plan(str(candidate), [note])
        other = differences(effective, candidate)
        if not other:  # this same run, there: its own state decides
            if _state(candidate) == "finished":
                return Plan(str(candidate), finished_lines(candidate, again), finished=True)
            return Plan(
                str(candidate),
                [f"hangwatch: {shown(base)} holds a finished run of {why}: this run is {shown(candidate)}"],
            )
        n += 1


def finished_lines(run_dir: Path, again: list[str]) -> list[str]:
    """What `hangwatch run` says when this very run already finished in `run_dir`: where it ended, its final
    adapter, and the command that starts it afresh (the new run dir before `--`, where it is `run`'s own option)."""
    state = read_json(run_dir / STATE_NAME) or {}
    step = state.get("step") if isinstance(state.get("step"), int) else state.get("last_good_step")
    wall = state.get("updated_wall")
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(wall)) if isinstance(wall, (int, float)) else None
    facts = ", ".join(x for x in (f"at step {step}" if step is not None else None, when) if x)
    lines = [
        f"hangwatch: {shown(run_dir)} already finished"
        + (f" ({facts})" if facts else "")
        + ": this same run — nothing "
        "started (exit 79)."
    ]
    final = run_dir / "final"
    if final.is_dir():
        lines.append(f"  its final adapter: {shown(final)}")
    fresh = shown(run_dir.with_name(f"{run_dir.name}-new"))
    lines.append(f"  to run it again from the start: hangwatch run --run-dir {fresh} {shlex.join(again)}".rstrip())
    lines.append(f"  (or remove it first: rm -r {shown(run_dir)})")
    return lines
