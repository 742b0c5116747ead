"""The lifecycle table and the restart policy, on a fake clock."""

from __future__ import annotations

import pytest

from hangwatch.common import transitions as common_transitions
from hangwatch.common.config import RestartCfg
from hangwatch.supervisor.rules.policy import RestartPolicy
from hangwatch.supervisor.rules.states import FINAL, TRANSITIONS, IllegalTransition, State, StateMachine


def test_every_state_has_a_row_and_final_states_have_no_exit():
    assert set(TRANSITIONS) == set(State)
    for s in FINAL:
        assert TRANSITIONS[s] == frozenset()
    for s in set(State) - FINAL:
        assert TRANSITIONS[s], s


def test_the_stall_path_and_restart():
    seen = []
    sm = StateMachine(on_change=lambda a, b, why: seen.append((a.value, b.value, why)))
    for dst in (State.RUNNING, State.STALLED, State.DUMPING, State.KILLING, State.BACKOFF, State.STARTING):
        sm.transition(dst, "x")
    assert sm.state is State.STARTING and len(seen) == 6 and seen[0] == ("starting", "running", "x")


@pytest.mark.parametrize(
    "path, bad",
    [
        ((), State.DUMPING),  # starting → dumping: no snapshot was taken
        ((State.RUNNING,), State.BACKOFF),  # running → backoff: the tree was never brought down
        ((State.RUNNING, State.STALLED), State.KILLING),  # no dump step
        ((State.RUNNING, State.KILLING, State.FINISHED), State.STARTING),  # final
        ((State.RUNNING, State.KILLING, State.FAILED), State.RUNNING),
        ((State.RUNNING, State.KILLING, State.PAUSED), State.RUNNING),  # resume goes through starting
    ],
)
def test_illegal_transitions_raise(path, bad):
    sm = StateMachine()
    for s in path:
        sm.transition(s)
    before = sm.state
    with pytest.raises(IllegalTransition) as err:
        sm.transition(bad, "because")
    assert sm.state is before
    assert f"{before.value} → {bad.value}" in str(err.value) and "because" in str(err.value)
    assert isinstance(err.value, common_transitions.IllegalTransition)  # the project's one, shared with the inbox


def cfg(**kw):
    base = dict(max_restarts=3, window_s=100, backoff_initial_s=1, backoff_max_s=5, healthy_after_s=50)
    base.update(kw)
    return RestartCfg(**base)


def test_the_first_restart_is_immediate_then_backoff_doubles_and_is_capped():
    p = RestartPolicy(cfg(max_restarts=100))
    delays = []
    for i in range(7):
        p.attempt_started(float(i))
        delays.append(p.on_failure(float(i) + 0.5, "crash").delay_s)
    assert delays == [0, 1, 2, 4, 5, 5, 5]


def test_backoff_resets_after_a_healthy_stretch():
    p = RestartPolicy(cfg(max_restarts=100))
    p.attempt_started(0.0)
    assert p.on_failure(1.0, "x").delay_s == 0
    p.attempt_started(2.0)
    assert p.on_failure(3.0, "x").delay_s == 1
    p.attempt_started(10.0)
    p.observed_step(5, 11.0)
    assert p.on_failure(10.0 + 50, "x").delay_s == 0  # ran 50 s and stepped: the streak starts again
    p.attempt_started(70.0)
    assert p.on_failure(200.0, "x").delay_s == 1  # long, but no step: not healthy


def test_crash_loop_without_a_new_step_fails_the_run():
    p = RestartPolicy(cfg())
    for i in range(3):
        p.attempt_started(float(i))
        assert p.on_failure(float(i), "crash").action == "restart"
    d = p.on_failure(4.0, "crash")
    assert d.action == "fail" and d.crash_loop and "crash loop" in d.reason and "max_restarts 3" in d.reason


def test_a_new_step_clears_the_crash_loop_count_but_replayed_steps_do_not():
    p = RestartPolicy(cfg())
    p.observed_step(10, 0.0)
    for i in range(3):
        p.on_failure(float(i), "x")
        p.observed_step(10, float(i))  # replayed after resume: not new
    assert p.on_failure(4.0, "x").action == "fail"
    q = RestartPolicy(cfg())
    for i in range(10):
        q.observed_step(i, float(i))  # every attempt gets one step further
        assert q.on_failure(float(i), "x").action == "restart"


def test_restarts_outside_the_window_do_not_count():
    p = RestartPolicy(cfg(window_s=10))
    for t in (0.0, 5.0, 20.0, 30.0, 40.0):
        assert p.on_failure(t, "x").action == "restart"


def test_zero_max_restarts_fails_on_the_first_failure():
    assert RestartPolicy(cfg(max_restarts=0)).on_failure(0.0, "x").action == "fail"


@pytest.mark.parametrize(
    "code, reason, action, rollback",
    [
        (0, "finished", "finish", False),
        (0, "idle", "finish", False),
        (0, None, "restart", False),  # exit 0 without saying it finished is not a finish
        (0, "terminated", "restart", False),  # stopped by someone else than the supervisor
        (65, None, "fail", False),
        (78, None, "fail", False),
        (75, None, "restart", True),
        (1, None, "restart", False),
        (None, None, "restart", False),
    ],
)
def test_exit_codes(code, reason, action, rollback):
    d = RestartPolicy(cfg()).on_exit(0.0, code, reason)
    assert (d.action, d.rollback) == (action, rollback)
    if code in (65, 78):
        assert "not restarting" in d.reason


def test_the_supervisor_never_imports_the_training_stack():
    import subprocess
    import sys

    code = (
        "import sys, hangwatch.supervisor.loop.supervisor, hangwatch.supervisor.processes.snapshot, "
        "hangwatch.supervisor.escalation.dump_collector;"
        "bad = {'torch', 'transformers', 'peft', 'numpy'} & set(sys.modules); print(sorted(bad)); sys.exit(bool(bad))"
    )
    from pathlib import Path

    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[3]
    )
    assert p.returncode == 0, p.stdout + p.stderr
