"""The tracker hooks with the real libraries and real processes: scripts written here — importing nothing from
hangwatch, using each tracker's own API — run as two attempts of one hangwatch run under the environment the
supervisor gives a `worker.command`; attempt 1 logs steps 1..24 and is killed (SIGKILL, a few seconds after its last
log: what a hang ends with), attempt 2 resumes at step 21 and logs 21..40.  What the runs hold is read with the
trackers' own readers (W&B's protobuf records of each offline file, `MlflowClient`, TensorBoard's EventAccumulator).

    frameworks  wandb.init() + rows with `train/global_step` (HF's WandbCallback), Lightning's MLFlowLogger (ignores
                MLFLOW_RUN_ID, creates its run with the client) and TensorBoardLogger (version_<N+1> each attempt),
                SummaryWriter() in its default dir (HF's TensorBoardCallback: runs/<date>_<host>, new each attempt):
                one W&B id, one MLflow run, the same two log dirs; attempt 2's replayed steps 21..24 dropped
    own         wandb.init(id=…) with step=, mlflow.start_run() + log_metric + log_param: the person's W&B id kept
                (and deduplicated: a row wandb had not committed when the process was killed is logged again, none
                twice); the MLflow run joined through start_run, a changed param not re-logged (MLflow would raise)
    outside     two processes on one W&B id without HANGWATCH_RUN_DIR: no record, nothing dropped
    broken      the record cannot be written: the script runs to its end, the hook reported once

All scenarios run at once (one module fixture); each test reads its own.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hangwatch.common import trackers as records
from hangwatch.common.instrumentation import instrument_env
from hangwatch.common.rundir import read_jsonl

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv" / "bin"
PY = str(VENV / "python") if (VENV / "python").exists() else sys.executable
RESUME = 20  # attempt 2 resumes from the checkpoint at step 20
KILL_AFTER_S = 3.5  # after the last log: W&B's flush interval (2 s, set by the hooks) has passed

PLAIN = """
import os, signal, sys, time

first, last = int(os.environ["T_FIRST"]), int(os.environ["T_LAST"])
attempt = int(os.environ["T_ATTEMPT"])
use = os.environ["T_TRACKERS"].split(",")
if "wandb" in use:
    import wandb

    settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, disable_git=True)
    run = wandb.init(project="hw", id=os.environ.get("T_WANDB_ID") or None, settings=settings)
if "mlflow" in use:
    import mlflow

    mlflow.start_run()
    mlflow.log_param("lr", 0.1)
    mlflow.log_param("attempt", attempt)  # changed at attempt 2: MLflow refuses a changed param value
for step in range(first, last + 1):
    value = attempt * 1000 + step
    if "wandb" in use:
        wandb.log({"loss": value}, step=step)
    if "mlflow" in use:
        mlflow.log_metric("loss", value, step=step)
if "mlflow" in use and attempt > 1:
    mlflow.log_metric("final", 1.0)  # no step: stored at step 0, kept
print("logged", last, flush=True)
if os.environ.get("T_KILL"):
    time.sleep(float(os.environ["T_KILL"]))
    os.kill(os.getpid(), signal.SIGKILL)
if "wandb" in use:
    wandb.finish()
if "mlflow" in use:
    mlflow.end_run()
"""

FRAMEWORKS = """
import os, signal, time

import wandb
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger
from torch.utils.tensorboard import SummaryWriter

first, last = int(os.environ["T_FIRST"]), int(os.environ["T_LAST"])
attempt = int(os.environ["T_ATTEMPT"])
settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True, disable_git=True)
wandb.init(project=os.getenv("WANDB_PROJECT", "huggingface"), settings=settings)  # as HF's WandbCallback
ml = MLFlowLogger(experiment_name="lt", tracking_uri=os.environ["MLFLOW_TRACKING_URI"])
tb = TensorBoardLogger(save_dir="logs", name="exp", default_hp_metric=False)
writer = SummaryWriter(purge_step=first)  # HF's TensorBoardCallback's default dir; purge_step as the findings advise
ml.log_hyperparams({"lr": 0.1, "attempt": attempt})
for step in range(first, last + 1):
    value = attempt * 1000 + step
    wandb.log({"loss": value, "train/global_step": step})  # HF's rows: the step in the row, no step=
    ml.log_metrics({"loss": value}, step=step)
    tb.log_metrics({"loss": value}, step=step)  # its SummaryWriter is made here: the process's second
    writer.add_scalar("loss", value, step)
print("logged", last, flush=True)
if os.environ.get("T_KILL"):
    time.sleep(float(os.environ["T_KILL"]))
    os.kill(os.getpid(), signal.SIGKILL)
wandb.finish()
ml.finalize("success")
tb.finalize("success")
writer.close()
"""


# ---- harness --------------------------------------------------------------------------------------------------------


class Scenario:
    def __init__(self, base: Path, name: str, script: str, trackers: str = "", **env):
        self.name = name
        self.cwd = base / name
        self.cwd.mkdir(parents=True)
        self.run_dir = self.cwd / "run"
        self.script = self.cwd / "script.py"
        self.script.write_text(textwrap.dedent(script))
        self.db = self.cwd / "mlflow.db"
        self.env = dict(env, T_TRACKERS=trackers)
        self.procs: list[subprocess.CompletedProcess] = []
        self.wall_s = 0.0

    @property
    def uri(self) -> str:
        return "sqlite:///" + str(self.db)

    def environ(self, attempt: int, supervised: bool) -> dict:
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("HANGWATCH_", "WANDB_", "MLFLOW_", "TENSORBOARD_")) and k != "PYTHONPATH"
        }
        env = {**base, **instrument_env(base, RESUME if attempt > 1 else None)}
        if supervised:
            env.update(
                HANGWATCH_RUN_DIR=str(self.run_dir),
                HANGWATCH_ATTEMPT=str(attempt),
                HANGWATCH_HEARTBEAT_DIR=str(self.run_dir / "attempts" / f"{attempt:04d}"),
                HANGWATCH_RESUME_FROM="",
            )
        env.update(
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            WANDB_MODE="offline",
            WANDB_SILENT="true",
            WANDB_CONFIG_DIR=str(self.cwd / ".wandb-config"),
            WANDB_CACHE_DIR=str(self.cwd / ".wandb-cache"),
            WANDB_DATA_DIR=str(self.cwd / ".wandb-data"),
            MLFLOW_TRACKING_URI=self.uri,
            T_ATTEMPT=str(attempt),
            T_FIRST="1" if attempt == 1 else str(RESUME + 1),
            T_LAST="24" if attempt == 1 else "40",
        )
        env.update(self.env)
        return env

    def attempt(self, attempt: int, kill: float = 0, supervised: bool = True) -> subprocess.CompletedProcess:
        env = self.environ(attempt, supervised)
        if kill:
            env["T_KILL"] = str(kill)
        start = time.monotonic()
        p = subprocess.run(
            [PY, str(self.script)], env=env, cwd=str(self.cwd), capture_output=True, text=True, timeout=240
        )
        self.wall_s += time.monotonic() - start
        self.procs.append(p)
        return p

    def check(self, *codes: int) -> None:
        assert [p.returncode for p in self.procs] == list(codes), "\n".join(
            f"--- {self.name} attempt {i + 1}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
            for i, p in enumerate(self.procs)
        )

    def record(self) -> dict:
        return records.read_rank(self.run_dir, 0)

    def warnings(self, attempt: int = 1) -> list[str]:
        beats = read_jsonl(self.run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl")
        return [b.get("message", "") for b in beats if b.get("event") == "warn"]


def two_attempts(s: Scenario, supervised: bool = True, kill: float = KILL_AFTER_S) -> None:
    if s.attempt(1, kill=kill, supervised=supervised).returncode in (0, -9):
        s.attempt(2, supervised=supervised)


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("trackers")
    frameworks = Scenario(base, "frameworks", FRAMEWORKS)
    own = Scenario(base, "own", PLAIN, "wandb,mlflow", T_WANDB_ID="mine0001")
    outside = Scenario(base, "outside", PLAIN, "wandb", T_WANDB_ID="out00001")
    broken = Scenario(base, "broken", PLAIN, "wandb")
    every = (frameworks, own, outside, broken)
    broken.run_dir.mkdir()
    (broken.run_dir / records.TRACKERS_DIR).write_text("not a directory\n")  # the record cannot be written
    start = time.monotonic()
    with ThreadPoolExecutor(len(every)) as pool:
        jobs = [pool.submit(two_attempts, outside, supervised=False, kill=0), pool.submit(broken.attempt, 1)]
        from mlflow import MlflowClient  # meanwhile: MLflow's tables, made once (seconds) and copied

        template = base / "template.db"
        MlflowClient("sqlite:///" + str(template)).search_experiments()
        for s in (frameworks, own):
            shutil.copy(template, s.db)
        jobs += [pool.submit(two_attempts, frameworks), pool.submit(two_attempts, own)]
        for job in jobs:
            job.result()
    print(
        "\ntracker scenarios: %.1f s wall (%s)"
        % (time.monotonic() - start, ", ".join("%s %.1f s" % (s.name, s.wall_s) for s in every))
    )
    return {s.name: s for s in every}


# ---- readers ---------------------------------------------------------------------------------------------------------


def wandb_records(path: Path):
    """The records of one offline `.wandb` file (a leveldb-style log of wandb's protobuf Records; a torn tail —
    a killed writer — ends it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7 : pos + 7 + length]
        if len(chunk) < length:
            break
        pos += 7 + length
        if kind in (1, 2):
            buf = chunk
        else:
            buf += chunk
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            yield r


def wandb_attempts(cwd: Path, key: str) -> list[dict]:
    """Per offline dir (in start order): its run id and the history's `key` values in order."""
    out = []
    for d in sorted((cwd / "wandb").glob("offline-run-*")):
        run_id, steps = None, []
        for r in wandb_records(next(d.glob("run-*.wandb"))):
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
            elif kind == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                steps.append(item[key] if key in item else r.history.step.num)
        out.append({"dir": d, "id": run_id, "steps": steps})
    return out


def mlflow_steps(uri: str, run_id: str, key: str = "loss") -> list[tuple]:
    from mlflow import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def tb_steps(log_dir: Path, tag: str = "loss") -> list[tuple]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(log_dir))
    ea.Reload()
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def expected(last_of_first: int = 24) -> list[tuple]:
    """Steps 1..40 once each: attempt 1's values up to `last_of_first`, attempt 2's after."""
    return [(s, float((1000 if s <= last_of_first else 2000) + s)) for s in range(1, 41)]


# ---- the tests -------------------------------------------------------------------------------------------------------


def test_wandb_attempts_join_one_run_and_log_no_step_twice(scenarios):
    s = scenarios["frameworks"]
    s.check(-9, 0)
    rec = s.record()["wandb"]
    one, two = wandb_attempts(s.cwd, "train/global_step")  # one offline dir per process, as wandb does
    assert one["id"] == two["id"] == rec["id"]
    assert one["steps"] == list(range(1, 25))  # all of attempt 1 on disk despite the SIGKILL: 2 s flushes
    assert two["steps"] == list(range(25, 41))  # 21..24 were the run's already
    assert rec["attempt"] == 2 and rec["own_id"] is False and rec["mode"] == "offline"
    assert rec["prev_step"] == 24 and rec["last_step"] == 40 and rec["step_key"] == "train/global_step"
    assert rec["project"] == "huggingface" and rec["root_dir"] == str(s.cwd)


def test_lightning_mlflow_logger_joins_the_first_attempts_run(scenarios):
    from mlflow import MlflowClient

    s = scenarios["frameworks"]
    s.check(-9, 0)
    rec = s.record()["mlflow"]
    client = MlflowClient(s.uri)
    runs = client.search_runs([client.get_experiment_by_name("lt").experiment_id])
    assert [r.info.run_id for r in runs] == [rec["run_id"]]
    assert runs[0].info.status == "FINISHED"
    assert mlflow_steps(s.uri, rec["run_id"]) == expected()
    assert runs[0].data.params == {"lr": "0.1", "attempt": "1"}  # attempt 2's "attempt" 2 not re-logged
    assert rec["attempt"] == 2 and rec["own_id"] is False and rec["prev_step"] == 24 and rec["last_step"] == 40
    assert rec["tracking_uri"] == s.uri and rec["experiment_id"] == runs[0].info.experiment_id


def test_tensorboard_writers_write_to_the_first_attempts_dirs_steps_once(scenarios):
    s = scenarios["frameworks"]
    s.check(-9, 0)
    (runs,) = (s.cwd / "runs").iterdir()  # SummaryWriter()'s default: one dir, not one per attempt
    version_0 = s.cwd / "logs" / "exp" / "version_0"  # Lightning's: not version_1 at attempt 2
    events = sorted(p.parent for p in s.cwd.rglob("events.out.tfevents.*"))
    assert events == sorted([runs, runs, version_0, version_0])
    assert tb_steps(runs) == expected()  # attempt 2's purge_step=21 did not hide attempt 1's 21..24
    assert tb_steps(version_0) == expected()
    rec = s.record()["tensorboard"]
    assert rec == {
        "log_dirs": [str(runs), str(version_0)],  # in the order the process made its writers
        "last_step": {str(runs): 40, str(version_0): 40},
        "prev_step": {str(runs): 24, str(version_0): 24},
        "attempt": 2,
    }


def test_a_persons_wandb_id_is_kept_and_still_deduplicated(scenarios):
    s = scenarios["own"]
    s.check(-9, 0)
    rec = s.record()["wandb"]
    one, two = wandb_attempts(s.cwd, "_step")
    assert one["id"] == two["id"] == rec["id"] == "mine0001"
    # step= rows: wandb commits one only when a higher step comes; the SIGKILL took the open row 24 with it, and the
    # record never counted it: attempt 2 logs it again — every step once, none lost
    assert one["steps"] == list(range(1, 24)) and two["steps"] == list(range(24, 41))
    assert rec["own_id"] is True and rec["prev_step"] == 23 and rec["step_key"] == "_step"


def test_mlflow_start_run_joins_the_first_attempts_run(scenarios):
    from mlflow import MlflowClient

    s = scenarios["own"]
    s.check(-9, 0)
    rec = s.record()["mlflow"]
    runs = MlflowClient(s.uri).search_runs(["0"])
    assert [r.info.run_id for r in runs] == [rec["run_id"]]
    assert mlflow_steps(s.uri, rec["run_id"]) == expected()
    assert mlflow_steps(s.uri, rec["run_id"], "final") == [(0, 1.0)]  # logged without a step: kept
    assert runs[0].data.params == {"lr": "0.1", "attempt": "1"}  # attempt 2's would have raised
    assert rec["attempt"] == 2 and rec["own_id"] is False and rec["prev_step"] == 24 and rec["last_step"] == 40
    assert rec["tracking_uri"] == s.uri and rec["experiment_id"] == "0"


def test_outside_hangwatch_nothing_is_recorded_or_dropped(scenarios):
    s = scenarios["outside"]
    s.check(0, 0)
    one, two = wandb_attempts(s.cwd, "_step")
    assert one["steps"] == list(range(1, 25)) and two["steps"] == list(range(21, 41))  # 21..24 twice: untouched
    assert not list(s.cwd.rglob(records.TRACKERS_DIR))


def test_a_record_that_cannot_be_written_costs_the_hook_not_the_script(scenarios):
    s = scenarios["broken"]
    s.check(0)
    assert "logged 24" in s.procs[0].stdout
    warnings = s.warnings()
    assert len([w for w in warnings if w.startswith("instrumentation error in tracker wandb:")]) == 1, warnings
    assert [one["steps"] for one in wandb_attempts(s.cwd, "_step")] == [list(range(1, 25))]
