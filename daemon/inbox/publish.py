"""Publishing into the inbox (`hangwatch submit`, scripts): the copy appears under its final name
complete, or not at all, and never replaces another writer's file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Optional

from hangwatch.common.durable import TMP_PREFIX, fsync_dir
from hangwatch.common.inbox_layout import MAX_NAME_BYTES, PARTIAL_SUFFIXES, Stage, is_candidate_name, with_priority

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


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


def free_name(directory: Path, name: str) -> str:
    """The first of `unique_names(name)` not taken in `directory`."""
    return next(n for n in unique_names(name) if not os.path.lexists(directory / n))


def check_name(name: str) -> Optional[str]:
    """Why `name` cannot be published into the inbox, or None."""
    if not name or "/" in name or name in (".", ".."):
        return f"{name!r} is not a file name"
    if not is_candidate_name(name):
        return f"{name!r} would be ignored by the inbox (dot-files and {', '.join(PARTIAL_SUFFIXES)} are partial files)"
    if len(name.encode()) > MAX_NAME_BYTES:
        return f"file name is {len(name.encode())} bytes, longer than {MAX_NAME_BYTES}"
    return None


class _RenameAt2:
    """renameat2(2) through ctypes, looked up once (None where libc lacks it)."""

    def __init__(self) -> None:
        self._fn: Any = None
        self._looked_up = False

    def __call__(self, src: Path, dst: Path) -> bool:
        """rename(2) that fails with FileExistsError rather than replace `dst`; False if unsupported."""
        if not self._looked_up:
            try:
                self._fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
            except OSError:
                self._fn = None
            self._looked_up = True
        if self._fn is None:
            return False
        if self._fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise FileExistsError(err, os.strerror(err), str(dst))
        if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise OSError(err, os.strerror(err), str(dst))


rename_noreplace = _RenameAt2()


def publish(
    src_path: os.PathLike | str,
    run_dir: os.PathLike | str,
    *,
    name: Optional[str] = None,
    priority: Optional[int] = None,
) -> Path:
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
        name = with_priority(name, priority)
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
        final = _place(tmp, inbox, name)
        fsync_dir(inbox)
        return final
    finally:
        tmp.unlink(missing_ok=True)


def _place(tmp: Path, directory: Path, name: str) -> Path:
    """Give `tmp` the first free one of `unique_names(name)` in `directory`, never replacing a file."""
    for candidate in unique_names(name):
        final = directory / candidate
        try:
            if rename_noreplace(tmp, final):
                return final
            os.link(tmp, final)  # no renameat2 here: a link also refuses a taken name
            return final
        except FileExistsError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                raise
            # Neither (some FUSE/network file systems): check, then rename.
            if final.exists():
                continue
            os.rename(tmp, final)
            return final
    raise AssertionError("unique_names never ends")
