"""Resume from the last *good* checkpoint, for a script that is not the built-in worker: the real
supervisor (`python -m hangwatch.supervisor run`) runs tests/fixtures/workers/ckpt_worker.py, which announces
two checkpoints and spoils the newer one with a NaN loss before dying; the next attempt must be
handed the older one in HANGWATCH_RESUME_FROM, and the record must say why the newer one is not good.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.sup_harness import ROOT, attempts, run_supervisor, state, wait_no_strays
from fixtures.fakes.watchdog_settings import FAST_WATCHDOG

pytestmark = pytest.mark.slow

CKPT_WORKER = ROOT / "tests" / "fixtures" / "workers" / "ckpt_worker.py"


def test_a_foreign_worker_resumes_from_the_last_good_checkpoint_not_the_newest(tmp_path):
    run_dir, got = tmp_path / "run", tmp_path / "resume.json"
    cfg = {
        "run_dir": str(run_dir),
        # A bare `python`, as users write it: the supervisor's own interpreter. cwd: the config's directory.
        "worker": {"command": ["python", str(CKPT_WORKER), str(got)]},
        "watchdog": FAST_WATCHDOG,
        "restart": {"backoff_initial_s": 0, "max_restarts": 3},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    rc, out = run_supervisor(tmp_path / "cfg.yaml", timeout=60)
    assert rc == 0 and state(run_dir)["state"] == "finished", out[-4000:]
    assert len(attempts(run_dir)) == 2 and not wait_no_strays(str(run_dir))

    good, spoiled = tmp_path / "ckpts" / "step-2", tmp_path / "ckpts" / "step-4"
    assert Path(f"{spoiled}.hangwatch-bad").is_dir()  # the newer one: renamed aside (never deleted), not handed over
    assert json.loads(got.read_text()) == {"env": str(good), "resume_from": str(good)}

    record = {c["path"]: c for c in json.loads((run_dir / "checkpoints.json").read_text())["checkpoints"]}
    good_rec = record["ckpts/step-2"]
    assert good_rec["status"] == "good" and good_rec["why"] == "confirmed by finite loss at steps 3, 4"
    assert record["ckpts/step-4"]["status"] == "bad" and record["ckpts/step-4"]["why"] == "loss nan at step 5"
    st = state(run_dir)
    assert (st["last_good_checkpoint"], st["last_good_step"]) == ("ckpts/step-2", 2)
    assert "checkpoint ckpts/step-4 (step 4) is not good: loss nan at step 5" in out  # the run's summary says so
    log = [json.loads(line) for line in (run_dir / "supervisor.log").read_text().splitlines()]
    assert not [r for r in log if r.get("event") == "resumed_from_differs"]  # it resumed from what it was handed
