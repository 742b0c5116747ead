"""Reading a config: YAML → the schema's records, with errors a person can act on.

Every problem becomes one line `FILE:LINE: dotted.key: what is wrong`; an unknown key gets a
"did you mean" from the keys of the section it sits in; a key written twice is an error naming both
lines (`yamldoc`); settings that contradict each other are errors too (`rules`).  Relative paths in a
config file are resolved against the directory of that file, so a config behaves the same whatever
the working directory (systemd runs from its StateDirectory).  `load_checked` adds the checks against this
machine (`deep`): what `hangwatch validate-config` and `hangwatch run` do before anything starts.
In a Slurm job (`worker.nnodes: auto`, or not written) the settings the job already holds are written into
the worker section before the records validate it (`slurm`), so every consumer reads plain values.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError

from hangwatch.common.config import deep, rules, slurm
from hangwatch.common.config.errors import ConfigError, line_of, located
from hangwatch.common.config.schema import Config
from hangwatch.common.config.yamldoc import Lines, read_yaml


def parse_config(
    text: str, source: str = "<config>", base_dir: Optional[Path] = None, environ: Optional[Mapping[str, str]] = None
) -> Config:
    """Validate YAML text (records, then the rules across settings). Raises ConfigError, one line per problem.
    `environ` (default: this process's) is where a Slurm job's settings are read (`slurm.resolve`)."""
    return _parse(text, source, base_dir, environ=environ)[0]


def load_config(
    path: Union[str, os.PathLike], run_dir: Optional[str] = None, environ: Optional[Mapping[str, str]] = None
) -> Config:
    """Read, validate and resolve a config file. `run_dir` (from --run-dir) overrides the file's (and the
    per-node directory a Slurm job would put under it); `environ` as for `parse_config`."""
    return _load(path, run_dir, environ=environ)[0]


COMMAND_LINE = "<command line>"  # the source named in problems when there is no config file


def load_checked(
    path: Union[str, os.PathLike, None],
    run_dir: Optional[str] = None,
    environ: Optional[Mapping[str, str]] = None,
    command: Optional[list[str]] = None,
) -> tuple[Config, list[str]]:
    """`load_config`, then the checks against this machine (files, model, command, directories):
    what `validate-config` and `run` use.  Returns (config, warnings); raises ConfigError with every
    problem.  `environ` is the supervisor's environment (the worker's is it plus `worker.env`).

    `command` (`hangwatch run [CONFIG] -- CMD…`) replaces `worker.command`; `path` None: no config file, every
    setting at its default, relative paths against the working directory.  Either way a config that names no
    `run_dir` of its own runs in `runs/<script name>` (`script_name`).  A Slurm job's settings come from `environ`
    too (`slurm.resolve`)."""
    env = os.environ if environ is None else environ
    cfg, lines = _load(path, run_dir, command, environ=env)
    source = str(path) if path is not None else COMMAND_LINE
    found = deep.check(cfg, env)
    if found.errors:
        raise ConfigError(_in_file_order(found.errors, source, lines))
    advice = [*rules.advice(cfg), *slurm.gpu_advice(cfg.worker._slurm, cfg.worker.nproc_per_node)]
    return cfg, _in_file_order([*found.warnings, *advice], source, lines)


def _in_file_order(findings: list[rules.Finding], source: str, lines: Lines) -> list[str]:
    """Problem lines sorted by where they are in the file (a stable sort: same line, same order)."""
    order = sorted(findings, key=lambda f: line_of(f[0], lines) or 0)
    return [located(loc, msg, source, lines) for loc, msg in order]


def _parse(
    text: str,
    source: str,
    base_dir: Optional[Path],
    command: Optional[list[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> tuple[Config, Lines]:
    data, lines = read_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}"])
    if command is not None:
        worker = data.setdefault("worker", {})
        if not isinstance(worker, dict):
            raise ConfigError(
                [located(("worker",), f"expected a mapping of settings, got {type(worker).__name__}", source, lines)]
            )
        worker["command"] = list(command)
        lines = {k: v for k, v in lines.items() if k[:2] != ("worker", "command")}  # not the file's any more
        if "run_dir" not in data:
            data["run_dir"] = str(Path("runs") / script_name(command))
    data, derived = _from_slurm(data, os.environ if environ is None else environ, source, lines)
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source, lines)) from None
    problems = [located(loc, msg, source, lines) for loc, msg in rules.errors(cfg)]
    if problems:
        raise ConfigError(problems)
    cfg.worker._slurm = derived
    if derived is not None and derived.run_subdir:
        cfg.run_dir = str(Path(cfg.run_dir) / derived.run_subdir)
    if base_dir is not None:
        cfg = resolve_paths(cfg, base_dir)
    return cfg, lines


def _from_slurm(data: dict, env: Mapping[str, str], source: str, lines: Lines) -> tuple[dict, Optional[slurm.Derived]]:
    """`data` with what a Slurm job supplies written into its worker section (`worker.nnodes: auto`, or unset in a
    job), so that the records validate, and every consumer reads, plain values; the Derived record says which."""
    worker = data.get("worker", {})
    if not isinstance(worker, dict):
        return data, None  # the record names the mistake
    try:
        derived = slurm.resolve(worker, env, socket.gethostname())
    except slurm.SlurmProblems as exc:
        raise ConfigError([located(loc, msg, source, lines) for loc, msg in exc.problems]) from None
    if derived is None:
        return data, None
    return {**data, "worker": {**worker, **derived.values}}, derived


def _given_run_dir(cfg: Config, run_dir: str) -> None:
    """--run-dir is used as given: no per-node directory of a Slurm job under it."""
    cfg.run_dir = str(Path(run_dir).expanduser().resolve())
    derived = cfg.worker._slurm
    if isinstance(derived, slurm.Derived) and derived.run_subdir:
        cfg.worker._slurm = dataclasses.replace(derived, run_subdir=None)


def _load(
    path: Union[str, os.PathLike, None],
    run_dir: Optional[str],
    command: Optional[list[str]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> tuple[Config, Lines]:
    if path is None:  # `hangwatch run -- CMD`: the defaults, relative to where the command is run
        cfg, lines = _parse("", COMMAND_LINE, Path.cwd(), command, environ)
        if run_dir is not None:
            _given_run_dir(cfg, run_dir)
        return cfg, lines
    p = Path(path)
    if p.is_dir():
        raise ConfigError([f"{p}: is a directory; give the config file (a .yaml) inside it"])
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such config file"]) from None
    except (PermissionError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError([f"{p}: cannot read config: {exc}"]) from None
    cfg, lines = _parse(text, str(p), p.resolve().parent, command, environ)
    if run_dir is not None:
        _given_run_dir(cfg, run_dir)
        lines = {k: v for k, v in lines.items() if k != ("run_dir",)}  # the file's line is not where it came from
    cfg._source = p.resolve()
    return cfg, lines


LAUNCHERS = {
    "torchrun": 0,
    "accelerate": 1,
    "deepspeed": 0,
    "python": 0,
    "env": 0,
}  # words before the script (+ subcommand)
SCRIPT_SUFFIXES = (".py", ".sh", ".bash")


def script_name(argv: list[str]) -> str:
    """What a command runs, as a run directory name: `python train.py` → train, `python -m pkg.train` → pkg.train,
    `torchrun --nproc-per-node 2 train.py` → train, `accelerate launch train.py` → train, `bash run.sh` → run,
    `trl sft …` → trl-sft, `./train` → train."""
    words = [w for w in argv if w]
    for i, word in enumerate(words):
        if word == "-m" and i + 1 < len(words):
            return _safe(words[i + 1])
        name = Path(word).name
        if name.endswith(SCRIPT_SUFFIXES) and not word.startswith("-"):
            return _safe(Path(name).stem)
    if not words:
        return "command"
    first = Path(words[0]).name
    sub = next((w for w in words[1:] if not w.startswith("-")), None)
    if first not in LAUNCHERS and not first.startswith("python") and sub and "/" not in sub and "=" not in sub:
        return _safe(f"{first}-{sub}")  # a console script's subcommand: `trl sft` → trl-sft
    return _safe(first)


def _safe(name: str) -> str:
    cleaned = "".join(c if c.isalnum() or c in "._-" else "-" for c in name).strip(".-")
    return cleaned or "command"


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Make the config's relative paths absolute against `base` (the config file's directory)."""
    cfg.run_dir = _resolve(base, cfg.run_dir)
    cfg.data.train = _resolve(base, cfg.data.train)
    cfg.data.eval = _resolve(base, cfg.data.eval)
    cfg.control.socket = _resolve(base, cfg.control.socket)
    cfg.checkpoint.dir = _resolve(base, cfg.checkpoint.dir)
    cfg.worker.cwd = _resolve(base, cfg.worker.cwd) or str(base)
    # A model name is a path only when it exists as one; else it is a hub-cache id, left as written.
    if cfg.model.name_or_path and (base / cfg.model.name_or_path).exists():
        cfg.model.name_or_path = _resolve(base, cfg.model.name_or_path)
    return cfg


def _resolve(base: Path, value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def dump_config(cfg: Config) -> str:
    """The effective config as YAML (what `config.yaml` in the run dir holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------------------------
# Error messages


def format_errors(err: ValidationError, source: str, lines: dict[tuple, int]) -> list[str]:
    """One line per validation error: where (file:line), which key, what is wrong (and what was given)."""
    problems = []
    errors = err.errors()
    locs = [_user_loc(e["loc"]) for e in errors]
    for e, loc in zip(errors, locs):
        if e["type"] == "string_type" and any(o != loc and o[: len(loc)] == loc for o in locs):
            continue  # the other union member's error says more
        if e["type"] == "extra_forbidden":
            problems.append(located(loc, f"unknown key{_did_you_mean(loc)}", source, lines))
            continue
        got = e.get("input")
        got_s = "" if isinstance(got, (dict, list)) else f", got {got!r}"
        msg = e["msg"].removeprefix("Value error, ")
        problems.append(located(loc, f"{msg}{got_s}", source, lines))
    return problems


def _user_loc(raw: tuple) -> tuple:
    """Union members appear in pydantic's location as tags ("str", "EvalPrompt"); users never wrote those."""
    return tuple(p for p in raw if not (isinstance(p, str) and (p[:1].isupper() or p in ("str", "list[str]"))))


def _did_you_mean(loc: tuple) -> str:
    import difflib  # only for a config with an unknown key (the supervisor of a good one never needs it)

    parent = _model_at(loc[:-1])
    if parent is None:
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{close[0]}'?)"
    return f" (known keys: {', '.join(parent.model_fields)})"


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The schema section a key path points into (for "did you mean")."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        model = _first_model(fields[part].annotation)
        if model is None:
            return None
    return model


def _first_model(ann) -> Optional[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None
