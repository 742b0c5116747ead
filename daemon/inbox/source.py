"""The training loop's source of examples in continuous mode: the queued files in training order,
with replay, a position a checkpoint stores, and commits that record what a checkpoint covers.

    source = ContinuousSource.from_config(run_dir, validator, cfg)
    source.restore(ckpt_position, step)     # None on a fresh run
    while True:
        item = source.next_example()        # None: nothing new yet (take in arrivals, wait)
        ...                                 # train on item.example; item.replay marks replays
        # at a checkpoint (on a step boundary, nothing taken beyond the steps it holds):
        pos = source.position(step)         # stored in the checkpoint; once that is committed:
        source.commit(pos)

Everything runs in the calling (training) thread.  Both `commit` and `restore` bring the ledger
(`ledger.py`) to exactly the examples before a position, so a kill between its append and the
moves to done/ is repaired by the next `restore`.  Replay draws carry an ordinal `n`; those not yet
logged travel inside the position until a commit logs them to done/replay.jsonl.
"""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from hangwatch.common.durable import FsOps
from hangwatch.common.inbox_layout import CURRENT, DataName, Stage, data_files, ensure_dirs, move, queue_order
from hangwatch.daemon.inbox.assess import Validator
from hangwatch.daemon.inbox.files import Loaded, TrainingFiles, default_line_of, json_bytes, reject, remove_temporaries
from hangwatch.daemon.inbox.ledger import Key, Ledger
from hangwatch.daemon.inbox.position import KIND, VERSION, check_position, covers_file, frontier
from hangwatch.daemon.inbox.replay import Replay


@dataclass(frozen=True)
class Item:
    id: str  # <sha16>:<line>
    file: str  # processing/ or done/ file name
    line: int  # 1-based, in the file as published
    example: Any  # what the validator returned for that line
    replay: bool = False


class ContinuousSource:
    """Examples of the queued files in training order, with replay, a position and commits.

    Training order: the file being trained (processing/, by take number) line by line, then the
    next file in processing/ (after a rollback), else the head of queue/ (moved to processing/
    with the next take number).  With probability `replay_ratio` an example is instead drawn
    uniformly from the files finished before the current one (`Item.replay`).

    Call `restore(position, step)` before the first `next_example()`: with the position of the
    checkpoint being resumed (None on a fresh run) it makes the ledger, `done/` and
    `processing/` agree with that checkpoint.
    """

    def __init__(
        self,
        run_dir: os.PathLike | str,
        loader: Validator,
        *,
        replay_ratio: float = 0.0,
        seed: int = 0,
        line_of: Callable[[Any], int] = default_line_of,
        cache_files: int = 4,
        ops: Optional[FsOps] = None,
    ):
        self.run_dir = Path(run_dir)
        self._replay = Replay(replay_ratio, seed)
        self._files = TrainingFiles(run_dir, loader, line_of=line_of, cache_files=cache_files)
        self._ops = ops or FsOps()
        self._ledger = Ledger(run_dir, self._ops)
        self._restored = False
        self.warnings: list[str] = []  # for the worker to pass on as `warn` beats
        self._reset()

    def _reset(self) -> None:
        self._cur: Optional[Loaded] = None
        self._take_number = 0  # take number of the current file (0: none yet)
        self._next_index = 0  # index of the current file's next example
        self._replay.reset()
        self._ledger.reset()

    @classmethod
    def from_config(cls, run_dir: os.PathLike | str, loader: Validator, cfg: Any, **kw: Any) -> "ContinuousSource":
        return cls(run_dir, loader, replay_ratio=cfg.data.replay_ratio, seed=cfg.train.seed, **kw)

    def _write_current(self) -> None:
        cur = self._cur
        live = cur is not None and self._next_index < len(cur.lines)
        state = {
            "file": cur.dn.filename if live else None,
            "index": self._next_index if live else 0,
            "total": len(cur.lines) if live else 0,
        }
        self._ops.write_file(Stage.PROCESSING.dir(self.run_dir) / CURRENT, json_bytes(state), durable=False)

    # ---- position ------------------------------------------------------------------------

    def position(self, step: Optional[int] = None) -> dict:
        """Where training is, as JSON-able data to store in a checkpoint (with its `step`, if given:
        `restore` then records that step in the ledger lines it adds)."""
        cur, i = self._cur, self._next_index
        return {
            "kind": KIND,
            "v": VERSION,
            "step": step,
            "file": cur.dn.filename if cur else None,
            "take": self._take_number,
            "digest": cur.dn.sha16 if cur else None,
            "next": i,
            "total": len(cur.lines) if cur else 0,
            "line": cur.lines[i] if cur and i < len(cur.lines) else None,
            "rng": self._replay.draws,
            "replay_n": self._replay.count,
            "replay_pending": [list(x) for x in self._replay.unlogged],
        }

    def progress(self) -> dict:
        """Small fields for a heartbeat."""
        cur = self._cur
        return {
            "file": cur.dn.filename if cur else None,
            "index": self._next_index,
            "total": len(cur.lines) if cur else 0,
            "replays": self._replay.count,
        }

    # ---- what a position covers ----------------------------------------------------------

    def _covered_examples(self, after: Optional[Key], front: Key) -> Iterator[tuple[DataName, int]]:
        """(file, line) of every example with after < (take, line) < front, in training order."""
        for dn in self._files.all():
            if dn.number > front[0] or (after is not None and dn.number < after[0]):
                continue
            try:
                loaded = self._files.load(dn)
            except FileNotFoundError:
                continue
            for line in loaded.lines:
                key = (dn.number, line)
                if (after is None or key > after) and key < front:
                    yield dn, line

    def _complete_files(self, front: Key, reopen: bool) -> tuple[list[str], list[str]]:
        """Move covered files to done/ (and, on restore, uncovered ones back to processing/)."""
        completed, reopened = [], []
        for dn in data_files(self.run_dir, Stage.PROCESSING):
            if covers_file(front, dn):
                move(self.run_dir, dn.filename, Stage.PROCESSING, Stage.DONE, ops=self._ops)
                completed.append(dn.filename)
        if reopen:
            for dn in data_files(self.run_dir, Stage.DONE):
                if not covers_file(front, dn):
                    move(self.run_dir, dn.filename, Stage.DONE, Stage.PROCESSING, ops=self._ops)
                    reopened.append(dn.filename)
        return completed, reopened

    # ---- restore and commit --------------------------------------------------------------

    def restore(self, position: Optional[dict], step: Optional[int] = None) -> dict:
        """Resume at `position` (from the checkpoint being resumed; None: a fresh run).

        The ledger ends up holding exactly the examples before the position, each once; files
        the position covers are in done/, the others in processing/.  Ledger lines this adds
        carry `step` (default: the position's own).  Returns what changed.
        """
        pos = check_position(position)
        if step is None:
            step = pos.get("step")
        ensure_dirs(self.run_dir)
        for stage in (Stage.QUEUED, Stage.PROCESSING, Stage.DONE, Stage.REJECTED):
            remove_temporaries(stage.dir(self.run_dir), ops=self._ops)
        self._reset()
        self._files.clear()
        self.warnings = []
        front = frontier(pos)
        summary: dict[str, Any] = {}

        summary["ledger_trimmed"], counts = self._ledger.cut(front)
        before = self._ledger.last_key
        summary["ledger_added"] = self._ledger.record(self._covered_examples(before, front), step)
        for dn, _line in self._covered_examples(before, front):
            counts[dn.filename] += 1

        replay_n = pos.get("replay_n", 0)
        summary["replay_trimmed"] = self._ledger.cut_replays(replay_n)
        summary["replay_added"] = self._ledger.record_replays(pos.get("replay_pending", []), replay_n, step)
        self._ledger.replays_logged = max(self._ledger.replays_logged, replay_n)

        summary["completed"], summary["reopened"] = self._complete_files(front, reopen=True)

        self._replay.reset(draws=pos.get("rng", 0), count=replay_n)
        for dn in self._files.all():
            if dn.number < front[0]:
                self._replay.pool.add(dn.filename, counts[dn.filename])
        self._take_number = front[0] if pos else 0
        if pos.get("file"):
            self._reopen_current(pos)
        self._restored = True
        self._write_current()
        summary["warnings"] = list(self.warnings)
        return summary

    def _reopen_current(self, pos: dict) -> None:
        """Continue inside the file `pos` was training, at its line."""
        try:
            self._cur = self._files.load(DataName.parse(pos["file"]))  # type: ignore[arg-type]
        except FileNotFoundError:
            self.warnings.append(
                f"{pos['file']} (the file the checkpoint was training on) is gone; continuing with the next file"
            )
            return
        lines = self._cur.lines
        self._next_index = len(lines) if pos.get("line") is None else bisect.bisect_left(lines, pos["line"])
        if self._next_index != pos["next"]:
            self.warnings.append(
                f"{pos['file']}: line {pos.get('line')} is example {self._next_index}, the checkpoint said "
                f"{pos['next']} (did the validator or data settings change?)"
            )

    def commit(self, position: dict, step: Optional[int] = None) -> dict:
        """A checkpoint holding `position` was committed: record and complete what it covers.

        Appends a ledger line per example trained before `position` and not yet recorded, logs
        its replay draws, and moves files whose last example it covers to done/.  Idempotent; a
        position older than the last commit changes nothing.  `step` defaults to the position's.
        """
        if not self._restored:
            raise RuntimeError("call restore() before commit()")
        pos = check_position(position)
        if step is None:
            step = pos.get("step")
        front = frontier(pos)
        added = 0
        last = self._ledger.last_key
        if last is None or last < front:
            added = self._ledger.record(self._covered_examples(last, front), step)
        replays = self._ledger.record_replays(pos.get("replay_pending", []), pos["replay_n"], step)
        self._replay.forget_logged(pos["replay_n"])
        completed, _ = self._complete_files(front, reopen=False)
        self._write_current()
        return {"ledger_added": added, "replay_added": replays, "completed": completed}

    # ---- examples ------------------------------------------------------------------------

    def _advance(self) -> bool:
        """Open the next file in training order; False when there is none yet."""
        while True:
            later = [dn for dn in data_files(self.run_dir, Stage.PROCESSING) if dn.number > self._take_number]
            if later:
                dn = later[0]
            else:
                head = next(iter(queue_order(self.run_dir)), None)
                if head is None:
                    return False
                take = max((d.number for d in self._files.all()), default=0)
                dn = DataName(max(take, self._take_number) + 1, head.sha16, head.name)
                move(self.run_dir, head.filename, Stage.QUEUED, Stage.PROCESSING, dn.filename, ops=self._ops)
            if self._cur is not None:
                self._replay.pool.add(self._cur.dn.filename, len(self._cur.lines))
                self._cur = None
            self._take_number = dn.number
            self._next_index = 0
            try:
                self._cur = self._files.load(dn)
            except Exception as exc:  # it validated at intake; failing now must not stop training
                self._reject_unloadable(dn, exc)
                continue
            self._write_current()
            return True

    def _reject_unloadable(self, dn: DataName, exc: Exception) -> None:
        message = f"could not be loaded for training: {type(exc).__name__}: {exc}"

        def report(rname: str) -> dict:
            return {
                "file": dn.filename,
                "sha256_16": dn.sha16,
                "action": "reject_file",
                "rejected_as": rname,
                "reasons": [{"code": "load_failed", "message": message}],
                "problems": [],
                "problems_total": 0,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }

        dest, _ = reject(self.run_dir, dn.filename, Stage.PROCESSING, report, self._ops)
        self.warnings.append(f"{dn.filename}: {message}; moved to rejected/{dest.name}")

    def has_fresh(self) -> bool:
        """Whether a new (non-replay) example is available now (may open the next file)."""
        if not self._restored:
            raise RuntimeError("call restore() before reading examples")
        while self._cur is None or self._next_index >= len(self._cur.lines):
            if not self._advance():
                return False
        return True

    def next_example(self) -> Optional[Item]:
        """The next example to train on, or None while there is no new data (go idle)."""
        if not self.has_fresh():
            return None
        if self._replay.coin():
            item = self._draw_replay()
            if item is not None:
                return item
        cur = self._cur
        assert cur is not None
        i = self._next_index
        self._next_index += 1
        line = cur.lines[i]
        return Item(f"{cur.dn.sha16}:{line}", cur.dn.filename, line, cur.examples[i])

    def take(self, n: int) -> list[Any]:
        """`DataSource.take`: up to `n` examples as the validator made them."""
        return [item.example for item in self.next_batch(n)]

    def next_batch(self, n: int) -> list[Item]:
        """Up to `n` examples (fewer when the data runs out)."""
        out: list[Item] = []
        while len(out) < n:
            item = self.next_example()
            if item is None:
                break
            out.append(item)
        return out

    def _draw_replay(self) -> Optional[Item]:
        filename, j = self._replay.pick()
        try:
            loaded = self._files.load(DataName.parse(filename))  # type: ignore[arg-type]
            example, line = loaded.examples[j], loaded.lines[j]
        except (FileNotFoundError, IndexError):
            return None  # deleted or changed under us: train a fresh example instead
        rid = f"{loaded.dn.sha16}:{line}"
        self._replay.record(rid, filename, line)
        return Item(rid, filename, line, example, replay=True)
