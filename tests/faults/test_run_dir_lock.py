"""One supervisor per run dir, with real processes: the lock dies with its holder."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from fixtures.fakes.sup_harness import PY, start_supervisor, write_config

from hangwatch.common.exitcodes import EX_CANTCREAT
from hangwatch.supervisor.records.runlock import LOCK_NAME, RunDirBusy, RunLock


def test_the_lock_dies_with_its_holder_even_by_sigkill(tmp_path):
    run = tmp_path / "run"
    code = (
        "import sys, time; from hangwatch.supervisor.records.runlock import RunLock; "
        f"RunLock.acquire({str(run)!r}); print('held', flush=True); time.sleep(60)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy) as err:
            RunLock.acquire(run)
        assert err.value.holder == p.pid
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert (run / LOCK_NAME).exists()  # left in place on purpose
    RunLock.acquire(run).release()  # no stale-lock cleanup needed


def _config_with_socket(tmp_path, name: str, base: dict, socket: str):
    data = {**base, "control": {"socket": socket}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hangwatch.supervisor", *args], capture_output=True, text=True, timeout=60)


TRIALS = 20


def test_two_supervisors_started_at_once_on_one_run_dir_exactly_one_runs(tmp_path):
    """Different sockets, same run dir, started back to back: one runs, one is refused naming the
    holder and changes nothing, and `--run-dir` still reaches the one that runs."""
    for trial in range(TRIALS):
        d = tmp_path / f"t{trial:02d}"
        d.mkdir()
        cfg, run_dir = write_config(d, "ok", "--steps", "100000", "--step-s", "0.05")
        base = yaml.safe_load(cfg.read_text())
        configs = [_config_with_socket(d, n, base, str(d / f"{n}.sock")) for n in ("a", "b")]
        procs = [start_supervisor(c) for c in configs]
        try:
            deadline = time.monotonic() + 30
            while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.02)
            ended = [p for p in procs if p.poll() is not None]
            assert len(ended) == 1, f"trial {trial}: {[p.poll() for p in procs]}"
            refused, running = ended[0], next(p for p in procs if p is not ended[0])
            out = refused.stdout.read()
            assert refused.returncode == EX_CANTCREAT, f"trial {trial}: {out}"
            assert re.search(r"another hangwatch \((pid \d+|a supervisor that is starting)\) is supervising", out), out
            loser_sock = d / ("a.sock" if refused is procs[0] else "b.sock")
            assert not loser_sock.exists()
            status = _cli("status", "--run-dir", str(run_dir), "--json")
            assert status.returncode == 0, status.stderr
            assert json.loads(status.stdout)["supervisor_pid"] == running.pid
            assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001"]
        finally:
            _cli("stop", "--run-dir", str(run_dir))
            for p in procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        assert running.returncode == 0
