"""The worker's standby half of `restart.prewarm`: load everything before knowing where to resume.

At a stall the supervisor spawns the next attempt's worker at once, as a standby
(`python -m hangwatch.daemon --config … --run-dir … --standby`, supervisor/processes/standby.py), with that
attempt's environment but no checkpoint to resume from.  While the stuck attempt is dumped and
killed, the standby (`hold`):
  * makes the process-wide settings a cold worker makes before loading (`prepare_torch`: offline and
    quiet libraries, deterministic algorithms, the tiny model's thread count) and imports torch,
    transformers, peft and the trainer;
  * builds the base model, its tokenizer and the LoRA wrapping on the CPU (`model.load_model` with the
    device forced to cpu: the very objects a cold worker builds before its `.to(device)`);
  * reads and validates the training and eval files (`read_files`; the inbox of continuous mode is
    opened only after release, as it keeps a ledger in the run dir).
Before its release it writes nothing in the run dir but its log and, once the preload is over, a small
`standby.json` ({pid, attempt, preload_s, error}: what `hangwatch status` shows of it); it opens no
heartbeat file, installs no signal handler, touches no checkpoint and takes no device (no CUDA call at
all: the model is built on the CPU, safetensors memory-mapped): a standby that is discarded leaves no
trace, the supervisor removes both files.  Nothing it does before release survives in the random state: the
model is initialised under `fork_rng` with the run's seed, as cold, and the trainer seeds or restores every
generator once the resume point is known (`Trainer.seed_fresh` / `restore`), so the training result is the
cold one's.

The loading runs in a thread while the main thread blocks on stdin for the release: one JSON line
`{"attempt": N, "resume_from": "…"}` (`read_release`), sent once the supervisor has decided to start
attempt N — after the old tree is gone and its GPU memory released.  It sets HANGWATCH_RESUME_FROM from
it and carries on as a cold worker would: it chooses its checkpoint, beats `start` at once (ready or
not: a cold worker, too, beats before its imports), enters `load`, waits there for the preload if it is
still running, and takes the device with `on_device`; its `load` phase then says what the standby
saved (`load_fields`).  End of file instead of a release means it was discarded (the restart is not
happening, or the supervisor died): it exits at once.

A preload that fails (a model that cannot load) is only printed: the released worker then loads cold
and fails there, with the last words and exit code a cold worker would have.

Standard library at import time (the supervisor's tests read `read_release` without torch).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import IO, Any, MutableMapping, Optional

from hangwatch.common.protocol import ENV_ATTEMPT, ENV_RESUME_FROM

STANDBY_FLAG = "--standby"  # the worker's command-line switch (supervisor/processes/standby.py passes it)
TRAINER_MODULES = (
    "hangwatch.daemon.distributed",
    "hangwatch.daemon.evaluate",
    "hangwatch.daemon.faults",
    "hangwatch.daemon.trainer.loop",
)


class ReleaseError(ValueError):
    """The release line is not what the supervisor sends: a standby must not guess where to resume."""


@dataclass(frozen=True)
class Release:
    attempt: int
    resume_from: str  # "" for none, as in HANGWATCH_RESUME_FROM


def read_release(stream: IO[bytes], attempt: int) -> Optional[Release]:
    """Block until the supervisor's release line; None at end of file (discarded).  Raises ReleaseError
    for a line that is not a release of attempt `attempt`."""
    line = stream.readline()
    if not line:
        return None
    try:
        msg = json.loads(line)
    except ValueError as exc:
        raise ReleaseError(f"release line is not JSON: {exc}: {line[:200]!r}") from None
    if (
        not isinstance(msg, dict)
        or not isinstance(msg.get("attempt"), int)
        or not isinstance(msg.get("resume_from"), str)
    ):
        raise ReleaseError(f"release line lacks attempt (int) and resume_from (str): {line[:200]!r}")
    if msg["attempt"] != attempt:
        raise ReleaseError(f"released as attempt {msg['attempt']}, but this standby was spawned for attempt {attempt}")
    return Release(msg["attempt"], msg["resume_from"])


# ---- the steps a cold worker and a standby share --------------------------------------------


def quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: local files or the hub cache only
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def prepare_torch(cfg) -> None:
    """The process-wide settings every worker makes before it builds its model (idempotent)."""
    quiet_libraries()
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.model.name_or_path is None and cfg.model.device != "cuda" and not torch.cuda.is_available():
        # The tiny model's ops are too small to gain from threads, and a fixed thread count keeps
        # CPU reductions bit-identical between attempts even if the machine's core count changes.
        torch.set_num_threads(1)


@dataclass
class FileData:
    """What the data files hold, read and validated; reported (printed, `warn` beats) once a heartbeat exists."""

    train: list = field(default_factory=list)
    train_problems: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    eval_problems: list = field(default_factory=list)


def read_files(cfg, tokenizer) -> FileData:
    """The training file (not in continuous mode: that is the inbox) and the eval file, validated."""
    from hangwatch.daemon.data import validate_file

    out = FileData()
    if not cfg.data.inbox and cfg.data.train is not None:
        out.train, out.train_problems = validate_file(cfg.data.train, tokenizer, cfg)
    if cfg.data.eval:
        out.eval, out.eval_problems = validate_file(cfg.data.eval, tokenizer, cfg)
    return out


# ---- the standby ------------------------------------------------------------------------------


@dataclass
class Preloaded:
    """What a standby loads before (and, if the release comes first, while) it is released.  Filled by the
    preload thread; `wait` before use.  `bundle` None after `wait`: the preload failed, load cold."""

    bundle: Any = None  # daemon.model.ModelBundle on the CPU
    files: Optional[FileData] = None  # None: the preload failed before reading them
    preload_s: float = 0.0
    ready_t: Optional[float] = None  # wall clock when the preload ended
    released_t: Optional[float] = None  # wall clock of the release
    error: Optional[str] = None
    thread: Optional[threading.Thread] = field(default=None, repr=False)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # ready marker vs release

    def wait(self) -> "Preloaded":
        """Block until the preload is over (the worker is in its `load` phase by then)."""
        if self.thread is not None:
            self.thread.join()
        return self

    @property
    def waited_s(self) -> float:
        """How long the ready standby waited for its release (0: released before it was ready)."""
        if self.ready_t is None or self.released_t is None:
            return 0.0
        return max(0.0, self.released_t - self.ready_t)

    def beat_fields(self) -> dict:
        """For the `start` beat: this attempt's worker came from a standby (the preload may still be running)."""
        return {"prewarmed": True}

    def load_fields(self) -> dict:
        """For the `load` phase's end, once the preload is over: what it took and how long it waited."""
        return {
            "prewarmed": True,
            "standby_preload_s": round(self.preload_s, 3),
            "standby_wait_s": round(self.waited_s, 3),
            "standby_ready_t": None if self.ready_t is None else round(self.ready_t, 6),
            "standby_preload_error": self.error,
        }

    def on_device(self, cfg):
        """The preloaded bundle on the configured device (what `load_model` ends with)."""
        from hangwatch.daemon.model import pick_device

        device, autocast = pick_device(cfg)
        if device.type != "cpu":
            self.bundle.model.to(device)
        self.bundle.device, self.bundle.autocast_dtype = device, autocast
        return self.bundle


def ready_path(cfg) -> Optional[os.PathLike]:
    from hangwatch.common.rundir import standby_ready_path

    run_dir = getattr(cfg, "run_dir", None)
    return standby_ready_path(run_dir) if run_dir else None


def announce_ready(cfg, into: Preloaded, attempt: int) -> None:
    """`standby.json` in the run dir: the preload is over (the supervisor reads it for `status`) — unless the
    release came first (the standby is an attempt by now).  Best effort: a standby that cannot say so is still a
    standby."""
    from hangwatch.common.durable import write_json_atomic

    path = ready_path(cfg)
    if path is None:
        return
    with into.lock:
        if into.released_t is not None:
            return
        try:
            write_json_atomic(
                path,
                {"pid": os.getpid(), "attempt": attempt, "preload_s": round(into.preload_s, 3), "error": into.error},
                durable=False,
            )
        except OSError:
            pass


def forget_ready(cfg, into: Preloaded) -> None:
    """Released: the marker goes (the supervisor removes it too; whichever comes second finds nothing)."""
    path = ready_path(cfg)
    with into.lock:
        into.released_t = time.time()
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass


def preload(cfg, into: Preloaded, out: IO[str] = sys.stdout, attempt: int = 0) -> None:
    """Imports, the model on the CPU, the data files: everything that does not depend on the checkpoint.
    Runs in the preload thread; a failure is recorded (the released worker then loads cold)."""
    t0 = time.monotonic()
    try:
        prepare_torch(cfg)  # in this thread too: the model is built with the cold worker's thread count
        for name in TRAINER_MODULES:  # imported now, so that nothing heavy is left for after the release
            importlib.import_module(name)
        from hangwatch.daemon.model import load_model

        on_cpu = cfg.model_copy(update={"model": cfg.model.model_copy(update={"device": "cpu"})})
        bundle = load_model(on_cpu)
        into.files = read_files(cfg, bundle.tokenizer)
        into.bundle = bundle
    except Exception as exc:  # the released worker loads cold and fails there, as a cold worker would
        traceback.print_exc(file=out)
        into.bundle, into.files, into.error = None, None, f"{type(exc).__name__}: {exc}"
    into.preload_s = time.monotonic() - t0
    into.ready_t = time.time()
    announce_ready(cfg, into, attempt)
    print(
        f"standby (pid {os.getpid()}): "
        + (f"preloaded in {into.preload_s:.1f}s" if into.error is None else "preload failed; will load cold"),
        file=out,
        flush=True,
    )


def hold(cfg, environ: MutableMapping[str, str], stream: IO[bytes], out: IO[str] = sys.stdout) -> Optional[Preloaded]:
    """The standby's life before its release: preload in a thread while the main thread waits for the
    release.  Returns the (possibly still running) preload, with HANGWATCH_RESUME_FROM set in `environ`;
    None when it was discarded.

    The release is read on the main thread while the preload runs, so a worker released before it is
    ready beats `start` at once, as a cold one does before its imports; it then waits for the preload in
    its `load` phase (`Preloaded.wait`).  Only the main thread trains: the preload thread's settings
    (`prepare_torch`) are made again on the main thread before the model is used."""
    attempt = int(environ.get(ENV_ATTEMPT) or 0)
    pre = Preloaded()
    pre.thread = threading.Thread(
        target=preload, args=(cfg, pre, out, attempt), name="hangwatch-standby-preload", daemon=True
    )
    pre.thread.start()
    print(
        f"standby for attempt {attempt} (pid {os.getpid()}): loading; waiting for the supervisor's release",
        file=out,
        flush=True,
    )
    release = read_release(stream, attempt)
    if release is None:
        print(f"standby for attempt {attempt}: discarded (no release)", file=out, flush=True)
        return None
    forget_ready(cfg, pre)
    environ[ENV_RESUME_FROM] = release.resume_from
    print(
        f"standby released as attempt {attempt}"
        + ("" if pre.ready_t is not None else " (still loading)")
        + f"; HANGWATCH_RESUME_FROM={release.resume_from or '(none)'}",
        file=out,
        flush=True,
    )
    return pre
