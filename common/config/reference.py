"""The configuration reference, generated from the schema: docs/configuration.md and `run --help`.

One source: a key, its type, its default and its doc come from the pydantic record itself, so the
documentation cannot drift from what is validated (tests/e2e/test_ops_systemd.py checks docs/configuration.md).
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal, Union

import yaml
from pydantic import BaseModel

from hangwatch.common.config.schema import Config, EvalPrompt, FaultCfg, LandmarkCfg

Row = tuple[str, str, str, str]  # key, type, default, doc


def reference_rows(model: type[BaseModel] = Config, prefix: str = "") -> list[Row]:
    """(key, type, default, doc) for every leaf setting, in schema order."""
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            rows.extend(reference_rows(f.annotation, key + "."))
            continue
        if f.is_required():
            default_s = "required"
        else:
            default = f.default_factory() if f.default_factory is not None else f.default
            default_s = (
                yaml.safe_dump(default, default_flow_style=True, width=float("inf")).strip().removesuffix("...").strip()
            )
        # a word the loader turns into a value before the record sees it (`worker.nnodes: auto`) is part of the type
        also = (f.json_schema_extra or {}).get("also", []) if isinstance(f.json_schema_extra, dict) else []
        rows.append((key, " or ".join([type_name(f.annotation), *also]), default_s, f.description or ""))
    return rows


def reference_markdown() -> str:
    """The reference table (docs/configuration.md): every key, then the keys of one `watchdog.landmarks[]` and one
    `faults[]` entry."""
    rows = (
        reference_rows() + reference_rows(LandmarkCfg, "watchdog.landmarks[].") + reference_rows(FaultCfg, "faults[].")
    )
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    out += [f"| `{key}` | {typ} | `{default}` | {doc} |" for key, typ, default, doc in rows]
    return "\n".join(out) + "\n"


def reference_text() -> str:
    """A compact plain-text reference for `--help` (two lines per key, never re-wrapped by click)."""
    lines = []
    for key, typ, default, doc in reference_rows():
        lines.append(f"  {key} = {default}  ({typ})")
        lines.append(f"      {doc}")
    return "\n".join(lines)


def type_name(ann) -> str:
    """A type annotation in words: "float or null", "map of str to float", "one of a, b"."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Annotated:  # bounds are said in the doc and enforced by the record
        return type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args) if len(args) > 1 else f"`{args[0]}`"
    if origin is Union:
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}"
    if ann is EvalPrompt:
        return "{prompt, reference}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann.__name__.removesuffix("Cfg").lower()
    return getattr(ann, "__name__", str(ann))
