"""What follows once no worker is left: one pure decision, every row of its table."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.rules.outcome import Intent, Outcome, next_outcome
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


def test_the_intent_reads_as_status_reports_it():
    assert [i.value for i in Intent] == [None, "exit", "requeue", "pause", "restart", "fail", "peer_failed"]
