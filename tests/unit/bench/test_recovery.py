"""The recovery section's figures against their goals: each goal is taken from the same trial (its dump settle,
its own cold start), read from the supervisor's record; no timing threshold — only the arithmetic and the table."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench import recovery, report  # noqa: E402

TIMINGS = {
    "dump_started_at_s": 0.0,
    "snapshot_s": 0.53,
    "dump_s": 0.53,
    "dump_files_s": 0.0,
    "py_spy_s": 0.33,
    "sigterm_at_s": 0.54,
    "term_grace_s": 0.5,
    "sigkill_after_s": 0.58,
    "tree_gone_after_s": 0.65,
    "detection_to_gone_s": 1.19,
}


def test_escalation_figures_come_from_the_incidents_own_timings():
    f = recovery.escalation_figures({"timings": TIMINGS, "decision": {"delay_s": 0.0}})
    assert f["dump_settle_s"] == 0.53 and f["detection_to_sigterm_s"] == 0.54 and f["sigterm_to_gone_s"] == 0.65
    assert f["gone_minus_goal_s"] == 1.19 - (0.53 + 0.5) and f["restart_delay_s"] == 0.0
    older = {k: v for k, v in TIMINGS.items() if k != "sigterm_at_s"}  # a supervisor that did not record it
    assert recovery.escalation_figures({"timings": older})["detection_to_sigterm_s"] == 1.19 - 0.65
    assert recovery.escalation_figures({})["gone_minus_goal_s"] is None


def test_goals_are_counted_per_trial_and_shown_against_the_median():
    rows = [
        {"hang_rank": 0, "gone_minus_goal_s": g, "next_step_minus_goal_s": n}
        for g, n in ((-0.1, 0.4), (0.2, -1.0), (0.3, -0.2))
    ]
    w = recovery.world_summary(rows + [{"error": "no stall incident"}], 1)
    assert (w["gone_goal_met"], w["next_step_goal_met"], w["errors"]) == (1, 2, ["no stall incident"])
    _, header, table, _ = report.recovery({"worlds": {"1": w}, "method": "m"})
    cells = {r[0]: r[1] for r in table}
    gone = next(v for k, v in cells.items() if k.startswith("**goal: detection → tree gone"))
    step = next(v for k, v in cells.items() if k.startswith("**goal: detection → next step"))
    assert gone == "misses: median +0.20 s (max +0.30 s); met in 1 of 3"
    assert step == "meets: median -0.20 s (max +0.40 s); met in 2 of 3"
    assert cells["· dump settle: SIGUSR1 → every dump in"] == "not measured"  # no trial carried it
