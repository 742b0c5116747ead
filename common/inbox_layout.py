"""Continuous mode, the file side: where a data file is, how it moves, and what is wrong with it.

The standard library only: the CLI (`hangwatch submit`) and the supervisor (`status`) import this
module, and neither may pull in torch or a file-watching thread.

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
`<sha16>:<line>` (1-based line in the file as published).
"""
from __future__ import annotations

import ctypes
import enum
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 1024 * 1024
MAX_NAME_BYTES = 200  # leaves room for the 26-character queue prefix within NAME_MAX (255)
MAX_REPORTED_PROBLEMS = 1000
TMP_PREFIX = ".tmp-"
PARTIAL_SUFFIXES = (".tmp", ".part", ".partial", ".crdownload", ".swp", "~")
LEDGER = "ledger.jsonl"
REPLAY_LOG = "replay.jsonl"
CURRENT = ".current.json"  # in processing/: what the training loop is on (for status)

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


class IllegalTransition(ValueError):
    pass


def ensure_dirs(run_dir: os.PathLike | str) -> None:
    for stage in Stage:
        stage.dir(run_dir).mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------------------------
# Names


def is_candidate_name(name: str) -> bool:
    """A name the inbox takes: not a dot-file (publishing temporaries) nor a partial download."""
    return bool(name) and not name.startswith(".") and not name.endswith(PARTIAL_SUFFIXES)


def priority_of(name: str) -> int:
    """`p<N>-data.jsonl` → N (0-99; higher is taken first); anything else → 0."""
    m = _PRIORITY.match(name)
    return int(m.group(1)) if m else 0


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


def unique_names(name: str) -> Iterable[str]:
    """name, name-2, name-3, … with the counter before the last extension (data-2.jsonl)."""
    yield name
    stem, dot, ext = name.rpartition(".")
    if not stem:
        stem, dot, ext = name, "", ""
    n = 2
    while True:
        yield f"{stem}-{n}{dot}{ext}"
        n += 1


def check_name(name: str) -> Optional[str]:
    """Why `name` cannot be published into the inbox, or None."""
    if not name or "/" in name or name in (".", ".."):
        return f"{name!r} is not a file name"
    if not is_candidate_name(name):
        return f"{name!r} would be ignored by the inbox (dot-files and {', '.join(PARTIAL_SUFFIXES)} are partial files)"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"file name is {len(name.encode())} bytes, longer than {MAX_NAME_BYTES}"
    return None


# --------------------------------------------------------------------------------------------
# Durable file operations (the crash seam: tests pass a subclass that dies between operations)


def fsync_dir(path: os.PathLike | str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsOps:
    """Every change continuous mode makes to the run dir goes through one of these methods."""

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)
        fsync_dir(dst.parent)
        if src.parent != dst.parent:
            fsync_dir(src.parent)

    def write_file(self, path: Path, data: bytes, durable: bool = True) -> None:
        """Atomic replace: a reader sees the old content or the new, never a mix."""
        tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{secrets.token_hex(4)}")
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
        if durable:
            fsync_dir(path.parent)

    def append(self, path: Path, data: bytes) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)
        fd = os.open(path, os.O_WRONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)


def move(run_dir: os.PathLike | str, filename: str, src: Stage, dst: Stage,
         new_name: Optional[str] = None, ops: Optional[FsOps] = None) -> Path:
    """Move one data file between stages (a legal transition only); returns the new path."""
    if dst not in TRANSITIONS[src]:
        raise IllegalTransition(f"{filename}: {src.value}/ → {dst.value}/ is not a legal move")
    target = dst.dir(run_dir) / (new_name or filename)
    if target.exists():
        # rename() would silently replace it and lose a file.
        raise FileExistsError(errno.EEXIST, f"{target} already exists")
    (ops or FsOps()).rename(src.dir(run_dir) / filename, target)
    return target


def remove_temporaries(directory: Path, older_than_s: float = 0.0, now: Optional[float] = None,
                       ops: Optional[FsOps] = None) -> list[str]:
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


# --------------------------------------------------------------------------------------------
# Publishing (writers: `hangwatch submit`, scripts)

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2: Any = None


def _rename_noreplace(src: Path, dst: Path) -> bool:
    """rename(2) that fails with FileExistsError rather than replace `dst`; False if unsupported."""
    global _renameat2
    if _renameat2 is None:
        try:
            _renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", False)
        except OSError:
            _renameat2 = False
    if not _renameat2:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), str(dst))
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def publish(src_path: os.PathLike | str, run_dir: os.PathLike | str, *, name: Optional[str] = None,
            priority: Optional[int] = None) -> Path:
    """Copy a file into `<run_dir>/inbox/` so that the inbox only ever sees it complete.

    The copy is written to `inbox/.tmp-<name>-<rand>` (dot-files are ignored), fsynced, then
    renamed to its final name with RENAME_NOREPLACE (a hard link where the kernel or file system
    lacks it), which fails instead of replacing a file of the same name, so two writers never
    clobber each other; a taken name gets `-2`, `-3`, … before its extension.
    `priority` (0-99, higher first) becomes the `p<N>-` name prefix.  Returns the published path.
    """
    src = Path(src_path)
    name = name or src.name
    if priority is not None:
        if not (isinstance(priority, int) and 0 <= priority <= 99):
            raise ValueError(f"priority must be an integer from 0 to 99, got {priority!r}")
        m = _PRIORITY.match(name)
        name = f"p{priority}-{name[m.end():] if m else name}"
    why = check_name(name)
    if why:
        raise ValueError(why)
    if not src.is_file():
        raise FileNotFoundError(errno.ENOENT, f"{src}: not a regular file")
    inbox = Stage.INBOX.dir(run_dir)
    inbox.mkdir(parents=True, exist_ok=True)
    tmp = inbox / f"{TMP_PREFIX}{name}-{secrets.token_hex(4)}"
    try:
        with open(src, "rb") as fi, open(tmp, "xb") as fo:
            shutil.copyfileobj(fi, fo, 1 << 20)
            fo.flush()
            os.fsync(fo.fileno())
        for candidate in unique_names(name):
            final = inbox / candidate
            try:
                if _rename_noreplace(tmp, final):
                    break
                os.link(tmp, final)  # no renameat2 here: a link also refuses a taken name
                break
            except FileExistsError:
                continue
            except OSError as exc:
                if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    raise
                # Neither (some FUSE/network file systems): check, then rename.
                if final.exists():
                    continue
                os.rename(tmp, final)
                break
        fsync_dir(inbox)
        return final
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Checking a file


@dataclass
class Assessment:
    """What intake (or the `hangwatch submit` pre-check) found out about one file."""

    path: Path
    sha256: Optional[str] = None
    size: int = 0
    lines: int = 0
    examples: int = 0
    reasons: list[dict] = field(default_factory=list)  # file-level: {code, message[, line]}
    problems: list[dict] = field(default_factory=list)  # line-level: {line, error}
    problems_total: int = 0
    accepted: bool = False
    skipped_lines: bool = False  # accepted with its bad lines left out (on_bad_lines = skip_lines)

    @property
    def sha16(self) -> Optional[str]:
        return self.sha256[:16] if self.sha256 else None

    def summary(self) -> str:
        if self.accepted:
            extra = f", {self.problems_total} bad line(s) skipped" if self.skipped_lines else ""
            return f"{self.path.name}: accepted, {self.examples} example(s){extra}"
        parts = [r["message"] for r in self.reasons]
        parts += [f"line {p['line']}: {p['error']}" for p in self.problems[:5]]
        if self.problems_total > 5:
            parts.append(f"… {self.problems_total - 5} more bad line(s)")
        return f"{self.path.name}: rejected: " + "; ".join(parts)

    def report(self, **extra: Any) -> dict:
        return {
            "file": self.path.name,
            "sha256": self.sha256,
            "bytes": self.size,
            "lines": self.lines,
            "examples_ok": self.examples,
            "reasons": self.reasons,
            "problems": self.problems,
            "problems_total": self.problems_total,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **extra,
        }


def _reason(code: str, message: str, **extra: Any) -> dict:
    return {"code": code, "message": message, **extra}


def check_file(path: os.PathLike | str, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
               max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> Assessment:
    """File-level checks, one streaming pass that also computes the sha256.

    Reasons (codes): not_regular, unreadable, too_large, empty, binary (a NUL byte), not_utf8,
    huge_line.  A file with any of them is rejected whole, before a validator has to parse it.
    Raises FileNotFoundError when the file is gone.
    """
    p = Path(path)
    a = Assessment(path=p)
    st = p.lstat()
    a.size = st.st_size
    if not os.path.isfile(p) or os.path.islink(p):
        a.reasons.append(_reason("not_regular", "not a regular file (symlink, device or fifo)"))
        return a
    if st.st_size > max_file_bytes:
        a.reasons.append(_reason(
            "too_large", f"file is {st.st_size} bytes, larger than data.max_file_bytes = {max_file_bytes}"))
        return a
    h = hashlib.sha256()
    seen: set[str] = set()
    nonblank = 0
    lineno = 0
    try:
        f = open(p, "rb")
    except FileNotFoundError:
        raise
    except OSError as exc:
        a.reasons.append(_reason("unreadable", f"cannot read: {exc.strerror or exc}"))
        return a
    with f:
        while True:
            chunk = f.readline(max_line_bytes + 1)
            if not chunk:
                break
            lineno += 1
            h.update(chunk)
            has_nul = b"\0" in chunk
            huge = not chunk.endswith(b"\n") and len(chunk) > max_line_bytes
            if huge:
                # Stream the rest of this line: hashed and measured, never held whole in memory.
                length = len(chunk)
                while not chunk.endswith(b"\n"):
                    chunk = f.readline(1 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
                    length += len(chunk)
                    has_nul = has_nul or b"\0" in chunk
                length -= chunk.endswith(b"\n")
            if has_nul:
                if "binary" not in seen:
                    seen.add("binary")
                    a.reasons.append(_reason("binary", f"binary file: NUL byte on line {lineno}", line=lineno))
            elif huge:
                if "huge_line" not in seen:
                    seen.add("huge_line")
                    a.reasons.append(_reason(
                        "huge_line", f"line {lineno} is {length} bytes, longer than the {max_line_bytes}-byte limit",
                        line=lineno))
            elif "not_utf8" not in seen and "binary" not in seen:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as exc:
                    seen.add("not_utf8")
                    a.reasons.append(_reason(
                        "not_utf8", f"not UTF-8 text: invalid byte 0x{chunk[exc.start]:02x} on line {lineno}, "
                        f"column {exc.start + 1}", line=lineno))
            if huge or chunk.strip():
                nonblank += 1
    a.lines = lineno
    a.sha256 = h.hexdigest()
    if st.st_size == 0:
        a.reasons.append(_reason("empty", "empty file (0 bytes)"))
    elif nonblank == 0 and not a.reasons:
        a.reasons.append(_reason("empty", f"no data: all {lineno} line(s) are blank"))
    return a


Validator = Callable[[Path], "tuple[Sequence[Any], Sequence[Any]]"]


def normalize_problem(p: Any) -> dict:
    """A validator's problem as {line, error}: from a dict, a (line, error) pair, or an object
    with `line` and `error`/`message` (daemon.data.Problem).  Line 0 or none: about the file."""
    if isinstance(p, dict):
        line, error = p.get("line"), p.get("error", p.get("message", p.get("reason")))
    elif isinstance(p, (tuple, list)) and len(p) == 2:
        line, error = p
    else:
        line = getattr(p, "line", None)
        error = getattr(p, "error", None) or getattr(p, "message", None)
    return {"line": line if isinstance(line, int) and line > 0 else None,
            "error": str(error if error is not None else p)}


def assess(path: os.PathLike | str, validator: Validator, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
           max_line_bytes: int = DEFAULT_MAX_LINE_BYTES, on_bad_lines: str = "reject_file",
           known_digests: Optional[dict[str, str]] = None) -> Assessment:
    """Everything intake decides about a file, without moving it.

    `validator(path) -> (examples, problems)`, problems as [{line, error}].  `known_digests` maps
    sha16 → where that content already is; equal content is refused because an example's id is
    the content hash plus the line, and the ledger holds each id once.
    """
    if on_bad_lines not in ("reject_file", "skip_lines"):
        raise ValueError(f"on_bad_lines must be reject_file or skip_lines, got {on_bad_lines!r}")
    a = check_file(path, max_file_bytes=max_file_bytes, max_line_bytes=max_line_bytes)
    name = Path(path).name
    if not a.reasons and len(name.encode()) > MAX_NAME_BYTES:
        a.reasons.append(_reason("name_too_long", check_name(name) or "file name too long"))
    if not a.reasons and known_digests and a.sha16 in known_digests:
        a.reasons.append(_reason(
            "duplicate", f"same content (sha256 {a.sha16}…) as {known_digests[a.sha16]}: "
            "every example would get an id that is already taken"))
    if a.reasons:
        return a
    try:
        examples, problems = validator(Path(path))
    except Exception as exc:  # a validator bug must not take the daemon down, nor lose the file
        a.reasons.append(_reason("validator_error", f"validator failed: {type(exc).__name__}: {exc}"))
        return a
    a.examples = len(examples)
    normalized = [normalize_problem(p) for p in problems]
    a.problems_total = len(normalized)
    a.problems = normalized[:MAX_REPORTED_PROBLEMS]
    if a.examples == 0:
        a.reasons.append(_reason("no_examples", "no usable example in the file"
                                 + (f" ({a.problems_total} bad line(s))" if normalized else "")))
    elif normalized and on_bad_lines == "reject_file":
        a.reasons.append(_reason(
            "bad_lines", f"{a.problems_total} of {a.problems_total + a.examples} example line(s) are bad "
            "(data.on_bad_lines = reject_file)"))
    else:
        a.accepted = True
        a.skipped_lines = bool(normalized)
    return a


def validate_only(paths: Iterable[os.PathLike | str], validator: Validator, *,
                  run_dir: Optional[os.PathLike | str] = None, **limits: Any) -> list[Assessment]:
    """The pre-check of `hangwatch submit FILE…`: what would be accepted, and why not.

    Nothing is moved or written.  With `run_dir`, content already queued, in training or done
    there is reported as a duplicate, as intake would.  `limits`: max_file_bytes, max_line_bytes,
    on_bad_lines.
    """
    known = known_digests(run_dir) if run_dir is not None else None
    out = []
    batch: dict[str, str] = {}
    for path in paths:
        p = Path(path)
        if not p.exists():
            a = Assessment(path=p)
            a.reasons.append(_reason("missing", "no such file"))
        else:
            # A symlink given on the command line is fine: its content is what gets published.
            a = assess(p.resolve(), validator, known_digests={**(known or {}), **batch}, **limits)
            a.path = p
        if a.accepted and a.sha16:
            batch[a.sha16] = f"{p} (same submission)"
        out.append(a)
    return out


def known_digests(run_dir: os.PathLike | str) -> dict[str, str]:
    """sha16 → `stage/filename` for every file queued, in training or done."""
    out: dict[str, str] = {}
    for stage in (Stage.DONE, Stage.PROCESSING, Stage.QUEUED):
        for d in data_files(run_dir, stage):
            out[d.sha16] = f"{stage.value}/{d.filename}"
    return out


# --------------------------------------------------------------------------------------------
# Status (supervisor: cheap, no torch, no threads)

_ledger_counts: dict[str, tuple[int, int, int]] = {}  # path → (inode, bytes counted, lines)


def count_lines(path: Path) -> int:
    """Lines of an append-only file, reading only what was appended since the last call."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0
    key = str(path)
    ino, done_bytes, lines = _ledger_counts.get(key, (st.st_ino, 0, 0))
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
    _ledger_counts[key] = (st.st_ino, done_bytes, lines)
    return lines


def read_json(path: Path) -> Optional[dict]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def queue_status(run_dir: os.PathLike | str) -> dict:
    """Counts for `hangwatch status`: a few directory listings and one small file."""
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
    rejected = sum(1 for n in rejected_names if n.endswith(".error.json") and n[: -len(".error.json")] in rejected_names)
    return {
        "inbox": arriving,
        "waiting": len(data_files(run_dir, Stage.QUEUED)),
        "processing": len(processing),
        "current_file": current.get("file"),
        "current_progress": progress,
        "rejected": rejected,
        "done": len(data_files(run_dir, Stage.DONE)),
        "ledger_examples": count_lines(Stage.DONE.dir(run_dir) / LEDGER),
    }
