"""The built-in worker's experiment trackers (`train.report_to`): W&B, MLflow, TensorBoard, on rank 0.

    log = TrackerLog.for_worker(cfg, configured, run_dir, attempt, warn)   # None when report_to is empty
    log.log(step, {"train/loss": …, "train/lr": …, "train/grad_norm": …})  # per optimizer step; eval/* after evals
    log.close("finished")                                                 # | "idle" | "terminated" | "failed"

The tracker hooks every unedited script gets (`daemon.trackers.hooks.TrackerHooks`) are installed first, before any
tracker library is imported, so the built-in worker has the same guarantees as a script: every attempt of a hangwatch
run joins the first attempt's tracker run (its W&B id, its MLflow run, its TensorBoard log dir), and a step an earlier
attempt logged is not logged again.  Within one process a metric is never logged twice at a step either: after a
recovery in the process (`restart.in_process`) the steps since the last good checkpoint are taken again, exactly, and
their points are already there.

Each tracker runs in a thread of its own, which imports its library, opens the run and then makes every call: the
training thread only hands it the step's numbers (`log` costs a queue put, ~10 µs; a synchronous MLflow write to a
sqlite store costs ~14 ms, a W&B `log` ~0.3 ms), an unreachable server is never a stuck training step the supervisor
would take for a hang, and one slow tracker does not hold back the others.  What waits in a queue goes in one call
where the tracker can (MLflow: one `log_batch`, at most once a second — its writes are mostly Python, and the GIL
they hold is the training thread's time).  A tracker that fails — its library missing, an import or `init` error, bad
credentials, a refused URI, a failing call, or a queue that fills up behind a stuck call — is said once (`warn`: the
worker's `warn` beat and log line) and is off for the rest of this attempt; training never stops because of a
tracker.  A hook that fails (or a recorded run the library refuses: a deleted MLflow run) is said once too; that
tracker goes on as the library would by itself.  `close` waits for what is queued (at most `timeout_s`) and ends each
run: W&B `finish(exit_code)`, MLflow `end_run(FINISHED | KILLED | FAILED)` (a graceful stop is KILLED: a later attempt
may resume it), the TensorBoard writer closed.  What a SIGKILL leaves queued (milliseconds' worth, unless a tracker was
behind) is lost, and not counted as logged by the hooks: the next attempt logs it.

Where the runs go: W&B project WANDB_PROJECT or `hangwatch`, WANDB_MODE as the environment says, its files under the
run dir (WANDB_DIR overrides), the run named `train.run_name` (default: the run dir's name), the training's sections
of the config as its config (`run_config`: not `worker.env` nor `alerts.urls`, where secrets live); MLflow experiment
MLFLOW_EXPERIMENT_NAME or `hangwatch` on MLFLOW_TRACKING_URI, key settings as params (`PARAM_KEYS`), written at most
once a second; TensorBoard TENSORBOARD_LOGGING_DIR or `<run_dir>/tensorboard`.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

Warn = Callable[..., None]  # warn(message, **fields): the worker's `warn` beat and log line

QUEUE_SIZE = 10_000  # steps a tracker may fall behind before it is turned off
CLOSE_TIMEOUT_S = 30.0
EXIT_CLOSE_TIMEOUT_S = 10.0  # at exit, when the worker failed before it closed them
BACKLOG = 1000  # most steps taken off a tracker's queue at once (one MLflow batch)
MLFLOW_INTERVAL_S = 1.0  # MLflow writes at most once a second, every step since in one batch
MLFLOW_MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch
_CLOSE = object()

# The settings MLflow gets as params (flattened, the config as written: OOM remediation does not change them, and a
# resumed run refuses a param whose value changes).
PARAM_KEYS = (
    "model.name_or_path",
    "model.dtype",
    "model.gradient_checkpointing",
    "model.load_in_4bit",
    "lora.r",
    "lora.alpha",
    "lora.dropout",
    "lora.target_modules",
    "lora.modules_to_save",
    "data.train",
    "data.eval",
    "data.max_length",
    "data.truncation",
    "data.inbox",
    "train.max_steps",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.lr",
    "train.weight_decay",
    "train.warmup_steps",
    "train.max_grad_norm",
    "train.seed",
    "eval.every_steps",
    "checkpoint.every_steps",
    "checkpoint.confirm_steps",
    "worker.nproc_per_node",
    "worker.nnodes",
    "run_dir",
)


# What W&B gets as the run's config: the training's sections, never `worker.env` or `alerts.urls` (secrets live there).
CONFIG_SECTIONS = ("run_dir", "model", "lora", "data", "train", "eval", "checkpoint", "faults")


def run_config(config: Mapping[str, Any]) -> dict:
    """The config a tracker run shows (W&B's `config=`): the sections that shape the training, and the world's size."""
    out = {k: config[k] for k in CONFIG_SECTIONS if k in config}
    worker = config.get("worker")
    if isinstance(worker, Mapping):
        out["worker"] = {k: worker[k] for k in ("nproc_per_node", "nnodes") if k in worker}
    return out


def params_of(config: Mapping[str, Any]) -> dict[str, str]:
    """PARAM_KEYS of a dumped config, flattened (`train.lr` → "0.0002")."""
    out = {}
    for key in PARAM_KEYS:
        value: Any = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value)
        out[key] = "" if value is None else str(value)
    return out


def step_metrics(m: Mapping[str, Any]) -> dict[str, float]:
    """What a training step's record (`Trainer._train_step`) gives the trackers."""
    out = {"train/loss": m.get("loss"), "train/lr": m.get("lr"), "train/grad_norm": m.get("grad_norm")}
    return {k: float(v) for k, v in out.items() if isinstance(v, (int, float))}


def eval_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """What an eval's summary (`run_eval`) gives the trackers."""
    loss = summary.get("loss")
    return {"eval/loss": float(loss)} if isinstance(loss, (int, float)) else {}


# ---- the trackers ------------------------------------------------------------------------------------------------


class Context:
    """What every tracker opens its run with."""

    def __init__(self, run_dir: Path, run_name: str, config: dict, environ: Mapping[str, str]):
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.config = config
        self.environ = environ


class WandbTracker:
    name = "wandb"

    def open(self, ctx: Context) -> None:
        import wandb

        self.wandb = wandb
        kw: dict[str, Any] = {}
        if not ctx.environ.get("WANDB_DIR"):
            kw["dir"] = str(ctx.run_dir)
        # No id and no resume: the hooks pass the first attempt's (a later attempt joins that run).
        self.run = wandb.init(
            project=ctx.environ.get("WANDB_PROJECT") or "hangwatch",
            name=ctx.run_name,
            config=run_config(ctx.config),
            **kw,
        )

    def log(self, step: int, metrics: dict, t: float) -> None:
        self.wandb.log(metrics, step=step)  # a row stays open for eval/* at the same step; the next step commits it

    def close(self, status: str) -> None:
        self.wandb.finish(exit_code=1 if status == "failed" else 0)


class MlflowTracker:
    name = "mlflow"
    # A store write is ~14 ms of mostly Python (SQLAlchemy) per call, taken from the training thread's GIL time when it
    # runs once per step: once a second, in one batch, it is next to nothing.
    interval_s = MLFLOW_INTERVAL_S

    def __init__(self, warn: Warn):
        self.warn = warn

    def open(self, ctx: Context) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(ctx.environ.get("MLFLOW_EXPERIMENT_NAME") or "hangwatch")
        # The hooks pass the first attempt's run id.  The fluent API's active run is this thread's: every call is.
        self.run_id = mlflow.start_run(run_name=ctx.run_name).info.run_id
        try:
            mlflow.log_params(params_of(ctx.config))
        except Exception as exc:  # e.g. a resumed run whose config changed a param: the metrics still go
            self.warn(f"report_to mlflow: params not logged ({_words(exc)})", tracker=self.name)

    def log(self, step: int, metrics: dict, t: float) -> None:
        # synchronous: what returned is in the store (the hooks count it logged then)
        self.mlflow.log_metrics(metrics, step=step, timestamp=int(t * 1000))

    def log_many(self, items: list) -> None:
        """A backlog of steps in one store transaction per MAX_BATCH points, not one per step (a synchronous write to
        a sqlite store costs ~14 ms: more than a small model's step)."""
        from mlflow.entities import Metric

        points = [Metric(k, v, int(t * 1000), step) for step, metrics, t in items for k, v in metrics.items()]
        client = self.mlflow.MlflowClient()
        for i in range(0, len(points), MLFLOW_MAX_BATCH):
            client.log_batch(self.run_id, metrics=points[i : i + MLFLOW_MAX_BATCH], synchronous=True)

    def close(self, status: str) -> None:
        self.mlflow.end_run({"failed": "FAILED", "terminated": "KILLED"}.get(status, "FINISHED"))


class TensorBoardTracker:
    name = "tensorboard"

    def open(self, ctx: Context) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = ctx.environ.get("TENSORBOARD_LOGGING_DIR")
        self.writer = SummaryWriter(
            log_dir=os.path.expanduser(log_dir) if log_dir else str(ctx.run_dir / "tensorboard")
        )

    def log(self, step: int, metrics: dict, t: float) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step, walltime=t)

    def close(self, status: str) -> None:
        self.writer.close()


def make_tracker(name: str, warn: Warn):
    if name == "wandb":
        return WandbTracker()
    if name == "mlflow":
        return MlflowTracker(warn)
    if name == "tensorboard":
        return TensorBoardTracker()
    raise ValueError(f"unknown tracker {name!r}")


# ---- one tracker's thread ------------------------------------------------------------------------------------------


class Channel:
    """One tracker in a thread of its own: it opens the run, then makes every call in order.  Off for good after its
    first failure (said once)."""

    def __init__(self, tracker, ctx: Context, fail: Callable[[str, str], None]):
        self.tracker = tracker
        self.name = tracker.name
        self.ctx = ctx
        self._fail = fail
        self.off = False
        self.queue: queue.Queue = queue.Queue(maxsize=QUEUE_SIZE)
        self.thread = threading.Thread(target=self._run, name=f"hangwatch-{self.name}", daemon=True)
        self._status = "finished"
        self.closing = threading.Event()
        self.broken = False  # a call failed: the run is left as it is (closing it could fail or hang too)
        self.steps = 0  # steps sent
        self.call_s = 0.0  # time spent in the tracker's own log calls (the thread's, not training's)

    def start(self) -> "Channel":
        self.thread.start()
        return self

    def put(self, item) -> None:
        if self.off:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.fail(f"{QUEUE_SIZE} steps behind (a call stuck?)")

    def fail(self, why: str) -> None:
        if not self.off:
            self.off = True
            self._fail(self.name, why)

    def _run(self) -> None:
        try:
            self.tracker.open(self.ctx)
        except BaseException as exc:  # an ImportError, a failed init, a SystemExit from a library
            self.broken = True
            self.fail(_words(exc))
            return
        sent_at = 0.0
        while True:
            try:
                item = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.closing.is_set():
                    break  # the close could not be queued (a full queue): what is left is not sent
                continue
            if item is _CLOSE:
                break
            if self.off:
                continue  # turned off (a backlog): drained, never sent
            items, last = [item], False
            until = sent_at + getattr(self.tracker, "interval_s", 0.0)
            while len(items) < BACKLOG:  # what is waiting (and, for a tracker with an interval, what comes until
                wait = until - time.monotonic()  # its next write) goes in one call where the tracker can
                try:
                    more = self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is _CLOSE:
                    last = True
                    break
                items.append(more)
            started = time.perf_counter()
            try:
                if len(items) > 1 and hasattr(self.tracker, "log_many"):
                    self.tracker.log_many(items)
                else:
                    for step, metrics, t in items:
                        self.tracker.log(step, metrics, t)
            except BaseException as exc:
                self.broken = True
                self.fail(_words(exc))
                return
            self.steps += len(items)
            self.call_s += time.perf_counter() - started
            sent_at = time.monotonic()
            if last:
                break
        try:
            self.tracker.close(self._status)
        except BaseException as exc:
            self.fail(f"closing: {_words(exc)}")

    def close(self, status: str) -> None:
        self._status = status
        self.closing.set()
        try:
            self.queue.put_nowait(_CLOSE)
        except queue.Full:
            pass  # the thread sees `closing` once the queue is empty for a moment


# ---- the worker's view -----------------------------------------------------------------------------------------------


class TrackerLog:
    """The built-in worker's trackers (rank 0).  `names`: `train.report_to`; `config`: the config as written, dumped;
    `warn(message, **fields)`: how the worker says a problem (once per tracker)."""

    def __init__(
        self,
        names: list[str],
        *,
        run_dir: os.PathLike | str,
        attempt: int,
        config: dict,
        warn: Warn,
        run_name: Optional[str] = None,
        rank: int = 0,
        environ: Optional[Mapping[str, str]] = None,
        trackers: Optional[list] = None,
        hooks: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.attempt = attempt
        self.rank = rank
        self._warn = warn
        self._said: set[str] = set()
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}  # metric → the highest step it was logged at in this process
        self.closed = False
        self.hooks = None
        env = os.environ if environ is None else environ
        ctx = Context(self.run_dir, run_name or self.run_dir.name, config, env)
        made = trackers if trackers is not None else [make_tracker(n, warn) for n in names]
        self.channels = {t.name: Channel(t, ctx, self._failed) for t in made}
        if hooks:  # before any thread imports a tracker's library
            self.hooks = self._install_hooks()
        for channel in self.channels.values():
            channel.start()
        atexit.register(self.close, "failed", EXIT_CLOSE_TIMEOUT_S)  # a worker that fails before `close`: at exit

    @classmethod
    def for_worker(cls, cfg, configured, run_dir, attempt: int, warn: Warn, **kw) -> Optional["TrackerLog"]:
        """The worker's trackers, or None when `train.report_to` names none.  `configured`: the config as written (its
        params and W&B config), `cfg` the one trained with."""
        names = list(cfg.train.report_to)
        if not names:
            return None
        return cls(
            names,
            run_dir=run_dir,
            attempt=attempt,
            config=configured.model_dump(mode="json"),
            warn=warn,
            run_name=cfg.train.run_name,
            **kw,
        )

    def _install_hooks(self):
        """The scripts' tracker hooks, before any tracker library is imported (the threads import them)."""
        try:
            from hangwatch.daemon.autoinstrument.imports import PostImportHooks
            from hangwatch.daemon.trackers.hooks import TrackerHooks

            hooks = TrackerHooks(str(self.run_dir), self.rank, self.attempt, self._hook_failed)
            hooks.install(PostImportHooks(on_error=lambda name, _callback, exc: self._hook_failed(name, exc)))
            return hooks
        except Exception as exc:
            self._say(
                "hooks",
                f"report_to: the tracker hooks could not be installed ({_words(exc)}): the attempts of this run "
                "may not join one tracker run, and steps logged before a restart may be logged again",
            )
            return None

    def _hook_failed(self, name: str, exc: BaseException) -> None:
        """A hook failed (or the run it would join was refused: a deleted MLflow run): the tracker goes on as the
        library itself would — this attempt's run may be a new one, and a step logged before the restart may be
        logged again — said once."""
        tracker = _tracker_of(name) or name
        self._say(
            f"{tracker}-hook",
            f"report_to {tracker}: hangwatch's hook failed ({_words(exc)}): this attempt logs to {tracker} as the "
            "library would by itself (maybe a new run, maybe steps logged before the restart again)",
        )

    def _failed(self, name: str, why: str) -> None:
        self._say(name, f"report_to {name}: {why} — {name} is off for this attempt; training goes on")

    def _say(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._said:
                return
            self._said.add(key)
        try:
            self._warn(message, tracker=key)
        except Exception:
            pass  # the heartbeat closed under a late thread: nothing to say it with

    # ---- what the trainer calls ------------------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The numbers of optimizer step `step` (train/*, or eval/* after an eval at that step).  A metric already
        logged at this step or a later one in this process is left out."""
        if self.closed:
            return
        last = self._last
        fresh = {k: v for k, v in metrics.items() if last.get(k, -1) < step}
        if not fresh:
            return
        for k in fresh:
            last[k] = step
        item = (step, fresh, time.time())
        for channel in self.channels.values():
            channel.put(item)

    def close(self, status: str = "finished", timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End every tracker's run (`status`: finished, idle, terminated or failed), waiting at most `timeout_s` for
        what is still queued; a tracker still busy then is left behind (said once)."""
        if self.closed:
            return
        self.closed = True
        for channel in self.channels.values():
            channel.close(status)
        deadline = time.monotonic() + timeout_s
        for channel in self.channels.values():
            channel.thread.join(max(0.0, deadline - time.monotonic()))
            if channel.thread.is_alive():
                channel.fail(f"still busy {timeout_s:.0f}s after the end: left behind, its last points may be lost")

    def stats(self) -> dict:
        """Per tracker: whether it is on, the steps sent so far and the mean time per step in its thread (seconds)."""
        return {
            name: {"on": not c.off, "steps": c.steps, "mean_step_s": (c.call_s / c.steps) if c.steps else None}
            for name, c in self.channels.items()
        }


def _tracker_of(name: str) -> Optional[str]:
    """The tracker a hook's module name belongs to (`torch.utils.tensorboard` → tensorboard)."""
    for tracker in ("wandb", "mlflow", "tensorboard"):
        if name == tracker or name.startswith(tracker + ".") or tracker in name.split("."):
            return tracker
    return None


def _words(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:300] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
