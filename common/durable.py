"""One durable write for the whole project: temporary file → fsync → rename → fsync the directory.

A reader sees the old content or the new, never a mix, and after a crash (or power loss) the new
content is either fully there or not at all.  A failed write (ENOSPC, EIO, EROFS, EDQUOT) removes its
own temporary file and re-raises: nothing half-written is ever left under the final name.

`FsOps` bundles the operations that move data between durable states, so tests can pass a subclass
that fails (or dies) at a chosen operation.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
from pathlib import Path
from typing import Any

TMP_PREFIX = ".tmp-"  # every temporary this module creates starts with it (a crash's leftovers are findable)

# The write failures that are the disk's, not the program's: no retry of the same write can help.
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EIO: "I/O error"}


def disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def describe_write_error(exc: OSError, path: os.PathLike | str) -> str:
    """"no space left on device at PATH" (or the OS's own words for another errno)."""
    what = DISK_ERRNOS.get(exc.errno) or (exc.strerror or str(exc)).lower()
    return f"{what} at {path}"


def fsync_dir(path: os.PathLike | str) -> None:
    """Make a rename or creation in `path` durable; a directory that cannot be opened is left alone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: os.PathLike | str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_name(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(3)}")


def write_atomic(path: os.PathLike | str, data: bytes | str, *, durable: bool = True, mode: int = 0o644) -> Path:
    """Replace `path` with `data` atomically (and durably unless `durable=False`)."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)
    return path


def write_json_atomic(path: os.PathLike | str, data: Any, *, durable: bool = True, indent: int = 1) -> Path:
    return write_atomic(path, json.dumps(data, indent=indent, default=str) + "\n", durable=durable)


def append_durable(path: os.PathLike | str, data: bytes) -> None:
    """Append `data` with O_APPEND and fsync it (a ledger line is either whole on disk or absent)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


class FsOps:
    """Every change that moves data between durable states goes through one of these methods.

    The default does the real thing; tests pass a subclass that raises (or kills the process)
    before or after a chosen operation — the seam that walks every write site.
    """

    def write_json(self, path: Path, data: Any, durable: bool = True) -> None:
        write_json_atomic(path, data, durable=durable)

    def mkdir(self, path: Path, exist_ok: bool = True) -> None:
        Path(path).mkdir(parents=True, exist_ok=exist_ok)

    def rename(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)
        fsync_dir(dst.parent)
        if src.parent != dst.parent:
            fsync_dir(src.parent)

    def write_file(self, path: Path, data: bytes, durable: bool = True) -> None:
        write_atomic(path, data, durable=durable)

    def append(self, path: Path, data: bytes) -> None:
        append_durable(path, data)

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)
        fsync_file(path)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)
