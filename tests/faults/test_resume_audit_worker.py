"""The built-in worker under the supervisor, SIGKILLed twice mid-run: each restart's replay of the steps between
the checkpoint and the kill is audited against the beats before it — bitwise equal (rtol 0, the built-in worker's
default), recorded in resume-audit.json, on each kill's incident and in the end summary."""

from __future__ import annotations

import json
import os
import signal

import pytest
from fixtures.fakes.sup_harness import start_supervisor, wait_for
from fixtures.fakes.workers import make_config, read_beats

from hangwatch.supervisor.incidents import IncidentStore

pytestmark = pytest.mark.slow


def _pid_at_step(run_dir, attempt: int, step: int) -> int:
    def reached():
        beats = read_beats(run_dir, attempt)
        return next((b["pid"] for b in beats if b["event"] == "step" and b["step"] >= step), None)

    return wait_for(reached, 120, f"attempt {attempt} reaching step {step}")


def test_a_sigkilled_worker_resumes_verified_bitwise(tmp_path):
    cfg = make_config(
        tmp_path,
        train={"max_steps": 26, "sleep_per_step_s": 0.05},
        checkpoint={"every_steps": 5, "confirm_steps": 1, "keep_last": 4},
        watchdog={"startup_timeout_s": 120, "silence_timeout_s": 60},
        restart={"backoff_initial_s": 0, "max_restarts": 4},
    )
    run_dir = tmp_path / "run"
    p = start_supervisor(cfg)
    try:
        os.kill(_pid_at_step(run_dir, 1, 8), signal.SIGKILL)  # steps 6–8 (at least) replayed from step 5's checkpoint
        os.kill(_pid_at_step(run_dir, 2, 18), signal.SIGKILL)  # steps 16–18 from step 15's
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out[-4000:]
    audits = json.loads((run_dir / "resume-audit.json").read_text())["audits"]
    assert [a["attempt"] for a in audits] == [2, 3]
    for a, resumed in zip(audits, (5, 15)):
        assert a["verdict"] == "verified", a
        assert a["resumed_step"] == resumed and a["rtol"] == 0.0
        assert a["replayed"][0] == resumed + 1 and a["compared"] == a["replayed"]
        assert set(a["figures"]) >= {"loss", "lr", "grad_norm"}
        assert a["text"].startswith(f"resume verified: steps {resumed + 1}–") and "bitwise equal" in a["text"]
        on_disk = json.loads(next((run_dir / "incidents").glob(f"{a['incident']}-*/incident.json")).read_text())
        assert "resume_audit" not in on_disk  # a later finding is linked, never written into the old incident
        inc = IncidentStore(run_dir).get(a["incident"])  # …and joined on read
        assert inc["kind"] == "signal" and inc["resume_audit"]["verdict"] == "verified"
    assert "resume verified" in out
    kinds = sorted(d.name.split("-", 1)[1] for d in (run_dir / "incidents").iterdir())
    assert kinds == ["signal", "signal"]
