"""The supervisor's tracker report helper (`daemon/trackers/report.py`) against the real libraries.

A script logs steps 1..24 to a W&B offline run, an MLflow run on sqlite (then it is SIGKILLed: the run stays
RUNNING, as a hung worker's does) and a TensorBoard dir.  The helper, run with this interpreter by file path and a
JSON payload on stdin, puts an incident (attempt 1 killed) and then the run's summary (hangwatch gave up) on all
three; each is read back with the tracker's own reader (tests/fixtures/tracker_readers.py):

* W&B: the alert, a `hangwatch/incident` row on hangwatch's own x-axis (in the helper's own offline dir of the same
  id, resumed), the last incident and "attempt 1 killed by hangwatch" in the summary, then the goodput;
* MLflow: KILLED after the incident (tags, the metric at the step, the text artifact), FAILED after the summary;
  a run the script itself ended keeps its status;
* TensorBoard: a scalar and a text at the step, then the goodput and the summary table; the run's own points stay.

And: a broken record is that tracker's error text while the others report "ok" (exit 0, no traceback); a payload
that cannot be read is exit 2 with one line on stderr.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures import tracker_readers as tr

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "daemon" / "trackers" / "report.py"
NEEDS = ("wandb", "mlflow", "sqlalchemy", "alembic", "tensorboard", "torch")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        any(importlib.util.find_spec(m) is None for m in NEEDS),
        reason=f"needs the trackers' libraries ({', '.join(NEEDS)})",
    ),
]

# One tracker per process, all three at once (mlflow's first sqlite use alone takes ~5 s creating its tables).
MAKE_RUN = r"""
import json, os, signal, sys
out, which = sys.argv[1], sys.argv[2]
if which == "wandb":
    import wandb
    root = os.path.join(out, "wandb_root")
    os.makedirs(root)
    run = wandb.init(project="hw", id="hwtrk0001", dir=root, mode="offline", resume="allow",
                     settings=wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, silent=True,
                                             x_save_requirements=False))
    for s in range(1, 25):
        run.log({"loss": 1.0 / s}, step=s)
    run.finish()
    rec = {"id": run.id, "project": "hw", "entity": None, "root_dir": root, "mode": "offline", "step_key": None,
           "last_step": 24, "attempt": 1, "own_id": True}
elif which == "tensorboard":
    from torch.utils.tensorboard import SummaryWriter
    tb = os.path.join(out, "tb")
    w = SummaryWriter(log_dir=tb, purge_step=1)
    for s in range(1, 25):
        w.add_scalar("loss", 1.0 / s, s)
    w.close()
    rec = {"log_dirs": [tb], "last_step": {tb: 24}, "attempt": 1}
else:
    import mlflow
    uri = "sqlite:///" + os.path.join(out, "mlflow.db")
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("hw")
    with mlflow.start_run() as done:  # a run the script ended itself
        mlflow.log_metric("loss", 1.0, step=1)
    run = mlflow.start_run()
    for s in range(1, 25):
        mlflow.log_metric("loss", 1.0 / s, step=s)
    rec = {"run_id": run.info.run_id, "tracking_uri": uri, "experiment_id": run.info.experiment_id,
           "last_step": 24, "attempt": 1, "own_id": True, "finished_run_id": done.info.run_id}
with open(os.path.join(out, which + ".json"), "w") as f:
    json.dump(rec, f)
if which == "mlflow":
    os.kill(os.getpid(), signal.SIGKILL)  # killed while RUNNING: nothing ends the run
"""

TEXT = (
    "stall at step 24: no progress for 300s\n"
    "culprit: rank 0 in train.py:42 (next(batch_iter))\n"
    "SIGKILL after 2.1s; attempt 2 resumes from checkpoint-20"
)
MARK = {
    "event": "incident",
    "title": "hangwatch: stall at step 24 (incident 0001)",
    "text": TEXT,
    "step": 24,
    "level": "ERROR",
    "incident": "0001",
    "kind": "stall",
    "attempt": 1,
    "status": "KILLED",
}
SUMMARY = {
    "goodput_pct": 87.5,
    "lost_s": 42.0,
    "wall_s": 336.0,
    "attempts": 2,
    "restarts": 1,
    "incidents": 1,
    "outcome": "failed",
    "status": "FAILED",
    "step": 24,
}


def report(payload, cwd: Path, raw: str | None = None) -> subprocess.CompletedProcess:
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    return subprocess.run(
        [sys.executable, str(REPORT)],
        input=raw if raw is not None else json.dumps(payload),
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=120,
    )


def result_of(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return json.loads(lines[0])


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """The three tracker runs of 'attempt 1' and their records ({"wandb", "mlflow", "tensorboard"})."""
    out = tmp_path_factory.mktemp("trackers")
    script = out / "make_run.py"
    script.write_text(MAKE_RUN)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(MLFLOW_DISABLE_TELEMETRY="true", MLFLOW_LOGGING_LEVEL="WARNING")
    procs = {
        which: subprocess.Popen(
            [sys.executable, str(script), str(out), which], cwd=out, env=env, stderr=subprocess.PIPE, text=True
        )
        for which in ("wandb", "tensorboard", "mlflow")
    }
    for which, p in procs.items():
        _, err = p.communicate(timeout=120)
        assert (out / f"{which}.json").exists(), f"{which}: rc {p.returncode}\n{err[-2000:]}"
    records = {which: json.loads((out / f"{which}.json").read_text()) for which in procs}
    return out, records


def test_incident_then_summary_land_on_all_three(tracked, tmp_path):
    out, records = tracked
    wb, ml, tb = records["wandb"], records["mlflow"], records["tensorboard"]
    trackers = {
        "wandb": wb,
        "mlflow": {k: v for k, v in ml.items() if k != "finished_run_id"},
        "tensorboard": tb,
    }
    log_dir = tb["log_dirs"][0]

    # before: attempt 1's data only
    before = tr.wandb_run(wb["root_dir"], wb["id"])
    assert len(before["files"]) == 1 and not before["alerts"]
    assert [r["_step"] for r in before["history"]] == list(range(1, 25))
    assert not any(k.startswith("hangwatch/") for k in before["summary"])
    ml_before = tr.mlflow_run(ml["tracking_uri"], ml["run_id"])
    assert ml_before["status"] == "RUNNING" and not ml_before["artifacts"]
    assert not any(k.startswith("hangwatch") for k in [*ml_before["tags"], *ml_before["metrics"]])
    assert set(tr.tensorboard_scalars(log_dir)) == {"loss"} and tr.tensorboard_texts(log_dir) == {}

    # the incident: attempt 1 killed at step 24
    started = time.monotonic()
    proc = report(
        {"run": "demo", "trackers": trackers, "marks": [MARK], "summary": None, "timeout_s": 60}, tmp_path / "cwd"
    )
    took = time.monotonic() - started
    assert result_of(proc) == {"wandb": "ok", "mlflow": "ok", "tensorboard": "ok"}
    print(f"report.py with all three trackers: {took:.1f}s")
    assert list((tmp_path / "cwd").iterdir()) == []  # nothing relative to the helper's cwd

    w = tr.wandb_run(wb["root_dir"], wb["id"])
    assert len(w["files"]) == 2
    attempt, helper = w["files"]
    assert [r["_step"] for r in attempt.history] == list(range(1, 25))  # the user's rows untouched
    assert helper.run_id == wb["id"] and helper.resume_flag is True and helper.exit_code == 0
    assert w["alerts"] == [(MARK["title"], TEXT, "ERROR")]
    assert [{k: v for k, v in r.items() if not k.startswith("_")} for r in helper.history] == [
        {"hangwatch/incident": 1, "hangwatch/step": 24}
    ]
    assert w["summary"]["hangwatch/last_incident"] == TEXT
    assert w["summary"]["hangwatch/state"] == "attempt 1 killed by hangwatch (stall at step 24)"
    assert w["summary"]["hangwatch/incidents"] == 1
    assert w["summary"]["loss"] == pytest.approx(1 / 24)  # the run's own summary still there (sync merges)

    m = tr.mlflow_run(ml["tracking_uri"], ml["run_id"])
    assert m["status"] == "KILLED"
    assert m["tags"]["hangwatch.last_incident"] == TEXT
    assert m["tags"]["hangwatch.incidents"] == "1"
    assert m["tags"]["hangwatch.state"] == "attempt 1 killed by hangwatch (stall at step 24)"
    assert m["metrics"]["hangwatch/incident"] == [(24, 1.0)]
    assert len(m["metrics"]["loss"]) == 24
    assert TEXT in m["artifacts"]["hangwatch/incident-0001.txt"]

    scalars, texts = tr.tensorboard_scalars(log_dir), tr.tensorboard_texts(log_dir)
    assert scalars["hangwatch/incident"] == [(24, 1.0)]
    assert [s for s, _ in scalars["loss"]] == list(range(1, 25))
    [(step, text)] = texts["hangwatch/incident"]
    assert step == 24 and MARK["title"] in text and all(line in text for line in TEXT.splitlines())

    # the summary: hangwatch gave up
    proc = report(
        {"run": "demo", "trackers": trackers, "marks": [], "summary": SUMMARY, "timeout_s": 60}, tmp_path / "cwd"
    )
    assert result_of(proc) == {"wandb": "ok", "mlflow": "ok", "tensorboard": "ok"}

    w = tr.wandb_run(wb["root_dir"], wb["id"])
    assert len(w["files"]) == 3 and w["files"][-1].history == []
    s = w["summary"]
    assert (s["hangwatch/goodput_pct"], s["hangwatch/lost_s"], s["hangwatch/restarts"]) == (87.5, 42.0, 1)
    assert (s["hangwatch/attempts"], s["hangwatch/incidents"], s["hangwatch/outcome"]) == (2, 1, "failed")
    assert s["hangwatch/state"] == "hangwatch run failed (2 attempts, 1 restart, goodput 87.5%)"
    assert s["hangwatch/last_incident"] == TEXT  # from the incident's file: sync merges in start order

    m = tr.mlflow_run(ml["tracking_uri"], ml["run_id"])
    assert m["status"] == "FAILED"  # over hangwatch's own KILLED
    assert m["tags"]["hangwatch.outcome"] == "failed"
    assert m["metrics"]["hangwatch/goodput_pct"] == [(24, 87.5)]
    assert m["metrics"]["hangwatch/lost_s"] == [(24, 42.0)]
    assert m["metrics"]["hangwatch/restarts"] == [(24, 1.0)]
    assert "| goodput | 87.5 % |" in m["artifacts"]["hangwatch/summary.md"]
    assert TEXT in m["artifacts"]["hangwatch/incident-0001.txt"]

    scalars, texts = tr.tensorboard_scalars(log_dir), tr.tensorboard_texts(log_dir)
    assert scalars["hangwatch/goodput_pct"] == [(24, 87.5)]
    assert scalars["hangwatch/incident"] == [(24, 1.0)]
    [(step, table)] = texts["hangwatch/summary"]
    assert step == 24 and "| goodput | 87.5 % |" in table and "| outcome | failed |" in table


def test_a_broken_record_is_its_entry_only(tracked, tmp_path):
    """wandb raises in init, one of two TensorBoard dirs is a file, an unknown tracker: each its own one-line entry;
    MLflow reports, and a run the script itself ended keeps its status."""
    out, records = tracked
    good, bad = tmp_path / "tb", tmp_path / "a-file"
    good.mkdir()
    bad.write_text("")
    ml = records["mlflow"]
    trackers = {
        "wandb": dict(records["wandb"], mode="bogus-mode"),
        "mlflow": {k: v for k, v in ml.items() if k != "finished_run_id"} | {"run_id": ml["finished_run_id"]},
        "tensorboard": {"log_dirs": [str(bad), str(good)], "last_step": {str(good): 7}, "attempt": 1},
        "aim": {},
    }
    mark = dict(MARK, step=None)  # no step: each tracker's last step
    proc = report({"run": "demo", "trackers": trackers, "marks": [mark], "timeout_s": 60}, tmp_path / "cwd")
    res = result_of(proc)
    assert res["mlflow"] == "ok"
    assert res["wandb"] != "ok" and "bogus-mode" in res["wandb"]
    assert res["tensorboard"].startswith(f"{bad}: ") and str(good) not in res["tensorboard"]
    assert res["aim"] == "unknown tracker 'aim'"
    assert all("\n" not in v for v in res.values())

    assert tr.tensorboard_scalars(good) == {"hangwatch/incident": [(7, 1.0)]}
    m = tr.mlflow_run(ml["tracking_uri"], ml["finished_run_id"])
    assert m["status"] == "FINISHED"  # the script's end_run stands
    assert m["metrics"]["hangwatch/incident"] == [(24, 1.0)] and "hangwatch.state" not in m["tags"]


def test_records_refused_before_any_import(tmp_path):
    """Refused before the libraries load: a disabled W&B run, a store that is not there (connecting would create an
    empty one), no log dirs; and a payload with nothing to report touches nothing."""
    root = tmp_path / "root"
    root.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    wandb_rec = {"id": "x1", "project": "hw", "root_dir": str(root), "mode": "disabled", "last_step": 3}
    trackers = {
        "wandb": wandb_rec,
        "mlflow": {"run_id": "0123456789abcdef0123456789abcdef", "tracking_uri": f"sqlite:///{blocker}/mlflow.db"},
        "tensorboard": {"log_dirs": [], "last_step": {}},
    }
    res = result_of(report({"run": "demo", "trackers": trackers, "marks": [MARK]}, tmp_path / "cwd"))
    assert res["wandb"] == "disabled"
    assert res["mlflow"].startswith(f"the tracking store sqlite:///{blocker}/mlflow.db is not there")
    assert res["tensorboard"] == "the record names no log_dirs"
    trackers["wandb"] = dict(wandb_rec, mode="offline")
    res = result_of(report({"trackers": trackers, "marks": [], "summary": None}, tmp_path / "cwd"))
    assert res["wandb"] == "ok"
    assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    "raw", ["not json", "[1, 2]", '{"marks": []}', '{"trackers": {}, "marks": [1]}', '{"trackers": {}, "summary": 3}']
)
def test_an_unreadable_payload_is_exit_2_with_one_line(raw, tmp_path):
    proc = report(None, tmp_path, raw=raw)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and "unreadable payload" in proc.stderr
