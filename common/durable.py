"""One durable write for the whole project: temporary file → fsync → rename → fsync the directory.

A reader sees the old content or the new, never a mix, and after a crash (or power loss) the new
content is either fully there or not at all.  A failed write (ENOSPC, EIO, EROFS, EDQUOT) removes its
own temporary file and re-raises: nothing half-written is ever left under the final name.

A record that must stay writable on a full disk (state.json: a run that ends for lack of space must
still say so) is written `reserved`: padded with spaces to whole blocks, so that when the replace is
refused for want of a new block, `overwrite_in_place` can rewrite the file in the blocks it already
holds.  That fallback trades the rename's atomicity for being able to write at all: the new text goes
in with one pwrite at offset 0 and the file keeps its size.  A reader that catches that write half done
(a window of one memory copy) can see a mix of old and new text, which almost always fails to parse
(`records.run_state.read` then reads again); a crash during it can leave such a mix on disk.  Neither
matters as much as a record that says `running` for ever.

A file that cannot be replaced by a rename (a pod's termination-message file, a mount point of its own) is
written `write_in_place`: truncated and written where it is, neither atomic nor durable, for a reader that comes
once the writer has exited.

`FsOps` bundles the operations that move data between durable states, so tests can pass a subclass
that fails (or dies) at a chosen operation.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path
from typing import Any, BinaryIO

TMP_PREFIX = ".tmp-"  # every temporary this module creates starts with it (a crash's leftovers are findable)

RESERVE_BYTES = 4096  # a reserved record's size is a multiple of this: a block, which the filesystem allocates anyway

# The write failures that are the disk's, not the program's: no retry of the same write can help.
DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EIO: "I/O error",
}


# The ones that mean "no new block": the blocks a file already holds may still be written.
NO_ROOM_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def describe_write_error(exc: OSError, path: os.PathLike | str) -> str:
    """ "no space left on device at PATH" (or the OS's own words for another errno)."""
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
    return path.with_name(f"{TMP_PREFIX}{path.name}-{os.getpid()}-{os.urandom(3).hex()}")


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
                view = view[os.write(fd, view) :]
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


def reserved(text: bytes, size: int = RESERVE_BYTES) -> bytes:
    """`text` (JSON ending in a newline) padded with spaces before that newline to a whole number of `size`
    blocks, with at least a block's room to grow: the space a later `overwrite_in_place` writes into.
    JSON allows the trailing whitespace; every reader of the file parses it unchanged."""
    body = text.rstrip(b"\n")
    total = -(-(len(body) + 1 + size // 2) // size) * size  # half a block free at least, rounded up to whole blocks
    return body + b" " * (total - len(body) - 1) + b"\n"


def overwrite_in_place(path: os.PathLike | str, text: bytes) -> None:
    """Rewrite `path` in the blocks it holds, for when the disk has no block for a temporary: `text` padded
    with spaces to the file's present size, written by one pwrite at offset 0, then fsync.  The size never
    changes (no truncate: a shorter file would give blocks back, and a reader between the write and the
    truncate would see a mix).  Text longer than the file raises ENOSPC before anything is written."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        body = text.rstrip(b"\n")
        if len(body) + 1 > size:
            raise OSError(errno.ENOSPC, f"{len(body) + 1} bytes do not fit in the {size} the file holds", str(path))
        view = memoryview(body + b" " * (size - len(body) - 1) + b"\n")
        offset = 0
        while offset < len(view):
            offset += os.pwrite(fd, view[offset:], offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_in_place(path: os.PathLike | str, data: bytes) -> None:
    """Replace the content of `path` where it is: open (created when missing), truncate, write — no temporary, no
    rename, no fsync.  For a file that another program reads on this machine and that cannot be replaced by a
    rename: a file bind-mounted on its own (a pod's /dev/termination-log — a rename onto a mount point fails with
    EBUSY), or one in a directory this process may not write.  A reader can see it empty or part-written while the
    write runs: meant for a file read once the writer has gone."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def append_durable(path: os.PathLike | str, data: bytes) -> None:
    """Append `data` with O_APPEND and fsync it (a ledger line is either whole on disk or absent)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
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

    def open_output(self, path: Path) -> BinaryIO:
        """A new file another process writes into (its stdout: a py-spy dump), created or emptied, opened for
        writing; the caller hands it over and closes its own copy."""
        return open(path, "wb")

    def overwrite(self, path: Path, data: bytes) -> None:
        overwrite_in_place(path, data)

    def write_in_place(self, path: Path, data: bytes) -> None:
        write_in_place(path, data)

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)
        fsync_file(path)

    def unlink(self, path: Path) -> None:
        path.unlink(missing_ok=True)
