"""Which Python processes of a worker tree are ranks (daemon/autoinstrument/ranks.py): pure functions of a
command line, an environment and a pid."""

from __future__ import annotations

import os
import sys

import pytest

from hangwatch.daemon.autoinstrument import process_roles as ranks
from hangwatch.daemon.autoinstrument.process_roles import (
    HELPER,
    INHERITED,
    LAUNCHER,
    OWN,
    RANK,
    Command,
    decide,
    effective_rank,
    parse_command,
)

PY = "/venv/bin/python"
HB = "/runs/r/attempts/0001"


@pytest.mark.parametrize(
    "argv,expect",
    [
        ([PY, "train.py", "--lr", "1"], Command(script="train.py", args=("--lr", "1"))),
        ([PY, "-u", "-X", "dev", "-W", "ignore", "train.py"], Command(script="train.py")),
        ([PY, "-Wd", "-Xfaulthandler", "train.py"], Command(script="train.py")),
        (
            [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "t.py"],
            Command(module="torch.distributed.run", args=("--nproc-per-node", "2", "t.py")),
        ),
        (
            [PY, "-um", "accelerate.commands.launch", "t.py"],
            Command(module="accelerate.commands.launch", args=("t.py",)),
        ),
        ([PY, "-mtorch.distributed.launch"], Command(module="torch.distributed.launch")),
        (
            [
                PY,
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                "--multiprocessing-fork",
            ],
            Command(
                code="from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5)",
                args=("--multiprocessing-fork",),
            ),
        ),
        (
            [PY, "--check-hash-based-pycs", "always", "--", "-odd-name.py", "x"],
            Command(script="-odd-name.py", args=("x",)),
        ),
        (
            [PY, "/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"],
            Command(script="/venv/bin/torchrun", args=("--nproc-per-node", "2", "t.py")),
        ),
        ([PY], Command()),
        ([PY, "-"], Command()),
    ],
)
def test_the_command_an_interpreter_runs(argv, expect):
    assert parse_command(argv) == expect


@pytest.mark.parametrize(
    "argv,kind",
    [
        ([PY, "/venv/bin/torchrun", "--nproc-per-node", "2", "t.py"], LAUNCHER),
        ([PY, "-m", "torch.distributed.run", "t.py"], LAUNCHER),
        ([PY, "-m", "torch.distributed.launch", "t.py"], LAUNCHER),
        ([PY, "/venv/bin/accelerate", "launch", "t.py"], LAUNCHER),
        ([PY, "-m", "accelerate.commands.launch", "t.py"], LAUNCHER),
        ([PY, "/usr/local/bin/deepspeed", "t.py"], LAUNCHER),
        ([PY, "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "t.py"], LAUNCHER),
        ([PY, "/venv/bin/trl", "sft", "--model", "m"], LAUNCHER),
        (
            [
                PY,
                "-c",
                "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
                "--multiprocessing-fork",
            ],
            HELPER,
        ),
        ([PY, "-c", "from multiprocessing.forkserver import main; main(8, 9, ['__main__'])"], HELPER),
        ([PY, "-c", "from multiprocessing.resource_tracker import main;main(6)"], HELPER),
        ([PY, "-m", "torch._inductor.compile_worker", "--workers=4"], HELPER),
        ([PY, "-m", "hangwatch.daemon", "--config", "c.yaml"], OWN),
        ([PY, "/venv/bin/hangwatch", "status"], OWN),
        ([PY, "train.py"], RANK),
        ([PY, "-m", "my_project.train"], RANK),
        ([PY, "-c", "import torch; print(torch.__version__)"], RANK),
    ],
)
def test_roles_from_the_command_line(argv, kind):
    assert decide({}, argv, HB, 100).kind == kind


def test_the_top_process_is_rank_0_and_a_launchers_ranks_are_ranks():
    top = decide({}, [PY, "train.py"], HB, 100)
    assert (top.kind, top.rank) == (RANK, 0)
    for r in (0, 1, 7):
        role = decide({"RANK": str(r), "LOCAL_RANK": str(r % 4)}, [PY, "-u", "train.py"], HB, 200 + r)
        assert (role.kind, role.rank) == (RANK, r)


def test_a_descendant_of_the_process_that_claimed_the_rank_is_silent():
    env: dict = {"RANK": "1"}
    ranks.claim(env, 1, 100, HB, held=True)
    child = decide(env, [PY, "-c", "import torch._inductor"], HB, 101)
    assert (child.kind, child.rank) == (INHERITED, 1) and "100" in child.why
    # a child standing for another rank is a rank (a launcher's rank under a rank, RANK=2 set by hand)
    assert decide({**env, "RANK": "2"}, [PY, "t.py"], HB, 102).kind == RANK
    # the claimant itself after exec() keeps its pid: still the rank
    assert decide(env, [PY, "t.py"], HB, 100).kind == RANK
    # a claim for another attempt's heartbeats (an environment copied into a new run) claims nothing here
    assert decide(env, [PY, "t.py"], "/runs/r/attempts/0002", 103).kind == RANK
    # no RANK at all: rank 0, claimed by the top process; until it trains, a script it starts takes rank 0 over
    # (a wrapper that runs the training script), `-c` code never does; once it trained, its children are its own
    top: dict = {}
    ranks.claim(top, 0, 50, HB)
    assert (
        decide(top, [PY, "train.py"], HB, 51).kind == RANK
        and "taken over from process 50" in decide(top, [PY, "train.py"], HB, 51).why
    )
    assert decide(top, [PY, "-m", "pkg.train"], HB, 51).kind == RANK
    assert decide(top, [PY, "-c", "import torch; print(torch.__version__)"], HB, 51).kind == INHERITED
    ranks.claim(top, 0, 50, HB, held=True)
    assert decide(top, [PY, "eval.py"], HB, 51).kind == INHERITED


def test_a_launcher_drops_the_claim_it_inherited():
    env = {ranks.ENV_CLAIM: ranks.format_claim(0, 50, HB)}
    ranks.release_claim(env)
    assert ranks.ENV_CLAIM not in env
    ranks.release_claim(env)  # none: nothing to do


@pytest.mark.parametrize(
    "env,rank",
    [
        ({}, 0),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 3),
        ({"RANK": ""}, 0),
        ({"RANK": "x"}, 0),
        ({"LOCAL_RANK": "2"}, 2),  # Lightning's own launcher on one node
        ({"LOCAL_RANK": "2", "NODE_RANK": "0"}, 2),
        ({"LOCAL_RANK": "2", "NODE_RANK": "1"}, 0),  # several nodes: the global rank is not known from this
        ({"LOCAL_RANK": "2", "GROUP_RANK": "1"}, 0),
    ],
)
def test_effective_rank(env, rank):
    assert effective_rank(env) == rank


def test_claims_round_trip_and_bad_ones_are_none():
    assert ranks.parse_claim(ranks.format_claim(3, 42, "/a:b/c")) == (3, 42, "/a:b/c", False)
    assert ranks.parse_claim(ranks.format_claim(3, 42, "/d", held=True)).held
    for bad in (None, "", "3", "3:x:open:/d", "x:1:open:/d", "3:1:maybe:/d", "3:1:/d"):
        assert ranks.parse_claim(bad) is None


def test_the_command_line_is_the_interpreters_own():
    line = ranks.command_line()
    expected = getattr(sys, "orig_argv", None)
    if expected:
        assert line == list(expected)
    else:
        assert os.path.basename(line[0]).startswith("python") or line
