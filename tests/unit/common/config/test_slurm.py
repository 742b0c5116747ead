"""A Slurm job's settings: the hostlist expander, and what `worker.nnodes: auto` (or unset in a job) takes from the
environment of an srun task — node count, rendezvous endpoint and id, node name, a run dir per node — what the
config's own values win over, and the environments refused with a message naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hangwatch.common.config import ConfigError, dump_config, load_checked, load_config, parse_config, reference_rows
from hangwatch.common.config.slurm import SlurmProblems, expand_hostlist, first_host, resolve

HOSTLISTS = [
    ("node01", ["node01"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[01-04,07],gpu-a[1-2]", ["node01", "node02", "node03", "node04", "node07", "gpu-a1", "gpu-a2"]),
    ("cn[8-10]", ["cn8", "cn9", "cn10"]),  # no padding when the low bound has none
    ("cn[08-10]", ["cn08", "cn09", "cn10"]),  # the low bound's width
    ("cn[098-101]", ["cn098", "cn099", "cn100", "cn101"]),
    ("a,b,c", ["a", "b", "c"]),
    ("login1,node[3,5-6]", ["login1", "node3", "node5", "node6"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
    ("node[7]", ["node7"]),
    ("node-a.cluster.local", ["node-a.cluster.local"]),
    ("localhost", ["localhost"]),
]


@pytest.mark.parametrize("text,hosts", HOSTLISTS, ids=[t for t, _ in HOSTLISTS])
def test_a_compressed_hostlist_expands_as_slurm_writes_it(text, hosts):
    assert expand_hostlist(text) == hosts
    assert first_host(text) == hosts[0]


@pytest.mark.parametrize("text", ["node[1-", "node1-2]", "node[]", "node[a-b]", "node[5-3]", "node[[1]]", ""])
def test_a_hostlist_that_is_not_slurm_syntax_is_refused(text):
    with pytest.raises(ValueError):
        first_host(text)


def test_the_first_host_of_a_huge_range_is_found_without_expanding_it():
    assert first_host("node[000000001-999999999]") == "node000000001"


# A task of `srun -N2 --ntasks-per-node=1` in job 4242 (what srun exports; SLURM_NODEID 1: the second node).
TASK = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}
# The minimum a task needs: a job, a count, a node list, a step.
BARE = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "3", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_STEP_ID": "2"}

RESOLVED = [
    # (worker section as written, environment) → (nnodes, endpoint, rdzv_id, node_name, run dir under the config's)
    ("auto, a full srun task", {"nnodes": "auto"}, TASK, (2, "gpu07:29400", "4242.0", "gpu08", "node1")),
    ("unset in a job", {}, TASK, (2, "gpu07:29400", "4242.0", "gpu08", "node1")),
    ("the minimum", {}, BARE, (3, "n1:29400", "77.2", "host-x", "host-x")),
    (
        "the step's nodes, not the job's",
        {},
        {**TASK, "SLURM_JOB_NODELIST": "gpu[01-08]", "SLURM_JOB_NUM_NODES": "8"},
        (2, "gpu07:29400", "4242.0", "gpu08", "node1"),
    ),
    (
        "SLURM_JOB_NUM_NODES alone",
        {},
        {"SLURM_JOB_ID": "5", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "a,b", "SLURM_STEP_ID": "0"},
        (2, "a:29400", "5.0", "host-x", "host-x"),
    ),
    ("rdzv_port", {"rdzv_port": 31000}, TASK, (2, "gpu07:31000", "4242.0", "gpu08", "node1")),
    (
        "the config's endpoint wins",
        {"rdzv_endpoint": "10.0.0.9:1234"},
        TASK,
        (2, "10.0.0.9:1234", "4242.0", "gpu08", "node1"),
    ),
    ("the config's rdzv_id wins", {"rdzv_id": "llama"}, TASK, (2, "gpu07:29400", "llama", "gpu08", "node1")),
    ("the config's node_name wins", {"node_name": "left"}, TASK, (2, "gpu07:29400", "4242.0", "left", "node1")),
    (
        "one node: nothing else",
        {},
        {**TASK, "SLURM_STEP_NUM_NODES": "1", "SLURM_NNODES": "1"},
        (1, None, None, None, None),
    ),
    (
        "one node, the batch script",
        {"nnodes": "auto"},
        {"SLURM_JOB_ID": "9", "SLURM_NNODES": "1"},
        (1, None, None, None, None),
    ),
]


@pytest.mark.parametrize("worker,env,expected", [r[1:] for r in RESOLVED], ids=[r[0] for r in RESOLVED])
def test_what_a_slurm_task_supplies(worker, env, expected):
    d = resolve(worker, env, hostname="host-x")
    nnodes, endpoint, rdzv_id, node_name, subdir = expected
    assert d.nnodes == nnodes
    assert d.values.get("rdzv_endpoint") == (None if "rdzv_endpoint" in worker else endpoint)
    assert d.values.get("rdzv_id") == (None if "rdzv_id" in worker else rdzv_id)
    assert d.values.get("node_name") == (None if "node_name" in worker else node_name)
    assert d.run_subdir == subdir
    assert d.job_id == env["SLURM_JOB_ID"]


@pytest.mark.parametrize(
    "worker,env",
    [
        ({"nnodes": 4}, TASK),  # a number: the config's word, Slurm is not asked
        ({"nnodes": 1}, TASK),
        ({}, {}),  # a workstation: the default, 1
        ({}, {"SLURM_JOB_ID": "1"}),  # no node count: not enough to call it a job
    ],
    ids=["explicit-4", "explicit-1", "workstation", "job-id-alone"],
)
def test_slurm_has_no_say(worker, env):
    assert resolve(worker, env, hostname="h") is None


REFUSED = [
    (
        "auto on a workstation",
        {"nnodes": "auto"},
        {},
        "auto takes the node count from Slurm, but this process is not in a Slurm job (SLURM_JOB_ID is not set; none "
        "of SLURM_STEP_NUM_NODES, SLURM_NNODES, SLURM_JOB_NUM_NODES is set)",
    ),
    ("auto without a count", {"nnodes": "auto"}, {"SLURM_JOB_ID": "3"}, "none of SLURM_STEP_NUM_NODES"),
    (
        "the batch script of a 4-node job",
        {},
        {"SLURM_JOB_ID": "3", "SLURM_NNODES": "4", "SLURM_JOB_NODELIST": "n[1-4]"},
        "Slurm job 3 has 4 nodes (SLURM_NNODES), but this process is not an srun task (SLURM_STEP_ID not set): it runs "
        "on this node only and the other 3 start no hangwatch",
    ),
    (
        "two tasks per node",
        {},
        {**TASK, "SLURM_STEP_TASKS_PER_NODE": "2(x2)"},
        "this srun step puts 2 tasks on a node (SLURM_STEP_TASKS_PER_NODE=2(x2))",
    ),
    ("uneven tasks per node", {}, {**TASK, "SLURM_STEP_TASKS_PER_NODE": "1,2"}, "puts 2 tasks on a node"),
    (
        "the second task of a node",
        {},
        {**TASK, "SLURM_STEP_TASKS_PER_NODE": "", "SLURM_LOCALID": "1"},
        "this is task 1 on its node (SLURM_LOCALID=1)",
    ),
    (
        "one node, two tasks",
        {},
        {**TASK, "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_TASKS_PER_NODE": "2"},
        "use `srun --ntasks-per-node=1`",
    ),
    (
        "a count that is not one",
        {},
        {**TASK, "SLURM_STEP_NUM_NODES": "two"},
        "SLURM_STEP_NUM_NODES='two' is not a node count",
    ),
    (
        "no node list",
        {},
        {"SLURM_JOB_ID": "3", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"},
        "no node list to take the rendezvous host from",
    ),
    (
        "a node list that is not one",
        {},
        {**TASK, "SLURM_STEP_NODELIST": "gpu[07-"},
        "SLURM_STEP_NODELIST='gpu[07-' is not a Slurm host list",
    ),
]


@pytest.mark.parametrize("worker,env,words", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_a_slurm_task_cannot_supply_is_refused_with_its_reason(worker, env, words):
    with pytest.raises(SlurmProblems) as info:
        resolve(worker, env, hostname="h")
    assert words in str(info.value)


def test_an_explicit_endpoint_needs_no_node_list():
    d = resolve(
        {"rdzv_endpoint": "h:1"}, {"SLURM_JOB_ID": "3", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"}, hostname="h"
    )
    assert d.nnodes == 2 and "rdzv_endpoint" not in d.values


# ---- through the loader --------------------------------------------------------------------------------

OWN = "worker:\n  command: [python, x.py]\n"


def test_the_loaded_config_holds_plain_values_and_the_effective_config_records_them(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(OWN + "  nnodes: auto\nrun_dir: runs/llama\ncheckpoint: {dir: /shared/ckpt}\n")
    cfg = load_config(path, environ=TASK)
    w = cfg.worker
    assert (w.nnodes, w.rdzv_endpoint, w.rdzv_id, w.node_name) == (2, "gpu07:29400", "4242.0", "gpu08")
    assert cfg.run_dir == str(tmp_path / "runs" / "llama" / "node1")
    effective = yaml.safe_load(dump_config(cfg))
    assert effective["worker"]["nnodes"] == 2 and effective["run_dir"] == cfg.run_dir
    # the effective config read again in the same job (the worker, under torchrun) is not derived twice
    again = tmp_path / "config.yaml"
    again.write_text(dump_config(cfg))
    reread = load_config(again, environ=TASK)
    assert reread.run_dir == cfg.run_dir and reread.worker.nnodes == 2 and reread.worker._slurm is None


def test_a_number_in_the_config_wins_over_the_job(tmp_path):
    cfg = parse_config(OWN + "  nnodes: 1\n", environ=TASK)
    assert cfg.worker.nnodes == 1 and cfg.worker.node_name is None and cfg.worker._slurm is None
    assert not cfg.run_dir.endswith("node1")


def test_run_dir_given_on_the_command_line_is_used_as_given(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(OWN)
    cfg = load_config(path, run_dir=str(tmp_path / "mine"), environ=TASK)
    assert cfg.run_dir == str(tmp_path / "mine") and cfg.worker.nnodes == 2
    assert cfg.worker._slurm.run_subdir is None


def test_problems_are_config_errors_at_the_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        parse_config(OWN + "  nnodes: auto\n", source="job.yaml", environ={})
    assert info.value.problems[0].startswith("job.yaml:3: worker.nnodes: auto takes the node count from Slurm")
    with pytest.raises(ConfigError) as info:
        parse_config(OWN, source="job.yaml", environ={**TASK, "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": ""})
    assert info.value.problems == [
        "job.yaml:1: worker.nnodes: this is task 1 on its node (SLURM_LOCALID=1): each task "
        "would be a hangwatch of its own, and one per node starts that node's "
        "worker.nproc_per_node ranks itself: use `srun --ntasks-per-node=1`"
    ]


def test_auto_past_the_loader_is_named(tmp_path):
    from pydantic import ValidationError

    from hangwatch.common.config import WorkerCfg

    with pytest.raises(ValidationError, match="auto is resolved from the Slurm job when a config file is loaded"):
        WorkerCfg.model_validate({"nnodes": "auto"})


def test_idle_gpus_of_the_node_are_a_warning_and_nproc_per_node_is_not_changed(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(OWN.replace("x.py", str(Path(__file__))) + "checkpoint: {dir: /shared/ckpt}\n")
    cfg, warnings = load_checked(path, environ={**TASK, "SLURM_GPUS_ON_NODE": "8", "PATH": "/usr/bin:/bin"})
    assert cfg.worker.nproc_per_node == 1
    assert any(
        "worker.nproc_per_node: 1, but Slurm gave this node 8 GPUs (SLURM_GPUS_ON_NODE): 7 would sit idle" in w
        for w in warnings
    ), warnings


def test_the_reference_says_auto_and_the_port():
    rows = {key: (typ, default) for key, typ, default, _ in reference_rows()}
    assert rows["worker.nnodes"] == ("int or auto", "1")
    assert rows["worker.rdzv_port"] == ("int", "29400")


def test_validate_config_and_run_say_what_came_from_the_job(tmp_path):
    from hangwatch.supervisor.cli.summary import config_summary, slurm_text

    path = tmp_path / "job.yaml"
    path.write_text(OWN)
    cfg = load_config(path, environ=TASK)
    text = slurm_text(cfg)
    assert text == (
        f"Slurm job 4242 step 0: worker.nnodes 2 (SLURM_STEP_NUM_NODES), worker.rdzv_endpoint gpu07:29400 "
        "(the first node of SLURM_STEP_NODELIST, port worker.rdzv_port), worker.rdzv_id 4242.0 "
        "(SLURM_JOB_ID.SLURM_STEP_ID), worker.node_name gpu08 (SLURMD_NODENAME), run dir "
        f"{tmp_path / 'runs' / 'default' / 'node1'} (node1 after the config's run_dir: SLURM_NODEID)"
    )
    assert ("slurm", text) in config_summary(cfg)
    assert slurm_text(parse_config(OWN, environ={})) is None


def test_the_sbatch_example_starts_one_hangwatch_per_node_on_a_config_the_job_completes():
    repo = Path(__file__).resolve().parents[4]
    script = (repo / "examples" / "slurm" / "hangwatch.sbatch").read_text()
    srun = next(line.split() for line in script.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and srun[-3:-1] == ["hangwatch", "run"]
    cfg = load_config(repo / srun[-1], environ=TASK)
    assert (cfg.worker.nnodes, cfg.worker.node_name, Path(cfg.run_dir).name) == (2, "gpu08", "node1")
    assert cfg.checkpoint.dir and not Path(cfg.checkpoint.dir).is_relative_to(cfg.run_dir)  # one dir for every node


def test_the_preamble_of_a_command_says_which_values_are_the_jobs():
    from hangwatch.supervisor.cli.summary import command_preamble

    cfg, _ = load_checked(None, command=["python", str(Path(__file__))], environ={**TASK, "PATH": "/usr/bin:/bin"})
    assert cfg.worker.nnodes == 2 and Path(cfg.run_dir).parts[-2:] == (Path(__file__).stem, "node1")
    assert (
        "hangwatch: worker.nnodes, worker.rdzv_endpoint, worker.rdzv_id, worker.node_name and run_dir there are this "
        "Slurm job's: take them out of a kept copy, and the next job supplies its own"
    ) in command_preamble(cfg, None)
