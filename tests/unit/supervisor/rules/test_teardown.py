"""A worker that died by a signal after every rank said it had finished is a finished run, not a failed one
(`rules.teardown`): the rule's table, the status the automatic instrumentation says at exit, what the
supervisor reads for it from an ended attempt, and the policy's reading of an `exit` stop line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.fakes.torchrun_report import root_cause

from hangwatch.common.config import RestartCfg
from hangwatch.daemon.autoinstrument.exits import _NOTHING, exit_status
from hangwatch.supervisor.escalation.episode import teardown_crash_of
from hangwatch.supervisor.rules.policy import RestartPolicy
from hangwatch.supervisor.rules.teardown import exit_hang, finished_stop, teardown_crash

EXIT0 = {"reason": "exit", "code": 0}
EXIT3 = {"reason": "exit", "code": 3}
RAISED = {"reason": "exit", "code": 1}
FINISHED = {"reason": "finished", "code": None}
IDLE = {"reason": "idle"}
TERMINATED = {"reason": "terminated"}


def root(rank, signal=None, exitcode=None) -> dict:
    return {"rank": rank, "exitcode": exitcode if exitcode is not None else (-6 if signal else 1), "signal": signal}


@pytest.mark.parametrize(
    "code, sig, stops, report, finished",
    [
        # every rank said it was done, then a signal: finished
        (None, "SIGABRT", {0: EXIT0}, None, True),
        (1, None, {0: EXIT0, 1: EXIT0}, root(1, "SIGABRT"), True),
        (1, None, {0: FINISHED, 1: FINISHED}, root(0, "SIGSEGV"), True),
        (None, "SIGKILL", {0: IDLE}, None, True),
        (1, None, {0: FINISHED, 1: EXIT0}, root(1, "SIGABRT"), True),
        # a rank that did not say so (killed before its exit, or still working): judged as usual
        (1, None, {0: None, 1: EXIT0}, root(1, "SIGABRT"), False),
        (1, None, {0: EXIT0, 1: EXIT3}, root(1, "SIGABRT"), False),
        (1, None, {0: EXIT0, 1: RAISED}, root(1, "SIGABRT"), False),
        (None, "SIGABRT", {0: TERMINATED}, None, False),
        (None, "SIGABRT", {}, None, False),
        # an exit status without a signal is the program's own: judged as usual
        (1, None, {0: EXIT0, 1: EXIT0}, root(1, exitcode=1), False),
        (1, None, {0: EXIT0, 1: EXIT0}, None, False),
        (2, None, {0: EXIT0}, None, False),
        # a clean exit needs no rule
        (0, None, {0: EXIT0}, None, False),
    ],
)
def test_teardown_crash(code, sig, stops, report, finished):
    why = teardown_crash(code, sig, stops, report)
    assert (why is not None) is finished, why
    if finished:
        assert "not restarting" in why and "after every rank had finished" in why
        assert (sig or report["signal"]) in why


def test_the_reason_names_the_rank_torchrun_reports_and_what_each_rank_said():
    why = teardown_crash(1, None, {0: FINISHED, 1: EXIT0}, root(1, "SIGABRT"))
    assert why.startswith("rank 1 died by SIGABRT while exiting")
    assert "rank 0: stop 'finished'" in why and "rank 1: the interpreter exited with status 0" in why


@pytest.mark.parametrize(
    "stop, done",
    [
        (EXIT0, True),
        (FINISHED, True),
        (IDLE, True),
        (EXIT3, False),
        (RAISED, False),
        ({"reason": "exit"}, False),
        ({"reason": "exit", "code": True}, False),
        ({"reason": "exit", "code": "0"}, False),
        (TERMINATED, False),
        ({"reason": "error"}, False),
        (None, False),
        ({}, False),
    ],
)
def test_finished_stop(stop, done):
    assert finished_stop(stop) is done


@pytest.mark.parametrize(
    "requested, last, status",
    [
        (_NOTHING, None, (0, None)),
        (None, None, (0, None)),
        (0, None, (0, None)),
        (3, None, (3, None)),
        (256 + 2, None, (2, None)),
        (False, None, (0, None)),
        (True, None, (1, None)),
        ("bye", None, (1, None)),
        (_NOTHING, KeyError("x"), (1, "KeyError")),
        (0, RuntimeError("late"), (1, "RuntimeError")),  # sys.exit(0) caught, then an uncaught exception
        (4, SystemExit(4), (4, None)),
    ],
)
def test_exit_status(requested, last, status):
    assert exit_status(requested, last) == status


def attempt(tmp_path: Path, stops: dict, *, code=1, sig=None, log: str = "", announced=()) -> SimpleNamespace:
    d = tmp_path / "attempts" / "0001"
    d.mkdir(parents=True, exist_ok=True)
    (d / "worker.log").write_text(log)
    worker = SimpleNamespace(exit_code=code, exit_signal=sig, log_path=d / "worker.log")
    return SimpleNamespace(dir=d, worker=worker, stop_lines=stops, announced={r: None for r in announced})


def test_torchruns_report_of_a_rank_aborted_after_both_said_exit_is_a_finished_run(tmp_path):
    log = "step 8\nterminate called without an active exception\n" + root_cause(
        rank=1, exitcode=-6, signal="SIGABRT", peer_sigterm=True
    )
    why = teardown_crash_of(attempt(tmp_path, {0: EXIT0, 1: EXIT0}, log=log), [0, 1])
    assert why is not None and why.startswith("rank 1 died by SIGABRT while exiting"), why


def test_a_rank_that_announced_itself_but_said_nothing_at_the_end_keeps_it_a_failure(tmp_path):
    log = root_cause(rank=1, exitcode=-6, signal="SIGABRT")
    assert teardown_crash_of(attempt(tmp_path, {1: EXIT0}, log=log, announced=(0, 1)), [1]) is None
    assert teardown_crash_of(attempt(tmp_path, {0: EXIT0, 1: EXIT0}, log=log, announced=(0, 1)), [1]) is not None


def test_a_single_process_killed_by_a_signal_after_its_exit_line(tmp_path):
    import signal

    why = teardown_crash_of(attempt(tmp_path, {0: EXIT0}, code=None, sig=signal.SIGSEGV), [0])
    assert why is not None and why.startswith("the worker died by SIGSEGV while exiting"), why
    assert teardown_crash_of(attempt(tmp_path, {0: EXIT0}, code=0), [0]) is None  # clean: nothing to excuse
    assert teardown_crash_of(attempt(tmp_path, {}, code=None, sig=signal.SIGSEGV), []) is None


def test_torchruns_report_of_an_exit_status_is_no_teardown_crash(tmp_path):
    log = root_cause(rank=1, exitcode=3)
    assert teardown_crash_of(attempt(tmp_path, {0: EXIT0, 1: EXIT0}, log=log), [0, 1]) is None


@pytest.mark.parametrize(
    "code, stop, own, action",
    [
        (0, "exit", True, "finish"),
        (0, None, True, "finish"),
        (0, "exit", False, "restart"),  # the built-in worker always says `finished`
        (0, "finished", False, "finish"),
        (1, "exit", True, "restart"),
    ],
)
def test_the_policy_reads_an_exit_line_with_status_0_as_a_completed_command(code, stop, own, action):
    policy = RestartPolicy(RestartCfg(backoff_initial_s=0))
    assert policy.on_exit(0.0, code, stop, own_command=own).action == action


@pytest.mark.parametrize(
    "deadline, stops, finished",
    [
        ("exit", {0: FINISHED, 1: EXIT0}, True),
        ("exit", {0: EXIT0}, True),
        ("exit", {0: EXIT0, 1: None}, False),  # a rank still working (or killed before its exit line)
        ("exit", {0: TERMINATED}, False),
        ("exit", {0: EXIT3}, False),
        ("exit", {}, False),
        ("step", {0: FINISHED}, False),  # another deadline: a stall, judged as one
        (None, {0: FINISHED}, False),
    ],
)
def test_exit_hang(deadline, stops, finished):
    why = exit_hang(deadline, stops)
    assert (why is not None) is finished, why
    if finished:
        assert (
            why.startswith("the worker did not exit after every rank had finished its work") and "not restarting" in why
        )


def test_the_policy_finishes_a_run_whose_unclean_exit_came_after_every_rank_had_finished():
    policy = RestartPolicy(RestartCfg(backoff_initial_s=0))
    d = policy.on_exit(0.0, None, "exit", own_command=True, teardown="rank 1 died by SIGABRT while exiting")
    assert (d.action, d.reason) == ("finish", "rank 1 died by SIGABRT while exiting")
    assert policy.total_restarts == 0
