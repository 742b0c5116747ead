"""Supervisor logging: structlog, JSON lines to a file, readable lines on stderr.

    logs.configure(run_dir, "info")       # once, in the main thread, before the loop
    log = structlog.get_logger("hangwatch.runner")
    log.info("worker started", pid=1234, attempt=2)

The file is `<run_dir>/supervisor.log` (one JSON object per line: timestamp, level, logger, event,
fields).  Under systemd (`LogsDirectory=` sets `$LOGS_DIRECTORY`) the file lives in the logs
directory, where logrotate expects it, and `<run_dir>/supervisor.log` is a symlink to it.

Log rotation: the file handler is a `WatchedFileHandler`, which notices that the file was moved or
removed and reopens the path before the next line, so logrotate's default (rename, create) works
with no signal at all.  SIGHUP is handled too (`systemctl reload`, `postrotate kill -HUP`): its handler
only records the request; `reopen_if_requested()` in the main loop reopens the files.

stderr gets coloured console lines when it is a terminal and plain `key=value` lines otherwise (the
journal, a pipe).
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Optional, TextIO, Union

import structlog

from daemon.heartbeat import attempt_dir

LOG_NAME = "supervisor.log"
WORKER_LOG_NAME = "worker.log"
ROOT_LOGGER = "hangwatch"

_reopen_requested = False
_handlers: list[logging.Handler] = []


def log_path(run_dir: os.PathLike | str, environ: Optional[Mapping[str, str]] = None) -> Path:
    """Where the supervisor log is written: $LOGS_DIRECTORY under systemd, else the run dir."""
    env = os.environ if environ is None else environ
    logs_dir = env.get("LOGS_DIRECTORY")
    if logs_dir:
        return Path(logs_dir.split(":")[0]) / LOG_NAME
    return Path(run_dir) / LOG_NAME


def configure(
    run_dir: os.PathLike | str,
    level: str = "info",
    *,
    stream: Optional[TextIO] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Path:
    """Send hangwatch's logs to the log file and to `stream` (stderr). Returns the log file's path.

    Calling it again replaces the previous set-up (tests, a second run in one process).
    """
    stream = sys.stderr if stream is None else stream
    path = log_path(run_dir, environ)
    path.parent.mkdir(parents=True, exist_ok=True)
    _link_into_run_dir(path, Path(run_dir))

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    file_handler = logging.handlers.WatchedFileHandler(path, encoding="utf-8")
    file_handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _leading_keys,
                structlog.processors.JSONRenderer(default=str),
            ],
        )
    )
    if _isatty(stream):
        console = structlog.dev.ConsoleRenderer(colors=True)
        console_processors = [structlog.stdlib.ProcessorFormatter.remove_processors_meta, console]
    else:
        console_processors = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.LogfmtRenderer(
                key_order=["timestamp", "level", "logger", "event"], drop_missing=True, bool_as_flag=False
            ),
        ]
    stream_handler = logging.StreamHandler(stream)
    stream_handler.setFormatter(structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=console_processors))

    root = logging.getLogger(ROOT_LOGGER)
    for old in _handlers:
        root.removeHandler(old)
        old.close()
    _handlers[:] = [file_handler, stream_handler]
    for h in _handlers:
        root.addHandler(h)
    root.setLevel(level.upper())
    root.propagate = False

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    _install_sighup()
    return path


def _leading_keys(logger, name, event_dict: dict) -> dict:
    """timestamp, level, logger, event first: the file is read by people with `tail` as much as by tools."""
    head = {k: event_dict.pop(k) for k in ("timestamp", "level", "logger", "event") if k in event_dict}
    return {**head, **event_dict}


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _link_into_run_dir(path: Path, run_dir: Path) -> None:
    """Under systemd the log lives in LOGS_DIRECTORY; the run dir keeps a symlink so tools find it there."""
    link = run_dir / LOG_NAME
    if path == link:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        if os.readlink(link) == str(path):
            return
        link.unlink()
    elif link.exists():
        return  # a log from a run outside systemd: keep it, never overwrite a real file
    os.symlink(path, link)


def _on_sighup(signum, frame) -> None:
    global _reopen_requested
    _reopen_requested = True


def _install_sighup() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGHUP, _on_sighup)


def reopen_if_requested() -> bool:
    """Reopen the log file when SIGHUP asked for it; call from the main loop. True when it did."""
    global _reopen_requested
    if not _reopen_requested:
        return False
    _reopen_requested = False
    reopen()
    return True


def reopen() -> None:
    for h in _handlers:
        if isinstance(h, logging.FileHandler):
            with h.lock:
                if h.stream is not None:
                    h.stream.close()
                h.stream = h._open()
                if isinstance(h, logging.handlers.WatchedFileHandler):
                    h._statstream()


# --------------------------------------------------------------------------------------------
# Reading the logs back (`hangwatch logs`)


class NoLogYet(Exception):
    pass


def worker_log_path(run_dir: os.PathLike | str, attempt: int) -> Path:
    return attempt_dir(run_dir, attempt) / WORKER_LOG_NAME


def latest_worker_log(run_dir: os.PathLike | str) -> Optional[Path]:
    """The worker log of the newest attempt that has one."""
    base = Path(run_dir) / "attempts"
    if not base.is_dir():
        return None
    for attempt in sorted((p.name for p in base.iterdir() if p.name.isdigit()), key=int, reverse=True):
        candidate = base / attempt / WORKER_LOG_NAME
        if candidate.exists():
            return candidate
    return None


def follow_log(
    run_dir: os.PathLike | str,
    *,
    supervisor: bool = False,
    attempt: Optional[int] = None,
    follow: bool = False,
    last_lines: Optional[int] = None,
    poll_s: float = 0.25,
    sleep=time.sleep,
) -> Iterator[Union[Path, bytes]]:
    """Yield a `Path` each time a file is opened, then its bytes as they arrive.

    The worker log is that of the newest attempt; with `follow`, once the current file is drained
    and a newer attempt's worker.log exists, the follower moves on to it (the old worker is dead by
    then: the supervisor starts an attempt only after the previous tree is reaped).  The supervisor
    log is followed like `tail -F`: a rotated (moved) file is drained, then the new one opened; a
    truncated one is read again from its start.
    """
    run_dir = Path(run_dir)

    def target() -> Optional[Path]:
        if supervisor:
            p = run_dir / LOG_NAME
            return p if p.exists() else None
        if attempt is not None:
            p = worker_log_path(run_dir, attempt)
            return p if p.exists() else None
        return latest_worker_log(run_dir)

    f = None
    path: Optional[Path] = None
    first = True
    try:
        while True:
            if f is None:
                path = target()
                if path is None:
                    if not follow:
                        what = "supervisor log" if supervisor else (f"worker log for attempt {attempt}" if attempt else "worker log")
                        raise NoLogYet(f"no {what} yet in {run_dir}")
                    sleep(poll_s)
                    continue
                f = open(path, "rb")
                if first and last_lines is not None:
                    f.seek(_tail_offset(f, last_lines))
                first = False
                yield path
            chunk = f.read(65536)
            if chunk:
                yield chunk
                continue
            if not follow:
                return
            now_target = target()
            if now_target is not None and (now_target != path or _inode(now_target) != os.fstat(f.fileno()).st_ino):
                f.close()
                f = None  # drained: move on to the new attempt / the file that replaced a rotated one
                continue
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)  # truncated in place (copytruncate)
                continue
            sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _tail_offset(f, lines: int) -> int:
    """Offset of the start of the last `lines` lines of the open binary file `f`."""
    end = f.seek(0, os.SEEK_END)
    if lines <= 0:
        return end
    pos, seen, block = end, 0, 65536
    # A file that ends with a newline: that newline terminates the last line, it does not start one.
    f.seek(max(end - 1, 0))
    skip_last = f.read(1) == b"\n"
    while pos > 0:
        start = max(pos - block, 0)
        f.seek(start)
        data = f.read(pos - start)
        if skip_last and pos == end:
            data = data[:-1]
        for i in range(len(data) - 1, -1, -1):
            if data[i] == 0x0A:
                seen += 1
                if seen == lines:
                    return start + i + 1
        pos = start
    return 0
