"""The `early_stalls` bench section: its simulated hours through the real deadline code raise no false stall, its
injected stalls are caught by the deadlines they are about, and it is registered with the bench and renders."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench import __main__ as cli  # noqa: E402
from bench import early_stalls, report  # noqa: E402


def test_the_section_is_registered():
    assert "early_stalls" in cli.SECTIONS and "early_stalls" in report.RENDERERS
    assert "early_stalls" in (cli.__doc__ or "")


def test_a_quick_run_has_no_false_stall_and_names_the_deadline_of_each_stall():
    s = early_stalls.section(None, quick=True)
    assert s["false_stalls_total"] == 0, s["false_stalls"]
    for name, by_kind in s["stalls"].items():
        for kind, runs in by_kind.items():
            fired = [r["fired"] for r in runs]
            assert all(f["after_last_progress_s"] <= 120 for f in fired), (name, kind, fired)
            expect = {"generate stops at its first call": {"token"}}.get(kind, {"step", "silence"})
            assert {f["deadline"] for f in fired} <= expect, (name, kind, fired)
    fast = s["stalls"]["fast steps"]
    assert {r["fired"]["deadline"] for r in fast["spin in step 5"]} == {"step"}
    assert max(r["fired"]["after_last_progress_s"] for r in fast["spin in step 5"]) < 15
    title, head, rows, how = report.RENDERERS["early_stalls"](s)
    assert len(rows) == len(s["healthy"]) and all(len(r) == len(head) for r in rows)
    assert "bench/early_stalls.py" in how
