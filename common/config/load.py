"""Reading a config: YAML → the schema's records, with errors a person can act on.

Every problem becomes one line `FILE:LINE: dotted.key: what is wrong`; an unknown key gets a
"did you mean" from the keys of the section it sits in.  Relative paths in a config file are
resolved against the directory of that file, so a config behaves the same whatever the working
directory (systemd runs from its StateDirectory).
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Optional, Union

import yaml
from pydantic import BaseModel, ValidationError

from hangwatch.common.config.schema import Config


class ConfigError(Exception):
    """A config that cannot be used. `problems` lists one human-readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def parse_config(text: str, source: str = "<config>", base_dir: Optional[Path] = None) -> Config:
    """Validate YAML text. Raises ConfigError with one line per problem."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}"])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_errors(err, source, line_index(text))) from None
    if base_dir is not None:
        cfg = resolve_paths(cfg, base_dir)
    return cfg


def load_config(path: Union[str, os.PathLike], run_dir: Optional[str] = None) -> Config:
    """Read, validate and resolve a config file. `run_dir` (from --run-dir) overrides the file's."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such config file"]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read config: {exc}"]) from None
    cfg = parse_config(text, str(p), p.resolve().parent)
    if run_dir is not None:
        cfg.run_dir = str(Path(run_dir).expanduser().resolve())
    cfg._source = p.resolve()
    return cfg


def resolve_paths(cfg: Config, base: Path) -> Config:
    """Make the config's relative paths absolute against `base` (the config file's directory)."""
    cfg.run_dir = _resolve(base, cfg.run_dir)
    cfg.data.train = _resolve(base, cfg.data.train)
    cfg.data.eval = _resolve(base, cfg.data.eval)
    cfg.control.socket = _resolve(base, cfg.control.socket)
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


def line_index(text: str) -> dict[tuple, int]:
    """Map each key path of a YAML document to its 1-based line, for error messages."""
    index: dict[tuple, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return index

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*path, k.value)
                index[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                index[(*path, i)] = item.start_mark.line + 1
                walk(item, (*path, i))

    if root is not None:
        walk(root, ())
    return index


def format_errors(err: ValidationError, source: str, lines: dict[tuple, int]) -> list[str]:
    """One line per validation error: where (file:line), which key, what is wrong (and what was given)."""
    problems = []
    errors = err.errors()
    locs = [_user_loc(e["loc"]) for e in errors]
    for e, loc in zip(errors, locs):
        if e["type"] == "string_type" and any(o != loc and o[: len(loc)] == loc for o in locs):
            continue  # the other union member's error says more
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        line = None
        probe = loc
        while probe and line is None:
            line = lines.get(probe)
            probe = probe[:-1]
        where = f"{source}:{line}" if line else source
        if e["type"] == "extra_forbidden":
            problems.append(f"{where}: {dotted}: unknown key{_did_you_mean(loc)}")
            continue
        got = e.get("input")
        got_s = "" if isinstance(got, (dict, list)) else f", got {got!r}"
        msg = e["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {dotted}: {msg}{got_s}")
    return problems


def _user_loc(raw: tuple) -> tuple:
    """Union members appear in pydantic's location as tags ("str", "EvalPrompt"); users never wrote those."""
    return tuple(p for p in raw if not (isinstance(p, str) and (p[:1].isupper() or p in ("str", "list[str]"))))


def _did_you_mean(loc: tuple) -> str:
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
