"""`restart.prewarm: always` on fakes: the next attempt's standby is spawned once the current attempt has stepped
(never while it loads), is what the restart releases, is followed by the next one once the new attempt steps; a
standby that dies is replaced after a back-off that grows while they keep dying; `status` shows it, loading or
ready, with its RAM; nothing of it is left when the run ends."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from fixtures.fakes.standby import keeper, prewarmed, signalled

from hangwatch.common.rundir import STANDBY_READY_NAME
from hangwatch.supervisor.processes import standby as prewarm


def status(h) -> dict:
    return h.sup.desk.handle({"cmd": "status"}, h.clock())["result"]


def test_the_standby_is_spawned_once_the_attempt_steps_not_while_it_loads(tmp_path):
    h, sp = prewarmed(tmp_path, "always")
    h.until(lambda: h.spawn.workers)
    w = h.worker
    w.start()
    h.tick(1.0)
    h.tick(1.0)
    assert sp.standbys == [] and status(h)["standby"] is None  # started, not stepped: its own loading comes first
    w.step(1)
    h.until(lambda: sp.standbys)
    (sb,) = sp.standbys
    assert sp.calls[0][0][-1] == prewarm.STANDBY_FLAG and sp.calls[0][1]["HANGWATCH_ATTEMPT"] == "2"
    assert keeper(h).standby.why == "always" and h.state == "running"
    assert not signalled(h, sb.worker.pid)
    h.tick(1.0)
    assert len(sp.standbys) == 1  # one at a time


def test_status_shows_the_standby_loading_then_ready_with_its_ram(tmp_path):
    h, sp = prewarmed(tmp_path, "always", rss=lambda pid: 812 << 20)
    h.running()
    h.until(lambda: sp.standbys)
    sb = sp.standbys[0]
    got = status(h)["standby"]
    assert (got["attempt"], got["pid"], got["state"], got["rss_mb"]) == (2, sb.worker.pid, "loading", 812.0)
    ready = Path(h.sup.cfg.run_dir) / STANDBY_READY_NAME
    ready.write_text(json.dumps({"pid": sb.worker.pid, "attempt": 2, "preload_s": 4.12, "error": None}))
    h.tick()
    got = status(h)["standby"]
    assert got["state"] == "ready" and got["preload_s"] == 4.12
    from hangwatch.supervisor.cli.render import standby_text

    assert standby_text(got) == (
        f"attempt 2 ready (preloaded in 4.1s), pid {sb.worker.pid}: 812 MiB RAM, no GPU memory until released"
    )
    ready.write_text(json.dumps({"pid": 1, "attempt": 2, "preload_s": 1.0, "error": None}))  # another process's word
    h.tick()
    assert status(h)["standby"]["state"] == "loading"


def test_a_failure_releases_the_ready_standby_and_the_new_attempt_gets_its_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt-2").mkdir()
    h, sp = prewarmed(tmp_path, "always")
    first = h.running()
    h.until(lambda: sp.standbys)
    sb = sp.standbys[0]
    (Path(h.sup.cfg.run_dir) / STANDBY_READY_NAME).write_text(json.dumps({"pid": sb.worker.pid, "attempt": 2}))
    first.proc.alive and h.table.end(first.pid, 1)  # the worker crashes: the policy restarts
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert h.sup.current.worker.pid == sb.worker.pid and h.sup.current.prewarmed
    assert len(h.spawn.workers) == 1 and len(sp.standbys) == 1  # no cold spawn, no second standby yet
    assert json.loads(sb.lines[0])["attempt"] == 2
    assert not (Path(h.sup.cfg.run_dir) / STANDBY_READY_NAME).exists()  # the marker went with the release
    sb.fake.start()
    h.tick()
    assert len(sp.standbys) == 1  # the new attempt has not stepped yet
    sb.fake.step(1)
    h.until(lambda: len(sp.standbys) == 2)
    assert sp.calls[1][1]["HANGWATCH_ATTEMPT"] == "3"


def test_a_standby_that_dies_is_replaced_later_each_time_it_dies_again(tmp_path):
    h, sp = prewarmed(tmp_path, "always")
    w = h.running()
    h.until(lambda: sp.standbys)
    gaps = []
    for n in range(1, 5):
        dead = sp.standbys[-1]
        h.table.end(dead.worker.pid, 1)
        h.tick(0.05)
        assert keeper(h).standby is None and dead.worker.pid in h.table.reaped
        gaps.append(round(keeper(h).replace_at - h.clock(), 1))
        h.tick(0.5)
        assert len(sp.standbys) == n  # not at once
        h.until(lambda: len(sp.standbys) == n + 1, within_s=30, each=lambda: w.step(1))  # training goes on meanwhile
    assert gaps == [1.0, 2.0, 4.0, 8.0], gaps  # 1 s, doubling while they keep dying
    assert h.state == "running" and "replacing a standby that died, 4 in a row" in keeper(h).standby.why


def test_a_standby_killed_between_the_two_looks_keeps_its_signal(tmp_path):
    """SIGKILL lands while the supervisor looks at the standby (it becomes a zombie during the look): the death is
    reaped at once, with its signal, never taken as reaped elsewhere."""
    h, sp = prewarmed(tmp_path, "always")
    h.running()
    h.until(lambda: sp.standbys)
    sb = sp.standbys[0]
    table_is_gone = h.table.is_gone

    def killed_meanwhile(ref):
        if ref.pid == sb.worker.pid:
            h.table.end(ref.pid, sig=signal.SIGKILL)
        return table_is_gone(ref)

    h.table.is_gone = killed_meanwhile
    h.tick(0.05)
    assert keeper(h).standby is None and sb.worker.pid in h.table.reaped
    assert (sb.worker.exit_code, sb.worker.exit_signal) == (None, signal.SIGKILL)


def test_a_released_standby_resets_the_back_off(tmp_path):
    h, sp = prewarmed(tmp_path, "always")
    first = h.running()
    h.until(lambda: sp.standbys)
    h.table.end(sp.standbys[0].worker.pid, 1)
    h.until(lambda: len(sp.standbys) == 2)
    assert keeper(h).deaths == 1
    h.table.end(first.pid, 1)
    h.until(lambda: h.sup.attempt == 2 and h.state == "starting")
    assert h.sup.current.worker.pid == sp.standbys[1].worker.pid and keeper(h).deaths == 0


@pytest.mark.parametrize("request_, end", [("stop", "stopped"), ("pause", "paused")])
def test_a_run_that_stops_or_pauses_discards_its_standby_and_its_files(tmp_path, request_, end):
    h, sp = prewarmed(tmp_path, "always")
    h.running()
    h.until(lambda: sp.standbys)
    (sb,) = sp.standbys
    ready = Path(h.sup.cfg.run_dir) / STANDBY_READY_NAME
    ready.write_text(json.dumps({"pid": sb.worker.pid, "attempt": 2}))
    h.request(cmd=request_)
    h.worker.graceful_exit()
    h.until(lambda: h.state == end)
    assert signal.SIGKILL in [sig for t, sig in h.table.sent if t in (sb.worker.pid, -sb.worker.pid)]
    h.tick()
    assert sb.worker.pid in h.table.reaped and keeper(h).pids() == set()
    assert not ready.exists() and not (Path(h.sup.cfg.run_dir) / prewarm.STANDBY_LOG_NAME).exists()
    if end == "paused":
        h.tick(5.0)
        assert len(sp.standbys) == 1  # paused: nothing is trained, nothing is prewarmed


def test_true_still_waits_for_the_stall(tmp_path):
    h, sp = prewarmed(tmp_path, True)
    w = h.running(steps=5)
    for _ in range(5):
        w.step(1)
        h.tick(0.5)
    assert sp.standbys == [] and status(h)["standby"] is None
