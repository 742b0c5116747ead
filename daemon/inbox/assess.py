"""What is wrong with a data file: file-level checks, the validator's verdict per line, duplicates.

Intake decides with `assess`; `hangwatch submit` runs the same checks first (`validate_only`), so
a writer hears why a file would be rejected before it is published.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from hangwatch.common.inbox_layout import MAX_NAME_BYTES, Stage, data_files
from hangwatch.daemon.inbox.publish import check_name

DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_LINE_BYTES = 1024 * 1024
MAX_REPORTED_PROBLEMS = 1000
ON_BAD_LINES = ("reject_file", "skip_lines")

Validator = Callable[[Path], "tuple[Sequence[Any], Sequence[Any]]"]


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

    def why_not(self, most: int = 5) -> list[str]:
        """The reasons and the first `most` bad lines, one phrase each."""
        parts = [r["message"] for r in self.reasons]
        parts += [f"line {p['line']}: {p['error']}" for p in self.problems[:most]]
        if self.problems_total > most:
            parts.append(f"… {self.problems_total - most} more bad line(s)")
        return parts

    def summary(self) -> str:
        if self.accepted:
            extra = f", {self.problems_total} bad line(s) skipped" if self.skipped_lines else ""
            return f"{self.path.name}: accepted, {self.examples} example(s){extra}"
        return f"{self.path.name}: rejected: " + "; ".join(self.why_not())

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


def reason(code: str, message: str, **extra: Any) -> dict:
    return {"code": code, "message": message, **extra}


def check_on_bad_lines(on_bad_lines: str) -> None:
    if on_bad_lines not in ON_BAD_LINES:
        raise ValueError(f"on_bad_lines must be reject_file or skip_lines, got {on_bad_lines!r}")


def check_file(
    path: os.PathLike | str,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
) -> Assessment:
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
        a.reasons.append(reason("not_regular", "not a regular file (symlink, device or fifo)"))
        return a
    if st.st_size > max_file_bytes:
        a.reasons.append(
            reason("too_large", f"file is {st.st_size} bytes, larger than data.max_file_bytes = {max_file_bytes}")
        )
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
        a.reasons.append(reason("unreadable", f"cannot read: {exc.strerror or exc}"))
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
                    a.reasons.append(reason("binary", f"binary file: NUL byte on line {lineno}", line=lineno))
            elif huge:
                if "huge_line" not in seen:
                    seen.add("huge_line")
                    a.reasons.append(
                        reason(
                            "huge_line",
                            f"line {lineno} is {length} bytes, longer than the {max_line_bytes}-byte limit",
                            line=lineno,
                        )
                    )
            elif "not_utf8" not in seen and "binary" not in seen:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError as exc:
                    seen.add("not_utf8")
                    a.reasons.append(
                        reason(
                            "not_utf8",
                            f"not UTF-8 text: invalid byte 0x{chunk[exc.start]:02x} on line {lineno}, "
                            f"column {exc.start + 1}",
                            line=lineno,
                        )
                    )
            if huge or chunk.strip():
                nonblank += 1
    a.lines = lineno
    a.sha256 = h.hexdigest()
    if st.st_size == 0:
        a.reasons.append(reason("empty", "empty file (0 bytes)"))
    elif nonblank == 0 and not a.reasons:
        a.reasons.append(reason("empty", f"no data: all {lineno} line(s) are blank"))
    return a


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
    return {
        "line": line if isinstance(line, int) and line > 0 else None,
        "error": str(error if error is not None else p),
    }


def assess(
    path: os.PathLike | str,
    validator: Validator,
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
    on_bad_lines: str = "reject_file",
    known_digests: Optional[dict[str, str]] = None,
) -> Assessment:
    """Everything intake decides about a file, without moving it.

    `validator(path) -> (examples, problems)`, problems as [{line, error}].  `known_digests` maps
    sha16 → where that content already is; equal content is refused because an example's id is
    the content hash plus the line, and the ledger holds each id once.
    """
    check_on_bad_lines(on_bad_lines)
    a = check_file(path, max_file_bytes=max_file_bytes, max_line_bytes=max_line_bytes)
    name = Path(path).name
    if not a.reasons and len(name.encode()) > MAX_NAME_BYTES:
        a.reasons.append(reason("name_too_long", check_name(name) or "file name too long"))
    if not a.reasons and known_digests and a.sha16 in known_digests:
        a.reasons.append(
            reason(
                "duplicate",
                f"same content (sha256 {a.sha16}…) as {known_digests[a.sha16]}: "
                "every example would get an id that is already taken",
            )
        )
    if a.reasons:
        return a
    try:
        examples, problems = validator(Path(path))
    except Exception as exc:  # a validator bug must not take the daemon down, nor lose the file
        a.reasons.append(reason("validator_error", f"validator failed: {type(exc).__name__}: {exc}"))
        return a
    a.examples = len(examples)
    normalized = [normalize_problem(p) for p in problems]
    a.problems_total = len(normalized)
    a.problems = normalized[:MAX_REPORTED_PROBLEMS]
    if a.examples == 0:
        a.reasons.append(
            reason(
                "no_examples",
                "no usable example in the file" + (f" ({a.problems_total} bad line(s))" if normalized else ""),
            )
        )
    elif normalized and on_bad_lines == "reject_file":
        a.reasons.append(
            reason(
                "bad_lines",
                f"{a.problems_total} of {a.problems_total + a.examples} example line(s) are bad "
                "(data.on_bad_lines = reject_file)",
            )
        )
    else:
        a.accepted = True
        a.skipped_lines = bool(normalized)
    return a


def validate_only(
    paths: Iterable[os.PathLike | str],
    validator: Validator,
    *,
    run_dir: Optional[os.PathLike | str] = None,
    **limits: Any,
) -> list[Assessment]:
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
            a.reasons.append(reason("missing", "no such file"))
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
