"""Heartbeat client, protocol version 1 — the standard library only, so any training script can use it.

    from hangwatch.daemon.heartbeat import Heartbeat
    hb = Heartbeat.from_env()          # reads HANGWATCH_* or falls back to ./runs/standalone
    hb.start()
    with hb.phase("train"):
        for step in range(1, n + 1):
            ...                         # one optimizer step
            hb.step(step, loss=loss)
    with hb.phase("eval", budget_s=600):
        ...
    hb.stop("finished")

`Heartbeat.resume_from()` is the last good checkpoint the supervisor hands each attempt
(HANGWATCH_RESUME_FROM), None when there is none.

`NullHeartbeat` is the null object: the same interface, nothing written (a baseline for benchmarks,
in-process tools that need a heartbeat nobody reads).

One heartbeat per process: `Heartbeat.shared()` is the instance every writer in this process uses for
its rank (the integrations' callbacks, the automatic instrumentation), so phase and step are one view
written once, never two interleaved.  `WRITERS` records who beats what in this process: the automatic
instrumentation (hangwatch.daemon.autoinstrument) stays quiet about steps once a callback or the
script's own code beats them, and altogether once the script drives a heartbeat of its own.

One append-only JSONL file per rank and attempt (`attempts/NNNN/heartbeat-rank<R>.jsonl`); each
line is one `os.write` on an O_APPEND descriptor and shorter than PIPE_BUF, so lines from several
writers never interleave or tear.  Beats must come from the thread that does the work: a timer
thread that beats would hide exactly the hangs the supervisor exists to catch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from hangwatch.common.protocol import (
    DUMP_SIGNAL,
    ENV_ATTEMPT,
    ENV_HEARTBEAT_DIR,
    ENV_RESUME_FROM,  # noqa: F401
    ENV_RUN_DIR,
    EVENTS,
    VERSION,
    encode,
    rank_from_env,
)
from hangwatch.common.rundir import attempt_dir, dump_path_for, forked_dump_path, heartbeat_path, next_attempt  # noqa: F401


def install_dump_handler(dump_path: os.PathLike | str, children_of: os.PathLike | str | None = None):
    """SIGUSR1 → faulthandler dump of every thread; fatal signals dump to the same file.

    Every process this one starts afterwards through a fork (a DataLoader's workers under `fork`) or through
    multiprocessing's `spawn` and `forkserver` (the default from Python 3.14) registers the same in itself, to a
    file of its own next to the rank's (`forked_dump_path`): a fork inherits the handler, which would otherwise
    write the child's stack into the parent's file, and a spawned child inherits none.  `children_of`: the
    rank's dump file, when this process is not the rank but one of its helpers (a forkserver, whose forks are
    the rank's workers): its children's files are named after the rank's, where the supervisor looks for them.

    Returns the open file, which must stay referenced for as long as the handler is installed.
    """
    global _fork_hook_registered
    f = open(dump_path, "a", buffering=1)
    faulthandler.enable(file=f, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    _forked_dumps["base"] = Path(children_of if children_of is not None else dump_path)
    if not _fork_hook_registered and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_dump_handler_in_forked_child)
        _fork_hook_registered = True
    _carry_dump_handler_to_spawned_children()
    return f


def launcher_fields(env) -> dict:
    """What torchrun's agent told this rank (its environment): `{"torchrun": {...}}`, or {} outside torchrun.
    `restart_count` > 0 is a new rendezvous round of the same launch (torchrun restarted its ranks by itself);
    `group_rank` is this node's rank in the round."""
    if not env.get("TORCHELASTIC_RUN_ID"):
        return {}
    info: dict = {"run_id": env.get("TORCHELASTIC_RUN_ID")}
    for key, name in (
        ("TORCHELASTIC_RESTART_COUNT", "restart_count"),
        ("GROUP_RANK", "group_rank"),
        ("LOCAL_RANK", "local_rank"),
        ("WORLD_SIZE", "world_size"),
        ("LOCAL_WORLD_SIZE", "local_world_size"),
    ):
        try:
            info[name] = int(env[key])
        except (KeyError, ValueError):
            pass
    return {"torchrun": info}


_fork_hook_registered = False
# The rank's dump file a forked or spawned child derives its own from (None: no handler to carry over), and a
# forked child's open file: faulthandler writes to its descriptor, so the file object must stay referenced.
_forked_dumps: dict[str, Any] = {"base": None, "file": None}


def _dump_handler_in_forked_child() -> None:
    """os.register_at_fork(after_in_child=…): runs in every child forked from a rank (DataLoader workers, a
    multiprocessing pool, a subprocess before its exec — whose file closes on exec, O_CLOEXEC)."""
    base = _forked_dumps["base"]
    if base is None:
        return
    try:
        f = open(forked_dump_path(base, os.getpid()), "a", buffering=1)
    except OSError:
        return  # the inherited handler stays: a dump into the parent's file beats none
    faulthandler.enable(file=f, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    _forked_dumps["file"] = f


# The key of multiprocessing's preparation data that carries the dump handler to a spawned child (`prepare()` in
# the child reads the keys it knows and passes over the others).
SPAWNED_DUMP_KEY = "hangwatch_dump_handler"
# Run in a spawned child while it unpickles its preparation data, before the process object and the user's code:
# the standard library only (hangwatch itself may not be importable there: the parent's sys.path reaches the child
# only afterwards, in `prepare()`), and nothing in it may stop the child from starting.  The descriptor is never
# closed: faulthandler writes to it for the life of the process.
_SPAWNED_CHILD_CODE = """\
try:
    import faulthandler, os, signal
    fd = os.open(head + str(os.getpid()) + tail, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    faulthandler.enable(fd, all_threads=True)
    faulthandler.register(signal.SIGUSR1, fd, all_threads=True, chain=False)
except Exception:
    pass
"""


class _SpawnedChildDump:
    """What the preparation data carries: unpickled in the child, it runs `_SPAWNED_CHILD_CODE` there (a spawned
    or forkserver child runs no code of its parent's before that, and no hook of hangwatch's unless the automatic
    instrumentation's bootstrap is on its PYTHONPATH)."""

    def __init__(self, base: Path):
        marker = "\0"  # no path holds a NUL: it splits the child's file name around its pid
        self.head, self.tail = str(forked_dump_path(base, marker)).split(marker)  # type: ignore[arg-type]

    def __reduce__(self):
        return exec, (_SPAWNED_CHILD_CODE, {"head": self.head, "tail": self.tail})


def _carry_dump_handler_to_spawned_children() -> None:
    """Wrap `multiprocessing.spawn.get_preparation_data`, which both the `spawn` and the `forkserver` start methods
    call in the parent for every child they start, so that the data they send the child carries the dump
    handler (`_SpawnedChildDump`) while this process has one to carry.  Once per process."""
    try:
        from multiprocessing import spawn
    except ImportError:
        return
    original = spawn.get_preparation_data
    if getattr(original, "_carries_dump_handler", False):
        return

    def get_preparation_data(name):
        data = original(name)
        base = _forked_dumps["base"]
        if base is not None:
            data[SPAWNED_DUMP_KEY] = _SpawnedChildDump(base)
        return data

    get_preparation_data._carries_dump_handler = True  # type: ignore[attr-defined]
    get_preparation_data.__doc__ = original.__doc__
    spawn.get_preparation_data = get_preparation_data


def target_from_env(env: Mapping[str, str], run_dir: os.PathLike | str | None = None) -> tuple[str, int, int]:
    """(heartbeat directory, rank, attempt) the environment names: where the supervisor said to write; without
    it, a fresh attempt in `run_dir` (or ./runs/standalone)."""
    rank = rank_from_env(env)
    rd = env.get(ENV_RUN_DIR) or (
        str(run_dir) if run_dir is not None else os.path.join(os.getcwd(), "runs", "standalone")
    )
    attempt = int(env[ENV_ATTEMPT]) if env.get(ENV_ATTEMPT) else next_attempt(rd)
    directory = env.get(ENV_HEARTBEAT_DIR) or str(attempt_dir(rd, attempt))
    return directory, rank, attempt


class Writers:
    """Who beats this process's heartbeat besides the automatic instrumentation (one instance: `WRITERS`).

    steps_elsewhere  a HangwatchCallback exists, or someone called `Heartbeat.step` / `start`: the optimizer
                     hook writes no `step` line (one source of truth per step)
    manual           the script drives a heartbeat of its own (`start` on an instance that is not the shared
                     one): the automatic instrumentation writes nothing but its own `start`
    phase_owners     the callbacks now driving phases (between their start and end): the automatic eval
                     phase stays out of their way
    """

    __slots__ = ("steps_elsewhere", "manual", "phase_owners")

    def __init__(self):
        self.steps_elsewhere = False
        self.manual = False
        self.phase_owners: set[int] = set()

    def note_start(self, hb: "Heartbeat") -> None:
        self.steps_elsewhere = True
        if not hb.is_shared():
            self.manual = True

    def own_phases(self, owner: object) -> None:
        self.phase_owners.add(id(owner))

    def release_phases(self, owner: object) -> None:
        self.phase_owners.discard(id(owner))

    def reset(self) -> None:
        self.__init__()


WRITERS = Writers()


def claim_steps() -> None:
    """Say that something other than the automatic instrumentation beats this process's steps (a
    HangwatchCallback does, from its constructor): the optimizer hook then stays quiet."""
    WRITERS.steps_elsewhere = True


_shared_lock = threading.Lock()
_shared: dict[str, Any] = {"hb": None, "key": None, "pid": None}
_shared_fork_hook = False


def _shared_key(env: Mapping[str, str]) -> tuple:
    return (rank_from_env(env), env.get(ENV_RUN_DIR), env.get(ENV_ATTEMPT), env.get(ENV_HEARTBEAT_DIR))


def _register_fork_reset() -> None:
    global _shared_fork_hook
    if not _shared_fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_reset_in_forked_child)
        _shared_fork_hook = True


def _reset_in_forked_child() -> None:
    """A forked child (a DataLoader worker) is not its parent's rank: it inherits no shared heartbeat (whose
    lines would carry the parent's pid) and none of the parent's knowledge of who beats what."""
    global _shared_lock
    _shared_lock = threading.Lock()  # the parent's may have been held by another thread at the fork
    _shared.update(hb=None, key=None, pid=None)
    WRITERS.reset()


class Heartbeat:
    """Writes heartbeat lines for one rank of one attempt."""

    def __init__(
        self,
        path: os.PathLike | str,
        *,
        rank: int = 0,
        attempt: int = 1,
        dump_path: os.PathLike | str | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.attempt = attempt
        self.dump_path = Path(dump_path) if dump_path is not None else dump_path_for(self.path.parent, rank)
        self._clock = clock
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pid = os.getpid()
        self._dump_file = None
        self.current_step = 0
        self.current_phase = "init"
        self.current_budget_s: Optional[float] = None  # the current phase's own budget (restored after a nested phase)
        self.phase_changes = 0  # `phase` lines so far: a step interval that spans one is no step time
        self.stopped = False  # the last of `start`/`stop` written was a `stop`: the script said it is done

    @classmethod
    def from_env(cls, run_dir: os.PathLike | str | None = None, environ: Optional[dict] = None, **kw) -> "Heartbeat":
        """Where the supervisor said to write; without it, a fresh attempt in `run_dir` (or ./runs/standalone)."""
        directory, rank, attempt = target_from_env(os.environ if environ is None else environ, run_dir)
        return cls(heartbeat_path(directory, rank), rank=rank, attempt=attempt, **kw)

    @classmethod
    def shared(cls, environ: Optional[Mapping[str, str]] = None) -> "Heartbeat":
        """This process's heartbeat for the rank and attempt `environ` names (default: os.environ), created on
        first use; every later call for the same rank and attempt returns the same instance, so the callbacks
        and the automatic instrumentation write one view of phase and step.  A call for another rank or
        attempt than the shared one gets an instance of its own (it writes another file).  A forked child
        shares nothing with its parent: its first call creates its own."""
        env = os.environ if environ is None else environ
        key = _shared_key(env)
        with _shared_lock:
            hb = _shared["hb"]
            if hb is not None and not hb.closed and _shared["pid"] == os.getpid():
                if _shared["key"] == key:
                    return hb
                return cls.from_env(environ=dict(env))
            hb = cls.from_env(environ=dict(env))
            _shared.update(hb=hb, key=key, pid=os.getpid())
            _register_fork_reset()
            return hb

    def is_shared(self) -> bool:
        return _shared["hb"] is self and _shared["pid"] == os.getpid()

    @staticmethod
    def resume_from(environ: Optional[dict] = None) -> Optional[str]:
        """The checkpoint this attempt should resume from: the supervisor's last *good* checkpoint
        (announced by a `checkpoint` beat, confirmed by finite steps after it), or None — outside
        hangwatch, on a first attempt, or when no checkpoint is good yet.  HF Trainer:
        `trainer.train(resume_from_checkpoint=Heartbeat.resume_from())`; Lightning: `ckpt_path=`."""
        env = os.environ if environ is None else environ
        return env.get(ENV_RESUME_FROM) or None

    # ---- writing -------------------------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> dict:
        if event not in EVENTS:
            raise ValueError(f"unknown heartbeat event {event!r}")
        if self._fd is None:
            raise ValueError("heartbeat is closed")
        rec = {
            "v": VERSION,
            "t": round(self._clock(), 6),
            "pid": self._pid,
            "rank": self.rank,
            "attempt": self.attempt,
            "event": event,
            "step": self.current_step,
            "phase": self.current_phase,
        }
        rec.update(fields)
        data = encode(rec)
        os.write(self._fd, data)  # one write on O_APPEND: atomic for < PIPE_BUF
        return rec

    def start(
        self,
        *,
        resumed_from: Optional[str] = None,
        skipped_checkpoints: list | tuple = (),
        install_dump: bool = True,
        **extra: Any,
    ) -> dict:
        """Announce the process; registers the SIGUSR1 stack-dump handler unless told not to.

        Under automatic instrumentation this is the script's own start (a callback's, or its own code's), after
        the bootstrap's (`instrumented: "auto"`, written at interpreter start-up, before anything was chosen to
        resume from): it carries what the bootstrap's could not, and tells the automatic instrumentation that
        someone else now beats this process's steps."""
        WRITERS.note_start(self)
        return self._start(
            resumed_from=resumed_from, skipped_checkpoints=skipped_checkpoints, install_dump=install_dump, **extra
        )

    def _start(
        self,
        *,
        resumed_from: Optional[str] = None,
        skipped_checkpoints: list | tuple = (),
        install_dump: bool = True,
        **extra: Any,
    ) -> dict:
        """The `start` line itself, leaving `WRITERS` alone (the automatic instrumentation's own start)."""
        if install_dump and self._dump_file is None:
            self._dump_file = install_dump_handler(self.dump_path)
        self.stopped = False
        return self.emit(
            "start",
            dump_signal=DUMP_SIGNAL if self._dump_file is not None else None,
            dump_path=str(self.dump_path) if self._dump_file is not None else None,
            resumed_from=resumed_from,
            skipped_checkpoints=list(skipped_checkpoints),
            **launcher_fields(os.environ),
            **extra,
        )

    def enter_phase(self, name: str, budget_s: Optional[float] = None, **extra: Any) -> dict:
        self.phase_changes += 1
        self.current_phase = name
        self.current_budget_s = budget_s
        if budget_s is not None:
            extra["budget_s"] = budget_s
        return self.emit("phase", **extra)

    @contextlib.contextmanager
    def phase(self, name: str, budget_s: Optional[float] = None, **extra: Any) -> Iterator[None]:
        """Enter `name`; on leaving, announce a return to the phase that was current before."""
        previous, previous_budget = self.current_phase, self.current_budget_s
        self.enter_phase(name, budget_s, **extra)
        try:
            yield
        finally:
            if not self.closed and self.current_phase == name:
                self.enter_phase(previous, previous_budget)  # an eval's own budget survives a nested generate

    def step(self, step: int, **metrics: Any) -> dict:
        WRITERS.steps_elsewhere = True  # whoever calls this beats the steps: the automatic step beats stay quiet
        self.current_step = int(step)
        return self.emit("step", **metrics)

    def _step(self, step: int, **metrics: Any) -> dict:
        """A `step` line from the automatic instrumentation's optimizer hook (does not silence it)."""
        self.current_step = int(step)
        return self.emit("step", **metrics)

    def progress(self, **extra: Any) -> dict:
        return self.emit("progress", **extra)

    def checkpoint(self, path: os.PathLike | str, step: int, good: bool, **extra: Any) -> dict:
        """A checkpoint was committed (good=False), or an earlier one was confirmed good (good=True)."""
        return self.emit("checkpoint", path=str(path), step=int(step), good=bool(good), **extra)

    def warn(self, message: str, **extra: Any) -> dict:
        return self.emit("warn", message=message, **extra)

    def stop(self, reason: str, **extra: Any) -> dict:
        rec = self.emit("stop", reason=reason, **extra)
        self.stopped = True  # the automatic instrumentation writes nothing after the script's own `stop`
        return rec

    def release_dump_handler(self) -> None:
        """Undo `start`'s faulthandler set-up: SIGUSR1 unregistered, fatal-signal dumps back to stderr,
        the dump file closed.  Matters when the worker runs inside another program (tests)."""
        if self._dump_file is None:
            return
        faulthandler.unregister(signal.SIGUSR1)
        _forked_dumps["base"] = None  # children forked or spawned from now on get no handler either
        if sys.__stderr__ is not None:
            faulthandler.enable(file=sys.__stderr__, all_threads=True)
        self._dump_file.close()
        self._dump_file = None

    @property
    def closed(self) -> bool:
        return self._fd is None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "Heartbeat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class NullHeartbeat(Heartbeat):
    """Heartbeat's null object: the same interface and phase/step bookkeeping, nothing written, no
    dump handler installed."""

    def __init__(self, *, rank: int = 0, attempt: int = 1):
        self.path = None
        self.dump_path = None
        self.rank = rank
        self.attempt = attempt
        self._fd = None
        self._dump_file = None
        self.current_step = 0
        self.current_phase = "init"
        self.current_budget_s = None
        self.phase_changes = 0
        self.stopped = False

    @property
    def closed(self) -> bool:
        return False

    def emit(self, event: str, **fields: Any) -> dict:
        if event not in EVENTS:
            raise ValueError(f"unknown heartbeat event {event!r}")
        return {}

    # Writing nothing, it beats nothing: it leaves the automatic instrumentation's bookkeeping alone.
    def start(self, **kw: Any) -> dict:
        kw["install_dump"] = False
        return self._start(**kw)

    def step(self, step: int, **metrics: Any) -> dict:
        return self._step(step, **metrics)
