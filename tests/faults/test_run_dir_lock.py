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
            assert f"another hangwatch (pid {running.pid}) is supervising {run_dir}" in out, out
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


# ---- a refusal names the holder, however close the race -------------------------------------------------------

RACER = """
import json, os, sys, time
from hangwatch.supervisor.records.runlock import RunDirBusy, RunLock
run, go = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, go - time.time() - 0.02))
while time.time() < go:  # every racer tries at the same instant
    pass
try:
    lock = RunLock.acquire(run)
except RunDirBusy as busy:
    print(json.dumps({"refused": busy.holder, "message": str(busy)}), flush=True)
    sys.exit(0)
print(json.dumps({"held": os.getpid()}), flush=True)
sys.stdin.read()  # held until the test closes our stdin
"""


@pytest.mark.parametrize("before", ["no lock file", "a dead holder's record", "a released lock"])
def test_ten_racing_for_the_lock_one_wins_and_every_refusal_names_the_winners_pid(tmp_path, before):
    for trial in range(4):
        run = tmp_path / f"run{trial}"
        run.mkdir()
        if before == "a dead holder's record":
            dead = subprocess.Popen([PY, "-c", "pass"])
            dead.wait()
            (run / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "started": 1.0, "command": "hangwatch run"}))
        elif before == "a released lock":
            RunLock.acquire(run).release()
        go = time.time() + 1.0
        racers = [
            subprocess.Popen(
                [PY, "-c", RACER, str(run), str(go)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for _ in range(10)
        ]
        try:
            said = [json.loads(r.stdout.readline()) for r in racers]
        finally:
            for r in racers:
                r.stdin.close()
                r.wait(timeout=30)
        [winner] = [s["held"] for s in said if "held" in s]
        refusals = [s for s in said if "refused" in s]
        assert len(refusals) == 9, said
        for s in refusals:
            assert s["refused"] == winner, (trial, said)
            assert f"another hangwatch (pid {winner}) is supervising {run} (started " in s["message"], s["message"]


def test_ten_hangwatch_runs_started_at_once_are_refused_naming_the_one_that_runs(tmp_path):
    cfg, run_dir = write_config(tmp_path, "ok", "--steps", "100000", "--step-s", "0.05")
    base = yaml.safe_load(cfg.read_text())
    configs = [_config_with_socket(tmp_path, f"c{i}", base, str(tmp_path / f"c{i}.sock")) for i in range(10)]
    procs = [start_supervisor(c) for c in configs]
    try:
        deadline = time.monotonic() + 60
        while sum(p.poll() is not None for p in procs) < 9 and time.monotonic() < deadline:
            time.sleep(0.05)
        [running] = [p for p in procs if p.poll() is None]
        status = _cli("status", "--run-dir", str(run_dir), "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["supervisor_pid"] == running.pid
        for p in procs:
            if p is running:
                continue
            out = p.stdout.read()
            assert p.returncode == EX_CANTCREAT, out
            said = re.search(
                r"another hangwatch \(pid (\d+)\) is supervising (\S+) \(started ([^:]+:[^:]+:\d\d): ([^)]*)\)", out
            )
            assert said is not None, out
            assert (int(said.group(1)), said.group(2)) == (running.pid, str(run_dir)), out
            assert " run " in said.group(4) and str(configs[procs.index(running)]) in said.group(4), out
    finally:
        _cli("stop", "--run-dir", str(run_dir))
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
