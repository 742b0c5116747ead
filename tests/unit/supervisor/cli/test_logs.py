"""`hangwatch logs`: every attempt's worker log, oldest first, each under a line that says how that attempt ended
(read from a run dir laid out on disk as the supervisor leaves it), one attempt, the last lines of them all; and `-f`,
which goes on into each new attempt and ends when the run ends (and only then), after printing everything written."""

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


# ---- every attempt, each under a line that says how it ended ---------------------------------------------------


def _json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _incident(run_dir: Path, ident: str, kind: str, attempt: int, **fields) -> None:
    _json(
        run_dir / "incidents" / f"{ident}-{kind}" / "incident.json",
        {"id": ident, "kind": kind, "attempt": attempt, **fields},
    )


def restarted_run(run_dir: Path) -> Path:
    """A run as the supervisor leaves it: attempt 1 hung in eval and was killed, attempt 2 crashed (its last words
    and the incident), attempt 3 runs (state.json, the lock held)."""
    _append(worker_log_path(run_dir, 1), "step 1\nstep 2\neval: generating\n")
    _incident(run_dir, "0001", "stall", 1, exit={"code": None, "signal": 9, "signal_name": "SIGKILL"})
    _append(worker_log_path(run_dir, 2), "resuming from step 2\nTraceback …\nRuntimeError: boom\n")
    _json(run_dir / "attempts" / "0002" / "exit.json", {"kind": "crash", "exit_code": 1, "attempt": 2})
    _incident(run_dir, "0002", "crash", 2, exit={"code": 1, "signal": None, "signal_name": None})
    # an incident that did not end its attempt (recovered in the process): no `exit`
    _incident(run_dir, "0003", "oom_adapted", 3, recovery={"path": "in_process"})
    _append(worker_log_path(run_dir, 3), "resuming from step 2\nstep 3\n")
    _json(run_dir / "state.json", {"state": "running", "attempt": 3})
    return run_dir


def logs_cli(*args):
    from click.testing import CliRunner

    from hangwatch.supervisor.cli.remote import logs

    return CliRunner().invoke(logs, [str(a) for a in args], catch_exceptions=False)


HEADINGS = [
    "──── attempt 1 (killed after a stall, incident 0001) ────",
    "──── attempt 2 (exit 1: crash, incident 0002) ────",
    "──── attempt 3 (running) ────",
]


def test_logs_shows_every_attempt_in_order_each_under_how_it_ended(tmp_path):
    run = restarted_run(tmp_path / "run")
    with RunLock.acquire(run):
        r = logs_cli("--run-dir", run)
    assert r.exit_code == 0, r.output
    assert r.output.splitlines() == [
        HEADINGS[0],
        "step 1",
        "step 2",
        "eval: generating",
        HEADINGS[1],
        "resuming from step 2",
        "Traceback …",
        "RuntimeError: boom",
        HEADINGS[2],
        "resuming from step 2",
        "step 3",
    ]


def test_logs_attempt_shows_that_one_and_names_those_there_are_when_it_is_not(tmp_path):
    run = restarted_run(tmp_path / "run")
    with RunLock.acquire(run):
        r = logs_cli("--run-dir", run, "--attempt", "1")
        assert r.output.splitlines() == [HEADINGS[0], "step 1", "step 2", "eval: generating"]
        r = logs_cli("--run-dir", run, "--attempt", "7")
    assert r.exit_code == 1
    assert r.output == f"hangwatch: no attempt 7 in {run}; its attempts: 1-3\n"
    (run / "attempts" / "0004").mkdir()  # spawned, no output yet
    r = logs_cli("--run-dir", run, "--attempt", "4")
    assert (r.exit_code, r.output) == (
        1,
        f"hangwatch: attempt 4 in {run} has no worker log yet; attempts with one: 1-3\n",
    )


def test_logs_last_lines_are_the_last_of_all_the_attempts(tmp_path):
    run = restarted_run(tmp_path / "run")  # no supervisor holds it now: attempt 3 is only recorded as running
    r = logs_cli("--run-dir", run, "-n", "4")
    assert r.output.splitlines() == [
        HEADINGS[1],
        "Traceback …",
        "RuntimeError: boom",
        "──── attempt 3 (running when last recorded; no supervisor now) ────",
        "resuming from step 2",
        "step 3",
    ]
    assert logs_cli("--run-dir", run, "-n", "1").output.splitlines()[1:] == ["step 3"]
    assert logs_cli("--run-dir", run, "-n", "100").output.splitlines()[0] == HEADINGS[0]


def test_a_heading_starts_a_line_of_its_own_after_a_log_cut_off_mid_line(tmp_path):
    run = tmp_path / "run"
    _append(worker_log_path(run, 1), "step 1\nkilled mid-li")
    _append(worker_log_path(run, 2), "step 2\n")
    _json(run / "state.json", {"state": "finished", "attempt": 2})
    assert logs_cli("--run-dir", run).output == (
        "──── attempt 1 (ended) ────\nstep 1\nkilled mid-li\n──── attempt 2 (finished) ────\nstep 2\n"
    )


@pytest.mark.parametrize(
    "files,state,outcome",
    [
        # the incident that ended it: the supervisor's kill after a deadline, or the worker's own exit
        (
            {"incident": ("livelock", {"signal": 15, "signal_name": "SIGTERM"})},
            None,
            "killed after a livelock, incident 0001",
        ),
        ({"incident": ("manual", {"signal": 9})}, None, "killed after restart --now, incident 0001"),
        (
            {"incident": ("signal", {"signal": 11, "signal_name": "SIGSEGV"})},
            None,
            "killed by SIGSEGV: signal, incident 0001",
        ),
        ({"incident": ("oom", {"code": 1})}, None, "exit 1: oom, incident 0001"),
        # no incident: its last words, its last `stop` beat (a graceful restart), else only that it ended
        ({"exit.json": {"kind": "data_error", "exit_code": 65}}, None, "exit 65: data_error"),
        ({"beat": {"event": "stop", "reason": "terminated"}}, None, "stopped: terminated"),
        ({}, None, "ended"),
        # the attempt state.json is about
        ({}, {"state": "finished", "attempt": 1}, "finished"),
        ({}, {"state": "paused", "attempt": 1}, "paused when last recorded; no supervisor now"),
    ],
)
def test_how_an_attempt_ended_comes_from_what_the_run_dir_records(tmp_path, files, state, outcome):
    from hangwatch.supervisor.cli.logs import AttemptOutcomes

    run = tmp_path / "run"
    _append(worker_log_path(run, 1), "x\n")
    if "incident" in files:
        kind, exit_info = files["incident"]
        _incident(run, "0001", kind, 1, exit={"code": None, "signal": None, **exit_info})
    if "exit.json" in files:
        _json(run / "attempts" / "0001" / "exit.json", files["exit.json"])
    if "beat" in files:
        _append(run / "attempts" / "0001" / "heartbeat-rank0.jsonl", json.dumps({"step": 4, **files["beat"]}) + "\n")
    if state:
        _json(run / "state.json", state)
    assert AttemptOutcomes(run).describe(1) == outcome


def test_an_attempt_just_spawned_is_running_before_state_json_says_so(tmp_path):
    from hangwatch.supervisor.cli.logs import AttemptOutcomes

    run = tmp_path / "run"
    _append(worker_log_path(run, 1), "x\n")
    _incident(run, "0001", "stall", 1, exit={"signal": 9})
    _json(run / "state.json", {"state": "backoff", "attempt": 1})
    _append(worker_log_path(run, 2), "y\n")
    with RunLock.acquire(run):
        assert AttemptOutcomes(run).describe(2) == "running"
    assert AttemptOutcomes(run).describe(2) == "ended"  # nobody supervises it: no reason to think it runs


def test_follow_goes_on_into_each_new_attempt_and_says_how_the_last_one_ended(tmp_path):
    from hangwatch.supervisor.cli.logs import AttemptOutcomes, attempt_of, heading

    run = tmp_path / "run"
    _append(worker_log_path(run, 1), "one\n")
    _json(run / "state.json", {"state": "running", "attempt": 1})
    lock = RunLock.acquire(run)
    outcomes = AttemptOutcomes(run)
    steps = [
        lambda: _append(worker_log_path(run, 1), "one more\n"),
        lambda: (
            _incident(run, "0001", "stall", 1, exit={"signal": 9}),
            _append(worker_log_path(run, 2), "two\n"),
            _append(worker_log_path(run, 3), "three\n"),  # two attempts appear between polls: neither is skipped
            _json(run / "state.json", {"state": "running", "attempt": 3}),
        ),
        lambda: (_json(run / "state.json", {"state": "finished", "attempt": 3}), lock.release()),
    ]

    def sleep(_s):
        steps.pop(0)()

    shown = []
    for item in follow_log(run, follow=True, sleep=sleep):
        if isinstance(item, Path):
            shown.append(heading(attempt_of(item), outcomes.describe(attempt_of(item))))
        else:
            shown.append(item.decode())
    assert shown == [
        "──── attempt 1 (running) ────",
        "one\n",
        "one more\n",
        "──── attempt 2 (ended) ────",
        "two\n",
        "──── attempt 3 (running) ────",
        "three\n",
    ]
    assert not steps
