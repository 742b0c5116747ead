"""`hangwatch run` leaves why the run ended where `logging.termination_log` says — in a pod, the container's
termination message, which `kubectl describe pod` shows (docs/kubernetes.md).  A real run of a command that fails
the same way at every attempt, no cluster: the message goes to a file of the test's."""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.user_shell import run_hangwatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_run_that_ends_failed_leaves_its_termination_message(tmp_path):
    message = tmp_path / "termination-log"
    cfg = {
        "logging": {"termination_log": str(message)},
        "restart": {"backoff_initial_s": 0, "no_progress_restarts": 2},  # ended at the third attempt, at once
    }
    r, run_dir = run_hangwatch(tmp_path, cfg, ["python", "-c", "raise SystemExit(3)"], timeout=60)
    assert r.returncode == 79, r.stderr[-3000:]  # no progress past a point: do not retry
    data = message.read_bytes()
    assert 0 < len(data) <= 4096
    lines = data.decode("utf-8").splitlines()
    assert lines[0].startswith("hangwatch: run failed, exit 79: do not retry: running it again would fail the same"), (
        lines
    )
    state = json.loads((run_dir / "state.json").read_text())
    last = state["last_incident"]
    assert last["kind"] == "no_progress"
    assert f"incident {last['id']} [no_progress] (attempt 3)" in lines, lines
    assert any(line.startswith("after incident ") and "[crash]: exited with code 3" in line for line in lines), lines
    assert f"run dir: {run_dir.resolve()} (attempt 3, 2 restart(s), {state['incidents']} incident(s))" in lines, lines
