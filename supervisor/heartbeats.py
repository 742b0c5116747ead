"""Tailing the heartbeat files of the current attempt (every rank) and waking the loop on writes.

`HeartbeatTail` reads what was appended to `attempts/NNNN/heartbeat-rank*.jsonl` since the last
call and decodes it line by line; a torn or invalid line is skipped and counted, never fatal.  A
line without its newline yet stays buffered until it is complete.

`FileEvents` runs a `watchdog` observer on the attempts directory and writes a byte into the
supervisor's wake-up pipe on every file event, so a new line is read at once.  File events are
only a shortcut: the loop also wakes on a timer, because a hang is exactly the absence of events.
"""
from __future__ import annotations

import os
import re
from collections import deque
from pathlib import Path
from typing import Optional

from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from hangwatch.common.protocol import decode_line

RANK_FILE = re.compile(r"^heartbeat-rank(\d+)\.jsonl$")
READ_CHUNK = 1 << 20
TAIL_KEEP = 50  # last raw lines per rank, kept for incidents


class HeartbeatTail:
    def __init__(self, directory: os.PathLike | str):
        self.directory = Path(directory)
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.torn = 0
        self.torn_examples: deque[str] = deque(maxlen=5)
        self.recent: dict[int, deque[str]] = {}

    def files(self) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = RANK_FILE.match(name)
            if m:
                out.append((int(m.group(1)), self.directory / name))
        return sorted(out)

    def read(self) -> list[dict]:
        """Every complete, valid line appended since the last call, file by file."""
        out: list[dict] = []
        for rank, path in self.files():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets.get(path, 0))
                    data = f.read(READ_CHUNK)
            except FileNotFoundError:
                continue
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            buf = self.partial.pop(path, b"") + data
            *lines, rest = buf.split(b"\n")
            if rest:
                self.partial[path] = rest
            keep = self.recent.setdefault(rank, deque(maxlen=TAIL_KEEP))
            for raw in lines:
                if not raw.strip():
                    continue
                keep.append(raw.decode("utf-8", "replace"))
                rec = decode_line(raw)
                if rec is None:
                    self.torn += 1
                    self.torn_examples.append(raw[:200].decode("utf-8", "replace"))
                    continue
                out.append(rec)
        return out

    def finish(self) -> int:
        """The attempt is over: a dangling partial line will never be completed — count it torn."""
        n = sum(1 for v in self.partial.values() if v.strip())
        self.torn += n
        self.partial.clear()
        return n

    def tail_text(self, rank: int) -> str:
        return "\n".join(self.recent.get(rank, ())) + ("\n" if self.recent.get(rank) else "")


class _Waker(FileSystemEventHandler):
    def __init__(self, fd: int):
        self.fd = fd

    # Only events that mean new content: reading a heartbeat file raises `opened` and
    # `closed_no_write`, and waking on those would make every read trigger the next pass.
    WAKE_ON = frozenset({"modified", "created", "moved", "closed"})

    def on_any_event(self, event) -> None:
        if event.event_type not in self.WAKE_ON:
            return
        try:
            os.write(self.fd, b"h")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake already


class FileEvents:
    """A watchdog observer on `directory` (recursive) that pokes `wake_fd` on every event."""

    def __init__(self, directory: os.PathLike | str, wake_fd: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.observer: Optional[Observer] = Observer()
        self.observer.daemon = True
        self.observer.schedule(_Waker(wake_fd), str(self.directory), recursive=True)

    def start(self) -> None:
        if self.observer is not None:
            self.observer.start()

    def stop(self) -> None:
        if self.observer is not None:
            self.observer.stop()
            self.observer.join(timeout=2)
            self.observer = None
