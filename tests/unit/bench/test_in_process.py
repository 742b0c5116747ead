"""The `in_process` bench section: its failure schedule (every kind in turn, by time, inside the run) and its table
drawn from the section's own figures, and the section registered with the bench."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench import __main__ as cli  # noqa: E402
from bench import in_process, report  # noqa: E402
from bench.harness import summary  # noqa: E402


def test_a_failure_every_interval_in_turn_inside_the_run(tmp_path):
    cfg, kills = in_process.goodput_config(tmp_path / "run", 600.0, 60.0, 0.12)
    kinds = [f["kind"] for f in cfg["faults"]]
    assert kinds == ["busy_loop", "nan", "oom", "busy_loop", "nan", "oom", "busy_loop", "nan"]
    assert kills == [210.0, 450.0]  # the 4th and 8th intervals' middles, in seconds from the first step
    steps = [f["at_step"] for f in cfg["faults"]]
    assert steps == sorted(steps) and steps[-1] < cfg["train"]["max_steps"]
    assert steps[0] == int(30.0 / 0.12) and cfg["restart"]["in_process"] is True


def test_the_table_comes_from_the_figures():
    spin = {
        m: {"detection_to_next_step_s": summary([v]), "restarts": summary([r])}
        for m, v, r in (("in_process", 0.7, 0), ("standby", 1.5, 1), ("cold", 7.3, 1))
    }
    section = {
        "method": "m",
        "spin": spin,
        "same_final_weights": "1 of 1",
        "oom": {
            "in_process": {"oom_to_fitting_step_s": 0.71, "restarts": 0, "micro_batch_at_end": 2},
            "restart": {"oom_to_fitting_step_s": 9.5, "restarts": 1, "micro_batch_at_end": 2},
        },
        "goodput": {"wall_s": 600.0, "faults": 8, "kills": 2, "restarts": 2, "goodput_pct": 93.1, "incidents": {}},
        "large": None,
    }
    title, header, rows, how = in_process.render(section)
    assert title == "Recovery in the process" and header[1:] == ["in the process", "standby (prewarm: always)", "cold"]
    assert rows[0] == ["Python spin: detection → next step", "0.70 s", "1.50 s", "7.30 s"]
    assert rows[4][1:3] == ["9.50 s", "1 restart(s)"] and rows[5][0] == "goodput, 600 s run, 10 failures"
    assert "in_process" in cli.SECTIONS and "in_process" in report.RENDERERS


def test_the_large_rows_come_from_their_trials():
    rows = {
        "in_process": [{"detection_to_next_step_s": 1.9, "weights": "a"}, {"detection_to_next_step_s": 2.1}],
        "cold": [{"detection_to_next_step_s": 5.7, "weights": "a"}, {"detection_to_next_step_s": 5.9, "weights": "b"}],
    }
    large = {
        "params": 1.06e9,
        "rows": rows,
        "detection_to_next_step_s": {m: summary([r["detection_to_next_step_s"] for r in rs]) for m, rs in rows.items()},
        "same_final_weights": 1,
    }
    section = {
        "method": "m",
        "spin": {m: {"detection_to_next_step_s": None, "restarts": None} for m in in_process.MODES},
        "same_final_weights": "0 of 0",
        "oom": {},
        "goodput": {"wall_s": 1.0, "faults": 0, "kills": 0, "restarts": 0, "goodput_pct": None, "incidents": {}},
        "large": large,
    }
    _, _, table, _ = in_process.render(section)
    assert table[-2][0] == "~1.06 B Llama (CPU), Python spin: detection → next step"
    assert table[-2][1].startswith("2.00 s (n=2") and table[-2][3].startswith("5.80 s (n=2")
    assert table[-1][1] == "1 of 2"
