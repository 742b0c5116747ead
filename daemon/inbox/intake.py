"""Intake: take files dropped into `<run_dir>/inbox/` into queue/ (valid) or rejected/ (with a report).

    inbox = Inbox.from_config(run_dir, validator, cfg.data)
    inbox.start()                           # takes what arrived while the worker was down
    while ...:
        inbox.poll()                        # intake of arrivals whose writer is done
        inbox.wait_for_work(1.0)            # or block until queue/ holds a file

Threads: the watchdog observer thread only records names in a queue; validation and moves happen
in the thread that calls `poll` and `wait_for_work` (the training thread).
"""

from __future__ import annotations

import logging
import os
import queue
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

from hangwatch.common.durable import FsOps
from hangwatch.common.inbox_layout import DataName, Stage, data_files, ensure_dirs, is_candidate_name, move
from hangwatch.daemon.inbox.assess import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_LINE_BYTES,
    Assessment,
    Validator,
    assess,
    check_on_bad_lines,
    known_digests,
)
from hangwatch.daemon.inbox.files import json_bytes, reject, remove_temporaries

_READY_KINDS = ("moved", "closed")  # the writer is done: renamed into place, or closed after writing
_WATCHED_KINDS = ("created", "modified", "moved", "closed")


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

    def __init__(
        self,
        run_dir: os.PathLike | str,
        validator: Validator,
        *,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        on_bad_lines: str = "reject_file",
        settle_s: float = 1.0,
        rescan_s: float = 2.0,
        stale_tmp_s: float = 3600.0,
        observer_factory: Callable[[], Any] = Observer,
        ops: Optional[FsOps] = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        check_on_bad_lines(on_bad_lines)
        self.run_dir = Path(run_dir)
        self.dir = Stage.INBOX.dir(run_dir)
        self._validator = validator
        self._limits = {
            "max_file_bytes": max_file_bytes,
            "max_line_bytes": max_line_bytes,
            "on_bad_lines": on_bad_lines,
        }
        self._settle_s = settle_s
        self._rescan_s = rescan_s
        self._stale_tmp_s = stale_tmp_s
        self._observer_factory = observer_factory
        self._ops = ops or FsOps()
        self._clock = clock
        self._wall = wall_clock
        self._events: "queue.SimpleQueue[tuple[str, str]]" = queue.SimpleQueue()
        self._arrivals: dict[str, bool] = {}  # name → writer known to be done; insertion = arrival order
        self._observer = None
        self._last_scan = float("-inf")

    @classmethod
    def from_config(cls, run_dir: os.PathLike | str, validator: Validator, data_cfg: Any, **kw: Any) -> "Inbox":
        return cls(run_dir, validator, max_file_bytes=data_cfg.max_file_bytes, on_bad_lines=data_cfg.on_bad_lines, **kw)

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
        if name in self._arrivals and kind not in _READY_KINDS:
            self._arrivals[name] = False  # written to again after a close: wait until it settles
        elif name not in self._arrivals or ready:
            self._arrivals[name] = ready

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
            if name not in self._arrivals:
                self._arrivals[name] = False

    def _drain(self) -> None:
        while True:
            try:
                name, kind = self._events.get_nowait()
            except queue.Empty:
                return
            self._note(name, kind)

    def arriving(self) -> int:
        """Files seen in inbox/ and not yet taken in (still being written, or settling)."""
        return len(self._arrivals)

    def poll(self) -> list[IntakeResult]:
        """Take every arrival whose writer is done: validate it and move it to queue/ or rejected/."""
        self._drain()
        if self._clock() - self._last_scan >= self._rescan_s:
            self._rescan()
        results = []
        for name, ready in list(self._arrivals.items()):
            try:
                st = (self.dir / name).lstat()
            except FileNotFoundError:
                del self._arrivals[name]  # taken away by its writer
                continue
            if not ready and self._wall() - st.st_mtime < self._settle_s:
                continue
            del self._arrivals[name]
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
            wait = min(remaining, self._rescan_s, self._settle_s / 2 if self._arrivals else remaining)
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
            dest, report = reject(
                self.run_dir,
                name,
                Stage.INBOX,
                lambda rname: a.report(action="reject_file", rejected_as=rname),
                self._ops,
            )
            return IntakeResult(name, "rejected", dest, a, report)
        seq = max((d.number for d in data_files(self.run_dir, Stage.QUEUED)), default=0) + 1
        qname = DataName(seq, a.sha16, name).filename
        skipped = None
        if a.skipped_lines:
            # Named by content and name, so that an intake retried after a crash rewrites it.
            skipped = Stage.REJECTED.dir(self.run_dir) / f"{a.sha16}-{name}.skipped.json"
            self._ops.write_file(skipped, json_bytes(a.report(action="skip_lines", queued_as=qname)))
        dest = move(self.run_dir, name, Stage.INBOX, Stage.QUEUED, qname, ops=self._ops)
        return IntakeResult(name, "queued", dest, a, skipped)
