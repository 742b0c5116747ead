"""Checks of a valid config against this machine: what it names must be there before anything starts.

`hangwatch validate-config` and `hangwatch run` (before it spawns a worker) call `check`; a problem
found here would otherwise surface seconds or minutes later as a worker's failure (a missing train
file was exit 65 after the model had loaded).  Checked:

    data.train, data.eval   exist, are files, readable; for the built-in worker the first lines are
                            JSON objects of the shape it trains on (`example_shape`)
    model.name_or_path      a model directory (with config.json), or an id already in the Hugging
                            Face hub cache: nothing is ever downloaded
    worker.cwd              a directory
    worker.command[0]       found the way the supervisor will run it (PATH of the worker's environment,
                            or a path relative to worker.cwd) and executable
    the script it runs      the file an interpreter is given (`python [-u …] train.py`, `torchrun … train.py`,
                            `python -m torch.distributed.run … train.py`) exists, relative to worker.cwd: the
                            interpreter would exit 2 at once ("can't open file"), a restart after it; `python -m
                            module`, `python -c …` and other programs are not looked into
    run_dir, control.socket can be created and written
    control.group           exists
    logging.termination_log a path written (not `auto`): its directory exists and it is not a directory (a
                            warning: the run goes on, only its termination message would be lost)
    worker.nproc_per_node   for the built-in worker on CUDA (model.device cuda, or auto with a GPU visible):
                            no more ranks than GPUs the worker sees (NVML's count through the worker's
                            CUDA_VISIBLE_DEVICES, `common.gpus`), since NCCL needs one per rank; without
                            NVML nothing is known and nothing is refused

Findings are `(key path, message)` like `rules`; the loader adds the file and line.  The standard
library only (the supervisor side runs this; it must not import the worker), and pynvml when a config puts
the built-in worker on a GPU.
"""

from __future__ import annotations

import grp
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional, Sequence

from hangwatch.common import gpus
from hangwatch.common.config.rules import Finding, builtin_worker
from hangwatch.common.config.schema import TERMINATION_LOG_AUTO, Config
from hangwatch.common.example_shape import EXPECTED, FIRST_LINE_WHY, ExampleRejected, example_of_line

SAMPLE_LINES = 20  # non-blank lines of a data file whose shape is checked
SAMPLE_BYTES = 1 << 20  # most bytes read from a data file for that
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # `name` or `org/name`, as the hub spells ids


@dataclass
class Found:
    errors: list[Finding] = field(default_factory=list)
    warnings: list[Finding] = field(default_factory=list)


def check(
    cfg: Config, environ: Mapping[str, str], gpu_uuids: Callable[[], Optional[Sequence[str]]] = gpus.nvml_uuids
) -> Found:
    """Everything the config names that this machine lacks (errors) or that looks wrong (warnings).
    `gpu_uuids`: the machine's GPUs as NVML lists them, None without NVML (the seam tests replace)."""
    found = Found()
    worker_env = {**environ, **cfg.worker.env}  # what the worker will run with
    base = cfg._source.parent if cfg._source is not None else Path.cwd()
    for key in ("train", "eval"):
        path = getattr(cfg.data, key)
        if path is not None:
            _data_file(found, ("data", key), Path(path), shape=builtin_worker(cfg))
    if builtin_worker(cfg) and cfg.model.name_or_path:
        found.errors += _model(cfg.model.name_or_path, base, worker_env)
    cwd = Path(cfg.worker.cwd) if cfg.worker.cwd else base
    cwd_ok = cwd.is_dir()
    if not cwd_ok:
        found.errors.append((("worker", "cwd"), f"{cwd}: {'not a directory' if cwd.exists() else 'no such directory'}"))
    if cfg.worker.command and cwd_ok:
        found.errors += _command(cfg.worker.command[0], cwd, worker_env)
        found.errors += _script(cfg.worker.command, cwd)
    found.errors += _writable_dir(("run_dir",), Path(cfg.run_dir), "the run directory")
    if cfg.checkpoint.dir:
        found.errors += _writable_dir(("checkpoint", "dir"), Path(cfg.checkpoint.dir), "the checkpoint directory")
    if cfg.control.socket:
        found.errors += _writable_dir(("control", "socket"), Path(cfg.control.socket).parent, "the socket's directory")
    if cfg.control.group:
        try:
            grp.getgrnam(cfg.control.group)
        except KeyError:
            found.errors.append((("control", "group"), f"no such group {cfg.control.group!r} on this machine"))
    found.errors += gpu_placement(cfg, environ, gpu_uuids)
    found.warnings += _termination_log(cfg.logging.termination_log)
    return found


def _termination_log(setting: str) -> list[Finding]:
    """A termination-message file that could not be written: said before the run rather than after it."""
    if setting in ("", TERMINATION_LOG_AUTO):
        return []
    path, loc = Path(setting), ("logging", "termination_log")
    if path.is_dir():
        return [(loc, f"{path}: is a directory; the run's termination message will not be written")]
    if not path.parent.is_dir():
        return [(loc, f"{path.parent}: no such directory; the run's termination message will not be written")]
    return []


def gpu_placement(
    cfg: Config, environ: Mapping[str, str], gpu_uuids: Callable[[], Optional[Sequence[str]]]
) -> list[Finding]:
    """The built-in worker's ranks against the GPUs it will see: a rank without a GPU of its own fails at
    NCCL's start, after the model load.  A worker.command's backend is its own business: not checked."""
    if not builtin_worker(cfg) or cfg.model.device == "cpu":
        return []  # NVML is not even asked
    view = gpus.worker_gpus(environ, cfg.worker.env, gpu_uuids())
    problem = gpus.placement_problem(cfg.model.device, cfg.worker.nproc_per_node, view)
    return [(problem.key, problem.text())] if problem else []


# ---- data files ----------------------------------------------------------------------------------


def _data_file(found: Found, loc: tuple, path: Path, *, shape: bool) -> None:
    if path.is_dir():
        found.errors.append((loc, f"{path}: is a directory, not a JSONL file"))
        return
    try:
        with open(path, "rb") as f:
            head = f.read(SAMPLE_BYTES)
    except FileNotFoundError:
        found.errors.append((loc, f"{path}: no such file"))
        return
    except OSError as exc:
        found.errors.append((loc, f"{path}: cannot read: {exc.strerror or exc}"))
        return
    if not shape:
        return  # a worker of one's own reads its files its own way
    bad = list(_bad_lines(head))
    sampled = _sampled(head)
    if not sampled:
        found.errors.append((loc, f"{path}: empty: no example in it"))
    elif len(bad) == len(sampled):
        lineno, why = bad[0]
        found.errors.append(
            (loc, f"{path}:{lineno}: {why} (and every other of the first {len(sampled)} line(s)): {EXPECTED}")
        )
    elif bad and bad[0][0] == sampled[0][0]:
        lineno, why = bad[0]
        found.errors.append((loc, f"{path}:{lineno}: {why}: {FIRST_LINE_WHY}; {EXPECTED}"))
    else:
        for lineno, why in bad:
            found.warnings.append((loc, f"{path}:{lineno}: {why}; the worker will skip this line"))


def _sampled(head: bytes) -> list[tuple[int, bytes]]:
    """(line number, line) of the first non-blank lines; a line cut by the read limit is left out."""
    lines = head.splitlines()
    if len(head) == SAMPLE_BYTES and lines:
        lines = lines[:-1]
    numbered = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    return numbered[:SAMPLE_LINES]


def _bad_lines(head: bytes) -> Iterator[tuple[int, str]]:
    for lineno, line in _sampled(head):
        try:
            example_of_line(line)
        except ExampleRejected as exc:
            yield lineno, str(exc)


# ---- model, command, directories -----------------------------------------------------------------


def hub_cache(env: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache the worker's transformers would read (same variables, same order)."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _in_hub_cache(model_id: str, cache: Path) -> bool:
    snapshots = cache / ("models--" + model_id.replace("/", "--")) / "snapshots"
    return any((s / "config.json").is_file() for s in snapshots.glob("*")) if snapshots.is_dir() else False


def _model(name: str, base: Path, env: Mapping[str, str]) -> list[Finding]:
    loc = ("model", "name_or_path")
    path = Path(name).expanduser()
    local = path if path.is_absolute() else base / path
    if local.is_dir():
        if not (local / "config.json").is_file():
            return [(loc, f"{local}: no config.json in it: not a Hugging Face model directory")]
        return []
    if local.exists():
        return [(loc, f"{local}: a file; expected a model directory (config.json, weights, tokenizer)")]
    if path.is_absolute() or not HUB_ID.match(name):
        return [(loc, f"{local}: no such directory")]
    cache = hub_cache(env)
    if _in_hub_cache(name, cache):
        return []
    return [
        (
            loc,
            f"{name!r} is neither a directory (no {local}) nor in the Hugging Face hub cache ({cache}); "
            f"hangwatch never downloads a model: give a model directory, or fetch it into the cache first "
            f"(`hf download {name}`)",
        )
    ]


def _command(program: str, cwd: Path, env: Mapping[str, str]) -> list[Finding]:
    loc = ("worker", "command", 0)
    if program in ("python", "python3"):
        return []  # the supervisor's own interpreter (supervisor.attempt.worker_argv)
    if os.sep in program:  # a path: relative ones are taken from worker.cwd, as the supervisor runs it
        path = Path(program).expanduser()
        path = path if path.is_absolute() else cwd / path
        if not path.exists():
            return [(loc, f"{path}: no such file")]
        if path.is_dir() or not os.access(path, os.X_OK):
            return [(loc, f"{path}: not an executable file")]
        return []
    search = env.get("PATH", os.defpath)
    if shutil.which(program, path=search) is None:
        return [(loc, f"{program!r}: not found on the worker's PATH ({search})")]
    return []


# The interpreter's options that take a value: the rest of their word, else the next word (`-W error`, `-Xdev`)
PYTHON_VALUE_FLAGS = "WX"
PYTHON_LONG_VALUE = ("--check-hash-based-pycs",)
# torchrun options after which its first argument is no script file: a module (-m) or a program of its own
TORCHRUN_NO_SCRIPT = ("-m", "--module", "--no-python", "--no_python")


def script_of(argv: Sequence[str]) -> Optional[int]:
    """The index in `argv` of the script file its interpreter is given, or None: no interpreter we read (any
    program but python and torchrun), or no script file (`python -m mod`, `python -c code`, `python -` reads stdin,
    `torchrun -m mod`).  python's own option syntax: flags cluster (`-uB`), `-c`/`-m` end the options, `-W`/`-X`
    take a value.  torchrun's options take values as separate words, so its script is the first word ending in
    `.py` that is no option (what follows the script is the script's own)."""
    if not argv:
        return None
    program = Path(argv[0]).name
    if program == "torchrun" or list(argv[1:3]) == ["-m", "torch.distributed.run"]:
        for i in range(1 if program == "torchrun" else 3, len(argv)):
            word = argv[i]
            if word in TORCHRUN_NO_SCRIPT:
                return None
            if word.endswith(".py") and not word.startswith("-"):
                return i
        return None
    if not program.startswith("python"):
        return None
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return i + 1 if i + 1 < len(argv) else None
        if word == "-":
            return None
        if word.startswith("--"):
            i += 2 if word in PYTHON_LONG_VALUE else 1
            continue
        if word.startswith("-"):
            flags = word[1:]
            for j, flag in enumerate(flags):
                if flag in "cm":
                    return None
                if flag in PYTHON_VALUE_FLAGS:
                    if j == len(flags) - 1:  # nothing after it in this word: its value is the next word
                        i += 1
                    break
            i += 1
            continue
        return i
    return None


def _script(argv: Sequence[str], cwd: Path) -> list[Finding]:
    """The script the interpreter is given is there (relative to worker.cwd, where the command runs)."""
    i = script_of(argv)
    if i is None:
        return []
    path = Path(argv[i])
    if path.is_absolute():
        return [] if path.exists() else [(("worker", "command", i), f"{path}: no such file")]
    if (cwd / path).exists():
        return []
    return [(("worker", "command", i), f"{str(path)!r}: no such file in {cwd} (where the command runs: worker.cwd)")]


def _writable_dir(loc: tuple, path: Path, what: str) -> list[Finding]:
    """`path` is a writable directory, or the nearest existing directory above it is (so it can be made)."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return [
            (loc, f"{path}: {probe} is not a directory, so {what} cannot be {'used' if probe == path else 'created'}")
        ]
    if not os.access(probe, os.W_OK | os.X_OK):
        verb = "written" if probe == path else "created"
        return [(loc, f"{path}: {what} cannot be {verb}: {probe} is not writable by uid {os.geteuid()}")]
    return []
