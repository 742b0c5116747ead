"""The built-in worker's trackers (`train.report_to: [wandb, mlflow, tensorboard]`) through a hang and its restart:
the worker blocks in C at step 7 (after the checkpoints of steps 2, 4 and 6), the supervisor kills it, attempt 2
resumes from the last good checkpoint and replays the steps after it.  Read back with the trackers' own readers
(tests/fixtures/tracker_readers.py): one W&B id across the attempts' offline files, one MLflow run, one TensorBoard
log dir, each with every step 1..max_steps once, in order — what the attempts logged twice is logged once — and the
eval losses at their steps."""

from __future__ import annotations

import subprocess

import pytest
from fixtures import tracker_readers as readers
from fixtures.fakes.demo_runs import beats, finish
from fixtures.fakes.sup_harness import PY, ROOT, env, incidents
from fixtures.fakes.workers import make_config

from hangwatch.common.trackers import read_records

pytestmark = pytest.mark.slow

MAX_STEPS, HANG_AT, EVAL_EVERY = 12, 7, 4
TRACKERS = ["wandb", "mlflow", "tensorboard"]
STEPS = list(range(1, MAX_STEPS + 1))
EVAL_STEPS = list(range(EVAL_EVERY, MAX_STEPS + 1, EVAL_EVERY))


@pytest.mark.timeout(400)
def test_one_tracker_run_across_a_hang_and_its_resume_with_no_step_twice(tmp_path):
    for library in ("wandb", "mlflow", "tensorboard"):
        pytest.importorskip(library)
    run_dir = tmp_path / "run"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = make_config(
        tmp_path,
        run_dir=str(run_dir),
        # the timing of the built-in worker's hang tests (fixtures.fakes.demo_runs)
        watchdog={
            "startup_timeout_s": 300,
            "silence_timeout_s": 60,
            "step_timeout_s": 8,
            "first_steps_timeout_s": 120,
            "dump_grace_s": 2,
            "term_grace_s": 2,
            "poll_interval_s": 0.1,
            "py_spy": False,
        },
        restart={"backoff_initial_s": 0, "max_restarts": 2, "in_process": False},
        train={"max_steps": MAX_STEPS, "report_to": TRACKERS, "run_name": "builtin-lora"},
        eval={"every_steps": EVAL_EVERY},
        checkpoint={"every_steps": 2, "confirm_steps": 1},
        faults=[{"kind": "block_c", "at_step": HANG_AT}],
    )
    trackers_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": uri}
    out = tmp_path / "hangwatch.out"
    with open(out, "w") as f:
        p = subprocess.Popen(
            [PY, "-m", "hangwatch.supervisor", "run", "-v", str(cfg)],
            cwd=ROOT,
            env={**env(), **trackers_env},
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    finish(p, run_dir, out, timeout=300)

    (inc,) = incidents(run_dir)
    assert inc["kind"] == "stall" and inc["attempt"] == 1, inc
    first, second = beats(run_dir, 1), beats(run_dir, 2)
    resumed = second[0]["resumed_step"]
    assert 0 < resumed < HANG_AT - 1, second[0]  # attempt 2 replays steps attempt 1 had logged
    assert max(b["step"] for b in first if b["event"] == "step") == HANG_AT - 1
    said = [b["message"] for b in first + second if b["event"] == "warn" and "tracker" in b]
    assert not said, said  # every tracker stayed on

    recs = read_records(run_dir)
    assert set(recs) >= set(TRACKERS), recs

    # W&B: every offline file under the run dir is the one id (no second run); each step's row is in one file only.
    wid = recs["wandb"]["id"]
    files = readers.wandb_files(run_dir)
    assert {f.run_id for f in files} == {wid}, [(f.path, f.run_id) for f in files]
    by_file = [[row["_step"] for row in f.history if "train/loss" in row] for f in files]
    assert len([s for s in by_file if s]) == 2, by_file  # both attempts logged
    w = readers.wandb_run(run_dir, wid)
    assert [row["_step"] for row in w["history"] if "train/loss" in row] == STEPS, by_file
    assert [row["_step"] for row in w["history"] if "eval/loss" in row] == EVAL_STEPS  # in the step's own row
    assert w["files"][-1].exit_code == 0

    # MLflow: one run in the experiment, resumed by attempt 2 and finished; each step once, in order.
    assert readers.mlflow_run_ids(uri, "hangwatch") == [recs["mlflow"]["run_id"]]
    m = readers.mlflow_run(uri, recs["mlflow"]["run_id"])
    assert m["status"] == "FINISHED", m["status"]
    assert m["tags"].get("mlflow.runName") == "builtin-lora"
    assert m["params"]["train.max_steps"] == str(MAX_STEPS) and m["params"]["lora.r"] == "4", m["params"]
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        assert [s for s, _ in m["metrics"][key]] == STEPS, (key, m["metrics"][key])
    assert [s for s, _ in m["metrics"]["eval/loss"]] == EVAL_STEPS
    # the replayed steps' values are the ones attempt 1 logged (exact resume; attempt 1 logged up to HANG_AT - 1)
    losses = dict(m["metrics"]["train/loss"])
    assert all(losses[b["step"]] == b["loss"] for b in first if b["event"] == "step")

    # TensorBoard: one log dir for both attempts, no step twice, strictly increasing.
    [log_dir] = recs["tensorboard"]["log_dirs"]
    assert log_dir == str(run_dir / "tensorboard")
    scalars = readers.tensorboard_scalars(log_dir)
    for key in ("train/loss", "train/lr", "train/grad_norm"):
        assert [s for s, _ in scalars[key]] == STEPS, (key, scalars[key])
    assert [s for s, _ in scalars["eval/loss"]] == EVAL_STEPS
