"""The tracker hooks' pure parts — the step of a W&B row, the drop rule, what wandb has committed — and TrackerHooks
on stand-in tracker modules: what a later attempt passes to `wandb.init` / `start_run`, what it drops, what the
record says, how an error of the hooks ends (once, the call made anyway), and what a log call costs.  The real
libraries in real processes: tests/faults/test_tracker_hooks.py."""

from __future__ import annotations

import json
import types
from fractions import Fraction

import pytest

from hangwatch.common import trackers as records
from hangwatch.daemon.trackers import hooks as th
from hangwatch.daemon.trackers.hooks import TrackerHooks, as_step, replayed, row_step, wandb_commit

# ---- pure parts ---------------------------------------------------------------------------------------------------


class Index:
    """Like numpy.int64 or a 0-d integer tensor: an integer through __index__."""

    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


@pytest.mark.parametrize(
    "value, step",
    [
        (7, 7),
        (0, 0),
        (7.0, 7),
        (7.5, None),
        (True, None),
        (None, None),
        ("7", None),
        (Index(9), 9),
        (Fraction(1, 2), None),
    ],
)
def test_as_step(value, step):
    assert as_step(value) == step


@pytest.mark.parametrize(
    "data, step, expected",
    [
        ({"loss": 1.0}, 12, (12, "_step")),  # step= wins over any key
        ({"loss": 1.0, "train/global_step": 5}, 12, (12, "_step")),
        ({"train/loss": 1.0, "train/global_step": 5}, None, (5, "train/global_step")),  # HF's WandbCallback
        ({"loss": 1.0, "trainer/global_step": 6}, None, (6, "trainer/global_step")),  # Lightning's WandbLogger
        ({"loss": 1.0, "global_step": Index(7)}, None, (7, "global_step")),
        ({"loss": 1.0}, None, (None, None)),  # wandb's own counter
        ({"train/global_step": "x", "global_step": 3}, None, (3, "global_step")),
        ({"loss": 1.0}, 2.5, (None, None)),
        (None, None, (None, None)),
    ],
)
def test_the_step_of_a_wandb_row(data, step, expected):
    assert row_step(data, step) == expected


@pytest.mark.parametrize(
    "step, prev, dropped",
    [(20, 24, True), (24, 24, True), (25, 24, False), (None, 24, False), (3, None, False), (0, 24, True)],
)
def test_the_drop_rule(step, prev, dropped):
    assert replayed(step, prev) is dropped


def test_mlflow_keeps_step_zero_where_a_stepless_point_lands():
    assert th._dropped(0, 24) is False and th._dropped(24, 24) is True and th._dropped(25, 24) is False


def test_what_wandb_has_committed():
    # step= rows stay open until a higher step: the last one is never committed by itself
    pending, committed = None, []
    for s in (1, 2, 2, 3):
        c, pending = wandb_commit(pending, s, True, None)
        committed.append(c)
    assert committed == [None, 1, None, 2] and pending == 3
    assert wandb_commit(3, 4, True, True) == (4, None)  # commit=True: at once
    assert wandb_commit(3, 2, True, None) == (None, 3)  # below the current step: wandb drops the row
    assert wandb_commit(3, None, False, None) == (3, None)  # a row without step= commits the open one
    assert wandb_commit(None, 7, False, None) == (7, None)  # HF's rows: committed at once
    assert wandb_commit(None, 7, False, False) == (None, 7)


# ---- stand-in trackers --------------------------------------------------------------------------------------------


def wandb_module(calls: list):
    """`wandb` and `wandb.sdk.wandb_run` as the hooks see them: init(...) → Run, Run.log."""

    class Run:
        def __init__(self, run_id, project, root_dir):
            self.id, self.project, self.entity = run_id, project, ""
            self.settings = types.SimpleNamespace(root_dir=root_dir)
            self.offline, self.disabled, self.rows = True, False, []

        def log(self, data, step=None, commit=None):
            self.rows.append((dict(data), step))

    def init(
        entity=None, project=None, dir=None, id=None, resume=None, resume_from=None, fork_from=None, settings=None
    ):
        calls.append(dict(project=project, dir=dir, id=id, resume=resume))
        if id == "refused":
            raise RuntimeError("run refused")
        return Run(id or "fresh%d" % len(calls), project or "uncategorized", dir or "/cwd")

    return types.SimpleNamespace(init=init, Run=Run)


CREATED: list = []  # this test's TrackerHooks: a process's hooks write their record from a thread of their own


def flush_all() -> None:
    """What each process's hooks write as it exits."""
    for hooks in CREATED:
        hooks.flush()


def record(tmp_path) -> dict:
    flush_all()
    return records.read_rank(tmp_path / "run", 0)


def new_hooks(tmp_path, attempt: int, errors: list) -> TrackerHooks:
    flush_all()  # the earlier attempt has exited
    hooks = TrackerHooks(str(tmp_path / "run"), 0, attempt, lambda name, exc: errors.append((name, exc)))
    CREATED.append(hooks)
    return hooks


@pytest.fixture(autouse=True)
def _created():
    CREATED.clear()
    yield
    CREATED.clear()


def hooked(tmp_path, attempt: int, errors: list, module=None, calls=None):
    calls = [] if calls is None else calls
    module = module or wandb_module(calls)
    hooks = new_hooks(tmp_path, attempt, errors)
    hooks.patch_wandb_run(module)
    hooks.patch_wandb(module)
    return hooks, module, calls


@pytest.fixture(autouse=True)
def _no_wandb_env(monkeypatch):
    for name in ("WANDB_RUN_ID", "WANDB_PROJECT", "WANDB_DIR", "WANDB_RESUME", "WANDB_RESUME_FROM", "WANDB_FORK_FROM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(th.FLUSH_ENV, raising=False)


def test_a_later_attempt_joins_the_wandb_run_and_drops_the_replayed_rows(tmp_path):
    errors: list = []
    hooks, wandb, calls = hooked(tmp_path, 1, errors)
    run = wandb.init(project="hw", dir="/data")
    for s in range(1, 25):
        run.log({"loss": s, "train/global_step": s})
    assert record(tmp_path)["wandb"]["last_step"] == 24
    assert th.os.environ[th.FLUSH_ENV] == "2"

    hooks, wandb, calls = hooked(tmp_path, 2, errors)
    run2 = wandb.init()  # as HF's callback does, with its project from WANDB_PROJECT or not
    assert calls == [dict(project="hw", dir="/data", id=run.id, resume="allow")]
    for s in range(21, 31):
        run2.log({"loss": s, "train/global_step": s})
        run2.log({"eval/loss": s, "train/global_step": s})  # the same step twice in one attempt: both kept
    run2.log({"no step here": 1})
    assert [r[0]["train/global_step"] for r in run2.rows[:-1]] == [s for s in range(25, 31) for _ in (0, 1)]
    rec = record(tmp_path)["wandb"]
    assert rec == {
        "id": run.id,
        "project": "hw",
        "entity": None,
        "root_dir": "/data",
        "mode": "offline",
        "step_key": "train/global_step",
        "last_step": 30,
        "prev_step": 24,
        "attempt": 2,
        "own_id": False,
    }
    assert errors == []


def test_a_persons_wandb_id_is_theirs_and_a_second_run_is_not_joined(tmp_path, monkeypatch):
    errors: list = []
    _, wandb, _ = hooked(tmp_path, 1, errors)
    wandb.init(id="mine")
    hooks, wandb, calls = hooked(tmp_path, 2, errors)
    monkeypatch.setenv("WANDB_RUN_ID", "other")
    wandb.init(project="p")
    assert calls == [dict(project="p", dir=None, id=None, resume=None)]  # nothing injected
    rec = record(tmp_path)["wandb"]
    assert rec["id"] == "fresh1" and rec["own_id"] is True and rec["prev_step"] is None
    monkeypatch.delenv("WANDB_RUN_ID")
    wandb.init()  # the process's second run: not the recorded one, nothing injected
    assert calls[-1]["id"] is None


def test_resume_from_or_fork_from_is_left_alone(tmp_path, monkeypatch):
    errors: list = []
    _, wandb, _ = hooked(tmp_path, 1, errors)
    wandb.init()
    _, wandb, calls = hooked(tmp_path, 2, errors)
    wandb.init(resume_from="abc?_step=20")
    assert calls[-1]["id"] is None
    _, wandb, calls = hooked(tmp_path, 2, errors)
    monkeypatch.setenv("WANDB_RESUME_FROM", "abc?_step=20")
    wandb.init()
    assert calls[-1]["id"] is None and errors == []


def test_a_refused_join_opens_a_fresh_run_and_is_reported_once(tmp_path):
    path = records.record_path(tmp_path / "run", 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"wandb": {"id": "refused", "attempt": 1, "last_step": 5}}))
    errors: list = []
    _, wandb, calls = hooked(tmp_path, 2, errors)
    run = wandb.init(project="p")
    assert [c["id"] for c in calls] == ["refused", None] and run.id == "fresh2"
    assert [(name, str(exc)) for name, exc in errors] == [("wandb", "run refused")]
    run.log({"loss": 1}, step=3)  # the hooks are off: only calls through
    assert run.rows == [({"loss": 1}, 3)]


def test_an_unwritable_record_costs_the_hook_not_the_script(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / records.TRACKERS_DIR).write_text("a file where the directory goes")
    errors: list = []
    _, wandb, _ = hooked(tmp_path, 1, errors)
    run = wandb.init()
    for s in range(1, 4):
        run.log({"loss": s}, step=s)
    flush_all()
    assert len(run.rows) == 3
    assert [name for name, _ in errors] == ["wandb"]


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"wandb": {"id": 7, "attempt": 1, "last_step": 5}}),
        json.dumps({"wandb": {"id": "x", "attempt": "1", "last_step": 5}}),
        json.dumps({"wandb": {"id": "x", "attempt": 2, "last_step": 5}}),  # not an earlier attempt's
        json.dumps({"wandb": "garbage", "mlflow": [1], "tensorboard": {"log_dirs": "nope", "attempt": 1}}),
    ],
)
def test_a_garbage_record_is_a_fresh_start(tmp_path, content):
    path = records.record_path(tmp_path / "run", 0)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    errors: list = []
    hooks, wandb, calls = hooked(tmp_path, 2, errors)
    assert hooks.earlier == {}
    run = wandb.init()
    run.log({"loss": 1}, step=1)
    run.log({"loss": 2}, step=2)
    assert calls[0]["id"] is None and len(run.rows) == 2 and errors == []
    assert record(tmp_path)["wandb"]["last_step"] == 1  # step 2: still open in wandb


def test_a_forked_child_only_calls_through(tmp_path, monkeypatch):
    errors: list = []
    _, wandb, _ = hooked(tmp_path, 1, errors)
    run = wandb.init()
    run.log({"loss": 1}, step=30)
    _, wandb, calls = hooked(tmp_path, 2, errors)
    monkeypatch.setattr(th.os, "getpid", lambda: -1)
    wandb.init()
    assert calls == [dict(project=None, dir=None, id=None, resume=None)]


# ---- MLflow on stand-ins ---------------------------------------------------------------------------------------------


def mlflow_modules(runs: dict, refuse: set):
    """`mlflow.tracking.fluent` (start_run, active_run) and `mlflow.tracking.client` (MlflowClient)."""
    active: list = []

    def start_run(run_id=None, experiment_id=None, run_name=None, nested=False, parent_run_id=None, tags=None):
        if run_id in refuse:
            raise RuntimeError("Cannot start run with ID %s because it is in the deleted state." % run_id)
        run_id = run_id or "run%d" % (len(runs) + 1)
        runs.setdefault(run_id, {"metrics": [], "params": {}})
        info = types.SimpleNamespace(run_id=run_id, experiment_id="0")
        active.append(types.SimpleNamespace(info=info))
        return active[-1]

    class MlflowClient:
        _tracking_client = types.SimpleNamespace(tracking_uri="sqlite:///x.db")

        def get_run(self, run_id):
            r = runs[run_id]
            return types.SimpleNamespace(
                info=types.SimpleNamespace(experiment_id="0"), data=types.SimpleNamespace(params=dict(r["params"]))
            )

        def log_metric(self, run_id, key, value, timestamp=None, step=None, synchronous=None):
            runs[run_id]["metrics"].append((key, step or 0))

        def log_batch(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
            for m in metrics:
                runs[run_id]["metrics"].append((m.key, m.step))
            for p in params:
                if runs[run_id]["params"].get(p.key, p.value) != p.value:
                    raise RuntimeError("Changing param values is not allowed")
                runs[run_id]["params"][p.key] = p.value

        def log_param(self, run_id, key, value, synchronous=None):
            runs[run_id]["params"][key] = value
            return value

    fluent = types.SimpleNamespace(__name__="mlflow.tracking.fluent", start_run=start_run, active_run=lambda: None)
    return fluent, types.SimpleNamespace(MlflowClient=MlflowClient)


def metric(key, step):
    return types.SimpleNamespace(key=key, value=1.0, timestamp=0, step=step)


def param(key, value):
    return types.SimpleNamespace(key=key, value=value)


def mlflow_hooked(tmp_path, attempt, errors, runs, refuse=(), monkeypatch=None):
    fluent, client_module = mlflow_modules(runs, set(refuse))
    monkeypatch.setitem(th.sys.modules, "mlflow.tracking.fluent", fluent)
    monkeypatch.delitem(th.sys.modules, "mlflow", raising=False)
    hooks = new_hooks(tmp_path, attempt, errors)
    hooks.patch_mlflow_fluent(fluent)
    hooks.patch_mlflow_client(client_module)
    return fluent, client_module.MlflowClient()


def test_a_later_attempt_joins_the_mlflow_run_drops_replayed_points_and_held_params(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    runs: dict = {}
    errors: list = []
    fluent, client = mlflow_hooked(tmp_path, 1, errors, runs, monkeypatch=monkeypatch)
    rid = fluent.start_run().info.run_id
    client.log_batch(rid, params=[param("lr", "0.1"), param("attempt", "1")])
    for s in range(1, 25):
        client.log_metric(rid, "loss", 1.0, step=s)
    fluent, client = mlflow_hooked(tmp_path, 2, errors, runs, monkeypatch=monkeypatch)
    assert fluent.start_run().info.run_id == rid
    client.log_batch(rid, params=[param("lr", "0.1"), param("attempt", "2"), param("new", "x")])
    for s in range(21, 31):
        client.log_batch(rid, metrics=[metric("loss", s), metric("lr", s)])
    client.log_metric(rid, "final", 1.0)  # no step: kept
    assert client.log_param(rid, "attempt", "2") == "2"  # held: not logged, its value returned as MLflow does
    steps = [s for k, s in runs[rid]["metrics"] if k == "loss"]
    assert steps == list(range(1, 31)) and ("final", 0) in runs[rid]["metrics"]
    assert runs[rid]["params"] == {"lr": "0.1", "attempt": "1", "new": "x"}
    rec = record(tmp_path)["mlflow"]
    assert rec == {
        "run_id": rid,
        "tracking_uri": None,  # no `mlflow` package module here: mlflow.get_tracking_uri() unknown
        "experiment_id": "0",
        "last_step": 30,
        "prev_step": 24,
        "attempt": 2,
        "own_id": False,
    }
    assert errors == []


def test_a_refused_mlflow_join_starts_a_fresh_run_and_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    path = records.record_path(tmp_path / "run", 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"mlflow": {"run_id": "gone", "attempt": 1, "last_step": 5}}))
    runs: dict = {}
    errors: list = []
    fluent, client = mlflow_hooked(tmp_path, 2, errors, runs, refuse={"gone"}, monkeypatch=monkeypatch)
    rid = fluent.start_run().info.run_id
    assert rid == "run1" and [name for name, _ in errors] == ["mlflow"] and "deleted" in str(errors[0][1])


def test_a_persons_mlflow_run_id_is_kept(tmp_path, monkeypatch):
    runs: dict = {}
    errors: list = []
    fluent, client = mlflow_hooked(tmp_path, 1, errors, runs, monkeypatch=monkeypatch)
    first = fluent.start_run().info.run_id
    fluent, client = mlflow_hooked(tmp_path, 2, errors, runs, monkeypatch=monkeypatch)
    monkeypatch.setenv("MLFLOW_RUN_ID", "theirs")
    runs["theirs"] = {"metrics": [], "params": {}}
    assert fluent.start_run().info.run_id not in (first, "theirs")  # the stand-in ignores the env: nothing injected
    rec = record(tmp_path)["mlflow"]
    assert rec["own_id"] is True and rec["prev_step"] is None


# ---- wiring and cost ------------------------------------------------------------------------------------------------


def test_install_registers_every_entry_point(tmp_path):
    seen = []
    hooks = TrackerHooks(str(tmp_path), 0, 1, lambda *a: None)
    hooks.install(types.SimpleNamespace(register=lambda name, callback: seen.append(name)))
    assert set(seen) == {
        "wandb",
        "wandb.sdk.wandb_run",
        "mlflow",
        "mlflow.tracking.fluent",
        "mlflow.tracking.client",
        "torch.utils.tensorboard.writer",
        "lightning.pytorch.loggers.mlflow",
        "pytorch_lightning.loggers.mlflow",
    }


def test_many_log_calls_each_dropped_counted_or_recorded(tmp_path):
    """A replayed step is dropped, a repeated one only counted, a new highest step handed to the record's writer
    thread: over thousands of calls, every row the script logs past the earlier attempts reaches the tracker and the
    record ends at the highest (what the hooks cost per call: `hangwatch bench --only trackers`)."""
    errors: list = []
    _, wandb, _ = hooked(tmp_path, 1, errors)
    wandb.init().log({"loss": 1.0, "train/global_step": 100_000})
    hooks, wandb, _ = hooked(tmp_path, 2, errors)
    run = wandb.init()
    n = 2000

    def log_all(steps, each=None):
        for s in steps:
            wandb.Run.log(run, {"loss": 1.0, "train/global_step": s})
            if each is not None:
                each()

    log_all(range(n))  # ≤ 100_000: replayed, dropped
    log_all(range(200_000, 200_000 + n))  # each a new highest step
    log_all([200_000 + n - 1] * n)  # logged, nothing to write
    log_all(range(300_000, 300_000 + 200), each=hooks.flush)  # + the write, in this thread
    assert errors == [] and len(run.rows) == 2 * n + 200
    assert record(tmp_path)["wandb"]["last_step"] == 300_199
