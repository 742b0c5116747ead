"""One tracker run per hangwatch run, with every incident on it: unedited scripts that log to W&B (offline files),
MLflow (a local sqlite store) and TensorBoard (event files), hung once under `hangwatch run -- …` and resumed, read
back with the trackers' own readers (tests/fixtures/tracker_readers.py).

  * an HF Trainer script (`report_to` all three, nothing wired for resuming): the second attempt joins the first's
    W&B id, MLflow run and TensorBoard dir; the steps it replays are not logged twice; the stall and the resume verdict
    are on each run at their steps; the run's goodput is in each summary;
  * a plain loop calling each tracker's own API, the same;
  * a run that ends with the hang (no restart left): the MLflow run is FAILED, not RUNNING for ever, and W&B's
    summary says the attempt was killed.

The bare commands' own behaviour is the reference: run without hangwatch, each attempt would be a run of its own
(findings in docs/trackers.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import tracker_readers as readers
from fixtures.fakes.user_shell import incidents, log_events, run_hangwatch, user_env, worker_logs

from hangwatch.common.trackers import read_records

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "fixtures" / "user_scripts"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRACKER_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_PROJECT": "hw",
    "WANDB_SILENT": "true",
    "MLFLOW_TRACKING_URI": "sqlite:///mlflow.db",
}
HANG_AT, MAX_STEPS, SAVE_STEPS = 12, 20, 5


def config(max_restarts: int = 2) -> dict:
    return {
        "watchdog": {
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            # learned step budget (a configured step_timeout_s would also bound the trackers' start-up before step 1)
            "first_steps_timeout_s": 90,
            "step_timeout_min_s": 5,
            "dump_grace_s": 2,
            "term_grace_s": 2,
            "py_spy": False,
            "poll_interval_s": 0.1,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": max_restarts},
        "checkpoint": {"confirm_steps": 1},
        "worker": {"resume_args": ["--resume", "{checkpoint}"]},
    }


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    return f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_logs(run_dir)}"


def strictly_increasing(steps: list) -> bool:
    return all(a < b for a, b in zip(steps, steps[1:]))


def assert_one_run_across_attempts(tmp_path: Path, run_dir: Path, loss: dict, wandb_step_key: str) -> dict:
    """The three trackers' runs, read back: one of each, the steps strictly increasing and complete, the stall and
    its restart on each at the hang step, goodput in each summary.  `loss`: the loss's key in each tracker (HF's
    integrations name it differently).  Returns what was read."""
    recs = read_records(run_dir)
    assert set(recs) == {"wandb", "mlflow", "tensorboard"}, recs
    [inc] = [i for _, i in incidents(run_dir)]
    # the step the incident hit: the last step the worker finished (the HF script hangs in the callback after it)
    hit = inc["step"]
    assert inc["kind"] in ("stall", "livelock") and inc["attempt"] == 1 and hit in (HANG_AT - 1, HANG_AT), inc

    # W&B: every file of the id — the two attempts' and the supervisor's reports — is one run when synced.
    wid = recs["wandb"]["id"]
    files = readers.wandb_files(tmp_path)
    assert {f.run_id for f in files} == {wid}, [(f.path, f.run_id) for f in files]  # no second run
    w = readers.wandb_run(tmp_path, wid)
    steps = [row[wandb_step_key] for row in w["history"] if loss["wandb"] in row]
    assert steps == list(range(1, MAX_STEPS + 1)), steps  # the replayed step is not logged twice
    titles = [a[0] for a in w["alerts"]]
    assert any(f"at step {hit}" in t and inc["kind"] in t for t in titles), titles
    assert any("resume verified" in t for t in titles), titles
    assert w["summary"]["hangwatch/restarts"] == 1 and w["summary"]["hangwatch/outcome"] == "finished", w["summary"]
    assert 0 < w["summary"]["hangwatch/goodput_pct"] <= 100, w["summary"]
    assert "killed by hangwatch" in str(w["summary"].get("hangwatch/attempt_1")), w["summary"]
    assert "finished" in str(w["summary"].get("hangwatch/state")), w["summary"]

    # MLflow: one run in its experiment, resumed, finished, the stall at its step with the incident as text.
    mid = recs["mlflow"]["run_id"]
    m = readers.mlflow_run(TRACKER_ENV["MLFLOW_TRACKING_URI"].replace("///", f"///{tmp_path}/"), mid)
    msteps = [s for s, _ in m["metrics"][loss["mlflow"]]]
    assert msteps == list(range(1, MAX_STEPS + 1)), msteps
    assert m["status"] == "FINISHED", m["status"]
    assert [s for s, _ in m["metrics"]["hangwatch/incident"]] == [hit], m["metrics"].keys()
    assert any(inc["id"] in name or "incident" in name for name in m["artifacts"]), m["artifacts"]
    assert "goodput" in " ".join(m["metrics"]) and m["tags"].get("hangwatch.outcome") == "finished", m["tags"]

    # TensorBoard: one log dir for both attempts, no step twice, the stall at its step.
    [log_dir] = recs["tensorboard"]["log_dirs"]
    scalars = readers.tensorboard_scalars(log_dir)
    tsteps = [s for s, _ in scalars[loss["tensorboard"]]]
    assert tsteps == list(range(1, MAX_STEPS + 1)), tsteps
    assert [s for s, _ in scalars["hangwatch/incident"]] == [hit], sorted(scalars)
    assert "hangwatch/goodput_pct" in scalars, sorted(scalars)
    texts = readers.tensorboard_texts(log_dir)
    assert any(inc["kind"] in t for _, t in texts.get("hangwatch/incident", [])), texts
    assert not [e for e in log_events(run_dir, "tracker_failed")], log_events(run_dir, "tracker_failed")
    return {"wandb": w, "mlflow": m, "tensorboard": scalars}


def test_an_unedited_hf_trainer_script_keeps_one_run_per_tracker_across_a_hang_and_its_resume(tmp_path):
    pytest.importorskip("transformers")
    cmd = ["python", str(SCRIPTS / "hf_trackers.py"), "--output-dir", "out", "--max-steps", str(MAX_STEPS)]
    cmd += ["--save-steps", str(SAVE_STEPS), "--hang-once", "hang.marker", "--hang-at", str(HANG_AT)]
    cfg = config()
    del cfg["worker"]  # the Trainer is handed its checkpoint by the instrumentation
    r, run_dir = run_hangwatch(tmp_path, cfg, cmd, env=TRACKER_ENV)
    assert r.returncode == 0, explain(r, run_dir)
    assert len(list((run_dir / "attempts").iterdir())) == 2, explain(r, run_dir)
    keys = {"wandb": "train/loss", "mlflow": "loss", "tensorboard": "train/loss"}
    assert_one_run_across_attempts(tmp_path, run_dir, keys, "train/global_step")


def test_a_plain_loop_logging_through_each_trackers_api_keeps_one_run_across_a_hang_and_its_resume(tmp_path):
    cmd = ["python", str(SCRIPTS / "plain_trackers.py"), "--steps", str(MAX_STEPS), "--save-every", str(SAVE_STEPS)]
    cmd += ["--hang-once", "hang.marker", "--hang-at", str(HANG_AT)]
    r, run_dir = run_hangwatch(tmp_path, config(), cmd, env=TRACKER_ENV)
    assert r.returncode == 0, explain(r, run_dir)
    got = assert_one_run_across_attempts(
        tmp_path, run_dir, dict.fromkeys(("wandb", "mlflow", "tensorboard"), "loss"), "_step"
    )
    # The bare script, run twice in a row the same way, makes two runs of each: what hangwatch joins.
    bare = {k: v for k, v in {**user_env(), **TRACKER_ENV}.items() if k != "PYTHONPATH"}
    (tmp_path / "bare").mkdir()
    for _ in range(2):
        subprocess.run(
            [sys.executable, str(SCRIPTS / "plain_trackers.py"), "--steps", "3", "--trackers", "wandb,mlflow"],
            cwd=tmp_path / "bare",
            env=bare,
            check=True,
            capture_output=True,
            timeout=120,
        )
    assert len({f.run_id for f in readers.wandb_files(tmp_path / "bare")}) == 2
    assert len(readers.mlflow_run_ids(f"sqlite:///{tmp_path}/bare/mlflow.db", "plain")) == 2
    assert got["mlflow"]["params"] == {"lr": "0.05"}


def test_a_run_that_ends_with_the_hang_leaves_no_tracker_run_running(tmp_path):
    cmd = ["python", str(SCRIPTS / "plain_trackers.py"), "--steps", str(MAX_STEPS), "--save-every", str(SAVE_STEPS)]
    cmd += ["--hang-once", "hang.marker", "--hang-at", str(HANG_AT), "--trackers", "wandb,mlflow"]
    r, run_dir = run_hangwatch(tmp_path, config(max_restarts=0), cmd, env=TRACKER_ENV)
    assert r.returncode != 0 and json.loads((run_dir / "state.json").read_text())["state"] == "failed", explain(
        r, run_dir
    )
    recs = read_records(run_dir)
    m = readers.mlflow_run(f"sqlite:///{tmp_path}/mlflow.db", recs["mlflow"]["run_id"])
    # bare, a SIGKILLed run stays RUNNING for ever: here KILLED once the attempt was, FAILED as the run gives up
    assert m["status"] == "FAILED", m["status"]
    assert any("SIGKILL" in text for name, text in m["artifacts"].items() if "0001" in name), m["artifacts"]
    assert m["tags"].get("hangwatch.outcome") == "failed", m["tags"]
    w = readers.wandb_run(tmp_path, recs["wandb"]["id"])
    assert "killed by hangwatch" in str(w["summary"].get("hangwatch/attempt_1")), w["summary"]
    assert w["summary"]["hangwatch/outcome"] == "failed"
    assert [f.exit_code for f in w["files"]][0] is None  # the killed attempt's own file has no exit: said beside it
