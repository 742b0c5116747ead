"""Where `hangwatch run` goes when its run dir already holds a run (`cli/rerun.py`): the decision table-tested
(`decide`: what the chain of run dirs holds, the effective config, who started us), then the edges that read the
run dirs and the environment (`plan`, `started_by`, `record_start`)."""

from __future__ import annotations

import fcntl
import json
import os

import pytest
import yaml

from hangwatch.supervisor.cli import rerun
from hangwatch.supervisor.cli.rerun import Recorded, Starter, decide, started_by

BASE = {"run_dir": "x", "worker": {"command": ["python", "train.py", "--steps", "3"]}, "train": {"lr": 0.1}}
AGAIN = ["--", "python", "train.py", "--steps", "3"]
PERSON = Starter()
SYSTEMD = Starter(systemd=True)
REQUEUE = Starter(slurm_job="77", slurm_restarts=1)
NEW_JOB = Starter(slurm_job="78")


def with_(**changes):
    out = json.loads(json.dumps(BASE))
    for k, v in changes.items():
        section, key = k.split("__")
        out.setdefault(section, {})[key] = v
    return out


OTHER_ARGS = with_(worker__command=["python", "train.py", "--steps", "100"])
OTHER_LR = with_(train__lr=0.5)
LONGER_DEADLINE = with_(watchdog__step_timeout_s=600)
MOVED_NODES = with_(worker__rdzv_id="78.0", worker__rdzv_endpoint="n9:29400", worker__node_name="n9")


def rec(name: str, state=None, config=BASE, **facts) -> Recorded:
    return Recorded(f"runs/{name}", state=state, config=config, **facts)


FREE = {name: Recorded(f"runs/{name}") for name in ("train", "train-2", "train-3")}
STOPPED = rec("train", "stopped", next_attempt=3, checkpoint="runs/train/checkpoints/step-40", checkpoint_step=40)
FAILED = rec("train", "failed", next_attempt=2)
FINISHED = rec("train", "finished", step=80, slurm_job="77")

# (what the chain holds, this run's config, who started us) → (run dir, its first line or a piece of it, finished)
TABLE = [
    # nothing there
    ([FREE["train"]], BASE, PERSON, ("runs/train", None, False)),
    # a failed or stopped run: the same command continues it and says so; another goes to a run dir of its own
    (
        [STOPPED, FREE["train-2"]],
        BASE,
        PERSON,
        (
            "runs/train",
            "hangwatch: continuing the stopped run in runs/train: attempt 3, from runs/train/checkpoints/step-40 "
            "(step 40)",
            False,
        ),
    ),
    (
        [FAILED, FREE["train-2"]],
        BASE,
        SYSTEMD,
        ("runs/train", "hangwatch: continuing the failed run in runs/train: attempt 2, from the start", False),
    ),
    (
        [rec("train", "running", next_attempt=5), FREE["train-2"]],  # its supervisor died: interrupted
        BASE,
        PERSON,
        ("runs/train", "hangwatch: continuing the interrupted run in runs/train: attempt 5", False),
    ),
    ([rec("train", "running", busy=True), FREE["train-2"]], BASE, PERSON, ("runs/train", None, False)),  # the lock says
    (
        [FAILED, FREE["train-2"]],
        OTHER_ARGS,
        PERSON,
        (
            "runs/train-2",
            "hangwatch: runs/train holds a failed run of another command or other arguments: this run goes to "
            "runs/train-2",
            False,
        ),
    ),
    (
        [STOPPED, FREE["train-2"]],
        OTHER_LR,
        SYSTEMD,
        ("runs/train-2", "runs/train holds a stopped run of another config (train.lr): this run goes to", False),
    ),
    (
        [rec("train", "running", busy=True), FREE["train-2"]],
        OTHER_ARGS,
        PERSON,
        ("runs/train-2", "runs/train holds a running run of another command", False),
    ),
    # how it is watched, and where a job's nodes meet, do not make another run
    (
        [FAILED, FREE["train-2"]],
        LONGER_DEADLINE,
        PERSON,
        (
            "runs/train",
            "continuing the failed run in runs/train: attempt 2, from the start; with this config's "
            "watchdog.step_timeout_s",
            False,
        ),
    ),
    ([FAILED, FREE["train-2"]], MOVED_NODES, NEW_JOB, ("runs/train", "continuing the failed run", False)),
    # a finished run, the same command: a person runs it again, in a run dir of its own; a machine gets a report
    (
        [FINISHED, FREE["train-2"]],
        BASE,
        PERSON,
        (
            "runs/train-2",
            "hangwatch: runs/train holds this same run, finished (at step 80): it runs again, in runs/train-2",
            False,
        ),
    ),
    ([FINISHED, FREE["train-2"]], BASE, NEW_JOB, ("runs/train-2", "it runs again", False)),  # a new sbatch: a person's
    (
        [FINISHED, FREE["train-2"]],
        BASE,
        SYSTEMD,
        (
            "runs/train",
            "hangwatch: runs/train already finished (at step 80): this same run, started again by systemd "
            "— reported, nothing started.",
            True,
        ),
    ),
    ([FINISHED, FREE["train-2"]], BASE, REQUEUE, ("runs/train", "started again by Slurm's requeue of job 77", True)),
    (
        [FINISHED, FREE["train-2"]],
        BASE,
        Starter(slurm_job="77"),  # the job that ran it, running it again
        ("runs/train", "started again by Slurm job 77 again", True),
    ),
    # a finished run, another command: a run dir of its own, the first free one or the one that holds that run
    (
        [FINISHED, FREE["train-2"]],
        OTHER_ARGS,
        SYSTEMD,
        (
            "runs/train-2",
            "runs/train holds a finished run of another command or other arguments: this run goes to runs/train-2",
            False,
        ),
    ),
    (
        [FINISHED, rec("train-2", "failed", config=OTHER_ARGS, next_attempt=4), FREE["train-3"]],
        OTHER_ARGS,
        PERSON,
        ("runs/train-2", "hangwatch: continuing the failed run in runs/train-2: attempt 4, from the start", False),
    ),
    (
        [FINISHED, rec("train-2", "finished", config=OTHER_ARGS), FREE["train-3"]],
        OTHER_ARGS,
        PERSON,
        ("runs/train-3", "runs/train-2 holds this same run, finished: it runs again, in runs/train-3", False),
    ),
    (
        [FINISHED, rec("train-2", "finished", config=OTHER_ARGS), FREE["train-3"]],
        OTHER_LR,
        PERSON,
        (
            "runs/train-3",
            "runs/train holds a finished run of another config (train.lr): this run goes to runs/train-3",
            False,
        ),
    ),
    # the same run finished, then ran again and failed: the newest of it continues
    (
        [FINISHED, rec("train-2", "stopped", next_attempt=2), FREE["train-3"]],
        BASE,
        PERSON,
        ("runs/train-2", "continuing the stopped run in runs/train-2", False),
    ),
    # a run dir that recorded no config is taken for this run, as before config.yaml was recorded
    ([rec("train", "failed", config=None), FREE["train-2"]], OTHER_ARGS, PERSON, ("runs/train", "continuing", False)),
]


@pytest.mark.parametrize("chain, effective, starter, expected", TABLE, ids=[f"row{i}" for i in range(len(TABLE))])
def test_where_the_run_goes(chain, effective, starter, expected):
    run_dir, first, finished = expected
    plan = decide(effective, chain, starter, AGAIN)
    assert (plan.run_dir, plan.finished) == (run_dir, finished), plan
    if first is None:
        assert plan.lines == []
    else:
        assert first in plan.lines[0], plan.lines


def test_a_reported_finished_run_names_its_adapter_and_the_way_to_run_it_afresh():
    plan = decide(BASE, [rec("train", "finished", final_adapter=True), FREE["train-2"]], SYSTEMD, AGAIN)
    assert plan.lines[1:] == [
        "  its final adapter: runs/train/final",
        "  to run it again from the start: hangwatch run --run-dir runs/train-new -- python train.py --steps 3",
        "  (or remove it first: rm -r runs/train)",
    ]


def test_a_run_dir_named_with_run_dir_continues_an_unfinished_run_of_another_config():
    plan = decide(OTHER_LR, [STOPPED, FREE["train-2"]], PERSON, AGAIN, pinned=True)
    assert plan.run_dir == "runs/train" and not plan.finished
    assert plan.lines == [
        "hangwatch: continuing the stopped run in runs/train: attempt 3, from runs/train/checkpoints/step-40 "
        "(step 40), as --run-dir asks, with another config (train.lr)"
    ]
    # a finished run there is not trained on: as without --run-dir, a run dir of its own
    assert decide(OTHER_LR, [FINISHED, FREE["train-2"]], PERSON, AGAIN, pinned=True).run_dir == "runs/train-2"
    # the same run: continued as always, without the words about another config
    assert "as --run-dir asks" not in decide(BASE, [STOPPED, FREE["train-2"]], PERSON, AGAIN, pinned=True).lines[0]


def test_an_inbox_run_keeps_its_run_dir_whatever_it_holds():
    for chain in ([FINISHED, FREE["train-2"]], [FAILED, FREE["train-2"]]):
        assert decide(OTHER_ARGS, chain, PERSON, AGAIN, continuous=True) == rerun.Plan("runs/train")


@pytest.mark.parametrize(
    "env, journal, starter",
    [
        ({}, False, Starter()),
        ({"INVOCATION_ID": "abc"}, False, Starter(systemd=True)),
        ({}, True, Starter(systemd=True)),
        ({"SLURM_JOB_ID": "77"}, False, Starter(slurm_job="77")),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"}, False, Starter(slurm_job="77", slurm_restarts=2)),
        ({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "x"}, False, Starter(slurm_job="77")),
    ],
)
def test_who_started_us(env, journal, starter):
    assert started_by(env, journal) == starter


# ---- the edges, on disk


def recorded(d, effective, state, **more):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(effective))
    (d / "state.json").write_text(json.dumps({"state": state, "step": 80, "last_good_step": 70, **more}))


def test_plan_reads_the_run_dirs_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "runs" / "train"
    recorded(base, BASE, "stopped", last_good_checkpoint=str(base / "checkpoints" / "step-70"))
    (base / "attempts" / "0001").mkdir(parents=True)
    (base / "attempts" / "0002").mkdir()
    plan = rerun.plan(BASE, str(base), AGAIN, environ={})
    assert plan == rerun.Plan(
        str(base),
        [
            "hangwatch: continuing the stopped run in runs/train: attempt 3, from runs/train/checkpoints/step-70 "
            "(step 70)"
        ],
    )
    recorded(base, BASE, "finished", updated_wall=1.8e9)
    plan = rerun.plan(BASE, str(base), AGAIN, environ={})
    assert plan.run_dir == str(base) + "-2" and not plan.finished and "(at step 80, " in plan.lines[0]
    plan = rerun.plan(BASE, str(base), AGAIN, environ={"INVOCATION_ID": "1"})
    assert plan.run_dir == str(base) and plan.finished and "already finished (at step 80, " in plan.lines[0]
    # the Slurm job that ran it, recorded: that job starting it again is a requeue
    rerun.record_start(str(base), {"SLURM_JOB_ID": "4242"})
    assert rerun.plan(BASE, str(base), AGAIN, environ={"SLURM_JOB_ID": "4242"}).finished
    assert not rerun.plan(BASE, str(base), AGAIN, environ={"SLURM_JOB_ID": "4243"}).finished
    # another run: past the run dirs that hold other runs
    recorded(base.with_name("train-2"), OTHER_ARGS, "failed")
    assert rerun.plan(OTHER_LR, str(base), AGAIN, environ={}).run_dir == str(base) + "-3"


def test_a_multi_node_jobs_rendezvous_id_names_the_job_that_ran_it(tmp_path):
    base = tmp_path / "train"
    recorded(base, {**BASE, "worker": {**BASE["worker"], "rdzv_id": "4242.0"}}, "finished")
    assert rerun.read_recorded(base).slurm_job == "4242"
    recorded(base, {**BASE, "worker": {**BASE["worker"], "rdzv_id": "my-run"}}, "finished")
    assert rerun.read_recorded(base).slurm_job is None


def test_a_run_dir_a_live_supervisor_holds_is_busy(tmp_path):
    base = tmp_path / "train"
    recorded(base, BASE, "running")
    assert not rerun.read_recorded(base).busy
    fd = os.open(base / "hangwatch.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert rerun.read_recorded(base).busy
    finally:
        os.close(fd)
    assert not rerun.read_recorded(base).busy
