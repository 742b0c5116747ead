"""`hangwatch logs -f` ends when the run ends (and only then), after printing everything written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hangwatch.common.rundir import worker_log_path
from hangwatch.supervisor.cli.logs import follow_log, run_ended
from hangwatch.supervisor.records.runlock import RunLock


def _append(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


def _state(run_dir: Path, state: str) -> None:
    (run_dir / "state.json").write_text(json.dumps({"state": state}))


@pytest.mark.parametrize(
    "state,locked,ended",
    [
        (None, False, False),  # not started yet
        ("running", True, False),
        ("running", False, False),  # the supervisor died: systemd may restart it, keep following
        ("paused", True, False),
        ("finished", True, False),  # written, but the supervisor has not exited yet
        ("finished", False, True),
        ("failed", False, True),
        ("stopped", False, True),
    ],
)
def test_run_ended_needs_an_end_state_and_no_live_supervisor(tmp_path, state, locked, ended):
    if state:
        _state(tmp_path, state)
    lock = RunLock.acquire(tmp_path) if locked else None
    try:
        assert run_ended(tmp_path) is ended
    finally:
        if lock:
            lock.release()


def test_follow_stops_once_the_run_has_ended_and_prints_the_last_lines(tmp_path):
    log = worker_log_path(tmp_path, 1)
    _append(log, "step 1\n")
    lock = RunLock.acquire(tmp_path)
    polls = []

    def sleep(_s):
        polls.append(1)
        if len(polls) == 1:
            _append(log, "step 2\n")  # still running: the follower must wait for more
        elif len(polls) == 2:
            _append(log, "finished\n")
            _state(tmp_path, "finished")
            lock.release()  # the supervisor exits
        else:
            raise AssertionError("kept following a run that had ended")

    out = [x.decode() for x in follow_log(tmp_path, follow=True, sleep=sleep) if isinstance(x, bytes)]
    assert "".join(out) == "step 1\nstep 2\nfinished\n"
    assert len(polls) == 2
