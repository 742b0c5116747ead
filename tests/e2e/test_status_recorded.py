"""`hangwatch status --run-dir` with no supervisor answering: what state.json last recorded, said as such,
and a supervisor that is gone (its pid and start time no longer a live process) said to be gone — never a
run shown as running when nothing watches it.  The exit stays 69: no supervisor was reachable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]


def status(run_dir: Path, *flags: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "hangwatch.supervisor", "status", "--run-dir", str(run_dir), *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO,
    )


def record(run_dir: Path, state: str, supervisor: dict, **more) -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "state.json").write_text(
        json.dumps(
            {
                "version": 1,
                "state": state,
                "updated_wall": time.time() - 90,
                "supervisor": supervisor,
                "attempt": 3,
                "restarts": 2,
                "incidents": 1,
                "last_incident": {"id": "0001", "kind": "stall", "summary": "rank 0 silent"},
                "last_good_checkpoint": "/ckpt/step-40",
                "last_good_step": 40,
                "run_dir": str(run_dir),
                **more,
            }
        )
    )


def dead_supervisor() -> dict:
    """The identity of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = {"pid": child.pid, "create_time": psutil.Process(child.pid).create_time()}
    child.wait()
    return ident


def test_a_running_state_whose_supervisor_is_gone_says_it_is_gone(tmp_path):
    sup = dead_supervisor()
    record(tmp_path / "run", "running", sup)
    r = status(tmp_path / "run")
    assert r.returncode == 69 and "no hangwatch running" in r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("state: running (as last recorded, 1m")
    assert f"the supervisor (pid {sup['pid']}) is gone" in first
    assert "last good checkpoint /ckpt/step-40 (step 40)" in r.stdout
    r = status(tmp_path / "run", "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 69 and out["source"] == "state.json" and out["supervisor_gone"] is True
    assert out["state"] == "running" and out["attempt"] == 3


def test_a_reused_pid_is_not_the_supervisor(tmp_path):
    me = psutil.Process()
    record(tmp_path / "run", "backoff", {"pid": me.pid, "create_time": me.create_time() - 1000})
    assert json.loads(status(tmp_path / "run", "--json").stdout)["supervisor_gone"] is True


def test_a_live_supervisor_that_does_not_answer_is_not_called_gone(tmp_path):
    me = psutil.Process()  # alive for as long as the test runs, and it holds no socket in the run dir
    record(tmp_path / "run", "running", {"pid": me.pid, "create_time": me.create_time()})
    r = status(tmp_path / "run")
    assert r.returncode == 69 and f"the supervisor (pid {me.pid}) is alive but did not answer" in r.stdout
    assert json.loads(status(tmp_path / "run", "--json").stdout)["supervisor_gone"] is False


def test_a_run_that_ended_shows_its_end_and_why(tmp_path):
    record(
        tmp_path / "run",
        "failed",
        dead_supervisor(),
        exit_code=74,
        why="no space left on device at /runs/x/checkpoints during running",
    )
    r = status(tmp_path / "run")
    assert r.returncode == 0, r.stderr  # a run that ended: its final state is the answer, not "nobody answered"
    assert (
        r.stdout.splitlines()[0].endswith(": no space left on device at /runs/x/checkpoints during running — exit 74")
        and "gone" not in r.stdout
    )


def test_no_state_json_is_the_plain_error(tmp_path):
    (tmp_path / "run").mkdir()
    r = status(tmp_path / "run")
    assert (r.returncode, r.stdout) == (69, "") and r.stderr.startswith("hangwatch: no hangwatch running at ")
