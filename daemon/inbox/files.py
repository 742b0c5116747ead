"""The worker's own operations on data files: loading the files in training (a few cached),
rejecting a file with its report, and removing the temporaries a crash left behind.

Every change goes through an `FsOps` (hangwatch.common.durable): the crash tests pass one that
dies between operations.
"""

from __future__ import annotations

import collections
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hangwatch.common.durable import TMP_PREFIX, FsOps
from hangwatch.common.inbox_layout import ERROR_SUFFIX, DataName, Stage, data_files, move
from hangwatch.daemon.inbox.assess import Validator
from hangwatch.daemon.inbox.publish import free_name


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode()


def remove_temporaries(
    directory: Path, older_than_s: float = 0.0, now: Optional[float] = None, ops: Optional[FsOps] = None
) -> list[str]:
    """Delete `.tmp-*` leftovers of writes a crash interrupted (only ones older than `older_than_s`)."""
    now = time.time() if now is None else now
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        p = directory / name
        try:
            if now - p.lstat().st_mtime < older_than_s:
                continue
        except FileNotFoundError:
            continue
        (ops or FsOps()).unlink(p)
        removed.append(name)
    return removed


def reject(
    run_dir: os.PathLike | str, filename: str, src: Stage, report: Callable[[str], dict], ops: FsOps
) -> tuple[Path, Path]:
    """Move `src/filename` to rejected/ under the first free name, its `report(name)` beside it
    (written first); returns (where the file is now, the report's path).

    A report left by a crash before the move is simply rewritten by the retry: the name is chosen
    by the data file alone."""
    rejected = Stage.REJECTED.dir(run_dir)
    rname = free_name(rejected, filename)
    report_path = rejected / f"{rname}{ERROR_SUFFIX}"
    ops.write_file(report_path, json_bytes(report(rname)))
    return move(run_dir, filename, src, Stage.REJECTED, rname, ops=ops), report_path


def default_line_of(example: Any) -> int:
    """The 1-based source line of a validator's example: `example["line"]` or `example.line`."""
    if isinstance(example, dict):
        return int(example["line"])
    return int(getattr(example, "line"))


@dataclass
class Loaded:
    dn: DataName
    examples: list  # in line order
    lines: list[int]  # the 1-based line of each example


class TrainingFiles:
    """The data files of processing/ and done/, in take order, loaded through the validator."""

    def __init__(
        self,
        run_dir: os.PathLike | str,
        loader: Validator,
        *,
        line_of: Callable[[Any], int] = default_line_of,
        cache_files: int = 4,
    ):
        self.run_dir = Path(run_dir)
        self._loader = loader
        self._line_of = line_of
        self._cache: "collections.OrderedDict[str, Loaded]" = collections.OrderedDict()
        self._cache_files = max(1, cache_files)

    def all(self) -> list[DataName]:
        files = data_files(self.run_dir, Stage.PROCESSING) + data_files(self.run_dir, Stage.DONE)
        return sorted(files, key=lambda d: d.number)

    def clear(self) -> None:
        self._cache.clear()

    def _path_of(self, filename: str) -> Optional[Path]:
        for stage in (Stage.PROCESSING, Stage.DONE):
            p = stage.dir(self.run_dir) / filename
            if p.exists():
                return p
        return None

    def load(self, dn: DataName) -> Loaded:
        """`dn`'s examples; FileNotFoundError when it is in neither processing/ nor done/."""
        hit = self._cache.get(dn.filename)
        if hit is not None:
            self._cache.move_to_end(dn.filename)
            return hit
        path = self._path_of(dn.filename)
        if path is None:
            raise FileNotFoundError(f"{dn.filename} is in neither processing/ nor done/")
        examples, _problems = self._loader(path)  # bad lines were reported at intake
        pairs = sorted(((self._line_of(e), e) for e in examples), key=lambda t: t[0])
        loaded = Loaded(dn, [e for _, e in pairs], [line for line, _ in pairs])
        self._cache[dn.filename] = loaded
        while len(self._cache) > self._cache_files:
            self._cache.popitem(last=False)
        return loaded
