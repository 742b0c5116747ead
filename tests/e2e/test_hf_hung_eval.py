"""A hung eval under transformers: a real `Trainer` run (tiny Llama built from a config, CPU) under
`hangwatch run` with the shipped HangwatchCallback, whose eval `generate()` never finishes on attempt 1 (EOS
suppressed, `max_new_tokens` of a million) after a newer checkpoint was made not-good by a NaN loss.

It must be caught by the generate budget (a livelock or stall of the `generate` phase), the incident's
summary must name `generate` and the user's callback that called it, attempt 2 must be handed the last
*good* checkpoint through HANGWATCH_RESUME_FROM (checkpoint-4, not the newer checkpoint-8) and resume there,
and the run must finish.  The script is tests/fixtures/workers/hf_hung_eval.py; it records what each attempt got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "workers" / "hf_hung_eval.py"
GENERATE_BUDGET_S = 6

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def hangwatch_argv() -> list[str]:
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]


def beats(run_dir: Path, attempt: int) -> list[dict]:
    path = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [r for r in map(decode_line, path.read_bytes().splitlines()) if r is not None]


def log_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def own_start(recs: list[dict]) -> dict:
    """The script's own start line (its callback's or heartbeat's), after the bootstrap's (`instrumented: auto`)."""
    return next(r for r in recs if r["event"] == "start" and r.get("instrumented") != "auto")


def test_hung_eval_generate_is_caught_and_the_run_resumes_from_the_last_good_checkpoint(tmp_path):
    config = {
        "run_dir": "run",
        # A bare `python`: the supervisor's own interpreter.  cwd: this config's directory.
        "worker": {
            "command": [
                "python",
                str(FIXTURE),
                "--output-dir",
                "out",
                "--max-steps",
                "12",
                "--save-steps",
                "4",
                "--eval-steps",
                "10",
                "--nan-at",
                "9",
            ]
        },
        "watchdog": {
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "first_steps_timeout_s": 60,
            "phase_budgets_s": {"eval": 60, "generate": GENERATE_BUDGET_S, "checkpoint": 30},
            # the kill-and-resume path (a runaway generate is truncated in process by default:
            # test_unedited_scripts.py proves that on the same kind of Trainer callback)
            "generate_overrun": "restart",
            "dump_grace_s": 2,
            "term_grace_s": 5,
            "py_spy": False,
            "poll_interval_s": 0.1,
        },
        "restart": {"max_restarts": 2, "backoff_initial_s": 0},
        "checkpoint": {"confirm_steps": 2},
    }
    path = tmp_path / "hf_hung_eval.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_") and k != "NOTIFY_SOCKET"}
    r = subprocess.run(
        [*hangwatch_argv(), "run", str(path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    run_dir, out = tmp_path / "run", tmp_path / "out"
    worker_logs = "\n".join(p.read_text()[-3000:] for p in sorted(run_dir.glob("attempts/*/worker.log")))
    assert r.returncode == 0, f"{r.stderr[-4000:]}\n{worker_logs}"
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"

    # One incident: the generate phase ran past its budget while beating progress (tokens kept coming).
    incidents = sorted((run_dir / "incidents").iterdir())
    assert len(incidents) == 1, [p.name for p in incidents]
    inc = json.loads((incidents[0] / "incident.json").read_text())
    assert inc["kind"] in ("livelock", "stall") and inc["attempt"] == 1 and inc["phase"] == "generate", inc["summary"]
    assert inc["deadline"]["name"] == "phase" and inc["deadline"]["budget_s"] == GENERATE_BUDGET_S
    assert inc["summary"].startswith("in generate(), called from on_evaluate (hf_hung_eval.py:"), inc["summary"]
    assert inc["landmark"]["name"] == "generate"

    # Attempt 1: checkpoint-4 confirmed good; checkpoint-8, newer, went bad with the NaN loss of step 9.
    a1 = beats(run_dir, 1)
    ckpt4, ckpt8 = str((out / "checkpoint-4").resolve()), str((out / "checkpoint-8").resolve())
    assert [(b["path"], b["good"]) for b in a1 if b["event"] == "checkpoint"] == [(ckpt4, False), (ckpt8, False)]
    assert [b["step"] for b in a1 if b["event"] == "warn"] == [9]
    good1 = [e["path"] for e in log_events(run_dir, "good_checkpoint") if e["attempt"] == 1]
    assert good1 == [ckpt4]
    not_good = [(e["path"], e["why"]) for e in log_events(run_dir, "checkpoint_not_good")]
    assert not_good == [(ckpt8, "loss nan at step 9")]
    hung = [b for b in a1 if b["event"] == "phase"][-1]
    assert (hung["phase"], hung["step"]) == ("generate", 10)
    assert [b["tokens"] for b in a1 if b["event"] == "progress" and b["phase"] == "generate"][:3] == [8, 16, 24]

    # Attempt 2 got checkpoint-4 through HANGWATCH_RESUME_FROM, resumed there and finished.
    got = {n: json.loads((run_dir / f"resume-{n}.json").read_text()) for n in (1, 2)}
    assert (got[1]["resume_from"], got[1]["start_step"]) == ("", 0)
    assert (got[2]["resume_from"], got[2]["start_step"]) == (ckpt4, 4)
    a2 = beats(run_dir, 2)
    assert a2[0]["event"] == "start" and own_start(a2)["resumed_from"] == ckpt4 and own_start(a2)["step"] == 4
    assert [b["step"] for b in a2 if b["event"] == "step"] == list(range(5, 13))
    assert a2[-1]["event"] == "stop" and a2[-1]["reason"] == "finished" and a2[-1]["step"] == 12
    assert sorted(p.name for p in run_dir.glob("attempts/*")) == ["0001", "0002"]
