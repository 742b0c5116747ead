"""The prewarm section's arithmetic and table: three modes on the demo, cold against `always` on the ~1B model;
figures from the trials' own records (no timing threshold)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench import prewarm, report  # noqa: E402


def trial(mode: str, next_step: float, cold_start: float, weights: str = "w", **more) -> dict:
    return {
        "mode": mode,
        "spawn_to_first_step_s": cold_start,
        "detection_to_next_step_s": next_step,
        "next_step_minus_cold_start_s": next_step - cold_start,
        "weights": weights,
        **more,
    }


def test_modes_summaries_count_the_standby_and_its_ram():
    rows = [
        trial(
            "always",
            1.2,
            4.0,
            standby_rss_mb=610.0,
            standby_ready_before_release=True,
            standby_spawned_before_detection_s=9.0,
        ),
        trial("always", 1.6, 4.2, standby_rss_mb=640.0, standby_ready_before_release=True),
        {"mode": "always", "error": "the next attempt did not come from the standby"},
    ]
    s = prewarm.mode_summary(rows)
    assert s["standby_rss_mb"]["median"] == 625.0 and s["standby_ready_before_release"] == 2
    assert s["below_cold_start"] == 2 and s["errors"] == ["the next attempt did not come from the standby"]
    assert s["detection_to_next_step_s"]["n"] == 2


def section(large: dict | None) -> dict:
    modes = {m: prewarm.mode_summary([trial(m, n, 4.0)]) for m, n in (("cold", 5.5), ("prewarm", 3.5), ("always", 1.1))}
    return {
        "method": "m",
        "trials": 1,
        "modes": modes,
        "same_final_weights": "1 of 1",
        "prewarm_detection_to_next_step_minus_cold_restart_start_s": prewarm.summary([-0.5]),
        "below_cold_restart_start": "1 of 1",
        "large": large,
    }


def test_the_table_has_a_column_per_mode_and_says_when_the_large_model_was_not_measured():
    title, header, rows, how = report.RENDERERS["prewarm"](section(None))
    assert header[1:] == ["prewarm off (cold spawn)", "`true` (standby at the stall)", "`always` (standby kept ready)"]
    cells = {r[0]: r[1:] for r in rows}
    assert cells["**detection → first step of the next attempt** (goal with `always`: ≤ 2 s)"] == [
        "5.50 s",
        "3.50 s",
        "1.10 s",
    ]
    assert cells["~1B Llama"][0] == "not measured under --quick"
    assert all(len(r) == 4 for r in rows)


def test_the_large_model_rows_give_always_over_cold():
    large = {
        "params": 1_060_000_000,
        "model_bytes": 4_240_000_000,
        "always_over_cold": 0.31,
        "same_final_weights": True,
        "modes": {
            "cold": prewarm.mode_summary([trial("cold", 40.0, 30.0)]),
            "always": prewarm.mode_summary([trial("always", 12.4, 31.0, standby_rss_mb=4300.0)]),
        },
    }
    _, _, rows, how = report.RENDERERS["prewarm"](section(large))
    cells = {r[0]: r[1:] for r in rows}
    assert cells["· **detection → first step of the next attempt**"] == ["40.00 s", "–", "12.40 s"]
    assert cells["· `always` ÷ cold, detection → next step (goal ≤ 0.5)"][2] == "0.31"
    assert cells["· same final weights, cold vs `always` (bitwise)"][0] == "yes"
    assert "1.06 B parameters" in next(k for k in cells if k.startswith("**~1B Llama"))
    assert "block_c at step" in how and all(len(r) == 4 for r in rows)
