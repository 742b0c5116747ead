"""A process that crashes on its way out after its work was done — as torch's gloo backend makes a rank do now
and then ("terminate called without an active exception", SIGABRT) — ends a finished run, not a restarted one;
a crash before the end, or a nonzero exit status, is still a failure.

Real `hangwatch run` over unedited scripts (automatic instrumentation): the teardown crash is an object whose
`__del__` calls `os.abort()` while the interpreter finalizes its modules — after every `atexit` handler, as a
native destructor's would be."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import VENV_BIN, incidents, log_events, run_hangwatch, worker_logs

from hangwatch.common.protocol import decode_line

pytestmark = pytest.mark.slow

TRAIN = """
    import os, sys
    import torch

    attempt = int(os.environ.get("HANGWATCH_ATTEMPT", "1"))
    rank = int(os.environ.get("RANK", "0"))
    how = os.environ.get("HOW", "")
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")


    class AbortInTeardown:
        def __del__(self, abort=os.abort):  # bound now: the module's globals are gone by then
            abort()


    class HangInTeardown:
        def __del__(self, pause=__import__("signal").pause):
            while True:
                pause()


    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 5):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        if how == "abort_mid_run" and attempt == 1 and step == 2:
            os.abort()
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    if attempt == 1 and how == "exit_3":
        sys.exit(3)
    if attempt == 1 and how == "raise":
        raise KeyError("late")
    if attempt == 1 and how == "teardown" and rank == int(os.environ.get("ABORT_RANK", "0")):
        keep = AbortInTeardown()
    if attempt == 1 and how == "teardown_hang":
        keep = HangInTeardown()
"""


def config() -> dict:
    return {
        "watchdog": {
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "first_steps_timeout_s": 60,
            "dump_grace_s": 2,
            "term_grace_s": 2,
            "py_spy": False,
            "poll_interval_s": 0.1,
            "exit_after_stop_s": 2,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 2},
    }


def run(tmp_path: Path, how: str, *, ranks: int = 1, abort_rank: int = 0):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN))
    env_prefix = ["env", f"HOW={how}", f"ABORT_RANK={abort_rank}", "OMP_NUM_THREADS=1"]
    if ranks == 1:
        cmd = [*env_prefix, "python", str(script)]
    else:
        cmd = [*env_prefix, str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), str(script)]
    return run_hangwatch(tmp_path, config(), cmd, timeout=240)


def lines(run_dir: Path, attempt: int, rank: int) -> list[dict]:
    path = run_dir / "attempts" / f"{attempt:04d}" / f"heartbeat-rank{rank}.jsonl"
    return [rec for raw in path.read_bytes().splitlines() if (rec := decode_line(raw)) is not None]


@pytest.mark.parametrize("ranks, abort_rank", [(1, 0), (2, 1), (2, 0)], ids=["one-process", "rank-1", "rank-0"])
def test_a_crash_in_teardown_after_every_rank_exited_cleanly_finishes_the_run(tmp_path, ranks, abort_rank):
    r, run_dir = run(tmp_path, "teardown", ranks=ranks, abort_rank=abort_rank)
    explain = f"exit {r.returncode}\n{r.stderr[-3000:]}\n{worker_logs(run_dir)}"
    assert r.returncode == 0, explain
    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "finished" and state["attempt"] == 1 and state["restarts"] == 0, state
    assert incidents(run_dir) == []
    for rank in range(ranks):
        stop = lines(run_dir, 1, rank)[-1]
        assert stop["event"] == "stop" and stop["reason"] == "exit" and stop["code"] == 0, stop
        assert [b["step"] for b in lines(run_dir, 1, rank) if b["event"] == "step"] == [1, 2, 3, 4]
    [crash] = log_events(run_dir, "worker_teardown_crash")
    who = "the worker" if ranks == 1 else f"rank {abort_rank}"
    assert crash["why"].startswith(f"{who} died by SIGABRT while exiting"), crash
    assert "SIGABRT" in worker_logs(run_dir) or ranks == 1


@pytest.mark.parametrize(
    "how, stop",
    [
        ("abort_mid_run", None),  # died at step 2: no exit line
        ("exit_3", {"reason": "exit", "code": 3}),
        ("raise", {"reason": "exit", "code": 1, "exception": "KeyError"}),
    ],
)
def test_an_unfinished_or_failed_exit_is_still_restarted(tmp_path, how, stop):
    r, run_dir = run(tmp_path, how)
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{worker_logs(run_dir)}"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "finished" and state["attempt"] == 2 and state["restarts"] == 1, state
    [(_, inc)] = incidents(run_dir)
    assert inc["attempt"] == 1
    last = lines(run_dir, 1, 0)[-1]
    if stop is None:
        assert last["event"] == "step" and last["step"] == 2, last
    else:
        assert last["event"] == "stop" and {k: last.get(k) for k in stop} == stop, last
    assert log_events(run_dir, "worker_teardown_crash") == []
    assert lines(run_dir, 2, 0)[-1] == {**lines(run_dir, 2, 0)[-1], "event": "stop", "reason": "exit", "code": 0}


def test_a_process_that_hangs_on_its_way_out_after_its_exit_line_is_killed_and_the_run_is_finished(tmp_path):
    r, run_dir = run(tmp_path, "teardown_hang")
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{worker_logs(run_dir)}"
    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "finished" and state["attempt"] == 1 and state["restarts"] == 0, state
    [(_, inc)] = incidents(run_dir)  # the hang is recorded, with its stack
    assert inc["deadline"]["name"] == "exit", inc["deadline"]
    assert lines(run_dir, 1, 0)[-1] == {**lines(run_dir, 1, 0)[-1], "event": "stop", "reason": "exit", "code": 0}
    [gone] = [e for e in log_events(run_dir, "tree_gone") if e["attempt"] == 1]
    assert gone["next"] == "finished" and "did not exit after every rank had finished its work" in gone["why"], gone
