"""Which Python a worker command runs, and whether hangwatch can instrument it (`worker.instrument: auto`).

The bootstrap (`common/instrumentation.py`) enters every Python process of the worker through PYTHONPATH;
an interpreter older than `MIN_PYTHON` is left alone (it says so on its own stderr).  Before the first
attempt, `instrument_note` tells the person what to expect, in the start line: the interpreter the
command names — `python…` itself, or the `#!` line of a script or console script (`torchrun`,
`accelerate`, `trl`, `./train.py`) — asked for its version once (a child process, time-boxed, before the
loop starts).  A shell script or a binary says nothing about the Pythons it will start: the note says
so, and each of them decides for itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional

from hangwatch.common.instrumentation import MIN_PYTHON
from hangwatch.supervisor.processes.attempt import BARE_PYTHONS

PROBE_TIMEOUT_S = 10.0


def executable_path(program: str, cwd: Optional[str], env: Mapping[str, str]) -> Optional[Path]:
    """The file `program` names as the worker would run it (PATH of its environment; relative to its cwd)."""
    if program in BARE_PYTHONS:
        return Path(sys.executable)
    if os.sep in program:
        p = Path(program).expanduser()
        return p if p.is_absolute() else Path(cwd or ".") / p
    found = shutil.which(program, path=env.get("PATH", os.defpath))
    return Path(found) if found else None


def shebang_python(path: Path) -> Optional[str]:
    """The interpreter of a `#!…python…` script (`#!/usr/bin/env python3` → python3), else None."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    if words and Path(words[0]).name == "env":
        words = [w for w in words[1:] if not w.startswith("-")]
    return words[0] if words and Path(words[0]).name.startswith("python") else None


def python_of(argv: list[str], cwd: Optional[str], env: Mapping[str, str]) -> Optional[str]:
    """The Python interpreter the command runs first, or None when the command does not say (a shell
    script, a binary)."""
    if not argv:
        return None
    first = executable_path(argv[0], cwd, env)
    if Path(argv[0]).name.startswith("python"):
        return str(first) if first else argv[0]
    if first is None or not first.is_file():
        return None
    inner = shebang_python(first)
    if inner is None:
        return None
    found = executable_path(inner, cwd, env)
    return str(found) if found else inner


def probe_version(python: str, env: Optional[Mapping[str, str]] = None) -> Optional[tuple[int, int]]:
    """(major, minor) of `python`, asked without site (so no sitecustomize runs); None when it cannot be asked."""
    try:
        done = subprocess.run(
            [python, "-S", "-c", "import sys; print('%d %d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env=dict(env) if env else None,
        )
        major, minor = done.stdout.split()
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def instrument_note(command: Optional[list[str]], instrument: str, cwd: Optional[str], env: Mapping[str, str]) -> str:
    """What instrumentation the worker gets, in words for the start line."""
    if command is None:
        return "built-in worker (instrumented by itself)"
    if instrument == "off":
        return "off (worker.instrument: off): watched by its output, py-spy and NVML"
    python = python_of(command, cwd, env)
    if python is None:
        return (
            f"auto: {Path(command[0]).name} is not a Python interpreter or script; the Python processes it starts "
            f"are instrumented (Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]}+), anything else is watched by its output"
        )
    version = probe_version(python, env)
    if version is None:
        return f"auto: {python} could not be asked for its version; it instruments itself if it can"
    if version < MIN_PYTHON:
        return (
            f"none: {python} is Python {version[0]}.{version[1]}, too old for instrumentation (needs "
            f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]}+): watched by its output, py-spy and NVML only"
        )
    return f"auto: {python} (Python {version[0]}.{version[1]}) and every Python process it starts"


def note_for(cfg, probe=instrument_note) -> str:
    """`instrument_note` for a config, asked once (kept on the config: the CLI's preamble and the supervisor's start
    line say the same without a second probe)."""
    if cfg._instrument_note is None:
        cfg._instrument_note = probe(
            cfg.worker.command, cfg.worker.instrument, cfg.worker.cwd, {**os.environ, **cfg.worker.env}
        )
    return cfg._instrument_note
