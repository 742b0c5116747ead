"""A checkpoint's data position in continuous mode, and the frontier it stands for.

A position is JSON-able data stored in the checkpoint (`ContinuousSource.position`): the file being
trained (`file`, its take number `take`), the next example's index (`next`) and line (`line`), the
replay draw counter (`rng`), the replays so far (`replay_n`) and the draws not yet logged
(`replay_pending`).  Its frontier is the (take, line) pair below which every example was trained.
"""

from __future__ import annotations

from typing import Optional

from hangwatch.common.inbox_layout import DataName

INF_LINE = 1 << 62  # "after every line": the frontier of a finished file
KIND = "inbox"
VERSION = 1


class PositionError(ValueError):
    """Not a continuous-mode position (a checkpoint of a run with data.inbox: false, or damaged)."""


def check_position(pos: Optional[dict]) -> dict:
    """`pos` when it is a continuous-mode position ({} for None); raises PositionError otherwise."""
    if pos is None:
        return {}
    if not isinstance(pos, dict) or pos.get("kind") != KIND or pos.get("v") != VERSION:
        raise PositionError(f"not a continuous-mode position (kind inbox, version 1): {pos!r:.200}")
    for key in ("take", "next", "rng", "replay_n"):
        if not isinstance(pos.get(key), int) or pos[key] < 0:
            raise PositionError(f"position: {key} must be a non-negative integer, got {pos.get(key)!r}")
    if pos.get("file") is not None and DataName.parse(pos["file"]) is None:
        raise PositionError(f"position: file {pos['file']!r} is not a processing/done file name")
    return pos


def frontier(pos: Optional[dict]) -> tuple[int, int]:
    """Examples with (take, line) below this were trained before `pos`."""
    if not pos:
        return (0, 0)
    if not pos.get("file"):
        # No current file (fresh, or it vanished): everything up to its take number is done.
        return (int(pos["take"]), INF_LINE) if pos.get("take") else (0, 0)
    line = pos.get("line")
    return (int(pos["take"]), INF_LINE if line is None else int(line))


def covers_file(front: tuple[int, int], dn: DataName) -> bool:
    """Whether every example of file `dn` lies below `front`."""
    return dn.number < front[0] or (dn.number == front[0] and front[1] == INF_LINE)
