"""Fault injection on real subprocesses: small heartbeat-writing scripts (tests/fixtures/workers/hbworker.py).

Each test runs `python -m hangwatch.supervisor run` on a config whose worker misbehaves on attempt 1 and
behaves on attempt 2, then checks the deadline that fired, the incident (kind, classification,
stuck function from the dump), that no process of the worker's tree survived, and that the run
finished after the restart.
"""

from __future__ import annotations

import pytest
from fixtures.fakes.sup_harness import (
    attempts,
    incidents,
    recorded_pids,
    run_supervisor,
    state,
    wait_no_strays,
    write_config,
)

pytestmark = pytest.mark.slow


def finished_after_one_incident(tmp_path, mode, *args, **cfg):
    cfg_path, run_dir = write_config(tmp_path, mode, *args, **cfg)
    rc, out = run_supervisor(cfg_path)
    assert rc == 0, out[-4000:]
    assert state(run_dir)["state"] == "finished", out[-4000:]
    assert len(attempts(run_dir)) == 2
    left = wait_no_strays(str(run_dir))
    assert not left, f"survivors: {[(p.pid, p.cmdline()) for p in left]}"
    incs = incidents(run_dir)
    assert len(incs) == 1, incs
    return incs[0], run_dir, out


@pytest.mark.parametrize(
    "mode, kind, deadline, classification, function",
    [
        ("block_c", "stall", "step", "blocked in C", "block_in_c"),
        ("busy", "stall", "step", "busy loop in Python", "spin_forever"),
        ("livelock", "livelock", "step", "livelock", "livelock_loop"),
        ("grandchild", "stall", "step", "blocked in C", "block_in_c"),
        ("setsid", "stall", "step", "blocked in C", "block_in_c"),
    ],
)
def test_stall_is_detected_dumped_killed_and_the_run_resumes(tmp_path, mode, kind, deadline, classification, function):
    inc, run_dir, out = finished_after_one_incident(tmp_path, mode)
    assert inc["kind"] == kind
    assert inc["deadline"]["name"] == deadline and inc["deadline"]["budget_s"] == 2
    assert inc["deadline"]["elapsed_s"] >= 2 and inc["deadline"]["overdue_s"] >= 0
    assert inc["phase"] == "train" and inc["step"] == 2
    assert classification in inc["classification"], inc["classification"]
    assert inc["stuck_frame"]["function"] == function
    assert inc["stuck_frame"]["file"].endswith("hbworker.py")
    assert inc["main_stack"][-1]["function"] == "<module>"
    assert (run_dir / "incidents" / f"{inc['id']}-{kind}" / "stack-rank0.txt").read_text().count(function) >= 1
    assert inc["decision"]["action"] == "restart"
    assert inc["last_good_checkpoint"] == "ckpt-2"
    assert {"heartbeat-tail-rank0.jsonl", "worker-log-tail.txt", "stack-rank0.txt"} <= set(inc["files"])
    if mode == "livelock":
        assert inc["deadline"]["progress_lines"] > 0
    if mode in ("grandchild", "setsid"):
        pids = recorded_pids(run_dir)
        assert len(pids) == 3  # worker, its grandchild, the worker of attempt 2
        if mode == "setsid":  # it left the group, so SIGTERM to the group missed it: it needed its own SIGKILL
            assert pids[1] in inc["timings"]["sigkilled_pids"]


def test_worker_that_never_starts_hits_the_startup_deadline(tmp_path):
    inc, run_dir, _ = finished_after_one_incident(tmp_path, "nostart", watchdog={"startup_timeout_s": 2})
    assert inc["kind"] == "startup_timeout"
    assert inc["deadline"]["name"] == "startup" and inc["deadline"]["budget_s"] == 2
    assert "never sent its start beat" in inc["classification"]
    assert inc["stuck_frame"] is None  # it never announced a dump signal, so it got no SIGUSR1
    assert inc["dump_signalled"] == {}


def test_phase_budget_from_the_heartbeat_line(tmp_path):
    inc, _, _ = finished_after_one_incident(
        tmp_path, "phase_hang", watchdog={"step_timeout_s": 30, "silence_timeout_s": 30}
    )
    assert inc["kind"] == "stall"
    assert (
        inc["deadline"]["name"] == "phase" and inc["deadline"]["source"] == "line" and inc["deadline"]["budget_s"] == 1
    )
    assert inc["phase"] == "eval"
    assert inc["stuck_frame"]["function"] == "block_in_c"


def test_silence_deadline_when_no_step_deadline_applies(tmp_path):
    inc, _, _ = finished_after_one_incident(
        tmp_path, "block_c", watchdog={"step_timeout_s": 60, "silence_timeout_s": 2}
    )
    assert inc["deadline"]["name"] == "silence" and inc["deadline"]["budget_s"] == 2


def test_crash_with_last_words(tmp_path):
    inc, run_dir, _ = finished_after_one_incident(tmp_path, "crash")
    assert inc["kind"] == "crash"
    assert "RuntimeError: injected crash at step 3" in inc["classification"]
    assert inc["exit"]["code"] == 1 and inc["exit"]["last_words"]["kind"] == "RuntimeError"
    assert "explode" in inc["exit"]["last_words"]["traceback"]
    assert "exit.json" in inc["files"]
    assert inc["deadline"] is None


def test_child_that_left_the_group_dies_even_when_the_worker_exits_first(tmp_path):
    """The worker setsid()s a child and exits at once: the orphan is re-parented to the supervisor
    (its subreaper) and must be killed as part of that attempt's tree, not left running."""
    inc, run_dir, _ = finished_after_one_incident(tmp_path, "setsid_exit")
    assert inc["kind"] == "crash" and inc["exit"]["code"] == 3
    worker_pid, *children = [int(x) for x in (run_dir / "attempts" / "0001" / "pids.txt").read_text().split()]
    assert children and set(children) <= set(inc["timings"]["sigkilled_pids"]), inc["timings"]


def test_killed_by_a_signal(tmp_path):
    inc, _, _ = finished_after_one_incident(tmp_path, "sigkill")
    assert inc["kind"] == "signal"
    assert inc["exit"]["signal_name"] == "SIGKILL"
    assert "killed by SIGKILL" in inc["classification"] and "OOM killer" in inc["classification"]


def test_segfault_names_the_frame_from_the_fatal_dump(tmp_path):
    inc, _, _ = finished_after_one_incident(tmp_path, "segv")
    assert inc["kind"] == "signal" and inc["exit"]["signal_name"] == "SIGSEGV"
    assert inc["exit"]["fatal_error"].startswith("Segmentation fault")
    assert inc["user_frame"]["function"] == "main"


def test_nonfinite_exit_restarts_with_rollback(tmp_path):
    inc, _, _ = finished_after_one_incident(tmp_path, "exit", "--code", "75")
    assert inc["kind"] == "nan"
    assert inc["decision"]["action"] == "restart" and inc["decision"]["rollback"] is True
    assert inc["rollback_to"] == "ckpt-2"


@pytest.mark.parametrize("code, kind", [(78, "config_error"), (65, "data_error")])
def test_do_not_restart_codes_fail_the_run(tmp_path, code, kind):
    cfg_path, run_dir = write_config(tmp_path, "exit", "--code", str(code))
    rc, out = run_supervisor(cfg_path)
    assert rc == code, out[-3000:]
    assert state(run_dir)["state"] == "failed"
    assert len(attempts(run_dir)) == 1
    (inc,) = incidents(run_dir)
    assert inc["kind"] == kind and inc["decision"]["action"] == "fail" and "not restarting" in inc["decision"]["reason"]
    assert not wait_no_strays(str(run_dir))


def test_the_same_failure_twice_ends_the_run_at_the_second(tmp_path):
    """A deterministic error — the same exception at the same step, attempt after attempt — is not retried until the
    crash-loop budget runs out: the second identical failure ends the run, its incident saying what repeated."""
    cfg_path, run_dir = write_config(
        tmp_path, "crash", "--bad-attempts", "99", "--same-crash", restart={"max_restarts": 5}
    )
    rc, out = run_supervisor(cfg_path)
    assert rc == 79, out[-3000:]  # do not retry: another run would fail the same way
    assert state(run_dir)["state"] == "failed" and len(attempts(run_dir)) == 2
    first, second = incidents(run_dir)
    assert first["kind"] == second["kind"] == "crash" and first["decision"]["action"] == "restart"
    reason = second["decision"]["reason"]
    assert second["decision"]["action"] == "fail" and "the same failure twice in a row after step 2" in reason, reason
    assert "RuntimeError: injected crash at step 3" in reason and second["repeated"] == first["id"]
    assert not wait_no_strays(str(run_dir))


def test_crash_loop_fails_the_run_with_a_final_incident(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "crash", "--bad-attempts", "99", restart={"max_restarts": 2})
    rc, out = run_supervisor(cfg_path)
    assert rc == 1, out[-3000:]
    st = state(run_dir)
    assert st["state"] == "failed" and st["exit_code"] == 1
    assert len(attempts(run_dir)) == 3
    incs = incidents(run_dir)
    assert [i["kind"] for i in incs] == ["crash", "crash", "crash", "crash_loop"]
    assert "crash loop" in incs[-1]["summary"] and incs[-1]["max_restarts"] == 2
    assert not wait_no_strays(str(run_dir))


def test_missing_worker_command_is_a_config_error(tmp_path):
    """Refused before anything is spawned (the spawn-failure incident, for a program that vanished after the
    check, is the fake-driven `the worker cannot be spawned` case in tests/unit/supervisor/loop/test_lifecycle.py)."""
    cfg_path, run_dir = write_config(tmp_path, "ok", worker={"command": [str(tmp_path / "no-such-program")]})
    rc, out = run_supervisor(cfg_path)
    assert rc == 78, out[-3000:]
    assert f"worker.command.0: {tmp_path / 'no-such-program'}: no such file" in out, out[-3000:]
    assert not (run_dir / "attempts").exists()


def test_torn_lines_are_skipped_and_counted(tmp_path):
    cfg_path, run_dir = write_config(tmp_path, "torn")
    rc, out = run_supervisor(cfg_path)
    assert rc == 0, out[-3000:]
    st = state(run_dir)
    assert st["state"] == "finished" and st["torn_lines"] == 2 and st["incidents"] == 0
    assert "torn_heartbeat_lines" in out


def test_unusable_config_exits_78_with_the_problem_on_stderr(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("watchdog:\n  silense_timeout_s: 3\n")
    rc, out = run_supervisor(bad)
    assert rc == 78
    assert "silense_timeout_s: unknown key (did you mean 'silence_timeout_s'?)" in out


def test_py_spy_runs_time_boxed_and_its_output_lands_in_the_incident(tmp_path):
    # a stand-in py-spy that answers, then hangs: the supervisor must cut it off
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "py-spy"
    fake.write_text('#!/bin/sh\necho "fake py-spy $*"\nexec sleep 60\n')
    fake.chmod(0o755)
    cfg_path, run_dir = write_config(
        tmp_path, "block_c", watchdog={"py_spy": True, "py_spy_timeout_s": 1, "py_spy_path": str(fake)}
    )
    inc, run_dir, _ = _run_prepared(cfg_path, run_dir)
    text = (run_dir / "incidents" / f"{inc['id']}-stall" / "py-spy-rank0.txt").read_text()
    assert f"fake py-spy dump --native --locals --pid {inc['worker_pid']}" in text
    assert "killed after 1s time box" in text
    assert inc["py_spy"].startswith("ran ") and "py-spy-rank0.txt" in inc["files"]
    assert inc["stuck_frame"]["function"] == "block_in_c"


def _run_prepared(cfg_path, run_dir):
    rc, out = run_supervisor(cfg_path)
    assert rc == 0, out[-4000:]
    assert not wait_no_strays(str(run_dir))
    (inc,) = incidents(run_dir)
    return inc, run_dir, out
