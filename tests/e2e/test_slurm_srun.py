"""`srun --ntasks-per-node=1 hangwatch run CONFIG` on a two-node allocation, faked on one machine: two `hangwatch run`
processes of one unedited config file, each with the environment srun gives its task (job 4242, step 0, node list
`localhost`, SLURMD_NODENAME node0 / node1, SLURM_NODEID 0 / 1).  The config names no node count, endpoint,
rendezvous id or node name: the job supplies them, each node gets a run dir of its own under the config's, and both
nodes train the tiny model through torchrun's c10d rendezvous to the end.
"""

from __future__ import annotations

import json
import time

import pytest
import yaml
from fixtures.fakes.nodes import free_port, pair_settings, start_node, steps_seen, wait_all
from fixtures.fakes.workers import make_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

MAX_STEPS = 6
JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOBID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "localhost",
    "SLURM_NODELIST": "localhost",
    "SLURM_STEP_NODELIST": "localhost",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0",
}


def task_env(node: int) -> dict:
    return {**JOB, "SLURMD_NODENAME": f"node{node}", "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}


def test_one_config_on_two_srun_tasks_meets_at_the_rendezvous_the_job_names_and_finishes(tmp_path):
    port = free_port()
    cfg = make_config(
        tmp_path, run_dir=str(tmp_path / "runs"), **pair_settings(tmp_path, {"rdzv_port": port}, max_steps=MAX_STEPS)
    )
    assert "nnodes" not in yaml.safe_load(cfg.read_text())["worker"]  # the default: the job's count
    run_dirs = {n: tmp_path / "runs" / f"node{n}" for n in (0, 1)}
    logs = {n: tmp_path / f"node{n}.out" for n in (0, 1)}
    procs = {}
    for n in (0, 1):
        procs[n] = start_node(cfg, logs[n], extra_env=task_env(n))
        time.sleep(0.5)
    codes = wait_all(procs, 420, logs)
    assert codes == {0: 0, 1: 0}, {n: log.read_text()[-3000:] for n, log in logs.items()}

    for n, run_dir in run_dirs.items():
        out = logs[n].read_text()
        assert (
            f"hangwatch: Slurm job 4242 step 0: worker.nnodes 2 (SLURM_STEP_NUM_NODES), worker.rdzv_endpoint "
            f"localhost:{port} "
        ) in out, out[-3000:]
        effective = yaml.safe_load((run_dir / "config.yaml").read_text())["worker"]
        assert (effective["nnodes"], effective["rdzv_endpoint"], effective["rdzv_id"], effective["node_name"]) == (
            2,
            f"localhost:{port}",
            "4242.0",
            f"node{n}",
        )
        state = json.loads((run_dir / "state.json").read_text())
        assert state["state"] == "finished"
        assert state["nodes"]["node"] == f"node{n}" and set(state["nodes"]["peers"]) == {"node0", "node1"}, state[
            "nodes"
        ]
        spawned = [
            json.loads(x) for x in (run_dir / "supervisor.log").read_text().splitlines() if '"worker_spawned"' in x
        ]
        argv = spawned[0]["argv"]
        assert argv[argv.index("--rdzv-id") + 1] == "4242.0-g0" and argv[argv.index("--nnodes") + 1] == "2"
    assert max(steps_seen(d) for d in run_dirs.values()) == MAX_STEPS
    assert (tmp_path / "shared-checkpoints" / "final" / "adapter_model.safetensors").exists()
