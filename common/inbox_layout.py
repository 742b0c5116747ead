"""Continuous mode's files in the run dir: the stages a data file moves through, their names, and
the queue counts `hangwatch status` shows.

The standard library only: the supervisor (`status`) imports this module and must not pull in
torch or a file-watching thread.  The worker's side (intake, assessment, publishing, the training
order and ledger) is `hangwatch.daemon.inbox`.

A data file goes through these stages, each a directory of the run dir:

    inbox/ ──intake──▶ queue/ ──taken──▶ processing/ ──covered by a checkpoint──▶ done/
       │                                     │  ▲                                   │
       └──────────▶ rejected/ ◀──────────────┘  └────────── rollback ───────────────┘

    INBOX → QUEUED | REJECTED      validated on arrival (bad or duplicate: rejected with a report)
    QUEUED → PROCESSING            taken by the training loop, in queue order
    PROCESSING → DONE              a committed checkpoint covers its last example
    PROCESSING → REJECTED          it could not be loaded at training time
    DONE → PROCESSING              resume from a checkpoint older than the file's completion

Every move is one `rename` inside the run dir followed by an fsync of both directories, so a
crash at any instant leaves each file in exactly one stage.  Names carry what must survive a
crash:

    inbox/<name>                               as published (`p<N>-<name>`: priority N, 0-99)
    queue/<seq:08d>-<sha16>-<name>             seq: arrival order
    processing/, done/<take:08d>-<sha16>-<name>    take: the order the training loop took files in
    rejected/<name>  + rejected/<name>.error.json
    rejected/<sha16>-<name>.skipped.json       with data.on_bad_lines = skip_lines: the lines left out
    done/ledger.jsonl, done/replay.jsonl

`sha16` is the first 16 hex digits of the file's sha256; an example's stable id is
`<sha16>:<line>` (1-based line in the file as published).  Note `Stage.QUEUED` is the directory
`queue/`.
"""

from __future__ import annotations

import enum
import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import read_json
from hangwatch.common.transitions import IllegalTransition

MAX_NAME_BYTES = 200  # leaves room for the 26-character queue prefix within NAME_MAX (255)
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".crdownload", ".swp", "~")
LEDGER = "ledger.jsonl"
REPLAY_LOG = "replay.jsonl"
CURRENT = ".current.json"  # in processing/: what the training loop is on (for status)
ERROR_SUFFIX = ".error.json"  # rejected/<name>.error.json: why <name> was rejected

_DATA_NAME = re.compile(r"^(\d{8})-([0-9a-f]{16})-(.+)$")
_PRIORITY = re.compile(r"^p(\d{1,2})-(?=.)")


class Stage(enum.Enum):
    INBOX = "inbox"
    QUEUED = "queue"
    PROCESSING = "processing"
    DONE = "done"
    REJECTED = "rejected"

    def dir(self, run_dir: os.PathLike | str) -> Path:
        return Path(run_dir) / self.value


TRANSITIONS: dict[Stage, frozenset[Stage]] = {
    Stage.INBOX: frozenset({Stage.QUEUED, Stage.REJECTED}),
    Stage.QUEUED: frozenset({Stage.PROCESSING}),
    Stage.PROCESSING: frozenset({Stage.DONE, Stage.REJECTED}),
    Stage.DONE: frozenset({Stage.PROCESSING}),
    Stage.REJECTED: frozenset(),
}


# --------------------------------------------------------------------------------------------
# Names


def is_candidate_name(name: str) -> bool:
    """A name the inbox takes: not a dot-file (publishing temporaries) nor a partial download."""
    return bool(name) and not name.startswith(".") and not name.endswith(PARTIAL_SUFFIXES)


def priority_of(name: str) -> int:
    """`p<N>-data.jsonl` → N (0-99; higher is taken first); anything else → 0."""
    m = _PRIORITY.match(name)
    return int(m.group(1)) if m else 0


def with_priority(name: str, priority: int) -> str:
    """`name` published at `priority`: its `p<N>-` prefix set (an existing one replaced)."""
    m = _PRIORITY.match(name)
    return f"p{priority}-{name[m.end() :] if m else name}"


@dataclass(frozen=True)
class DataName:
    """`<number:08d>-<sha16>-<name>`: number is the arrival seq in queue/, the take order after."""

    number: int
    sha16: str
    name: str

    @property
    def filename(self) -> str:
        return f"{self.number:08d}-{self.sha16}-{self.name}"

    @property
    def priority(self) -> int:
        return priority_of(self.name)

    @classmethod
    def parse(cls, filename: str) -> Optional["DataName"]:
        m = _DATA_NAME.match(filename)
        return cls(int(m.group(1)), m.group(2), m.group(3)) if m else None


def data_files(run_dir: os.PathLike | str, stage: Stage) -> list[DataName]:
    """The data files of queue/, processing/ or done/, by number (ledgers and reports excluded)."""
    try:
        names = os.listdir(stage.dir(run_dir))
    except FileNotFoundError:
        return []
    out = [d for d in map(DataName.parse, names) if d is not None]
    out.sort(key=lambda d: d.number)
    return out


def queue_order(run_dir: os.PathLike | str) -> list[DataName]:
    """queue/ in the order the training loop takes it: higher priority first, then arrival."""
    return sorted(data_files(run_dir, Stage.QUEUED), key=lambda d: (-d.priority, d.number))


# --------------------------------------------------------------------------------------------
# Moves


def ensure_dirs(run_dir: os.PathLike | str) -> None:
    for stage in Stage:
        stage.dir(run_dir).mkdir(parents=True, exist_ok=True)


def move(
    run_dir: os.PathLike | str,
    filename: str,
    src: Stage,
    dst: Stage,
    new_name: Optional[str] = None,
    ops: Optional[FsOps] = None,
) -> Path:
    """Move one data file between stages (a legal transition only); returns the new path."""
    if dst not in TRANSITIONS[src]:
        raise IllegalTransition(f"{filename}: {src.value}/ → {dst.value}/ is not a legal move")
    target = dst.dir(run_dir) / (new_name or filename)
    if target.exists():
        # rename() would silently replace it and lose a file.
        raise FileExistsError(errno.EEXIST, f"{target} already exists")
    (ops or FsOps()).rename(src.dir(run_dir) / filename, target)
    return target


# --------------------------------------------------------------------------------------------
# Status (supervisor: cheap, no torch, no threads)


class LineCounter:
    """Lines of append-only files, reading only what was appended since the last count.

    Hold one for as long as the same files are counted again (the supervisor: for the run)."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, int, int]] = {}  # path → (inode, bytes counted, lines)

    def count(self, path: Path) -> int:
        try:
            st = path.stat()
        except FileNotFoundError:
            return 0
        key = str(path)
        ino, done_bytes, lines = self._seen.get(key, (st.st_ino, 0, 0))
        if ino != st.st_ino or st.st_size < done_bytes:  # replaced or truncated (rollback)
            done_bytes, lines = 0, 0
        with open(path, "rb") as f:
            f.seek(done_bytes)
            while True:
                block = f.read(1 << 20)
                if not block:
                    break
                lines += block.count(b"\n")
                done_bytes += len(block)
        self._seen[key] = (st.st_ino, done_bytes, lines)
        return lines


def queue_status(run_dir: os.PathLike | str, lines: Optional[LineCounter] = None) -> dict:
    """Counts for `hangwatch status`: a few directory listings and one small file.

    `lines` keeps the ledger's line count between calls (without one the ledger is read whole)."""
    inbox = Stage.INBOX.dir(run_dir)
    try:
        arriving = sum(1 for n in os.listdir(inbox) if is_candidate_name(n))
    except FileNotFoundError:
        arriving = 0
    processing = data_files(run_dir, Stage.PROCESSING)
    current = read_json(Stage.PROCESSING.dir(run_dir) / CURRENT) or {}
    progress = None
    if current.get("file") and isinstance(current.get("total"), int):
        progress = {"index": current.get("index", 0), "total": current["total"]}
    try:
        rejected_names = set(os.listdir(Stage.REJECTED.dir(run_dir)))
    except FileNotFoundError:
        rejected_names = set()
    rejected = sum(1 for n in rejected_names if n.endswith(ERROR_SUFFIX) and n[: -len(ERROR_SUFFIX)] in rejected_names)
    return {
        "inbox": arriving,
        "waiting": len(data_files(run_dir, Stage.QUEUED)),
        "processing": len(processing),
        "current_file": current.get("file"),
        "current_progress": progress,
        "rejected": rejected,
        "done": len(data_files(run_dir, Stage.DONE)),
        "ledger_examples": (lines or LineCounter()).count(Stage.DONE.dir(run_dir) / LEDGER),
    }
