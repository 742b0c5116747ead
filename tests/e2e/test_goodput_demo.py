"""The goodput ledger over the demo with two injected failures (a hung eval generate() that produces no token —
killed and restarted — and a crash): every second of the run is in one category, the categories add up to the
run's wall time within 1 %, the failures' cost shows where it belongs, and the end summary says it in a line."""

from __future__ import annotations

import json

import pytest
import yaml
from fixtures.fakes.sup_harness import ROOT, run_supervisor, state

from hangwatch.supervisor.records.goodput import CATEGORIES, GOODPUT_NAME, RECOVERY

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DEMO = ROOT / "configs" / "demo.yaml"


def test_goodput_categories_add_up_to_the_demos_wall_time(tmp_path):
    cfg = yaml.safe_load(DEMO.read_text())
    run_dir = tmp_path / "demo"
    cfg.update(
        run_dir=str(run_dir),
        data={
            "train": str(ROOT / "configs/data/train.jsonl"),
            "eval": str(ROOT / "configs/data/eval.jsonl"),
            "max_length": 64,
        },
        faults=[{"kind": "hang_generate", "at_step": 20}, {"kind": "crash", "at_step": 33}],
    )
    cfg["train"].update(max_steps=44, sleep_per_step_s=0.05)
    cfg["eval"].update(every_steps=10)
    cfg["checkpoint"].update(every_steps=5, confirm_steps=1)
    cfg["watchdog"]["phase_budgets_s"]["generate"] = 5
    cfg["restart"].update(backoff_initial_s=1, in_process=False)  # the restart path's ledger
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))

    rc, out = run_supervisor(path, timeout=600)
    assert rc == 0, out[-5000:]
    assert state(run_dir)["state"] == "finished"
    g = json.loads((run_dir / GOODPUT_NAME).read_text())
    cats = g["categories"]
    assert set(cats) == set(CATEGORIES)
    wall = g["updated_unix"] - g["started_unix"]  # the wall clock, read at both ends: not the ledger's own sum
    assert abs(sum(cats.values()) - wall) <= 0.01 * wall, (sum(cats.values()), wall)
    assert g["wall_s"] == pytest.approx(sum(cats.values()), abs=0.01)
    # the timeline covers the run without a gap or an overlap
    segs = g["segments"]
    assert all(abs(a[1] - b[0]) < 1e-3 for a, b in zip(segs, segs[1:]))
    assert abs((segs[-1][1] - segs[0][0]) - wall) <= 0.01 * wall
    # where the two failures' time went
    assert g["failures"] == 2
    assert cats["detection"] > 0 and cats["dumps"] > 0 and cats["kill"] > 0 and cats["restart_startup"] > 0
    assert cats["backoff"] >= 1.0  # one backoff of 1 s at least (the second failure's may be longer)
    assert cats["redone"] > 0  # both restarts replay steps after their checkpoint
    assert cats["training"] > 0 and cats["eval"] > 0 and cats["checkpoint"] > 0 and cats["startup"] > 0
    assert cats["paused"] == 0 and cats["idle"] == 0
    # the hang was caught at its 5 s generate budget: its detection wait is at least that long
    assert cats["detection"] >= 5.0
    assert sum(cats[c] for c in RECOVERY) > 0
    assert g["line"].startswith("goodput ") and "2 failures" in g["line"]
    assert g["line"] in out  # the end summary
