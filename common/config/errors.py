"""A config that cannot be used, and where in its file each problem is.

Every problem is one line `FILE:LINE: dotted.key: what is wrong`; the line is the key's own, or that
of its nearest parent written in the file (a default the file does not mention has no line of its own).
"""

from __future__ import annotations

from typing import Optional


class ConfigError(Exception):
    """A config that cannot be used. `problems` lists one human-readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


def dotted(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def line_of(loc: tuple, lines: dict[tuple, int]) -> Optional[int]:
    """The line of a key path: its own, else its nearest written parent's; None when neither is written."""
    probe = loc
    while probe:
        if probe in lines:
            return lines[probe]
        probe = probe[:-1]
    return None


def where(loc: tuple, source: str, lines: dict[tuple, int]) -> str:
    """`FILE:LINE` for a key path, or `FILE` when the file does not mention it."""
    line = line_of(loc, lines)
    return f"{source}:{line}" if line else source


def located(loc: tuple, message: str, source: str, lines: dict[tuple, int]) -> str:
    """One problem line: `FILE:LINE: dotted.key: message`."""
    return f"{where(loc, source, lines)}: {dotted(loc)}: {message}"
