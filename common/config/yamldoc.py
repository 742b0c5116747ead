"""YAML text → (plain data, a line for every key path), refusing duplicate keys.

PyYAML keeps the last of two equal keys in a mapping without a word, so `silence_timeout_s` set twice
would silently be the second value; here the node tree is walked before it is constructed and every
duplicate is a problem naming both lines.  The same walk records the line of each key path, which
every later message (`FILE:LINE: dotted.key: ...`) uses.
"""

from __future__ import annotations

from typing import Any

import yaml

from hangwatch.common.config.errors import ConfigError, dotted

MERGE_TAG = "tag:yaml.org,2002:merge"  # `<<: *base`: later keys override the merged ones, by design

Lines = dict[tuple, int]  # key path → 1-based line


def read_yaml(text: str, source: str) -> tuple[Any, Lines]:
    """(data, lines) of one YAML document; ConfigError for bad YAML or duplicate keys."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        lines: Lines = {}
        problems: list[str] = []
        if node is not None:
            _walk(node, (), lines, problems, source)
        if problems:
            raise ConfigError(problems)
        return (loader.construct_document(node) if node is not None else None), lines
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}"]) from None
    finally:
        loader.dispose()


def _walk(node: yaml.Node, path: tuple, lines: Lines, problems: list[str], source: str) -> None:
    if isinstance(node, yaml.MappingNode):
        first: dict[tuple, int] = {}
        for k, v in node.value:
            if k.tag == MERGE_TAG or not isinstance(k, yaml.ScalarNode):
                continue
            line = k.start_mark.line + 1
            ident = (k.tag, k.value)  # `1` and `"1"` are different keys
            key = (*path, k.value)
            if ident in first:
                problems.append(
                    f"{source}:{line}: {dotted(key)}: duplicate key (first at line {first[ident]}); "
                    "YAML would silently keep only the last one: remove one of them"
                )
                continue
            first[ident] = line
            lines[key] = line
            _walk(v, key, lines, problems, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[(*path, i)] = item.start_mark.line + 1
            _walk(item, (*path, i), lines, problems, source)
