"""restart.prewarm on fakes: when a standby is spawned, that it stays out of the failed attempt's tree, that
it is released (with the resume point decided then) only once that tree is gone, and that it is discarded —
killed and reaped — when no restart follows; a standby that died or cannot be released means a cold spawn.
Plus the pure parts (eligibility, when a restart is coming) and the release line both sides must agree on.
No process is started and torch is not imported."""

from __future__ import annotations

import io
import json
import signal
from pathlib import Path

import pytest
from fixtures.fakes.fake_supervisor import Harness
from fixtures.fakes.standby import keeper, prewarmed, signalled

from hangwatch.common.config import Config
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_HEARTBEAT_DIR, ENV_RESUME_FROM
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.daemon import standby_worker as worker_side
from hangwatch.supervisor.processes import standby as prewarm
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.policy import Decision

# ---- the pure parts ----------------------------------------------------------------------------


def cfg(**over) -> Config:
    base = {"run_dir": "/tmp/r", "restart": {"prewarm": True}, "data": {"train": "train.jsonl"}}
    for key, value in over.items():
        base[key] = {**base.get(key, {}), **value}
    return Config.model_validate(base)


@pytest.mark.parametrize(
    "config, why",
    [
        (cfg(), None),
        (cfg(restart={"prewarm": False}), "restart.prewarm is off"),
        (cfg(worker={"command": ["python", "train.py"]}), "only the built-in worker"),
        (cfg(worker={"nproc_per_node": 2}), "only a single-process worker"),
        (cfg(restart={"prewarm": "always"}), None),
        (
            cfg(restart={"prewarm": "always"}, model={"name_or_path": "/m", "load_in_4bit": True, "device": "cuda"}),
            "a standby must hold no GPU memory",
        ),
    ],
)
def test_which_runs_are_prewarmed(config, why):
    got = prewarm.ineligible(config)
    assert (got is None) if why is None else (why in got)


@pytest.mark.parametrize(
    "value, error", [("always", None), (True, None), ("sometimes", "restart.prewarm"), (3, "restart.prewarm")]
)
def test_prewarm_takes_a_bool_or_always(value, error):
    from hangwatch.common.config import ConfigError
    from hangwatch.common.config.load import parse_config

    text = (
        "run_dir: /tmp/r\ndata:\n  train: t.jsonl\nrestart:\n"
        f"  prewarm: {value if not isinstance(value, bool) else str(value).lower()}\n"
    )
    if error is None:
        assert parse_config(text, "c.yaml").restart.prewarm == value
    else:
        with pytest.raises(ConfigError) as info:
            parse_config(text, "c.yaml")
        assert any(p.startswith("c.yaml:5: restart.prewarm") for p in info.value.problems), info.value.problems


RESTART, FAIL, FINISH = Decision("restart", "crash"), Decision("fail", "exit 78"), Decision("finish", "done")


@pytest.mark.parametrize(
    "intent, decision, want",
    [
        (Intent.NONE, None, True),  # a stall: the policy decides later; a restart is the usual outcome
        (Intent.NONE, RESTART, True),
        (Intent.NONE, FAIL, False),
        (Intent.NONE, FINISH, False),
        (Intent.RESTART, None, True),  # `restart` (graceful)
        (Intent.RESTART, FAIL, True),  # an explicit restart wins over the policy, as in outcome.next_outcome
        (Intent.EXIT, None, False),
        (Intent.PAUSE, RESTART, False),
        (Intent.FAIL, None, False),
    ],
)
def test_a_standby_is_wanted_only_where_a_restart_follows(intent, decision, want):
    assert prewarm.wanted(intent, decision) is want


def test_the_release_line_is_what_the_standby_reads():
    stream = io.BytesIO(prewarm.release_line(3, "/runs/x/checkpoints/step-00000010"))
    assert worker_side.read_release(stream, 3) == worker_side.Release(3, "/runs/x/checkpoints/step-00000010")
    assert worker_side.read_release(io.BytesIO(prewarm.release_line(2, "")), 2).resume_from == ""
    assert prewarm.STANDBY_FLAG == worker_side.STANDBY_FLAG


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b'{"attempt": 4, "resume_from": ""}\n', "spawned for attempt 3"),
        (b"resume please\n", "not JSON"),
        (b'{"attempt": "3", "resume_from": ""}\n', "lacks attempt"),
        (b'{"attempt": 3}\n', "lacks attempt"),
    ],
)
def test_a_standby_refuses_a_release_it_cannot_trust(raw, problem):
    with pytest.raises(worker_side.ReleaseError, match=problem):
        worker_side.read_release(io.BytesIO(raw), 3)


def fake_preload(monkeypatch, body):
    """The preload itself is torch's business: stand it in (these tests are about the wait and the release)."""

    def run(cfg, into, out, attempt):
        body(into)
        into.ready_t = 1.0

    monkeypatch.setattr(worker_side, "preload", run)


def test_end_of_file_instead_of_a_release_means_discarded(monkeypatch):
    fake_preload(monkeypatch, lambda into: setattr(into, "bundle", "model"))
    env, out = {ENV_ATTEMPT: "2"}, io.StringIO()
    assert worker_side.hold(object(), env, io.BytesIO(b""), out) is None
    assert ENV_RESUME_FROM not in env and "discarded" in out.getvalue()


def test_the_release_sets_the_resume_point_and_the_preload_is_waited_for(monkeypatch):
    fake_preload(monkeypatch, lambda into: setattr(into, "bundle", "model"))
    env, out = {ENV_ATTEMPT: "2"}, io.StringIO()
    got = worker_side.hold(object(), env, io.BytesIO(prewarm.release_line(2, "/ck/step-00000004")), out)
    assert env[ENV_RESUME_FROM] == "/ck/step-00000004"
    assert got.beat_fields() == {"prewarmed": True}  # said at once, loaded or not
    assert got.wait().bundle == "model" and got.load_fields()["standby_preload_error"] is None


def test_a_failed_preload_is_released_all_the_same_and_loads_cold(monkeypatch):
    def broken(into):
        into.error = "OSError: no such model directory"  # what `preload` records when loading raises

    fake_preload(monkeypatch, broken)
    env, out = {ENV_ATTEMPT: "5"}, io.StringIO()
    got = worker_side.hold(object(), env, io.BytesIO(prewarm.release_line(5, "")), out).wait()
    assert got.bundle is None and "no such model directory" in got.load_fields()["standby_preload_error"]
    assert env[ENV_RESUME_FROM] == ""


def test_preload_records_a_failure_instead_of_raising(monkeypatch):
    def no_torch(cfg):
        raise ImportError("No module named 'torch'")

    monkeypatch.setattr(worker_side, "prepare_torch", no_torch)
    into, out = worker_side.Preloaded(), io.StringIO()
    worker_side.preload(object(), into, out)
    assert into.bundle is None and into.error == "ImportError: No module named 'torch'" and into.ready_t is not None
    assert "will load cold" in out.getvalue()


# ---- the lifecycle on the fake supervisor -----------------------------------------------------


def test_a_stall_spawns_the_standby_at_once_and_the_restart_releases_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the fake worker announces `ckpt-2`, relative to its cwd: make it exist
    (tmp_path / "ckpt-2").mkdir()
    h, sp = prewarmed(tmp_path)
    first = h.running()
    old = first.proc
    sp.observe = lambda: (old.alive, h.sup.lifecycle.state.value)
    h.until(lambda: sp.standbys)
    (sb,) = sp.standbys
    assert sp.sent_at_spawn == [[]]  # spawned at detection, before any dump signal or kill
    argv, env = sp.calls[0]
    assert argv[-1] == prewarm.STANDBY_FLAG and argv[1:3] == ["-m", "hangwatch.daemon"]
    run_dir = Path(h.sup.cfg.run_dir)
    assert env[ENV_ATTEMPT] == "2" and env[ENV_HEARTBEAT_DIR] == str(attempt_dir(run_dir, 2))
    assert env[ENV_RESUME_FROM] == ""  # decided at the release, not at the spawn
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")

    assert len(h.spawn.workers) == 1  # no cold spawn: attempt 2's worker is the standby
    cur = h.sup.current
    assert cur.worker.pid == sb.worker.pid and cur.prewarmed
    assert sp.at_release == [(False, "starting")]  # released only once attempt 1's tree was gone
    assert signalled(h, sb.worker.pid) == []  # the kill of attempt 1 left it alone, though it is our child
    (line,) = sb.lines
    assert json.loads(line) == {"attempt": 2, "resume_from": str(tmp_path / "ckpt-2")}  # the last good one, decided now
    assert cur.resume_from == str(tmp_path / "ckpt-2")
    assert (attempt_dir(run_dir, 2) / WORKER_LOG_NAME).read_text() == "standby log\n"
    assert not (run_dir / prewarm.STANDBY_LOG_NAME).exists()
    assert cur.worker.log_path == attempt_dir(run_dir, 2) / WORKER_LOG_NAME

    sb.fake.start()  # from here it is attempt 2's worker like any other
    sb.fake.step(1)
    h.until(lambda: h.state == "running")
    assert h.sup.current.announced[0].ref.pid == sb.worker.pid


def test_a_standby_that_died_means_a_cold_spawn(tmp_path):
    h, sp = prewarmed(tmp_path)
    h.running()
    h.until(lambda: sp.standbys)
    sb = sp.standbys[0]
    h.table.end(sb.worker.pid, 1)
    h.tick()
    assert sb.worker.pid in h.table.reaped and keeper(h).standby is None
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert len(h.spawn.workers) == 2 and not h.sup.current.prewarmed and sb.lines == []


def test_a_release_that_fails_kills_the_standby_and_spawns_cold(tmp_path):
    h, sp = prewarmed(tmp_path)
    h.running()
    sp.broken = True
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    (sb,) = sp.standbys
    assert len(h.spawn.workers) == 2 and not h.sup.current.prewarmed
    assert signal.SIGKILL in signalled(h, sb.worker.pid)
    h.tick()
    assert sb.worker.pid in h.table.reaped


@pytest.mark.parametrize("code, spawned", [(1, True), (75, True), (78, False), (65, False)])
def test_an_exit_gets_a_standby_only_when_the_policy_restarts(tmp_path, code, spawned):
    h, sp = prewarmed(tmp_path, restart={"backoff_initial_s": 0})
    h.running().exit(code)
    h.until(lambda: (h.sup.attempt == 2 and h.state == "starting") if spawned else h.state == "failed")
    assert len(sp.standbys) == int(spawned)
    if spawned:
        assert h.sup.current.prewarmed and h.sup.current.worker.pid == sp.standbys[0].worker.pid


def test_a_graceful_restart_is_prewarmed_too(tmp_path):
    h, sp = prewarmed(tmp_path)
    h.running()
    h.request(cmd="restart")
    h.until(lambda: h.state == "stopping")
    assert len(sp.standbys) == 1
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert h.sup.current.prewarmed and len(h.spawn.workers) == 1


def test_the_standby_waits_out_a_backoff_and_is_released_after_it(tmp_path):
    h, sp = prewarmed(tmp_path, restart={"backoff_initial_s": 5, "max_restarts": 5})
    h.running()  # stall 1: restarted at once, from standby 1
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    sp.standbys[0].fake.start()  # then silent: stall 2, a repeated failure, backs off
    h.until(lambda: h.state == "backoff")
    sb = sp.standbys[1]
    h.until(lambda: h.clock() >= h.sup.backoff_until - 0.5)
    assert h.state == "backoff" and sb.fake.proc.alive and sb.lines == []  # held, not released, through the backoff
    h.until(lambda: h.sup.attempt == 3 and h.state == "starting")
    assert h.sup.current.worker.pid == sb.worker.pid and json.loads(sb.lines[0])["attempt"] == 3


@pytest.mark.parametrize("request_, end", [("stop", "stopped"), ("pause", "paused")])
def test_no_restart_discards_the_standby(tmp_path, request_, end):
    h, sp = prewarmed(tmp_path, proc={"term": "ignore"})  # a stuck worker: its kill takes the grace
    h.running()
    h.until(lambda: h.state == "killing")
    (sb,) = sp.standbys
    h.request(cmd=request_)  # while the stalled attempt is being killed
    h.until(lambda: h.state == end)
    assert signal.SIGKILL in signalled(h, sb.worker.pid) and sb.closed and sb.lines == []
    h.tick()
    assert sb.worker.pid in h.table.reaped and keeper(h).pids() == set()
    assert not (Path(h.sup.cfg.run_dir) / prewarm.STANDBY_LOG_NAME).exists()


def test_a_stall_that_ends_in_a_crash_loop_discards_its_standby(tmp_path):
    h, sp = prewarmed(tmp_path, restart={"max_restarts": 1, "backoff_initial_s": 0})
    h.running()  # stalls: restart 1, from the standby
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    sp.standbys[0].fake.start()  # then silent: the first-steps deadline fires, and no new step since: a crash loop
    h.until(lambda: h.state == "failed")
    assert len(sp.standbys) == 2  # spawned at the second stall, before the policy said fail
    last = sp.standbys[-1]
    assert signal.SIGKILL in signalled(h, last.worker.pid) and last.lines == [] and last.closed
    assert keeper(h).standby is None


def test_without_prewarm_nothing_is_spawned_beside_the_worker(tmp_path):
    h = Harness(tmp_path)
    assert h.sup.concern("prewarmed_standby") is None  # not registered: absent from the pass
    h.running()
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert len(h.spawn.workers) == 2 and not h.sup.current.prewarmed


def test_a_standby_spawn_that_fails_leaves_the_restart_cold(tmp_path):
    h, sp = prewarmed(tmp_path)

    def refuse(*a, **kw):
        raise PermissionError(13, "Permission denied")

    keeper(h).spawn = refuse
    h.running()
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert len(h.spawn.workers) == 2 and not h.sup.current.prewarmed


def test_closing_kills_and_reaps_the_standby(tmp_path):
    h, sp = prewarmed(tmp_path)
    h.running()
    h.until(lambda: sp.standbys)
    (sb,) = sp.standbys
    keeper(h).close(h.clock())  # the supervisor's teardown (or its failure path)
    assert signal.SIGKILL in signalled(h, sb.worker.pid) and sb.worker.pid in h.table.reaped
    assert keeper(h).pids() == set()
