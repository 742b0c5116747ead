"""The README's "What you see when something hangs" is the demo's own output: the demo is run as `./scripts/demo.sh`
runs it (`hangwatch run configs/demo.yaml`, from a copy of the checkout's configs), and every line the README shows
must be found in what it printed — the events in the same order, with the same fields where they do not vary from
run to run (what fired, on which budget, where the stack was, what the run resumed from, the summary)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import hangwatch_argv, user_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Fields whose values differ from run to run (times, pids, durations); everything else the README shows must match.
VARYING = {"elapsed_s", "overdue_s", "pids", "grace_s", "timestamp", "gone_after_s"}
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\[[^\]]*\]|\S+)')


def readme_sample() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## What you see when something hangs", 1)[1].split("```", 2)[1]
    return [line for line in section.splitlines()[1:] if line.strip() and not line.startswith("$ ")]


# A CPU share sampled from a process is a measurement too: a sleeping worker reads 0 % on a quiet machine, a few
# per cent on a loaded one.
CPU = re.compile(r"CPU \d+%")


def fields(line: str) -> dict[str, str]:
    return {k: CPU.sub("CPU #%", v) for k, v in FIELD.findall(line) if k not in VARYING}


def matches(shown: str, printed: str) -> bool:
    """`printed` is the line the README `shown` stands for: an event line with every stable field of it equal, or a
    plain line equal up to its figures that vary (`in 0.3s`, `exceeded by 0.0s`)."""
    if "event=" in shown:
        want = fields(shown)
        got = fields(printed)
        return all(got.get(k) == v for k, v in want.items())
    figures = re.compile(r"\d+\.\d+s\b")
    return CPU.sub("#", figures.sub("#", shown.strip())) == CPU.sub("#", figures.sub("#", printed.strip()))


def test_the_readmes_demo_output_is_what_the_demo_prints(tmp_path):
    shutil.copytree(REPO / "configs", tmp_path / "configs")
    p = subprocess.run(
        [*hangwatch_argv(), "run", "configs/demo.yaml"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-5000:]
    # paths as the README shows them: relative to where the demo runs (its run dir) and to the checkout (the code)
    printed = p.stderr.replace(f"{tmp_path}/", "").replace(f"{REPO}/", "").splitlines()
    at = 0
    for shown in readme_sample():
        found = next((i for i in range(at, len(printed)) if matches(shown, printed[i])), None)
        assert found is not None, (
            f"README.md shows a line the demo did not print (after line {at} of its stderr):\n  {shown}\n"
            "its stderr:\n" + "\n".join(printed)
        )
        at = found + 1
