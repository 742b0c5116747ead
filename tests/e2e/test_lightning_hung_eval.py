"""The hung-eval scenario for Lightning, under `hangwatch run` as a user starts it: examples/lightning_train.py
(HangwatchCallback, ModelCheckpoint every 2 steps, a validation that generates) with the faults of
tests/fixtures/workers/lightning_hung_eval.py in attempt 1:

  step 7's loss is NaN             → the step-6 checkpoint, newer than step 4's, is not good;
  validation after step 8 generates with EOS suppressed and a huge max_new_tokens → generate() never returns.

hangwatch must catch the stall in the `generate` phase (its budget, not the eval's), name `generate` in the
incident's summary, hand attempt 2 the last *good* checkpoint (step 4) through HANGWATCH_RESUME_FROM — which
the script passes to `trainer.fit(ckpt_path=resume_from())` — and the run must then finish.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "workers" / "lightning_hung_eval.py"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAN_AT, HANG_AT, MAX_STEPS = 7, 8, 10
GENERATE_BUDGET_S = 8


def hangwatch_argv() -> list[str]:
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]


def beats(run_dir: Path, attempt: int) -> list[dict]:
    p = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [r for r in map(decode_line, p.read_bytes().splitlines()) if r is not None]


def own_start(recs: list[dict]) -> dict:
    """The script's own start line (its callback's or heartbeat's), after the bootstrap's (`instrumented: auto`)."""
    return next(r for r in recs if r["event"] == "start" and r.get("instrumented") != "auto")


def worker_logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in sorted(run_dir.glob("attempts/*/worker.log")))


def test_lightning_eval_generate_that_never_returns_is_caught_and_resumed_from_the_last_good_checkpoint(tmp_path):
    pytest.importorskip("lightning")
    out = tmp_path / "out"
    cfg = {
        "run_dir": "run",
        "worker": {
            # A bare `python`: the supervisor's own interpreter.
            "command": [
                "python",
                str(FIXTURE),
                "--out",
                str(out),
                "--max-steps",
                str(MAX_STEPS),
                "--ckpt-every",
                "2",
                "--val-every",
                str(HANG_AT),
                "--batch-size",
                "4",
            ],
            "env": {"HUNG_EVAL_NAN_AT": str(NAN_AT), "HUNG_EVAL_HANG_AT": str(HANG_AT)},
        },
        "watchdog": {
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "first_steps_timeout_s": 60,
            "phase_budgets_s": {"eval": 120, "generate": GENERATE_BUDGET_S, "checkpoint": 60},
            "generate_overrun": "restart",  # the kill-and-resume path (truncation: test_unedited_scripts.py)
            "dump_grace_s": 3,
            "term_grace_s": 5,
            "py_spy": False,
            "poll_interval_s": 0.2,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 2},
        "checkpoint": {"confirm_steps": 2},
    }
    config = tmp_path / "lightning-hung-eval.yaml"
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_") and k != "NOTIFY_SOCKET"}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run(
        [*hangwatch_argv(), "run", str(config)], capture_output=True, text=True, timeout=420, env=env, cwd=tmp_path
    )
    assert r.returncode == 0, f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_logs(run_dir)}"
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"

    # Attempt 1: step 7 was non-finite, then validation's generate() ran (progress beats) until killed.
    ev1 = beats(run_dir, 1)
    losses = {e["step"]: e["loss"] for e in ev1 if e["event"] == "step"}
    assert sorted(losses) == list(range(1, HANG_AT + 1))
    assert math.isnan(losses[NAN_AT]) and all(math.isfinite(v) for s, v in losses.items() if s != NAN_AT)
    announced = {e["step"]: e["path"] for e in ev1 if e["event"] == "checkpoint"}
    assert sorted(announced) == [2, 4, 6, 8]
    assert all(Path(p).is_file() or Path(p + ".hangwatch-bad").is_file() for p in announced.values())
    assert ev1[-1]["phase"] == "generate" and ev1[-1]["step"] == HANG_AT
    hung_at = max(i for i, e in enumerate(ev1) if e["event"] == "phase" and e["phase"] == "generate")
    assert ev1[hung_at - 1]["phase"] == "eval"
    assert [e["event"] for e in ev1[hung_at + 1 :]] and {e["event"] for e in ev1[hung_at + 1 :]} == {"progress"}

    # The incident: the generate budget fired, and the summary names generate() first.
    # One failure.  The resume audit may add a finding: Lightning restarts an epoch it resumes in the middle of
    # (a shuffled DataLoader is not resumable, as it warns), so the replay may train other batches than before.
    incidents = sorted((run_dir / "incidents").iterdir())
    assert [p.name.split("-", 1)[1] for p in incidents[:1]] == ["livelock"], [p.name for p in incidents]
    assert all(p.name.endswith("-resume_diverged") for p in incidents[1:]), [p.name for p in incidents]
    inc = json.loads((incidents[0] / "incident.json").read_text())
    assert inc["attempt"] == 1 and inc["phase"] == "generate" and inc["step"] == HANG_AT
    assert inc["deadline"]["budget_s"] == GENERATE_BUDGET_S and inc["deadline"]["progress_lines"] > 0
    assert inc["landmark"]["kind"] == "generate"
    assert inc["summary"].startswith("in generate()"), inc["summary"]
    assert "lightning_train.py" in inc["summary"], inc["summary"]  # called from the example's generate_sample

    # Attempt 2 was handed step 4 — the newest *good* one: 6 was followed by a NaN, 8 by nothing — and
    # Lightning restored it.
    resumes = [json.loads(line) for line in (out / "resumes.jsonl").read_text().splitlines()]
    assert [x["attempt"] for x in resumes] == [1, 2]
    assert not resumes[0]["resume_from"] and resumes[0]["global_step"] == 0
    assert resumes[1]["resume_from"] == announced[4] and resumes[1]["ckpt_path"] == announced[4]
    assert resumes[1]["global_step"] == 4
    # the newer, not-good checkpoint was passed over, and renamed aside (never deleted) so no "latest" search finds it
    assert Path(announced[6] + ".hangwatch-bad").is_file()

    ev2 = beats(run_dir, 2)
    assert ev2[0]["event"] == "start" and own_start(ev2)["resumed_from"] == announced[4]
    steps2 = [e["step"] for e in ev2 if e["event"] == "step"]
    assert steps2 == list(range(5, MAX_STEPS + 1))
    assert all(math.isfinite(e["loss"]) for e in ev2 if e["event"] == "step")
    assert "generate" in [e["phase"] for e in ev2 if e["event"] == "phase"]  # validation generated, and finished
    assert ev2[-1]["event"] == "stop" and ev2[-1]["reason"] == "finished"
    assert not (run_dir / "attempts" / "0003").exists()
