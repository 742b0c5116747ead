"""torchrun's command line for a multi-node attempt: the built-in worker, a `python` script, a torchrun command line
whose own rendezvous options are replaced.  Pure."""

from __future__ import annotations

import sys

import pytest

from hangwatch.common.config import Config
from hangwatch.supervisor.processes.attempt import worker_argv
from hangwatch.supervisor.processes.launcher import split_torchrun

NODE = {"nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400", "rdzv_id": "job", "nproc_per_node": 4}
RDZV = [
    "--nnodes",
    "2",
    "--rdzv-backend",
    "c10d",
    "--rdzv-endpoint",
    "10.0.0.1:29400",
    "--rdzv-id",
    "job-g3",
    "--rdzv-conf",
    "is_host=false,join_timeout=2592000",
    "--max-restarts",
    "0",
]
TR = [sys.executable, "-m", "torch.distributed.run"]


def cfg(**worker) -> Config:
    return Config.model_validate({"run_dir": "/r", "worker": {**NODE, **worker}, "data": {"train": "/t.jsonl"}})


@pytest.mark.parametrize(
    "command, expected",
    [
        (
            None,
            TR
            + RDZV
            + ["--nproc-per-node", "4", "-m", "hangwatch.daemon", "--config", "/r/config.yaml", "--run-dir", "/r"],
        ),
        (["python", "train.py", "--lr", "1e-4"], TR + RDZV + ["--nproc-per-node", "4", "train.py", "--lr", "1e-4"]),
        (["python3", "-m", "pkg.train", "x"], TR + RDZV + ["--nproc-per-node", "4", "-m", "pkg.train", "x"]),
        # a torchrun line: its rendezvous options (both spellings, with and without =) give way; its own nproc stays
        (
            [
                "torchrun",
                "--standalone",
                "--nproc-per-node=8",
                "--nnodes",
                "1",
                "--rdzv_id=x",
                "--max-restarts",
                "3",
                "--log-dir",
                "/logs",
                "train.py",
                "--nnodes",
                "7",
            ],
            ["torchrun"] + RDZV + ["--nproc-per-node=8", "--log-dir", "/logs", "train.py", "--nnodes", "7"],
        ),
        (
            ["python", "-m", "torch.distributed.run", "--rdzv-endpoint", "h:1", "-m", "pkg.train"],
            TR + RDZV + ["--nproc-per-node", "4", "-m", "pkg.train"],
        ),
    ],
)
def test_multinode_argv(command, expected):
    from pathlib import Path

    assert worker_argv(cfg(command=command), Path("/r/config.yaml"), "job-g3") == expected


def test_max_restarts_is_torchruns_own():
    argv = worker_argv(cfg(max_restarts=2), __import__("pathlib").Path("/r/c.yaml"), "job-g0")
    assert argv[argv.index("--max-restarts") + 1] == "2"


def test_split_torchrun_stops_at_the_script():
    head, opts, script = split_torchrun(["torchrun", "--nproc_per_node", "2", "--no-python", "echo", "--x"])
    assert (head, opts, script) == (["torchrun"], ["--nproc_per_node", "2", "--no-python"], ["echo", "--x"])
