"""A foreign 2-rank torchrun job (gloo, CPU) under `hangwatch run`: rank 1 spins in pure Python, rank 0 therefore
blocks in C inside `dist.all_reduce`.  Ten stalls in one run (the fault repeats on attempts 1–10, attempt 11
finishes): every incident names rank 1 as the culprit with its own classification and frame, rank 0 as a victim
waiting in all_reduce, keeps both ranks' dumps, never signals torchrun with SIGUSR1, and torchrun and both ranks
are gone before the next attempt starts.

The same job training a DDP model, its culprit rank idle (sleeping) after its forward and the other rank waiting
inside `backward()` for DDP's gradient all-reduce, which runs in C++ below any Python frame: with py-spy, its native
frames show the wait; without (`watchdog.py_spy: false`, or a py-spy that cannot start), the rank in backward() only
probably waits — the verdict names the culprit from the other rank's evidence, never that victim."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.sup_harness import (
    PY,
    ROOT,
    alive,
    attempt_pids,
    incidents,
    run_supervisor,
    spawned_pids,
    start_supervisor,
    wait_no_strays,
)
from fixtures.fakes.watchdog_settings import FAST_WATCHDOG

from hangwatch.supervisor.escalation.dump_collector import find_py_spy

FIXTURE = ROOT / "tests" / "fixtures" / "workers" / "ddp_spin.py"
STALLS = 10


def config(
    tmp_path: Path, stalls: int = STALLS, fixture_args: tuple = (), watchdog: dict = {}, max_restarts: int = STALLS + 2
) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {
            "command": [
                PY,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                str(FIXTURE),
                "--spin-at",
                "3",
                "--bad-attempts",
                str(stalls),
                "--steps",
                "6",
                *fixture_args,
                "--tag",
                str(run_dir),
            ],
            "env": {"OMP_NUM_THREADS": "1"},
        },
        # torchrun and two ranks importing torch on a shared 2-core machine: a generous start, a short step deadline
        "watchdog": {
            **FAST_WATCHDOG,
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "step_timeout_s": 2,
            "dump_grace_s": 3,
            **watchdog,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": max_restarts},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def test_ten_stalls_all_name_the_spinning_rank(tmp_path):
    cfg, run_dir = config(tmp_path)
    sup = start_supervisor(cfg)
    left_over: list[str] = []
    checked = 1
    deadline = time.monotonic() + 400
    try:
        # Watch the run: once attempt n+1 is spawned, nothing of attempts ≤ n may be alive.
        while sup.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish in time"
            spawned = spawned_pids(run_dir)
            while checked + 1 in spawned:
                for n in range(1, checked + 1):
                    for pid in {spawned[n]} | attempt_pids(run_dir, n):
                        if alive(pid):
                            left_over.append(f"attempt {n}: pid {pid} alive when attempt {checked + 1} started")
                checked += 1
            time.sleep(0.05)
        out = sup.stdout.read()
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == 0, out[-4000:]
    assert left_over == []
    assert wait_no_strays(str(run_dir)) == []

    stalls = incidents(run_dir)
    assert len(stalls) == STALLS, [i.get("summary") for i in stalls]
    for inc in stalls:
        where = f"incident {inc['id']}: {inc['summary']}"
        assert inc["kind"] == "stall" and inc["culprit_rank"] == 1, where
        assert inc["summary"].startswith("rank 1: busy loop in Python"), where
        assert "at _poll_shard_ready (" in inc["summary"].split(";")[0], where
        assert "; rank 0 waiting in all_reduce;" in inc["summary"], where
        ranks = {r["rank"]: r for r in inc["ranks"]}
        assert ranks[1]["role"] == "culprit" and ranks[1]["stuck_frame"]["function"] == "_poll_shard_ready", where
        assert ranks[1]["classification"].startswith("busy loop in Python"), where
        assert ranks[0]["role"] == "victim" and ranks[0]["collective"] == "all_reduce", where
        assert ranks[0]["classification"].startswith("blocked in C"), where  # its own CPU, not rank 1's
        assert ranks[0]["pid"] != ranks[1]["pid"] and inc["worker_pid"] not in (ranks[0]["pid"], ranks[1]["pid"])
        # both ranks' dumps, and SIGUSR1 went to the two ranks only: torchrun, for which it is fatal, was never sent it
        d = run_dir / "incidents" / f"{inc['id']}-stall"
        assert "in _poll_shard_ready" in (d / "stack-rank1.txt").read_text(), where
        assert "in all_reduce" in (d / "stack-rank0.txt").read_text(), where
        assert inc["dump_signalled"] == {"0": True, "1": True}, where
        assert inc["exit"]["signal"] != signal.SIGUSR1, where
        assert inc["timings"]["survivors"] == [], where


DEFAULT_PY_SPY = find_py_spy()  # next to the interpreter that runs the supervisor: a core dependency of hangwatch
BACKWARD_ROWS = {  # watchdog settings → whether the victim's C stack is seen
    "py-spy": ({"py_spy": True, "py_spy_timeout_s": 20}, True),
    "no py-spy": ({"py_spy": False}, False),
    "py-spy cannot start": ({"py_spy": True, "py_spy_path": "/nonexistent/py-spy"}, False),
}


@pytest.mark.parametrize("row", list(BACKWARD_ROWS))
def test_a_rank_waiting_inside_backward_is_never_named_the_culprit(tmp_path, row):
    watchdog, native = BACKWARD_ROWS[row]
    # one attempt: `max_restarts: 0` ends the run at the first incident
    cfg, run_dir = config(tmp_path, 1, ("--backward", "--hang", "sleep"), watchdog, max_restarts=0)
    rc, out = run_supervisor(cfg, timeout=240)
    stalls = [i for i in incidents(run_dir) if i["kind"] == "stall"]
    assert len(stalls) == 1, ([(i["kind"], i.get("summary")) for i in incidents(run_dir)], out[-4000:])
    inc = stalls[0]
    where = f"incident {inc['id']}: {inc['summary']} / {inc.get('py_spy')}"
    ranks = {r["rank"]: r for r in inc["ranks"]}
    assert inc["culprit_rank"] == 1, where  # named from its own evidence: idle in its own code, outside any collective
    assert re.match(r"rank 1: blocked in C \(CPU \d+%, state S\) at _wait_for_shard \(", inc["summary"]), where
    assert ranks[1]["role"] == "culprit" and ranks[1]["stuck_frame"]["function"] == "_wait_for_shard", where
    assert ranks[0]["role"] == "victim" and ranks[0]["caller_frame"]["function"] == "main", where
    assert (
        inc["py_spy"]
        == {
            "py-spy": f"ran {DEFAULT_PY_SPY}",
            "no py-spy": "disabled (watchdog.py_spy: false)",
            "py-spy cannot start": "could not start /nonexistent/py-spy (its error is in the py-spy files)",
        }[row]
    ), where
    if native:  # py-spy's native frames under backward(): the wait, for sure
        assert ranks[0]["collective"] is not None and ranks[0]["probable_wait"] is None, where
        assert f"; rank 0 waiting in {ranks[0]['collective']};" in inc["summary"], where
    else:
        assert ranks[0]["collective"] is None and ranks[0]["probable_wait"] == "DDP's gradient all-reduce", where
        assert ranks[0]["landmark"]["name"] == "backward", where
        assert ranks[0]["classification"].startswith(
            "waiting, probably in DDP's gradient all-reduce — cannot tell the culprit from this rank alone; "
            "blocked in C"
        ), where
        assert "; rank 0 waiting, probably in DDP's gradient all-reduce (no C stack);" in inc["summary"], where
        assert (
            "in _engine_run_backward" in (run_dir / "incidents" / f"{inc['id']}-stall" / "stack-rank0.txt").read_text()
        )
    assert wait_no_strays(str(run_dir)) == []
