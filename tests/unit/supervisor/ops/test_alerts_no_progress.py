"""The no-progress stop: restarts that never step past the last good step end the run before the restart budget."""

from __future__ import annotations

import pytest

from hangwatch.common.config import RestartCfg
from hangwatch.supervisor.rules.outcome import Intent, next_outcome
from hangwatch.supervisor.rules.policy import NoProgress, ProgressPolicy
from hangwatch.supervisor.rules.states import State


@pytest.mark.parametrize(
    "attempts, limit, stops_at",
    [
        # (restart?, last good step when it started, its highest step) per failed attempt
        ([(False, None, None), (True, None, None), (True, None, None), (True, None, None)], 3, 4),  # never starts
        ([(False, None, 8), (True, 6, 6), (True, 6, 5), (True, 6, None)], 3, 4),  # resumes at 6, never past it
        ([(True, 6, 6), (True, 6, 7), (True, 6, 6), (True, 6, 6)], 3, None),  # step 7 was progress: the count restarts
        ([(True, 6, 6)] * 10, 0, None),  # 0: off
        ([(False, 6, 6)] * 5, 1, None),  # the run's first attempt is no restart
        ([(True, None, 1)] * 5, 1, None),  # no good checkpoint: any step is progress
    ],
)
def test_no_progress_table(attempts, limit, stops_at):
    np = NoProgress(limit)
    stopped = next((i + 1 for i, a in enumerate(attempts) if np.attempt_ended(*a)), None)
    assert stopped == stops_at


def run_policy(limit, attempt_steps, last_good=6, max_restarts=10):
    """Attempts that each step through `steps` and then fail; → the decisions."""
    p = ProgressPolicy(RestartCfg(max_restarts=max_restarts, window_s=3600, backoff_initial_s=0), limit)
    out, now = [], 0.0
    for steps in attempt_steps:
        p.attempt_started(now, last_good_step=last_good)
        for s in steps:
            now += 1
            p.observed_step(s, now)
        now += 1
        out.append(p.on_failure(now, "worker exited with code 1"))
        if out[-1].action != "restart":
            break
    return p, out


def test_a_resume_that_never_steps_fails_the_run_on_the_limit():
    p, decisions = run_policy(3, [[7, 8, 9], [6], [], [6]])
    assert [d.action for d in decisions] == ["restart", "restart", "restart", "fail"]
    assert decisions[-1].reason.startswith(
        "no progress: 3 restart(s) in a row ended without stepping past step 6, "
        "the last good checkpoint (restart.no_progress_restarts 3); last failure: worker "
        "exited with code 1"
    )
    assert not decisions[-1].crash_loop
    assert p.gave_up["restarts"] == 3 and p.gave_up["last_good_step"] == 6 and p.gave_up["attempt_top_step"] == 6
    out = next_outcome(Intent.NONE, decisions[-1], 1)
    assert out.state is State.FAILED and out.exit_code == 1


def test_the_crash_loop_wins_when_both_would_stop_the_run():
    p, decisions = run_policy(3, [[7], [6], [6], [6]], max_restarts=3)
    assert decisions[-1].crash_loop and p.gave_up is None


def test_progress_in_between_restarts_the_count():
    p, decisions = run_policy(2, [[7], [6], [7, 8], [6], [6]])
    assert [d.action for d in decisions] == ["restart", "restart", "restart", "restart", "fail"]
