"""What follows once no worker is left: one pure decision, every row of its table."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.rules.outcome import Intent, Outcome, done_before_stop, next_outcome, run_exit_status
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.rules.states import State

FINISH = Decision("finish", "worker exited 0 after stop 'finished'")
FAIL = Decision("fail", "worker exited 78: configuration error (EX_CONFIG); not restarting")
LOOP = Decision("fail", "crash loop: 3 restart(s) …", crash_loop=True)
RESTART = Decision("restart", "worker exited with code 1", delay_s=4.0)


@pytest.mark.parametrize(
    "intent, decision, code, during, expected",
    [
        # an explicit request wins over whatever the policy decided
        (Intent.EXIT, RESTART, 1, None, Outcome(State.STOPPED, "stop requested")),
        (Intent.EXIT, FAIL, 78, None, Outcome(State.STOPPED, "stop requested")),
        (Intent.PAUSE, RESTART, 1, None, Outcome(State.PAUSED, "pause requested")),
        # SIGUSR1 (a batch job's time limit is near): stopped, exit 75 for the job script to requeue the job
        (Intent.REQUEUE, RESTART, 1, None, Outcome(State.STOPPED, "stopped to be run again (requeue)", 75)),
        (
            Intent.REQUEUE,
            None,
            None,
            "backoff",
            Outcome(State.STOPPED, "stopped to be run again (requeue) during backoff", 75),
        ),
        # the worker finished its work as the stop arrived: the run finished, nothing is to be run again
        (Intent.REQUEUE, FINISH, 0, None, Outcome(State.FINISHED, FINISH.reason)),
        (Intent.EXIT, FINISH, 0, None, Outcome(State.FINISHED, FINISH.reason)),
        (Intent.PAUSE, FINISH, 0, None, Outcome(State.PAUSED, "pause requested")),
        (Intent.RESTART, FAIL, 78, None, Outcome(State.STARTING, "restart requested")),
        (Intent.RESTART, None, None, None, Outcome(State.STARTING, "restart requested")),
        # requests while nothing runs
        (Intent.EXIT, None, None, "backoff", Outcome(State.STOPPED, "stop requested during backoff")),
        (Intent.PAUSE, None, None, "backoff", Outcome(State.PAUSED, "pause requested during backoff")),
        (Intent.RESTART, None, None, "paused", Outcome(State.STARTING, "restart requested during paused")),
        # the disk refused a write: failed with 74 whatever the worker's exit or the policy would say
        (Intent.FAIL, RESTART, 1, None, Outcome(State.FAILED, "the run cannot go on", 74)),
        (Intent.FAIL, FINISH, 0, None, Outcome(State.FAILED, "the run cannot go on", 74)),
        (Intent.FAIL, None, None, "backoff", Outcome(State.FAILED, "the run cannot go on during backoff", 74)),
        (Intent.PEER_FAILED, RESTART, 1, None, Outcome(State.FAILED, "a peer node failed", 1)),
        # no request: the policy's decision
        (Intent.NONE, FINISH, 0, None, Outcome(State.FINISHED, FINISH.reason, 0)),
        (Intent.NONE, FAIL, 78, None, Outcome(State.FAILED, FAIL.reason, 78)),
        (Intent.NONE, Decision("fail", "x"), 65, None, Outcome(State.FAILED, "x", 65)),
        (Intent.NONE, LOOP, 1, None, Outcome(State.FAILED, LOOP.reason, 1)),
        (Intent.NONE, LOOP, None, None, Outcome(State.FAILED, LOOP.reason, 1)),  # last one died by a signal
        (
            Intent.NONE,
            RESTART,
            1,
            None,
            Outcome(State.BACKOFF, "worker exited with code 1; next attempt in 4s", 0, 4.0),
        ),
        # nothing asked, nothing decided (a backoff or a pause still running): stay
        (Intent.NONE, None, None, "backoff", None),
        (Intent.NONE, None, None, "paused", None),
    ],
)
def test_resolve(intent, decision, code, during, expected):
    assert next_outcome(intent, decision, code, during=during) == expected


@pytest.mark.parametrize(
    "code, stop_reason, finishes",
    [
        (0, "finished", True),  # its last step was done before the stop reached it
        (0, "terminated", False),  # it stopped because it was asked
        (0, None, False),  # a command that says nothing: its exit answered the stop
        (1, "finished", False),  # finished, then crashed on the way out: not a clean finish
        (None, "finished", False),  # killed by a signal
    ],
)
def test_a_worker_done_as_the_stop_came_finished_the_run(code, stop_reason, finishes):
    decision = done_before_stop(code, stop_reason)
    assert (decision is not None and decision.action == "finish") is finishes


def test_the_intent_reads_as_status_reports_it():
    assert [i.value for i in Intent] == [None, "exit", "requeue", "pause", "restart", "fail", "peer_failed"]


# ---- the exit status of `hangwatch run` (run_exit_status)

STOPPED = Outcome(State.STOPPED, "stop requested (SIGINT)")
REQUEUED = Outcome(State.STOPPED, "stopped to be run again (requeue)", 75)
FAILED = Outcome(State.FAILED, "crash loop", 1)
FINISHED = Outcome(State.FINISHED, "worker exited 0")
DISK = Outcome(State.FAILED, "the run cannot go on", 74)
NO_RETRY = Decision("fail", "the same failure twice", exit_code=79)
RANK = Decision("fail", "rank 3 exited 78", exit_code=78)


@pytest.mark.parametrize(
    "out, decision, code, signum, by_itself, stop_signal, transparent, expected",
    [
        (FINISHED, None, 0, None, True, None, True, 0),
        # the command's own failure ended the run: its status, as bare
        (FAILED, LOOP, 3, None, True, None, True, 3),
        (FAILED, LOOP, None, 9, True, None, True, 137),  # killed by SIGKILL (the kernel's OOM killer, say)
        (FAILED, LOOP, None, 11, True, None, True, 139),
        # hangwatch ended it: its own codes
        (FAILED, NO_RETRY, 3, None, True, None, True, 79),
        (FAILED, RANK, 1, None, True, None, True, 78),  # a rank's do-not-restart code that torchrun's 1 hides
        (FAILED, LOOP, None, 9, False, None, True, 79),  # stalls it killed, again and again
        (DISK, None, 1, None, True, None, True, 74),
        (Outcome(State.FAILED, "unusable data", 65), None, 65, None, True, None, True, 65),
        # a stop passed on: the command's answer, or 128+N for the signal hangwatch got
        (STOPPED, None, None, 2, True, 2, True, 130),  # Ctrl-C, KeyboardInterrupt re-raised
        (STOPPED, None, None, 15, False, 2, True, 130),  # Ctrl-C, then SIGTERM after the grace
        (STOPPED, None, None, None, False, 2, True, 130),  # Ctrl-C during a backoff: nothing was running
        (STOPPED, None, 0, None, True, 2, True, 0),  # its handler saved and exited 0, as it would bare
        (STOPPED, None, 4, None, True, 15, True, 4),
        (STOPPED, None, None, 15, True, 15, True, 143),
        (STOPPED, None, None, 3, True, 3, True, 131),  # SIGQUIT
        (STOPPED, None, 0, None, True, None, True, 0),  # `hangwatch stop`
        (REQUEUED, None, 0, None, True, 10, True, 75),  # requeue me, whatever the worker said
        # as a service: hangwatch's codes as always
        (STOPPED, None, None, 15, True, 15, False, 0),
        (FAILED, LOOP, 3, None, True, None, False, 1),
    ],
)
def test_the_run_exits_with_the_commands_status_where_its_exit_ended_the_run(
    out, decision, code, signum, by_itself, stop_signal, transparent, expected
):
    got = run_exit_status(
        out,
        decision,
        code=code,
        signum=signum,
        by_itself=by_itself,
        stop_signal=stop_signal,
        transparent=transparent,
    )
    assert got == expected
