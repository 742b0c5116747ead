"""Tailing the heartbeat files of the current attempt (every rank), and hearing them grow.

`HeartbeatTail` reads what was appended to `attempts/NNNN/heartbeat-rank*.jsonl` since the last
call — every new byte of every rank in one call, however many lines that is — and decodes it line by
line; a torn or invalid line is skipped and counted, never fatal.  A line without its newline yet
stays buffered until it is complete.  The files stay open between calls (one read(2) per rank and
call, no open/seek), and the directory is listed again only when its modification time says that a
file came or went (one stat(2) otherwise).

When was a line written?  Reads are coalesced (`wakeup.MIN_READ_S`), so the time a line is read can be
later than the time it was written.  `read_timed` gives each line its file's modification time, taken
after the read (no line of that read was written later): the kernel's clock, which on a local file
system is this machine's, not the writer's.  `written_at` turns it into the reader's clock, never
before the previous read (the line was not there then) nor after this one; where the file system
takes its times from a server (NFS, SMB, FUSE: `local_file_times`) the reading time is used instead.

`FileEvents` is Linux inotify through watchdog's binding (`watchdog.observers.inotify_c`:
`inotify_init`, `inotify_add_watch`, `inotify_rm_watch`, `InotifyConstants`), read by the loop itself:
its descriptor — made non-blocking and close-on-exec here — sits in the loop's selector beside the
wake-up pipe, so there is no thread and no per-event hand-off.  Neither watchdog's observers nor its
reader classes: `InotifyFD` (watchdog 7) is built for a reader thread — its read waits in poll() until
an event comes, its close() frees the descriptor only after that thread has read — and `Inotify`
(watchdog 4 to 6) reads blocking and gives all its watches one mask, where the directory needs
another than the files.  It watches the current attempt's directory for new heartbeat files and each
heartbeat file for writes — not the directory for writes, so a chatty worker.log wakes nothing.
`drain()` reads every queued event at once (never waiting) and says whether a heartbeat file grew;
`take()` says which did since the last call, so a pass reads those files only (64 ranks are 64
read(2)s a pass otherwise).  File events are only a shortcut to read lines promptly: a hang is exactly
the absence of events, so the deadlines have their own timer (`Wakeup.wait`'s timeout).  Where inotify
is missing (another OS, the instance limit reached) `FileEvents.open` says why, and where a directory
cannot be watched (the watch limit reached) `watching` is false: the loop falls back to reading on a
short timer.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
import time
from collections import deque
from pathlib import Path
from typing import Collection, Optional

from hangwatch.common.protocol import decode_line

RANK_FILE = re.compile(r"^heartbeat-rank(\d+)\.jsonl$")
RANK_PREFIX = "heartbeat-rank"
READ_CHUNK = 1 << 20  # per file and call: a runaway writer cannot make one pass read without bound
TAIL_KEEP = 50  # last raw lines per rank, kept for incidents
# A directory's mtime ticks with the kernel's coarse clock: a file created in the same tick as the last
# listing leaves it unchanged.  Until the mtime is this old (wall clock), the directory is listed anyway.
MTIME_SETTLE_NS = 200_000_000


def _tick_s() -> float:
    """The granularity of file modification times: the kernel's coarse clock (CLOCK_REALTIME_COARSE)."""
    try:
        return time.clock_getres(5)  # CLOCK_REALTIME_COARSE, Linux only (not named in the time module)
    except (OSError, AttributeError):
        return 0.01


FILE_TIME_TICK_S = _tick_s()  # a modification time may lag the write by up to this much
NETWORK_FS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "9p",
        "ceph",
        "glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "afs",
        "ocfs2",
        "gfs2",
        "davfs",
    }
)


def written_at(mtime_ns: Optional[int], wall_now: float, now: float, lo: float) -> float:
    """When lines that a read at `now` (reader's clock; `wall_now` on the wall clock) found in a file
    modified at `mtime_ns` (wall clock, after the read) were written, on the reader's clock: the
    modification time converted and moved up by one file-time tick, kept within [lo, now] — not before
    `lo`, the previous read, and not after this one.  Without a time: `now`."""
    if mtime_ns is None:
        return now
    return min(now, max(lo, now - (wall_now - mtime_ns / 1e9) + FILE_TIME_TICK_S))


def local_file_times(path: os.PathLike | str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether files under `path` get their modification times from this machine's clock: False on a
    network or FUSE file system (a server sets them, by its own clock) and where it cannot be told."""
    try:
        target = os.path.realpath(path)
        with open(mountinfo) as f:
            mounts = [line.split() for line in f]
    except OSError:
        return False
    best, fstype = "", None
    for fields in mounts:
        if "-" not in fields:
            continue
        point = fields[4].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[fields.index("-") + 1]
    return fstype is not None and fstype not in NETWORK_FS and not fstype.startswith("fuse")


class HeartbeatTail:
    def __init__(self, directory: os.PathLike | str):
        self.directory = Path(directory)
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.torn = 0
        self.torn_examples: deque[str] = deque(maxlen=5)
        self.recent: dict[int, deque[bytes]] = {}
        self.backlog = False  # the last read stopped at READ_CHUNK with more bytes waiting: read again at once
        self.read_at: Optional[float] = None  # the reader's clock at the previous read (`written_at`'s lower bound)
        self._local_times: Optional[bool] = None
        self._names: frozenset[str] = frozenset()  # the last listing (a new one is matched again)
        self._files: list[tuple[int, Path]] = []  # what that listing holds, by rank
        self._known: frozenset[str] = frozenset()  # their names
        self._mtime_ns: Optional[int] = None  # the directory's mtime when it was listed, once settled
        self._open: dict[Path, int] = {}  # path → descriptor, kept open while the attempt is read

    def files(self) -> list[tuple[int, Path]]:
        try:
            mtime = os.stat(self.directory).st_mtime_ns
            if mtime == self._mtime_ns:
                return self._files
            names = os.listdir(self.directory)
        except FileNotFoundError:
            self._mtime_ns = None
            return []
        self._mtime_ns = mtime if time.time_ns() - mtime > MTIME_SETTLE_NS else None
        listed = frozenset(names)
        if listed != self._names:  # a file came or went: match again (the same Path objects are kept)
            known = {p.name: (r, p) for r, p in self._files}
            found = []
            for name in listed:
                if name in known:
                    found.append(known[name])
                elif name.startswith(RANK_PREFIX):
                    m = RANK_FILE.match(name)
                    if m:
                        found.append((int(m.group(1)), self.directory / name))
            self._files = sorted(found)
            self._known = frozenset(p.name for _r, p in self._files)
            self._names = listed
        return self._files

    def _chunk(self, path: Path) -> bytes:
        """The bytes appended to `path` since the last call (at most READ_CHUNK)."""
        fd = self._open.get(path)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            offset = self.offsets.get(path, 0)
            if offset:
                os.lseek(fd, offset, os.SEEK_SET)
            self._open[path] = fd
        return os.read(fd, READ_CHUNK)

    def local_times(self) -> bool:
        """Whether this directory's file times come from this machine's clock (asked once)."""
        if self._local_times is None:
            self._local_times = local_file_times(self.directory)
        return self._local_times

    def read(self, names: Optional[Collection[str]] = None) -> list[dict]:
        """Every complete, valid line appended since the last call, file by file; only to the files
        named in `names` when given (those the file events said grew)."""
        return [rec for _mtime, rec in self.read_timed(names)]

    def read_timed(self, names: Optional[Collection[str]] = None) -> list[tuple[Optional[int], dict]]:
        """`read`, each line with its file's modification time (ns, wall clock) taken after the read."""
        out: list[tuple[Optional[int], dict]] = []
        self.backlog = False
        # The file events name only files that exist: when all are known already, no listing is needed.
        listing = self._files if names is not None and self._known.issuperset(names) else self.files()
        for rank, path in listing:
            if names is not None and path.name not in names:
                continue
            try:
                data = self._chunk(path)
            except FileNotFoundError:
                continue
            if not data:
                continue
            if len(data) == READ_CHUNK:
                self.backlog = True
            try:
                mtime: Optional[int] = os.fstat(self._open[path]).st_mtime_ns
            except OSError:
                mtime = None
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            rest = self.partial.pop(path, None)
            *lines, tail = (rest + data if rest else data).split(b"\n")
            if tail:
                self.partial[path] = tail
            keep = self.recent.get(rank)
            if keep is None:
                keep = self.recent[rank] = deque(maxlen=TAIL_KEEP)
            for raw in lines:
                if not raw or raw.isspace():
                    continue
                keep.append(raw)  # raw bytes: decoded only if an incident asks for the tail
                rec = decode_line(raw)
                if rec is None:
                    self.torn += 1
                    self.torn_examples.append(raw[:200].decode("utf-8", "replace"))
                    continue
                out.append((mtime, rec))
        return out

    def finish(self) -> int:
        """The attempt is over: a dangling partial line will never be completed — count it torn.
        The files are closed (a later `read` opens them again where it left off)."""
        n = sum(1 for v in self.partial.values() if v.strip())
        self.torn += n
        self.partial.clear()
        self.close()
        return n

    def close(self) -> None:
        for fd in self._open.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._open.clear()

    def __del__(self):  # an attempt dropped without `finish` must not leak its descriptors
        self.close()

    def tail_text(self, rank: int) -> str:
        lines = self.recent.get(rank)
        if not lines:
            return ""
        return "\n".join(raw.decode("utf-8", "replace") for raw in lines) + "\n"


# --------------------------------------------------------------------------------------------
# inotify, through watchdog's binding

EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then `len` bytes of NUL-padded name
READ_EVENTS = 64 * 1024

_inotify_c = None  # watchdog.observers.inotify_c, once imported


def _inotify():
    """watchdog's inotify binding (`watchdog.observers.inotify_c`: `inotify_init`, `inotify_add_watch`,
    `inotify_rm_watch`, `InotifyConstants`), imported at first use — watchdog refuses to load it where
    the C library has no inotify (another OS), and `HeartbeatTail` is needed there too."""
    global _inotify_c
    if _inotify_c is None:
        from watchdog.observers import inotify_c

        _inotify_c = inotify_c
    return _inotify_c


class FileEvents:
    """inotify on one attempt directory at a time; `fileno()` goes into the loop's selector."""

    def __init__(self, fd: int):
        self.fd = fd
        self.directory: Optional[Path] = None
        self._dir_wd: Optional[int] = None
        self._files: dict[int, str] = {}  # watch descriptor → heartbeat file name
        self._dir_modify = False  # per-file watches failed: the directory watch reports writes (filtered by name)
        self._grown: set[str] = set()  # heartbeat files that grew since `take`
        self._everything = True  # …or read them all (a new watch, lost events)
        c = _inotify().InotifyConstants
        self._created = c.IN_CREATE | c.IN_MOVED_TO  # a new file in the attempt dir (a rank started)
        self._dir_mask = self._created | c.IN_ONLYDIR
        self._file_mask = c.IN_MODIFY  # a heartbeat file grew
        self._overflow = c.IN_Q_OVERFLOW
        self._ignored = c.IN_IGNORED

    @classmethod
    def open(cls) -> tuple[Optional["FileEvents"], Optional[str]]:
        """(events, None), or (None, why inotify cannot be used here)."""
        try:
            lib = _inotify()
        except Exception as exc:  # ImportError, OSError, watchdog's UnsupportedLibcError
            return None, f"no inotify: {exc}"
        fd = lib.inotify_init()
        if fd < 0:
            return None, f"inotify_init: {os.strerror(ctypes.get_errno())}"
        try:
            # watchdog binds inotify_init, not inotify_init1: what IN_CLOEXEC | IN_NONBLOCK would do, here.
            os.set_inheritable(fd, False)  # no worker inherits it
            os.set_blocking(fd, False)  # `drain` reads until EAGAIN and never waits
        except OSError as exc:
            os.close(fd)
            return None, f"inotify descriptor: {exc}"
        return cls(fd), None

    def fileno(self) -> int:
        return self.fd

    def _add(self, path: Path, mask: int) -> int:
        wd = _inotify().inotify_add_watch(self.fd, os.fsencode(path), mask)
        if wd < 0:
            err = ctypes.get_errno()  # watchdog's binding keeps errno (use_errno)
            raise OSError(err, os.strerror(err), str(path))
        return wd

    def watch(self, directory: Optional[Path]) -> bool:
        """Watch `directory` (the current attempt's) instead of the previous one; None: watch nothing.
        True when the watch changed — what was written before it existed made no event, so the caller
        reads once at once.  A directory that cannot be watched leaves nothing watched (the caller
        then reads on a timer: see `watching`)."""
        if directory is self.directory or directory == self.directory:
            return False
        directory = Path(directory) if directory is not None else None
        self._unwatch()
        self.directory = directory
        self._everything = True
        if directory is None:
            return True
        try:
            self._dir_wd = self._add(directory, self._dir_mask)
            for name in os.listdir(directory):
                if RANK_FILE.match(name):
                    self._watch_file(name)
        except OSError:
            self._unwatch()
        return True

    @property
    def watching(self) -> bool:
        """A directory is watched: heartbeat writes wake the loop."""
        return self._dir_wd is not None

    def _watch_file(self, name: str) -> None:
        if self._dir_modify or self.directory is None:
            return
        try:
            self._files[self._add(self.directory / name, self._file_mask)] = name
        except FileNotFoundError:
            pass  # renamed or removed already
        except OSError as exc:
            if exc.errno != errno.ENOSPC:  # out of watches: the directory watch reports writes instead
                raise
            self._dir_modify = True
            self._dir_wd = self._add(self.directory, self._dir_mask | self._file_mask)

    def _unwatch(self) -> None:
        rm = _inotify().inotify_rm_watch
        for wd in [*self._files, *([self._dir_wd] if self._dir_wd is not None else [])]:
            rm(self.fd, wd)  # fails harmlessly for a watch the kernel dropped already
        self._files.clear()
        self._dir_wd = None
        self._dir_modify = False

    def take(self) -> Optional[set[str]]:
        """The names of the heartbeat files that grew since the last call (after reading what is queued);
        None when every file must be read (the watch is new, or events were lost)."""
        self.drain()
        grown, everything = self._grown, self._everything
        self._grown, self._everything = set(), False
        return None if everything else grown

    def drain(self) -> bool:
        """Read every queued event; True when a heartbeat file was created or grew (or events were
        lost: then everything must be read).  Never waits: the descriptor is non-blocking."""
        grew = False
        while True:
            try:
                buf = os.read(self.fd, READ_EVENTS)
            except (BlockingIOError, InterruptedError):
                return grew
            if not buf:
                return grew
            off = 0
            while off + EVENT.size <= len(buf):
                wd, mask, _cookie, length = EVENT.unpack_from(buf, off)
                name = buf[off + EVENT.size : off + EVENT.size + length].rstrip(b"\0").decode("utf-8", "replace")
                off += EVENT.size + length
                if mask & self._overflow:
                    grew = self._everything = True
                elif mask & self._ignored:
                    self._files.pop(wd, None)
                    if wd == self._dir_wd:
                        self._dir_wd = None  # the directory went away
                elif wd == self._dir_wd:
                    if RANK_FILE.match(name):
                        grew = True
                        self._grown.add(name)
                        if mask & self._created:
                            try:
                                self._watch_file(name)
                            except OSError:
                                pass  # its writes still show up at the next read of this rank
                elif wd in self._files:
                    grew = True
                    self._grown.add(self._files[wd])

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._files.clear()
        self._dir_wd = None
        self.directory = None
