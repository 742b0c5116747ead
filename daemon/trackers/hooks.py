"""One tracker run per hangwatch run, across its attempts, and no step logged twice — in an unedited script.

A hangwatch run restarts the user's command; a resumed attempt replays the steps after its checkpoint.  Left alone,
every attempt opens a new W&B run (or, with a fixed id, an offline file that holds the replayed steps again), a new
MLflow run (or duplicates at the replayed steps of the same one), a new TensorBoard log dir (HF's default
`runs/<date>_<host>`, Lightning's `version_<N+1>`).  These hooks, wrapped around the trackers' own entry points the
moment the script imports them (post-import callbacks, autoinstrument/imports.py), make the attempts one run:

  * join: the first attempt records, per rank, which run it writes to (`<run_dir>/trackers/rank<R>.json`,
    `hangwatch.common.trackers`); a later attempt opens that run again —
        W&B          `wandb.init`: the recorded id (+ resume="allow", the recorded project and root dir)
        MLflow       `start_run` (the fluent API, HF's MLflowCallback): run_id=<recorded>; Lightning's MLFlowLogger
                     (which ignores MLFLOW_RUN_ID and creates its run with the client): its run_id argument
        TensorBoard  `SummaryWriter.__init__`: the n-th writer of the process writes to the n-th recorded log dir
    — unless the person chose the run (id=, WANDB_RUN_ID, run_id=, MLFLOW_RUN_ID): theirs is kept, and recorded;
  * no step twice: what a later attempt logs at a step the run already holds (≤ the highest step the earlier
    attempts logged) is dropped, silently — for the joined run only, and never within one attempt (W&B merges a
    step's rows itself; HF logs the train and the eval row at one global step).  Where a row's step comes from:
        W&B          `Run.log`: step=, else the row's `train/global_step` (HF), `trainer/global_step` (Lightning),
                     `global_step`; a row with none is wandb's own counter and passes
        MLflow       `MlflowClient.log_metric` / `log_batch` (everything fluent ends there): each point's step; and
                     a param the joined run already has is not logged again (HF re-logs every TrainingArguments at
                     each attempt, and a changed value raises "Changing param values is not allowed")
        TensorBoard  `FileWriter.add_event` (every add_scalar/add_text/… ends there): the event's step
  * the record follows the highest step logged (rewritten when it rises, by a thread of the hooks, at most every
    50 ms: an atomic replace costs 0.3-2 ms on ext4, a log call a few µs; the interpreter's exit writes what is
    left): a later attempt knows where to start.  MLflow's step 0 is never dropped: a point logged without a
    step lands there (a final `log_metric("test_acc", x)`).

W&B commits a row given with `step=` (and no commit=True) only when a higher step comes: until then it is not in the
run's file (a SIGKILL loses it), so the record counts it only once committed — the next attempt logs it again instead
of leaving a hole.  Before every `wandb.init`, WANDB__TRANSACTION_LOG_FLUSH_INTERVAL defaults to 2 s (wandb's 15 s
lose everything a killed process logged in its last 15 s).

Every hook keeps to the instrumentation's rule: hangwatch's bookkeeping in `try`, the user's call outside it; the
first error of a tracker's hooks goes to `on_error(tracker, exc)` once, and from then on that tracker's hooks only
call through.  An injected run that the library refuses (an MLflow run deleted or of another experiment, a W&B init
that fails) is opened again without hangwatch's arguments — a fresh run — and reported, never raised.  A forked
child (a DataLoader worker) only calls through.

Standard library only: the trackers' modules are handed to the callbacks, never imported here.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from hangwatch.common import trackers as records

OnError = Callable[[str, BaseException], None]

WANDB, MLFLOW, TENSORBOARD = "wandb", "mlflow", "tensorboard"  # the trackers' names: records' keys and on_error's
# Where a W&B row's step is when the call gives none: HF's WandbCallback, Lightning's WandbLogger, plain scripts.
STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step")
DROP = object()  # a client call not to make at all
EXPLICIT_STEP = "_step"  # step_key of rows logged with `step=` (wandb's own `_step`)
# The record is rewritten at most this often (by the writer thread): what a SIGKILL can leave unwritten is the last
# 50 ms of logged steps — W&B's own file loses the last 2 s (FLUSH_S).
WRITE_EVERY_S = 0.05
FLUSH_ENV = "WANDB__TRANSACTION_LOG_FLUSH_INTERVAL"
FLUSH_S = "2"


# ---- pure parts ------------------------------------------------------------------------------------------------


def as_step(value: Any) -> Optional[int]:
    """`value` as a step: an int (numpy's and torch's integers too), a float with no fraction; else None."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    index = getattr(type(value), "__index__", None)  # numpy.int64, a 0-d integer tensor
    if index is not None:
        try:
            return int(index(value))
        except Exception:
            return None
    return None


def row_step(data: Any, step: Any = None) -> Tuple[Optional[int], Optional[str]]:
    """(step, the key it came from) of a W&B row `Run.log(data, step=step)`; (None, None) for a row on wandb's own
    counter."""
    if step is not None:
        s = as_step(step)
        return (s, EXPLICIT_STEP) if s is not None else (None, None)
    if isinstance(data, Mapping):
        for key in STEP_KEYS:
            if key in data:
                s = as_step(data[key])
                if s is not None:
                    return s, key
    return None, None


def replayed(step: Optional[int], prev_step: Optional[int]) -> bool:
    """Whether a point at `step` is one the joined run already holds from an earlier attempt (`prev_step`: their
    highest; None: no earlier attempt logged to this run)."""
    return step is not None and prev_step is not None and step <= prev_step


def wandb_commit(
    pending: Optional[int], step: Optional[int], explicit: bool, commit: Optional[bool]
) -> Tuple[Optional[int], Optional[int]]:
    """(the highest step this row makes committed or None, the step left pending) for a W&B row at `step` after
    one pending at `pending`.  wandb keeps a row logged with `step=` open — more keys may join it — until a higher
    step, or commit=True; a row without `step=` is committed at once unless commit=False (and commits the open one)."""
    if explicit:
        if step is None:
            return None, pending
        if pending is not None and step < pending:
            return None, pending  # wandb drops a row below its current step (with a warning)
        committed = pending if pending is not None and step > pending else None
        if commit:
            return _max(committed, step), None
        return committed, step
    if commit is False:
        return None, _max(pending, step)
    return _max(pending, step), None


def _max(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None:
        return b
    if b is None:
        return a
    return a if a >= b else b


def _text(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and value else None


def _arguments(signature: Optional[inspect.Signature], args: tuple, kwargs: dict) -> Optional[dict]:
    """The call's arguments by name (to be passed back as keywords), or None when that cannot be done safely."""
    if signature is None:
        return None
    try:
        bound = signature.bind_partial(*args, **kwargs)
    except TypeError:
        return None  # the original raises its own TypeError
    out: Dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        elif kind is inspect.Parameter.POSITIONAL_ONLY:
            return None
        else:
            out[name] = value
    return out


def _signature(func: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(func)
    except (TypeError, ValueError):
        return None


def _setting(settings: Any, name: str) -> Any:
    """A field of a wandb `settings=` argument (a Settings object or a dict)."""
    if settings is None:
        return None
    if isinstance(settings, Mapping):
        return settings.get(name)
    return getattr(settings, name, None)


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    if len(args) > position:
        return args[position]
    return kwargs.get(name, default)


def _earlier(data: Mapping, attempt: int) -> Dict[str, dict]:
    """The records of `data` that an earlier attempt wrote, each with the field that names its run."""
    out = {}
    for name, key in ((WANDB, "id"), (MLFLOW, "run_id"), (TENSORBOARD, "log_dirs")):
        rec = data.get(name)
        if not isinstance(rec, dict):
            continue
        made_by = rec.get("attempt")
        if not isinstance(made_by, int) or isinstance(made_by, bool) or made_by >= attempt:
            continue
        run = rec.get(key)
        if name == TENSORBOARD:
            if not isinstance(run, list) or not all(isinstance(d, str) and d for d in run):
                continue
        elif not _text(run):
            continue
        out[name] = rec
    return out


# ---- the hooks ----------------------------------------------------------------------------------------------------


class _WandbRun:
    """The W&B run this process records (its first `wandb.init`)."""

    __slots__ = ("ref", "id", "prev", "last", "pending")

    def __init__(self, run, run_id: str, prev: Optional[int], last: Optional[int]):
        self.ref = weakref.ref(run)
        self.id = run_id
        self.prev = prev  # the earlier attempts' highest step, when this is their run
        self.last = last  # the highest committed step of the run (the earlier attempts' included)
        self.pending = None  # a row logged with step= that wandb has not committed yet


class _MlflowRun:
    __slots__ = ("id", "prev", "last", "params")

    def __init__(self, run_id: str, prev: Optional[int]):
        self.id = run_id
        self.prev = prev
        self.last = prev
        self.params: Optional[frozenset] = None  # the joined run's param keys, fetched at its first params


class TrackerHooks:
    """The hooks of one rank process (see the module docstring).  `on_error(tracker, exc)`: at most once per
    tracker; the tracker's hooks only call through after it."""

    def __init__(self, run_dir: str, rank: int, attempt: int, on_error: OnError):
        self.run_dir = str(run_dir)
        self.rank = int(rank)
        self.attempt = int(attempt)
        self._on_error = on_error
        self._failed: set = set()
        self._pid = os.getpid()
        self._lock = threading.Lock()  # the records in memory
        self._write_lock = threading.Lock()  # one write of the file at a time
        self._wake = threading.Event()
        self._writer: Optional[threading.Thread] = None
        self._version = self._written = 0  # changes of the records in memory / the change last written
        self._dirty: set = set()  # the trackers changed since the last write
        found = records.read_rank(self.run_dir, self.rank)
        self._file = {k: v for k, v in found.items() if k not in records.NAMES or isinstance(v, dict)}
        self.earlier = _earlier(found, self.attempt)  # tracker → the record this attempt joins
        self.current: Dict[str, dict] = {}  # tracker → this attempt's record
        self._wandb: Optional[_WandbRun] = None
        self._mlflow: Optional[_MlflowRun] = None
        self._mlflow_own: set = set()  # run ids the person gave (run_id=, MLFLOW_RUN_ID)
        self._tb_made = 0  # SummaryWriters created so far in this process
        self._tb_dirs: List[str] = []  # their log dirs, absolute, in creation order
        self._tb_prev: Dict[str, int] = {}  # joined log dir → the earlier attempts' highest step
        self._tb_last: Dict[str, int] = {}  # log dir → highest step logged (the earlier attempts' included)
        self._tb_of: Dict[str, Optional[str]] = {}  # a FileWriter's log dir as given → the recorded dir it writes
        rec = self.earlier.get(TENSORBOARD)
        if rec is not None:
            for d in rec["log_dirs"]:
                step = records.last_step(rec, d)
                if step is not None:
                    self._tb_prev[d] = step
                    self._tb_last[d] = step

    # ---- wiring ----------------------------------------------------------------------------------------------------

    def install(self, hooks) -> None:
        """Register the callbacks with `hooks` (a PostImportHooks): each runs when its module is imported (at once
        when it already is)."""
        for name, callback in (
            ("wandb.sdk.wandb_run", self.patch_wandb_run),
            ("wandb", self.patch_wandb),
            ("mlflow.tracking.client", self.patch_mlflow_client),
            ("mlflow.tracking.fluent", self.patch_mlflow_fluent),
            ("mlflow", self.patch_mlflow_fluent),  # `mlflow.start_run`, bound from the fluent module
            ("torch.utils.tensorboard.writer", self.patch_tensorboard_writer),
            ("lightning.pytorch.loggers.mlflow", self.patch_lightning_mlflow),
            ("pytorch_lightning.loggers.mlflow", self.patch_lightning_mlflow),
        ):
            hooks.register(name, callback)

    def _on(self, tracker: str) -> bool:
        return tracker not in self._failed and os.getpid() == self._pid

    def _fail(self, tracker: str, exc: BaseException) -> None:
        if tracker in self._failed:
            return
        self._failed.add(tracker)
        try:
            self._on_error(tracker, exc)
        except Exception:
            pass

    def _save(self, tracker: str) -> None:
        """This attempt's record of `tracker` changed (under self._lock): the writer thread rewrites the file.  Not
        on the logging thread: an atomic replace of a file costs 0.3-2 ms on ext4 (the rename flushes the new
        file's data), a training step's log call should not; the window a SIGKILL can catch is WRITE_EVERY_S —
        where W&B's own is 2 s."""
        self._version += 1
        self._dirty.add(tracker)
        if self._writer is None:
            atexit.register(self.flush)  # what the thread has not written yet, as the interpreter exits
            self._writer = threading.Thread(target=self._write_loop, name="hangwatch-trackers", daemon=True)
            try:
                self._writer.start()
            except RuntimeError:
                pass  # no new thread at interpreter shutdown: the exit's flush writes it
        self._wake.set()

    def flush(self) -> None:
        """Write this rank's record now, when it changed since the last write: this attempt's runs, and an earlier
        attempt's for a tracker this one has not opened yet (a later attempt still joins it)."""
        if os.getpid() != self._pid:
            return
        with self._write_lock:
            with self._lock:
                version, dirty = self._version, self._dirty
                if version <= self._written:
                    return
                self._dirty = set()
                data = dict(self._file)
                data.update((name, dict(rec)) for name, rec in self.current.items())
            try:
                records.write_rank(self.run_dir, self.rank, data)
            except Exception as exc:
                for tracker in sorted(dirty):
                    self._fail(tracker, exc)
            self._written = version

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            try:
                self.flush()
            except Exception:
                pass
            time.sleep(WRITE_EVERY_S)  # a burst of logged steps is one write, not one per step

    # ---- W&B -------------------------------------------------------------------------------------------------------

    def patch_wandb(self, module) -> None:
        """`wandb.init` (HF's WandbCallback and Lightning's WandbLogger call it through the module at call time)."""
        original = module.init
        if getattr(original, "__hangwatch_original__", None) is not None:
            return
        signature = _signature(original)
        hooks = self

        @functools.wraps(original)
        def init(*args, **kwargs):
            if not hooks._on(WANDB):
                return original(*args, **kwargs)
            plan = None
            try:
                os.environ.setdefault(FLUSH_ENV, FLUSH_S)  # a killed process loses ≤ 2 s, not wandb's 15
                plan = hooks._wandb_plan(signature, args, kwargs)
            except Exception as exc:
                hooks._fail(WANDB, exc)
            run = refused = None
            if plan is not None and plan[0] is not None:
                try:
                    run = original(**plan[0])
                except Exception as exc:  # the run named by the record cannot be opened: a fresh one
                    refused = exc
                if refused is not None:
                    hooks._fail(WANDB, refused)
                    return original(*args, **kwargs)
            else:
                run = original(*args, **kwargs)
            if plan is not None:
                try:
                    hooks._wandb_started(run, plan[1])
                except Exception as exc:
                    hooks._fail(WANDB, exc)
            return run

        init.__hangwatch_original__ = original
        module.init = init

    def _wandb_plan(self, signature, args: tuple, kwargs: dict) -> Tuple[Optional[dict], bool]:
        """(the keywords to call init with instead — None: the call as it is —, whether the person chose the id)."""
        env = os.environ
        given = _arguments(signature, args, kwargs)
        if given is None:
            return None, bool(kwargs.get("id") or env.get("WANDB_RUN_ID"))
        settings = given.get("settings")
        own = bool(given.get("id") or env.get("WANDB_RUN_ID") or _setting(settings, "run_id"))
        rec = self.earlier.get(WANDB)
        if (
            own
            or rec is None
            or self._wandb is not None  # the process's first run is the recorded one; a second is not joined
            or given.get("resume_from")
            or given.get("fork_from")
            or env.get("WANDB_RESUME_FROM")
            or env.get("WANDB_FORK_FROM")
            or _setting(settings, "resume_from")
            or _setting(settings, "fork_from")
        ):
            return None, own
        call = dict(given)
        call["id"] = rec["id"]
        if given.get("resume") is None and not env.get("WANDB_RESUME") and _setting(settings, "resume") is None:
            call["resume"] = "allow"
        if not given.get("project") and not env.get("WANDB_PROJECT") and _text(rec.get("project")):
            call["project"] = rec["project"]
        if not given.get("dir") and not env.get("WANDB_DIR") and _text(rec.get("root_dir")):
            call["dir"] = rec["root_dir"]  # offline: every attempt's directory next to the first's
        return call, False

    def _wandb_started(self, run, own: bool) -> None:
        if run is None:
            return
        run_id = _text(getattr(run, "id", None))
        if run_id is None:
            return
        with self._lock:
            tracked = self._wandb
            if tracked is not None:
                if tracked.id == run_id:
                    tracked.ref = weakref.ref(run)  # the same run opened again in this process: go on counting
                return
            rec = self.earlier.get(WANDB)
            joined = rec is not None and rec.get("id") == run_id
            prev = records.last_step(rec) if joined else None
            self._wandb = _WandbRun(run, run_id, prev, prev)
            settings = getattr(run, "settings", None)
            if getattr(run, "disabled", False):
                mode = "disabled"
            elif getattr(run, "offline", False):
                mode = "offline"
            else:
                mode = "online"
            self.current[WANDB] = {
                "id": run_id,
                "project": _text(getattr(run, "project", None)),
                "entity": _text(getattr(run, "entity", None)),
                "root_dir": _text(getattr(settings, "root_dir", None)),
                "mode": mode,
                "step_key": rec.get("step_key") if joined else None,
                "last_step": prev,
                "prev_step": prev,
                "attempt": self.attempt,
                "own_id": bool(own),
            }
            self._save(WANDB)

    def patch_wandb_run(self, module) -> None:
        """`wandb.sdk.wandb_run.Run.log` (wandb.log is the run's bound `log`; Lightning calls experiment.log)."""
        cls = module.Run
        original = cls.__dict__["log"]
        if getattr(original, "__hangwatch_original__", None) is not None:
            return
        hooks = self

        @functools.wraps(original)
        def log(run, *args, **kwargs):
            tracked = hooks._wandb
            if tracked is None or tracked.ref() is not run or not hooks._on(WANDB):
                return original(run, *args, **kwargs)
            row = None
            try:
                row = hooks._wandb_row(tracked, args, kwargs)
            except Exception as exc:
                hooks._fail(WANDB, exc)
            if row is False:
                return None  # a step the run holds from an earlier attempt
            result = original(run, *args, **kwargs)
            if row is not None:
                try:
                    hooks._wandb_logged(tracked, *row)
                except Exception as exc:
                    hooks._fail(WANDB, exc)
            return result

        log.__hangwatch_original__ = original
        cls.log = log

    def _wandb_row(self, tracked: _WandbRun, args: tuple, kwargs: dict):
        """False: drop the row; else (step, key, explicit, commit) to count once it is logged."""
        explicit = _arg(args, kwargs, 1, "step")
        step, key = row_step(_arg(args, kwargs, 0, "data"), explicit)
        if replayed(step, tracked.prev):
            return False
        return step, key, explicit is not None, _arg(args, kwargs, 2, "commit")

    def _wandb_logged(self, tracked: _WandbRun, step, key, explicit: bool, commit) -> None:
        committed, tracked.pending = wandb_commit(tracked.pending, step, explicit, commit)
        if committed is None or (tracked.last is not None and committed <= tracked.last):
            return
        with self._lock:
            tracked.last = committed
            rec = self.current.get(WANDB)
            if rec is None:
                return
            rec["last_step"] = committed
            if key is not None:
                rec["step_key"] = key
            self._save(WANDB)

    # ---- MLflow ----------------------------------------------------------------------------------------------------

    def patch_mlflow_fluent(self, module) -> None:
        """`mlflow.tracking.fluent.start_run` — also what `mlflow.log_metric` & co. call without an active run —
        and `mlflow.start_run`: mlflow/__init__ binds it from the fluent module (`from mlflow.tracking.fluent import
        start_run`, not lazily), after the fluent module ran: this callback runs for both modules, whichever comes."""
        fluent = sys.modules.get("mlflow.tracking.fluent")
        if fluent is None or not callable(getattr(fluent, "start_run", None)):
            return
        original = fluent.start_run
        wrapper = original
        if getattr(original, "__hangwatch_original__", None) is None:
            wrapper = self._wrap_start_run(fluent, original)
            fluent.start_run = wrapper
        else:
            original = original.__hangwatch_original__
        package = sys.modules.get("mlflow")
        if package is not None and getattr(package, "start_run", None) is original:
            package.start_run = wrapper

    def _wrap_start_run(self, fluent, original):
        signature = _signature(original)
        hooks = self

        @functools.wraps(original)
        def start_run(*args, **kwargs):
            if not hooks._on(MLFLOW):
                return original(*args, **kwargs)
            plan = None
            try:
                plan = hooks._mlflow_plan(fluent, signature, args, kwargs)
            except Exception as exc:
                hooks._fail(MLFLOW, exc)
            refused = None
            if plan is not None and plan[0] is not None:
                try:
                    active = original(**plan[0])
                except Exception as exc:  # deleted, or another experiment than the active one: a fresh run
                    refused = exc
                if refused is not None:
                    hooks._fail(MLFLOW, refused)
                    return original(*args, **kwargs)
            else:
                active = original(*args, **kwargs)
            if plan is not None and plan[2]:
                try:
                    hooks._mlflow_started(active, plan[1])
                except Exception as exc:
                    hooks._fail(MLFLOW, exc)
            return active

        start_run.__hangwatch_original__ = original
        return start_run

    def _mlflow_plan(self, fluent, signature, args: tuple, kwargs: dict) -> Tuple[Optional[dict], bool, bool]:
        """(the keywords to call start_run with instead or None, whether the person chose the run, whether the run
        it opens is one to record: a top-level one)."""
        given = _arguments(signature, args, kwargs)
        if given is None:
            return None, bool(kwargs.get("run_id") or os.environ.get("MLFLOW_RUN_ID")), False
        own_id = given.get("run_id") or os.environ.get("MLFLOW_RUN_ID")  # start_run deletes MLFLOW_RUN_ID
        own = bool(own_id)
        if own:
            self._mlflow_own.add(own_id)  # start_run may log its tags with the client before it returns
        nested = bool(given.get("nested") or given.get("parent_run_id"))
        active = fluent.active_run() is not None
        top = not nested and not active
        rec = self.earlier.get(MLFLOW)
        if own or not top or rec is None or self._mlflow is not None:
            return None, own, top
        return dict(given, run_id=rec["run_id"]), False, top

    def _mlflow_started(self, active, own: bool) -> None:
        info = getattr(active, "info", None)
        run_id = _text(getattr(info, "run_id", None))
        if run_id is None:
            return
        package = sys.modules.get("mlflow")
        uri = getattr(package, "get_tracking_uri", None)
        self._mlflow_record(run_id, uri() if callable(uri) else None, getattr(info, "experiment_id", None), own)

    def _mlflow_record(self, run_id: str, uri: Optional[str], experiment_id: Any, own: bool) -> None:
        with self._lock:
            if self._mlflow is not None:
                return
            rec = self.earlier.get(MLFLOW)
            joined = rec is not None and rec.get("run_id") == run_id
            prev = records.last_step(rec) if joined else None
            self._mlflow = _MlflowRun(run_id, prev)
            self.current[MLFLOW] = {
                "run_id": run_id,
                "tracking_uri": _text(uri),
                "experiment_id": None if experiment_id is None else str(experiment_id),
                "last_step": prev,
                "prev_step": prev,
                "attempt": self.attempt,
                "own_id": bool(own),
            }
            self._save(MLFLOW)

    def patch_mlflow_client(self, module) -> None:
        """`MlflowClient.log_metric` / `log_batch` / `log_param`: fluent's log_metric(s)/log_param(s), HF's
        callback and Lightning's logger all end there."""
        cls = module.MlflowClient
        for name, decide in (
            ("log_metric", self._mlflow_metric),
            ("log_batch", self._mlflow_batch),
            ("log_param", self._mlflow_param),
        ):
            original = cls.__dict__.get(name)
            if original is not None and getattr(original, "__hangwatch_original__", None) is None:
                setattr(cls, name, self._wrap_client_method(original, decide))

    def _wrap_client_method(self, original, decide):
        """`decide(client, signature, args, kwargs)`: None — call as it is —, (DROP, result) — do not call, return
        result —, or (keywords or None for the call as it is, the step to count once it returned or None)."""
        signature = _signature(original)
        hooks = self

        @functools.wraps(original)
        def method(client, *args, **kwargs):
            if not hooks._on(MLFLOW):
                return original(client, *args, **kwargs)
            decision = None
            try:
                decision = decide(client, signature, args, kwargs)
            except Exception as exc:
                hooks._fail(MLFLOW, exc)
            if decision is None:
                return original(client, *args, **kwargs)
            call, counted = decision
            if call is DROP:
                return counted  # nothing left to log: what the method returns then
            result = original(client, **call) if call is not None else original(client, *args, **kwargs)
            if counted is not None:
                try:
                    hooks._mlflow_logged(counted)
                except Exception as exc:
                    hooks._fail(MLFLOW, exc)
            return result

        method.__hangwatch_original__ = original
        return method

    def _mlflow_run(self, client, run_id: Any) -> Optional[_MlflowRun]:
        """The recorded run when `run_id` is it; the first run a client logs to is recorded when no start_run
        was seen (Lightning creates its run with the client)."""
        tracked = self._mlflow
        if tracked is None and _text(run_id):
            try:
                uri = client._tracking_client.tracking_uri
            except Exception:
                uri = None
            if not _text(uri):
                get = getattr(sys.modules.get("mlflow"), "get_tracking_uri", None)
                uri = get() if callable(get) else None
            try:
                experiment_id = client.get_run(run_id).info.experiment_id
            except Exception:
                experiment_id = None
            self._mlflow_record(run_id, uri, experiment_id, run_id in self._mlflow_own)
            tracked = self._mlflow
        return tracked if tracked is not None and tracked.id == run_id else None

    def _mlflow_metric(self, client, signature, args: tuple, kwargs: dict):
        """log_metric(run_id, key, value, timestamp=None, step=None, synchronous=None, …)."""
        tracked = self._mlflow_run(client, _arg(args, kwargs, 0, "run_id"))
        if tracked is None:
            return None
        step = as_step(_arg(args, kwargs, 4, "step"))
        if _dropped(step, tracked.prev):
            return DROP, _no_operations(_arg(args, kwargs, 5, "synchronous"))
        if step is None or (tracked.last is not None and step <= tracked.last):
            return None
        return None, step

    def _mlflow_batch(self, client, signature, args: tuple, kwargs: dict):
        """log_batch(run_id, metrics=(), params=(), tags=(), synchronous=None): the points at replayed steps and
        the params the joined run already has are left out."""
        tracked = self._mlflow_run(client, _arg(args, kwargs, 0, "run_id"))
        if tracked is None:
            return None
        given_metrics = _arg(args, kwargs, 1, "metrics") or ()
        given_params = _arg(args, kwargs, 2, "params") or ()
        metrics, params = list(given_metrics), list(given_params)
        rebuild = not isinstance(given_metrics, (list, tuple)) or not isinstance(given_params, (list, tuple))
        steps = [as_step(getattr(m, "step", None)) for m in metrics]
        kept = [m for m, s in zip(metrics, steps) if not _dropped(s, tracked.prev)]
        kept_params = list(params)
        if params and tracked.prev is not None:
            held = self._mlflow_params(client, tracked)
            kept_params = [p for p in params if getattr(p, "key", None) not in held]
        top = max((s for m, s in zip(metrics, steps) if s is not None and not _dropped(s, tracked.prev)), default=None)
        counted = top if top is not None and (tracked.last is None or top > tracked.last) else None
        if len(kept) == len(metrics) and len(kept_params) == len(params) and not rebuild:
            return None if counted is None else (None, counted)  # an iterator is read once: passed on as a list
        synchronous = _arg(args, kwargs, 4, "synchronous")
        if not kept and not kept_params and not _arg(args, kwargs, 3, "tags"):
            return DROP, _no_operations(synchronous)
        given = _arguments(signature, (client, *args), kwargs)
        if given is None:
            return None
        given.pop("self", None)
        given["metrics"], given["params"] = kept, kept_params
        return given, counted

    def _mlflow_param(self, client, signature, args: tuple, kwargs: dict):
        """log_param(run_id, key, value, synchronous=None): a key the joined run has is not logged again."""
        tracked = self._mlflow_run(client, _arg(args, kwargs, 0, "run_id"))
        if tracked is None or tracked.prev is None:
            return None
        if _arg(args, kwargs, 1, "key") in self._mlflow_params(client, tracked):
            return DROP, _arg(args, kwargs, 2, "value")  # log_param returns the value
        return None

    def _mlflow_params(self, client, tracked: _MlflowRun) -> frozenset:
        if tracked.params is None:
            tracked.params = frozenset(client.get_run(tracked.id).data.params)
        return tracked.params

    def _mlflow_logged(self, step: int) -> None:
        tracked = self._mlflow
        if tracked is None or (tracked.last is not None and step <= tracked.last):
            return
        with self._lock:
            tracked.last = step
            rec = self.current.get(MLFLOW)
            if rec is not None:
                rec["last_step"] = step
                self._save(MLFLOW)

    def patch_lightning_mlflow(self, module) -> None:
        """Lightning's `MLFlowLogger.__init__`: it ignores MLFLOW_RUN_ID and creates its run with the client
        unless given run_id= — which a later attempt gets (the recorded run, when the person gave none)."""
        cls = module.MLFlowLogger
        original = cls.__dict__["__init__"]
        if getattr(original, "__hangwatch_original__", None) is not None:
            return
        signature = _signature(original)
        hooks = self

        @functools.wraps(original)
        def __init__(logger, *args, **kwargs):
            if not hooks._on(MLFLOW):
                return original(logger, *args, **kwargs)
            injected = None
            try:
                given = _arguments(signature, (logger, *args), kwargs)
                run_id = given.get("run_id") if given is not None else kwargs.get("run_id")
                rec = hooks.earlier.get(MLFLOW)
                if run_id:
                    hooks._mlflow_own.add(run_id)
                elif (
                    given is not None
                    and rec is not None
                    and hooks._mlflow is None
                    and not os.environ.get("MLFLOW_RUN_ID")
                ):
                    injected = rec["run_id"]
                    given.pop("logger", None)
                    given.pop("self", None)
                    args, kwargs = (), dict(given, run_id=injected)
            except Exception as exc:
                hooks._fail(MLFLOW, exc)
            result = original(logger, *args, **kwargs)
            if injected is not None:
                hooks._check_lightning_run(logger, injected)
            return result

        __init__.__hangwatch_original__ = original
        cls.__init__ = __init__

    def _check_lightning_run(self, logger, run_id: str) -> None:
        """The logger opens the injected run only at its first use, where a deleted or vanished run would raise in
        the script: look now, and let it create a fresh run instead (reported)."""
        try:
            run = logger._mlflow_client.get_run(run_id)
            if getattr(run.info, "lifecycle_stage", None) == "deleted":
                raise RuntimeError("MLflow run %s is deleted" % run_id)
        except Exception as exc:
            try:
                if getattr(logger, "_run_id", None) == run_id:
                    logger._run_id = None
            except Exception:
                pass
            self._fail(MLFLOW, exc)

    # ---- TensorBoard -----------------------------------------------------------------------------------------------

    def patch_tensorboard_writer(self, module) -> None:
        """torch.utils.tensorboard.writer: `SummaryWriter.__init__` (the log dir) and `FileWriter.add_event`."""
        writer_cls, file_cls = module.SummaryWriter, module.FileWriter
        original_init = writer_cls.__dict__["__init__"]
        original_add = file_cls.__dict__["add_event"]
        if getattr(original_init, "__hangwatch_original__", None) is not None:
            return
        signature = _signature(original_init)
        hooks = self

        @functools.wraps(original_init)
        def __init__(writer, *args, **kwargs):
            if not hooks._on(TENSORBOARD):
                return original_init(writer, *args, **kwargs)
            try:
                args, kwargs = hooks._tb_redirect(signature, writer, args, kwargs)
            except Exception as exc:
                hooks._fail(TENSORBOARD, exc)
            result = original_init(writer, *args, **kwargs)
            try:
                hooks._tb_created(writer)
            except Exception as exc:
                hooks._fail(TENSORBOARD, exc)
            return result

        @functools.wraps(original_add)
        def add_event(file_writer, event, *args, **kwargs):
            if not hooks._on(TENSORBOARD) or not (hooks._tb_prev or hooks._tb_dirs):
                return original_add(file_writer, event, *args, **kwargs)
            step = None
            try:
                step, drop = hooks._tb_event(file_writer, event, _arg(args, kwargs, 0, "step"))
                if drop:
                    return None  # a step the log dir holds from an earlier attempt
            except Exception as exc:
                hooks._fail(TENSORBOARD, exc)
            result = original_add(file_writer, event, *args, **kwargs)
            if step is not None:
                try:
                    hooks._tb_logged(*step)
                except Exception as exc:
                    hooks._fail(TENSORBOARD, exc)
            return result

        __init__.__hangwatch_original__ = original_init
        add_event.__hangwatch_original__ = original_add
        writer_cls.__init__ = __init__
        file_cls.add_event = add_event

    def _tb_redirect(self, signature, writer, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        """The n-th writer of this process writes to the n-th log dir the earlier attempt recorded (HF's default dir
        and Lightning's version_<N> are new at each attempt; a fixed path is the recorded one anyway)."""
        index = self._tb_made
        self._tb_made += 1
        rec = self.earlier.get(TENSORBOARD)
        if rec is None or index >= len(rec["log_dirs"]):
            return args, kwargs
        given = _arguments(signature, (writer, *args), kwargs)
        if given is None:
            return args, kwargs
        given.pop("self", None)
        return (), dict(given, log_dir=rec["log_dirs"][index])

    def _tb_created(self, writer) -> None:
        log_dir = os.path.abspath(os.fspath(writer.log_dir))
        with self._lock:
            self._tb_dirs.append(log_dir)
            self._tb_of.clear()
            self._save_tb()

    def _tb_dir(self, file_writer) -> Optional[str]:
        """The recorded log dir a FileWriter writes to (add_scalars' writers write in a subdirectory of it)."""
        raw = file_writer.get_logdir()
        found = self._tb_of.get(raw, False)
        if found is not False:
            return found
        path = os.path.abspath(os.fspath(raw))
        known = set(self._tb_dirs) | set(self._tb_prev)  # the earlier dirs: purge_step's events come before
        found = path if path in known else (os.path.dirname(path) if os.path.dirname(path) in known else None)
        self._tb_of[raw] = found
        return found

    def _tb_event(self, file_writer, event, step_arg) -> Tuple[Optional[tuple], bool]:
        step = as_step(step_arg)
        if step is None:
            # SummaryWriter(purge_step=N) writes its SessionLog.START without a step argument, at event.step: one
            # at a step the dir holds would hide the earlier attempt's points there from TensorBoard's readers
            if _session_start(event):
                log_dir = self._tb_dir(file_writer)
                return None, log_dir is not None and replayed(as_step(event.step), self._tb_prev.get(log_dir))
            return None, False
        log_dir = self._tb_dir(file_writer)
        if log_dir is None:
            return None, False
        if replayed(step, self._tb_prev.get(log_dir)):
            return None, True
        last = self._tb_last.get(log_dir)
        return ((log_dir, step) if last is None or step > last else None), False

    def _tb_logged(self, log_dir: str, step: int) -> None:
        with self._lock:
            last = self._tb_last.get(log_dir)
            if last is not None and step <= last:
                return
            self._tb_last[log_dir] = step
            self._save_tb()

    def _save_tb(self) -> None:
        rec = self.earlier.get(TENSORBOARD) or {}
        earlier_dirs = list(rec.get("log_dirs") or ())
        last = dict(rec.get("last_step") or {}) if isinstance(rec.get("last_step"), dict) else {}
        last.update(self._tb_last)
        self.current[TENSORBOARD] = {
            "log_dirs": self._tb_dirs + earlier_dirs[len(self._tb_dirs) :],
            "last_step": last,
            "prev_step": {d: s for d, s in self._tb_prev.items() if d in self._tb_dirs},
            "attempt": self.attempt,
        }
        self._save(TENSORBOARD)


def _dropped(step: Optional[int], prev_step: Optional[int]) -> bool:
    """MLflow: a point at a replayed step — but not at step 0, where MLflow puts a point logged without a step
    (`log_metric("test_acc", x)` after a resumed training must not be lost)."""
    return step is not None and step > 0 and replayed(step, prev_step)


def _no_operations(synchronous: Any):
    """What MLflow returns for a call with nothing to log: None, or an empty RunOperations when asked async."""
    if synchronous is not False:
        return None
    module = sys.modules.get("mlflow.utils.async_logging.run_operations")
    cls = getattr(module, "RunOperations", None)
    return cls([]) if cls is not None else None


def _session_start(event) -> bool:
    try:
        return event.HasField("session_log") and event.session_log.status == 1  # SessionLog.START
    except Exception:
        return False


__all__ = ["TrackerHooks", "as_step", "row_step", "replayed", "wandb_commit", "STEP_KEYS"]
