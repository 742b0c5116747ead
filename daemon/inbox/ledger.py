"""The two append-only logs of done/: `ledger.jsonl`, one line per trained example in training
order, and `replay.jsonl`, one line per replay draw, numbered `n`.

Idempotency: the ledger is appended in training order, so it is always a prefix of that order.
On resume it is cut back to the examples before the resumed position (a rollback undid the
training past it) and the missing ones are appended; a torn last line (a kill mid-append) is cut
off when the log is read.
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any, Iterable, Optional

from hangwatch.common.durable import FsOps
from hangwatch.common.inbox_layout import LEDGER, REPLAY_LOG, DataName, Stage

Key = tuple[int, int]  # (take number, line): the training order


def line_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def read_jsonl(path: Path, ops: FsOps) -> list[tuple[int, dict]]:
    """(byte offset, object) per valid line; a torn last line (crash mid-append) is cut off."""
    out: list[tuple[int, dict]] = []
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return out
    offset = 0
    cut = None
    with f:
        for raw in f:
            try:
                obj = json.loads(raw) if raw.endswith(b"\n") else None
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                out.append((offset, obj))
                cut = None
            elif cut is None:
                cut = offset
            offset += len(raw)
    if cut is not None:
        # Only trailing garbage is ours to cut; a bad line in the middle was not written by us.
        ops.truncate(path, cut)
    return out


def entry_key(obj: dict) -> Optional[Key]:
    dn = DataName.parse(str(obj.get("file", "")))
    line = obj.get("line")
    return (dn.number, line) if dn is not None and isinstance(line, int) else None


class Ledger:
    """done/ledger.jsonl and done/replay.jsonl; `last_key` and `replays_logged` say how far each goes."""

    def __init__(self, run_dir: os.PathLike | str, ops: FsOps):
        self.examples_path = Stage.DONE.dir(run_dir) / LEDGER
        self.replays_path = Stage.DONE.dir(run_dir) / REPLAY_LOG
        self._ops = ops
        self.reset()

    def reset(self) -> None:
        self.last_key: Optional[Key] = None  # (take, line) of the last ledger entry
        self.replays_logged = 0  # `n` of the last replay.jsonl entry

    # ---- examples

    def cut(self, front: Key) -> tuple[int, collections.Counter]:
        """Cut the ledger back to the entries before `front`: (lines cut, file name → entries kept)."""
        counts: collections.Counter = collections.Counter()
        entries = read_jsonl(self.examples_path, self._ops)
        for i, (offset, obj) in enumerate(entries):
            key = entry_key(obj)
            if key is None:
                continue
            if key >= front:
                self._ops.truncate(self.examples_path, offset)
                return len(entries) - i, counts
            counts[obj["file"]] += 1
            self.last_key = key
        return 0, counts

    def record(self, examples: Iterable[tuple[DataName, int]], step: Optional[int]) -> int:
        """Append one line per (file, line), in one durable write; returns how many."""
        lines = []
        last = self.last_key
        for dn, line in examples:
            lines.append(line_bytes({"id": f"{dn.sha16}:{line}", "file": dn.filename, "line": line, "step": step}))
            last = (dn.number, line)
        if lines:
            self._ops.append(self.examples_path, b"".join(lines))
            self.last_key = last
        return len(lines)

    # ---- replay draws

    def cut_replays(self, upto_n: int) -> int:
        """Cut replay.jsonl back to the draws numbered up to `upto_n`; returns the lines cut."""
        replays = read_jsonl(self.replays_path, self._ops)
        for i, (offset, obj) in enumerate(replays):
            n = obj.get("n")
            if isinstance(n, int) and n > upto_n:
                self._ops.truncate(self.replays_path, offset)
                return len(replays) - i
            if isinstance(n, int):
                self.replays_logged = n
        return 0

    def record_replays(self, draws: Iterable[list], upto_n: int, step: Optional[int]) -> int:
        """Append the draws [n, id, file, line] numbered after the last logged and up to `upto_n`."""
        lines = []
        for n, rid, fname, line in draws:
            if self.replays_logged < n <= upto_n:
                lines.append(line_bytes({"n": n, "id": rid, "file": fname, "line": line, "step": step}))
                self.replays_logged = n
        if lines:
            self._ops.append(self.replays_path, b"".join(lines))
        return len(lines)
