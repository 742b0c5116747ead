"""Continuous mode, the training side: take files dropped into the inbox, feed their examples to
the training loop in order, and record what a committed checkpoint has trained.

No torch here (the supervisor and the CLI import this module); the training loop hands in a
`validator(path) -> (examples, problems)` that knows the tokenizer.

    inbox = Inbox.from_config(run_dir, validator, cfg.data)
    inbox.start()                           # takes what arrived while the worker was down
    source = ContinuousSource.from_config(run_dir, validator, cfg)
    source.restore(ckpt_position)           # None on a fresh run
    while True:
        inbox.poll()                        # intake of new arrivals, in this (the training) thread
        item = source.next_example()
        if item is None:                    # nothing left: phase idle, beat, wait
            inbox.wait_for_work(1.0)
            continue
        ...                                 # train on item.example; item.replay marks replays
        # at a checkpoint (on a step boundary, nothing taken beyond the steps it holds):
        pos = source.position(step)         # stored in the checkpoint; once that is committed:
        source.commit(pos)

Threads: the watchdog observer thread only records names in a queue; validation, moves and
ledger writes all happen in the thread that calls `poll`, `wait_for_work` and the source.

The file lifecycle and the naming scheme are in `hangwatch.common.inbox_layout`.

Ledger idempotency: `done/ledger.jsonl` is appended in training order, so it is always a prefix
of that order.  Both `commit` and `restore` bring it to exactly the examples before a position:
entries past it are cut off (resuming from an older checkpoint: that training was undone), the
missing ones are appended.  A kill between the append and the moves to `done/` is repaired by
the next `restore`; a torn last line is cut off.  Replay draws carry an ordinal `n`; those not
yet logged travel inside the position until a commit logs them to `done/replay.jsonl`.
"""
from __future__ import annotations

import bisect
import collections
import hashlib
import json
import logging
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from hangwatch.common.inbox_layout import (
    CURRENT,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    LEDGER,
    REPLAY_LOG,
    Assessment,
    DataName,
    FsOps,
    IllegalTransition,
    Stage,
    Validator,
    assess,
    data_files,
    ensure_dirs,
    is_candidate_name,
    known_digests,
    move,
    publish,
    queue_order,
    queue_status,
    remove_temporaries,
    unique_names,
    validate_only,
)

__all__ = [
    "Inbox", "IntakeResult", "ContinuousSource", "Item", "PositionError",
    "publish", "validate_only", "queue_status", "Stage", "IllegalTransition",
]

_READY_KINDS = ("moved", "closed")  # the writer is done: renamed into place, or closed after writing
_WATCHED_KINDS = ("created", "modified", "moved", "closed")


# --------------------------------------------------------------------------------------------
# Watching and intake


class _Recorder(FileSystemEventHandler):
    """Runs in the observer thread; records (name, kind) and does nothing else."""

    def __init__(self, directory: Path, sink: "queue.SimpleQueue[tuple[str, str]]"):
        self._dir = os.path.abspath(directory)
        self._sink = sink

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.is_directory or event.event_type not in _WATCHED_KINDS:
            return
        path = os.fsdecode(event.dest_path if event.event_type == "moved" else event.src_path)
        if os.path.dirname(os.path.abspath(path)) == self._dir:
            self._sink.put((os.path.basename(path), event.event_type))


def _drop_stop_race(record: logging.LogRecord) -> bool:
    return "called when the thread is inactive" not in record.getMessage()


@dataclass
class IntakeResult:
    name: str  # as it arrived in inbox/
    outcome: str  # "queued" or "rejected"
    path: Path  # where it is now
    assessment: Assessment
    report: Optional[Path] = None  # rejected/…error.json, or the skipped-lines report


class Inbox:
    """Takes files from `<run_dir>/inbox/` into `queue/` (valid) or `rejected/` (with a report).

    A name is taken once the writer is done with it: at once after a rename into the inbox (the
    publishing protocol) or a close after writing; otherwise (a hard link, a `mv` from elsewhere,
    a writer that never closes) once its mtime is `settle_s` old.  The inbox is also re-listed
    every `rescan_s`, in case the kernel dropped events.
    """

    def __init__(self, run_dir: os.PathLike | str, validator: Validator, *,
                 max_file_bytes: int = DEFAULT_MAX_FILE_BYTES, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 on_bad_lines: str = "reject_file", settle_s: float = 1.0, rescan_s: float = 2.0,
                 stale_tmp_s: float = 3600.0, observer_factory: Callable[[], Any] = Observer,
                 ops: Optional[FsOps] = None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        if on_bad_lines not in ("reject_file", "skip_lines"):
            raise ValueError(f"on_bad_lines must be reject_file or skip_lines, got {on_bad_lines!r}")
        self.run_dir = Path(run_dir)
        self.dir = Stage.INBOX.dir(run_dir)
        self._validator = validator
        self._limits = {"max_file_bytes": max_file_bytes, "max_line_bytes": max_line_bytes,
                        "on_bad_lines": on_bad_lines}
        self._settle_s = settle_s
        self._rescan_s = rescan_s
        self._stale_tmp_s = stale_tmp_s
        self._observer_factory = observer_factory
        self._ops = ops or FsOps()
        self._clock = clock
        self._wall = wall_clock
        self._events: "queue.SimpleQueue[tuple[str, str]]" = queue.SimpleQueue()
        self._pending: dict[str, bool] = {}  # name → writer known to be done; insertion = arrival order
        self._observer = None
        self._last_scan = float("-inf")

    @classmethod
    def from_config(cls, run_dir: os.PathLike | str, validator: Validator, data_cfg: Any, **kw: Any) -> "Inbox":
        return cls(run_dir, validator, max_file_bytes=data_cfg.max_file_bytes,
                   on_bad_lines=data_cfg.on_bad_lines, **kw)

    # ---- lifecycle -----------------------------------------------------------------------

    def recover(self) -> None:
        """Create the stage directories and delete temporaries left by a crash.

        Nothing else needs repair: a file is moved by one rename, so after any crash it is in
        exactly one stage, and an intake cut short is simply done again (its report rewritten).
        """
        ensure_dirs(self.run_dir)
        remove_temporaries(self.dir, older_than_s=self._stale_tmp_s, ops=self._ops)  # a live writer's is young
        remove_temporaries(Stage.REJECTED.dir(self.run_dir), ops=self._ops)

    def start(self) -> "Inbox":
        """Recover, watch, and list what is already there (arrived while the worker was down)."""
        self.recover()
        observer = self._observer_factory()
        observer.schedule(_Recorder(self.dir, self._events), str(self.dir), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer
        # Listed after the watch is in place, so nothing arriving in between is missed.
        self._rescan()
        return self

    def stop(self) -> None:
        if self._observer is None:
            return
        # watchdog logs an ERROR when a move event it was still pairing arrives while it stops
        # (files we just moved out of inbox/); harmless, and not worth alarming a user about.
        inotify_log = logging.getLogger("watchdog.observers.inotify")
        inotify_log.addFilter(_drop_stop_race)
        try:
            self._observer.stop()
            self._observer.join(timeout=5)
        finally:
            inotify_log.removeFilter(_drop_stop_race)
            self._observer = None

    def __enter__(self) -> "Inbox":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ---- arrivals ------------------------------------------------------------------------

    def _note(self, name: str, kind: str) -> None:
        if not is_candidate_name(name):
            return
        ready = kind in _READY_KINDS
        if name in self._pending and kind not in _READY_KINDS:
            self._pending[name] = False  # written to again after a close: wait until it settles
        elif name not in self._pending or ready:
            self._pending[name] = ready

    def _rescan(self) -> None:
        self._last_scan = self._clock()
        entries = []
        try:
            with os.scandir(self.dir) as it:
                for e in it:
                    if not is_candidate_name(e.name) or e.is_dir(follow_symlinks=False):
                        continue
                    try:
                        entries.append((e.stat(follow_symlinks=False).st_mtime, e.name))
                    except FileNotFoundError:
                        continue
        except FileNotFoundError:
            return
        for _, name in sorted(entries):  # oldest first: arrival order, as far as it is known
            if name not in self._pending:
                self._pending[name] = False

    def _drain(self) -> None:
        while True:
            try:
                name, kind = self._events.get_nowait()
            except queue.Empty:
                return
            self._note(name, kind)

    def poll(self) -> list[IntakeResult]:
        """Take every arrival whose writer is done: validate it and move it to queue/ or rejected/."""
        self._drain()
        if self._clock() - self._last_scan >= self._rescan_s:
            self._rescan()
        results = []
        for name, ready in list(self._pending.items()):
            try:
                st = (self.dir / name).lstat()
            except FileNotFoundError:
                del self._pending[name]  # taken away by its writer
                continue
            if not ready and self._wall() - st.st_mtime < self._settle_s:
                continue
            del self._pending[name]
            result = self.intake(name)
            if result is not None:
                results.append(result)
        return results

    def queued(self) -> int:
        return len(data_files(self.run_dir, Stage.QUEUED))

    def wait_for_work(self, timeout: float) -> bool:
        """Block until queue/ holds a file (True) or `timeout` passes (False).

        Wakes on the observer's first event for a new file; a file still being written is
        re-checked every `settle_s / 2`.
        """
        deadline = self._clock() + timeout
        while True:
            self.poll()
            if self.queued():
                return True
            remaining = deadline - self._clock()
            if remaining <= 0:
                return False
            wait = min(remaining, self._rescan_s, self._settle_s / 2 if self._pending else remaining)
            try:
                name, kind = self._events.get(timeout=max(wait, 0.01))
            except queue.Empty:
                continue
            self._note(name, kind)

    # ---- one file ------------------------------------------------------------------------

    def intake(self, name: str) -> Optional[IntakeResult]:
        """Validate `inbox/<name>` and move it to queue/ or rejected/ (None if it is gone or a directory)."""
        path = self.dir / name
        if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)):
            return None
        ensure_dirs(self.run_dir)
        try:
            a = assess(path, self._validator, known_digests=known_digests(self.run_dir), **self._limits)
        except FileNotFoundError:
            return None  # taken back by its writer while we looked
        if not a.accepted:
            return self._reject(name, a)
        seq = max((d.number for d in data_files(self.run_dir, Stage.QUEUED)), default=0) + 1
        qname = DataName(seq, a.sha16, name).filename
        report = None
        if a.skipped_lines:
            # Named by content and name, so that an intake retried after a crash rewrites it.
            report = Stage.REJECTED.dir(self.run_dir) / f"{a.sha16}-{name}.skipped.json"
            self._ops.write_file(report, _json_bytes(a.report(action="skip_lines", queued_as=qname)))
        dest = move(self.run_dir, name, Stage.INBOX, Stage.QUEUED, qname, ops=self._ops)
        return IntakeResult(name, "queued", dest, a, report)

    def _reject(self, name: str, a: Assessment) -> IntakeResult:
        rejected = Stage.REJECTED.dir(self.run_dir)
        # The first name whose data file is free: a report left by a crash before the move is
        # simply rewritten by the retry.
        rname = next(n for n in unique_names(name) if not os.path.lexists(rejected / n))
        report = rejected / f"{rname}.error.json"
        self._ops.write_file(report, _json_bytes(a.report(action="reject_file", rejected_as=rname)))
        dest = move(self.run_dir, name, Stage.INBOX, Stage.REJECTED, rname, ops=self._ops)
        return IntakeResult(name, "rejected", dest, a, report)


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, ensure_ascii=False) + "\n").encode()


def _line_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


# --------------------------------------------------------------------------------------------
# The training loop's source of examples


INF_LINE = 1 << 62  # "after every line": the frontier of a finished file


class PositionError(ValueError):
    pass


@dataclass(frozen=True)
class Item:
    id: str  # <sha16>:<line>
    file: str  # processing/ or done/ file name
    line: int  # 1-based, in the file as published
    example: Any  # what the validator returned for that line
    replay: bool = False


@dataclass
class _Loaded:
    dn: DataName
    examples: list
    lines: list[int]


def default_line_of(example: Any) -> int:
    """The 1-based source line of a validator's example: `example["line"]` or `example.line`."""
    if isinstance(example, dict):
        return int(example["line"])
    return int(getattr(example, "line"))


def _uniform(seed: int, counter: int) -> float:
    """Counter-based generator: draw k depends only on (seed, k), so the state is one integer."""
    digest = hashlib.sha256(f"hangwatch-replay:{seed}:{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _read_jsonl(path: Path, ops: FsOps) -> list[tuple[int, dict]]:
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

    def __init__(self, run_dir: os.PathLike | str, loader: Validator, *, replay_ratio: float = 0.0,
                 seed: int = 0, line_of: Callable[[Any], int] = default_line_of, cache_files: int = 4,
                 ops: Optional[FsOps] = None):
        if not 0 <= replay_ratio < 1:
            raise ValueError(f"replay_ratio must be in [0, 1), got {replay_ratio!r}")
        self.run_dir = Path(run_dir)
        self._loader = loader
        self._ratio = float(replay_ratio)
        self._seed = int(seed)
        self._line_of = line_of
        self._cache: "collections.OrderedDict[str, _Loaded]" = collections.OrderedDict()
        self._cache_files = max(1, cache_files)
        self._ops = ops or FsOps()
        self._restored = False
        self.warnings: list[str] = []  # for the worker to pass on as `warn` beats
        self._reset()

    def _reset(self) -> None:
        self._cur: Optional[_Loaded] = None
        self._take = 0  # take number of the current file (0: none yet)
        self._next = 0
        self._rng = 0
        self._replay_n = 0
        self._pending: list[list] = []  # replay draws not yet in replay.jsonl: [n, id, file, line]
        self._pool_files: list[str] = []
        self._pool_cum: list[int] = []
        self._last_key: Optional[tuple[int, int]] = None  # (take, line) of the last ledger entry
        self._replay_logged = 0

    @classmethod
    def from_config(cls, run_dir: os.PathLike | str, loader: Validator, cfg: Any, **kw: Any) -> "ContinuousSource":
        return cls(run_dir, loader, replay_ratio=cfg.data.replay_ratio, seed=cfg.train.seed, **kw)

    @property
    def _ledger(self) -> Path:
        return Stage.DONE.dir(self.run_dir) / LEDGER

    @property
    def _replay_log(self) -> Path:
        return Stage.DONE.dir(self.run_dir) / REPLAY_LOG

    # ---- files ---------------------------------------------------------------------------

    def _path_of(self, filename: str) -> Optional[Path]:
        for stage in (Stage.PROCESSING, Stage.DONE):
            p = stage.dir(self.run_dir) / filename
            if p.exists():
                return p
        return None

    def _load(self, dn: DataName) -> _Loaded:
        hit = self._cache.get(dn.filename)
        if hit is not None:
            self._cache.move_to_end(dn.filename)
            return hit
        path = self._path_of(dn.filename)
        if path is None:
            raise FileNotFoundError(f"{dn.filename} is in neither processing/ nor done/")
        examples, _problems = self._loader(path)  # bad lines were reported at intake
        pairs = sorted(((self._line_of(e), e) for e in examples), key=lambda t: t[0])
        loaded = _Loaded(dn, [e for _, e in pairs], [line for line, _ in pairs])
        self._cache[dn.filename] = loaded
        while len(self._cache) > self._cache_files:
            self._cache.popitem(last=False)
        return loaded

    def _files(self) -> list[DataName]:
        files = data_files(self.run_dir, Stage.PROCESSING) + data_files(self.run_dir, Stage.DONE)
        return sorted(files, key=lambda d: d.number)

    def _write_current(self) -> None:
        cur = self._cur
        live = cur is not None and self._next < len(cur.lines)
        state = {"file": cur.dn.filename if live else None, "index": self._next if live else 0,
                 "total": len(cur.lines) if live else 0}
        self._ops.write_file(Stage.PROCESSING.dir(self.run_dir) / CURRENT, _json_bytes(state), durable=False)

    # ---- position ------------------------------------------------------------------------

    def position(self, step: Optional[int] = None) -> dict:
        """Where training is, as JSON-able data to store in a checkpoint (with its `step`, if given:
        `restore` then records that step in the ledger lines it adds)."""
        cur = self._cur
        return {
            "kind": "inbox",
            "v": 1,
            "step": step,
            "file": cur.dn.filename if cur else None,
            "take": self._take,
            "digest": cur.dn.sha16 if cur else None,
            "next": self._next,
            "total": len(cur.lines) if cur else 0,
            "line": cur.lines[self._next] if cur and self._next < len(cur.lines) else None,
            "rng": self._rng,
            "replay_n": self._replay_n,
            "replay_pending": [list(x) for x in self._pending],
        }

    def progress(self) -> dict:
        """Small fields for a heartbeat."""
        cur = self._cur
        return {"file": cur.dn.filename if cur else None, "index": self._next,
                "total": len(cur.lines) if cur else 0, "replays": self._replay_n}

    @staticmethod
    def _frontier(pos: Optional[dict]) -> tuple[int, int]:
        """Examples with (take, line) below this were trained before `pos`."""
        if not pos:
            return (0, 0)
        if not pos.get("file"):
            # No current file (fresh, or it vanished): everything up to its take number is done.
            return (int(pos["take"]), INF_LINE) if pos.get("take") else (0, 0)
        line = pos.get("line")
        return (int(pos["take"]), INF_LINE if line is None else int(line))

    @staticmethod
    def _check_position(pos: Optional[dict]) -> dict:
        if pos is None:
            return {}
        if not isinstance(pos, dict) or pos.get("kind") != "inbox" or pos.get("v") != 1:
            raise PositionError(f"not a continuous-mode position (kind inbox, version 1): {pos!r:.200}")
        for key in ("take", "next", "rng", "replay_n"):
            if not isinstance(pos.get(key), int) or pos[key] < 0:
                raise PositionError(f"position: {key} must be a non-negative integer, got {pos.get(key)!r}")
        if pos.get("file") is not None and DataName.parse(pos["file"]) is None:
            raise PositionError(f"position: file {pos['file']!r} is not a processing/done file name")
        return pos

    # ---- ledger --------------------------------------------------------------------------

    @staticmethod
    def _entry_key(obj: dict) -> Optional[tuple[int, int]]:
        dn = DataName.parse(str(obj.get("file", "")))
        line = obj.get("line")
        return (dn.number, line) if dn is not None and isinstance(line, int) else None

    def _covered_examples(self, after: Optional[tuple[int, int]], front: tuple[int, int]) -> Iterator[tuple[DataName, int]]:
        """(file, line) of every example with after < (take, line) < front, in training order."""
        for dn in self._files():
            if dn.number > front[0] or (after is not None and dn.number < after[0]):
                continue
            try:
                loaded = self._load(dn)
            except FileNotFoundError:
                continue
            for line in loaded.lines:
                key = (dn.number, line)
                if (after is None or key > after) and key < front:
                    yield dn, line

    def _append_ledger(self, front: tuple[int, int], step: Optional[int]) -> int:
        lines = []
        last = self._last_key
        for dn, line in self._covered_examples(self._last_key, front):
            lines.append(_line_bytes({"id": f"{dn.sha16}:{line}", "file": dn.filename, "line": line, "step": step}))
            last = (dn.number, line)
        if lines:
            self._ops.append(self._ledger, b"".join(lines))
            self._last_key = last
        return len(lines)

    def _append_replays(self, pos: dict, step: Optional[int]) -> int:
        lines = []
        for n, rid, fname, line in pos.get("replay_pending", []):
            if self._replay_logged < n <= pos["replay_n"]:
                lines.append(_line_bytes({"n": n, "id": rid, "file": fname, "line": line, "step": step}))
                self._replay_logged = n
        if lines:
            self._ops.append(self._replay_log, b"".join(lines))
        return len(lines)

    def _complete_files(self, front: tuple[int, int], reopen: bool) -> tuple[list[str], list[str]]:
        """Move covered files to done/ (and, on restore, uncovered ones back to processing/)."""
        def covered(dn: DataName) -> bool:
            return dn.number < front[0] or (dn.number == front[0] and front[1] == INF_LINE)

        completed, reopened = [], []
        for dn in data_files(self.run_dir, Stage.PROCESSING):
            if covered(dn):
                move(self.run_dir, dn.filename, Stage.PROCESSING, Stage.DONE, ops=self._ops)
                completed.append(dn.filename)
        if reopen:
            for dn in data_files(self.run_dir, Stage.DONE):
                if not covered(dn):
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
        pos = self._check_position(position)
        if step is None:
            step = pos.get("step")
        ensure_dirs(self.run_dir)
        for stage in (Stage.QUEUED, Stage.PROCESSING, Stage.DONE, Stage.REJECTED):
            remove_temporaries(stage.dir(self.run_dir), ops=self._ops)
        self._reset()
        self._cache.clear()
        self.warnings = []
        front = self._frontier(pos)
        summary: dict[str, Any] = {"ledger_trimmed": 0, "ledger_added": 0, "replay_trimmed": 0,
                                   "replay_added": 0, "completed": [], "reopened": []}

        counts: collections.Counter = collections.Counter()
        entries = _read_jsonl(self._ledger, self._ops)
        for i, (offset, obj) in enumerate(entries):
            key = self._entry_key(obj)
            if key is None:
                continue
            if key >= front:
                self._ops.truncate(self._ledger, offset)
                summary["ledger_trimmed"] = len(entries) - i
                break
            counts[obj["file"]] += 1
            self._last_key = key
        before = self._last_key
        summary["ledger_added"] = self._append_ledger(front, step)
        for dn, _line in self._covered_examples(before, front):
            counts[dn.filename] += 1

        replay_n = pos.get("replay_n", 0)
        for i, (offset, obj) in enumerate(replays := _read_jsonl(self._replay_log, self._ops)):
            n = obj.get("n")
            if isinstance(n, int) and n > replay_n:
                self._ops.truncate(self._replay_log, offset)
                summary["replay_trimmed"] = len(replays) - i
                break
            if isinstance(n, int):
                self._replay_logged = n
        summary["replay_added"] = self._append_replays(pos, step) if pos else 0
        self._replay_logged = max(self._replay_logged, replay_n)

        summary["completed"], summary["reopened"] = self._complete_files(front, reopen=True)

        for dn in self._files():
            if dn.number < front[0]:
                self._pool_add(dn.filename, counts[dn.filename])
        self._take = front[0] if pos else 0
        self._rng = pos.get("rng", 0)
        self._replay_n = replay_n
        if pos.get("file"):
            dn = DataName.parse(pos["file"])
            try:
                self._cur = self._load(dn)
            except FileNotFoundError:
                self.warnings.append(f"{pos['file']} (the file the checkpoint was training on) is gone; "
                                     "continuing with the next file")
            else:
                lines = self._cur.lines
                self._next = len(lines) if pos.get("line") is None else bisect.bisect_left(lines, pos["line"])
                if self._next != pos["next"]:
                    self.warnings.append(
                        f"{pos['file']}: line {pos.get('line')} is example {self._next}, the checkpoint said "
                        f"{pos['next']} (did the validator or data settings change?)")
        self._restored = True
        self._write_current()
        summary["warnings"] = list(self.warnings)
        return summary

    def commit(self, position: dict, step: Optional[int] = None) -> dict:
        """A checkpoint holding `position` was committed: record and complete what it covers.

        Appends a ledger line per example trained before `position` and not yet recorded, logs
        its replay draws, and moves files whose last example it covers to done/.  Idempotent; a
        position older than the last commit changes nothing.  `step` defaults to the position's.
        """
        if not self._restored:
            raise RuntimeError("call restore() before commit()")
        pos = self._check_position(position)
        if step is None:
            step = pos.get("step")
        front = self._frontier(pos)
        added = 0
        if self._last_key is None or self._last_key < front:
            added = self._append_ledger(front, step)
        replays = self._append_replays(pos, step)
        self._pending = [x for x in self._pending if x[0] > pos["replay_n"]]
        completed, _ = self._complete_files(front, reopen=False)
        self._write_current()
        return {"ledger_added": added, "replay_added": replays, "completed": completed}

    # ---- examples ------------------------------------------------------------------------

    def _pool_add(self, filename: str, count: int) -> None:
        if count > 0:
            self._pool_files.append(filename)
            self._pool_cum.append((self._pool_cum[-1] if self._pool_cum else 0) + count)

    def _advance(self) -> bool:
        """Open the next file in training order; False when there is none yet."""
        while True:
            later = [dn for dn in data_files(self.run_dir, Stage.PROCESSING) if dn.number > self._take]
            if later:
                dn = later[0]
            else:
                head = next(iter(queue_order(self.run_dir)), None)
                if head is None:
                    return False
                take = max((d.number for d in self._files()), default=0)
                dn = DataName(max(take, self._take) + 1, head.sha16, head.name)
                move(self.run_dir, head.filename, Stage.QUEUED, Stage.PROCESSING, dn.filename, ops=self._ops)
            if self._cur is not None:
                self._pool_add(self._cur.dn.filename, len(self._cur.lines))
                self._cur = None
            self._take = dn.number
            self._next = 0
            try:
                self._cur = self._load(dn)
            except Exception as exc:  # it validated at intake; failing now must not stop training
                self._reject_unloadable(dn, exc)
                continue
            self._write_current()
            return True

    def _reject_unloadable(self, dn: DataName, exc: Exception) -> None:
        rejected = Stage.REJECTED.dir(self.run_dir)
        rname = next(n for n in unique_names(dn.filename) if not os.path.lexists(rejected / n))
        message = f"could not be loaded for training: {type(exc).__name__}: {exc}"
        report = {"file": dn.filename, "sha256_16": dn.sha16, "action": "reject_file", "rejected_as": rname,
                  "reasons": [{"code": "load_failed", "message": message}], "problems": [], "problems_total": 0,
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._ops.write_file(rejected / f"{rname}.error.json", _json_bytes(report))
        move(self.run_dir, dn.filename, Stage.PROCESSING, Stage.REJECTED, rname, ops=self._ops)
        self.warnings.append(f"{dn.filename}: {message}; moved to rejected/{rname}")

    def has_fresh(self) -> bool:
        """Whether a new (non-replay) example is available now (may open the next file)."""
        if not self._restored:
            raise RuntimeError("call restore() before reading examples")
        while self._cur is None or self._next >= len(self._cur.lines):
            if not self._advance():
                return False
        return True

    def next_example(self) -> Optional[Item]:
        """The next example to train on, or None while there is no new data (go idle)."""
        if not self.has_fresh():
            return None
        if self._ratio > 0:
            coin = _uniform(self._seed, self._rng)
            self._rng += 1
            if coin < self._ratio and self._pool_cum:
                item = self._draw_replay()
                if item is not None:
                    return item
        cur = self._cur
        assert cur is not None
        i = self._next
        self._next += 1
        line = cur.lines[i]
        return Item(f"{cur.dn.sha16}:{line}", cur.dn.filename, line, cur.examples[i])

    def take(self, n: int) -> list[Any]:
        """`daemon.data.DataSource.take`: up to `n` examples as the validator made them."""
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
        total = self._pool_cum[-1]
        r = min(int(_uniform(self._seed, self._rng) * total), total - 1)
        self._rng += 1
        k = bisect.bisect_right(self._pool_cum, r)
        j = r - (self._pool_cum[k - 1] if k else 0)
        filename = self._pool_files[k]
        try:
            loaded = self._load(DataName.parse(filename))  # type: ignore[arg-type]
            example, line = loaded.examples[j], loaded.lines[j]
        except (FileNotFoundError, IndexError):
            return None  # deleted or changed under us: train a fresh example instead
        self._replay_n += 1
        rid = f"{loaded.dn.sha16}:{line}"
        self._pending.append([self._replay_n, rid, filename, line])
        return Item(rid, filename, line, example, replay=True)
