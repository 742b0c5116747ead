"""The soak section, one minute of it: a supervisor watching 8 ranks at 20 Hz, asked `status` every second
and its log rotated (rename + SIGHUP) several times, ends with no more descriptors than it had after its
warm-up, answered every request, and reopened its log at every SIGHUP.  Its RSS and CPU figures are in
the results for reading (docs/benchmarks.md, section 12), not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"


@pytest.mark.slow
def test_a_one_minute_soak_leaks_no_descriptor_and_answers_every_status(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "soak", "--out", str(out), "--workdir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((out / "bench-results.json").read_text())["sections"]["soak"]
    assert not s["ended_early"] and s["supervisor_exit"] == 0, s
    assert s["status_asked"] >= 30 and s["status_answered"] == s["status_asked"], s["status_errors"]
    assert s["rotations"] >= 3 and s["log_reopened"] == s["rotations"]  # a SIGHUP is heard every time
    after_warmup = [x for x in s["samples"] if x["t"] >= s["warmup_s"]]
    assert len(after_warmup) >= 4
    assert s["fds_end"] <= s["fds_start"], (s["fd_kinds_start"], s["fd_kinds_end"], s["fd_targets_added"])
    assert s["fd_kinds_end"] == s["fd_kinds_start"]  # the rotated log's descriptor was given back, not kept
    assert s["heartbeat_lines"] > 0 and s["torn_lines"] == 0
    md = (out / "bench-results.md").read_text()
    assert f"| `status` requests answered |  | {s['status_answered']} of {s['status_asked']} |" in md
