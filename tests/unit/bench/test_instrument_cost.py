"""The `instrument` bench section's table: every figure drawn from the section's own samples (no timing threshold
here — only the arithmetic and the rendering), and the section registered with the bench."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

from bench import __main__ as cli  # noqa: E402
from bench import instrument_cost, report
from bench.harness import summary  # noqa: E402


def fake_section() -> dict:
    with_s, without_s = [0.0101, 0.0102, 0.0103], [0.0100, 0.0100, 0.0101]
    s_with, s_without = summary(with_s), summary(without_s)
    ratio = s_with["median"] / s_without["median"]
    own = {
        "calls": 30,
        "step_hook_us": 12.5,
        "train_plain_us": 90.0,
        "train_wrapped_us": 92.0,
        "train_wrapper_us": 2.0,
        "modules": 33,
        "lines_written": 31,
        "total_us": 14.5,
    }
    return {
        "method": "m",
        "steps_per_run": 3,
        "rounds": 1,
        "step_s_with": with_s,
        "step_s_without": without_s,
        "summary_with": s_with,
        "summary_without": s_without,
        "ratio_of_medians": ratio,
        "cost_percent": (ratio - 1) * 100,
        "target_percent": instrument_cost.TARGET_PERCENT,
        "per_run": [
            {"instrumented": True, "median_s": 0.0102, "steps": 3},
            {"instrumented": False, "median_s": 0.0100, "steps": 3},
        ],
        "step_beats_written": 13,
        "in_process": own,
        "own_work_percent": 14.5 / (s_without["median"] * 1e6) * 100,
        "startup_s_with": [0.06],
        "startup_s_without": [0.03],
        "startup_with": summary([0.06]),
        "startup_without": summary([0.03]),
    }


def test_the_section_is_registered():
    assert "instrument" in cli.SECTIONS and "instrument" in report.RENDERERS
    assert "instrument" in (cli.__doc__ or "")


def test_the_table_shows_the_sections_own_figures():
    title, head, rows, how = report.RENDERERS["instrument"](fake_section())
    table = {r[0]: r[1] for r in rows}
    assert title.startswith("9. Automatic instrumentation cost")
    assert table["**cost end to end (ratio of medians − 1)**"] == "**+2.00 %** (target ≤ 0.5 %)"
    assert table["**own work per step / median step**"] == "**0.145 %** (within the target)"
    assert table["in process: optimizer hook (loss .item(), lr, one beat)"] == "12.5 µs"
    assert table["per-run medians, instrumented / not (ms)"] == "10.200 / 10.000 (spread 0.200 ms)"
    assert how.startswith("m ")


def test_the_loop_script_is_an_unedited_script(tmp_path):
    path = instrument_cost.loop_script(tmp_path, steps=3, warmup=1)
    text = path.read_text()
    tree = ast.parse(text, str(path))
    # The script's own code: no hangwatch import, and no mention of it but the probe that says whether the
    # instrumentation loaded.  The examples folder it imports the tiny model from is a path, whatever the checkout
    # is called (a clone named `hangwatch` included): data, not code.
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert sorted(imported) == ["json", "sys", "time", "tiny_model", "torch"]
    words = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    words += [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)]
    words += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert str(instrument_cost.EXAMPLES) in words
    mentions = [w for w in words if "hangwatch" in w.lower() and w != str(instrument_cost.EXAMPLES)]
    assert mentions == ["hangwatch.daemon.autoinstrument"]
    env = instrument_cost.child_env(tmp_path, True, 2)
    assert env["HANGWATCH_INSTRUMENT"] == "auto" and env["HANGWATCH_ATTEMPT"] == "2"
    assert not any(k.startswith("HANGWATCH_") for k in instrument_cost.child_env(tmp_path, False, 1))
