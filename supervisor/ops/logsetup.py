"""Supervisor logging: structlog, JSON lines to a file, readable lines on stderr.

    logsetup.configure(run_dir, "info")       # once, in the main thread, before the loop
    log = structlog.get_logger("hangwatch.runner")
    log.info("worker started", pid=1234, attempt=2)

The file is `<run_dir>/supervisor.log` (one JSON object per line: timestamp, level, logger, event,
fields).  Under systemd (`LogsDirectory=` sets `$LOGS_DIRECTORY`) the file lives in the logs
directory, where logrotate expects it, and `<run_dir>/supervisor.log` is a symlink to it.

Log rotation: the file handler is a `WatchedFileHandler`, which notices that the file was moved or
removed and reopens the path before the next line, so logrotate's default (rename, create) works
with no signal at all.  SIGHUP (`systemctl reload`, `postrotate kill -HUP`) is recorded by the
supervisor's wake-up (`supervisor.wakeup`) like every other signal; the loop then calls `reopen()`.
This module installs no signal handler and keeps no state but the handlers it made.

stderr gets coloured console lines when it is a terminal and plain `key=value` lines otherwise (the
journal, a pipe).

Taps (`add_tap`): functions that see every event dict the supervisor logs (after the timestamp, before
rendering) — how alerts and metrics learn what happened without a hook in the loop.  A tap must be
cheap and must not block (append to a deque; the ops layer reads it at the end of the loop's pass); one
that raises is ignored, never a reason to lose a log line.

`import_structlog` (what `hangwatch run` calls before anything imports structlog): importing structlog
imports its development renderer, and with it rich (tracebacks, pretty-printing, pygments: about 5 MiB of a
supervisor's memory) whenever rich is installed, and asyncio (its async loggers: another 2.5 MiB).  The
supervisor uses rich only through the coloured console lines on a terminal, and asyncio never, so it
imports structlog without rich when its stderr is not a terminal (a service, a pipe, a file: the console
lines are logfmt), and with an asyncio that is imported at its first use.  The lines are the same.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Callable, Mapping, Optional, TextIO

from hangwatch.common.rundir import SUPERVISOR_LOG_NAME
from hangwatch.supervisor.ops.lean_imports import import_without

LOG_NAME = SUPERVISOR_LOG_NAME
ROOT_LOGGER = "hangwatch"

_handlers: list[logging.Handler] = []
_taps: list[Callable[[dict], None]] = []


def add_tap(fn: Callable[[dict], None]) -> None:
    """Hand every logged event dict to `fn` (cheap, non-blocking; it must not change the dict)."""
    if fn not in _taps:
        _taps.append(fn)


def remove_tap(fn: Callable[[dict], None]) -> None:
    if fn in _taps:
        _taps.remove(fn)


def _run_taps(logger, name, event_dict: dict) -> dict:
    for fn in tuple(_taps):
        try:
            fn(event_dict)
        except Exception:  # a broken tap must never cost a log line
            pass
    return event_dict


def import_structlog(terminal: Optional[bool] = None) -> None:
    """Import structlog for a supervisor whose stderr is a terminal (`terminal`; default: ask sys.stderr) or
    not: without rich when it is not, asyncio deferred to its first use either way (the module docstring says
    why).  Nothing happens when structlog is already imported."""
    if "structlog" in sys.modules:
        return
    if terminal is None:
        terminal = _isatty(sys.stderr)
    # Python 3.12+: every LogRecord asks the asyncio in sys.modules for its current task, and structlog builds one
    # while it is imported: that question would load the real asyncio through the stand-in.  No task can be running
    # in an asyncio that was never imported, so the question is switched off for the import (the record's taskName is
    # None either way).
    ask = getattr(logging, "logAsyncioTasks", None)
    if ask is not None:
        logging.logAsyncioTasks = False
    try:
        import_without("structlog", defer=("asyncio",), hide=() if terminal else ("rich",))
    finally:
        if ask is not None:
            logging.logAsyncioTasks = ask


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
    console: bool = True,
) -> Path:
    """Send hangwatch's logs to the log file and, with `console`, to `stream` (stderr): a service's journal, or
    `hangwatch run -v`; in the foreground a person sees plain lines instead (`ops.narrator`).  Returns the log
    file's path.

    Calling it again replaces the previous set-up (tests, a second run in one process).
    """
    import structlog

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
    file_handler = _FileHandler(path, encoding="utf-8", stream=stream)
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
        console_processors = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.dev.ConsoleRenderer(colors=True),
        ]
    else:
        console_processors = [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            structlog.processors.LogfmtRenderer(
                key_order=["timestamp", "level", "logger", "event"], drop_missing=True, bool_as_flag=False
            ),
        ]
    stream_handler = logging.StreamHandler(stream)
    stream_handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=console_processors)
    )

    root = logging.getLogger(ROOT_LOGGER)
    for old in _handlers:
        root.removeHandler(old)
        old.close()
    _handlers[:] = [file_handler, stream_handler] if console else [file_handler]
    for h in _handlers:
        root.addHandler(h)
    root.setLevel(level.upper())
    root.propagate = False

    structlog.configure(
        processors=[*shared, _run_taps, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    return path


class _FileHandler(logging.handlers.WatchedFileHandler):
    """The JSON log file.  When the disk refuses a line (full, read-only), the supervisor carries on:
    the failure is said once per errno on stderr (the journal under systemd) instead of a traceback
    per line, and the console handler still carries every line."""

    def __init__(self, path: Path, *, encoding: str, stream: TextIO):
        super().__init__(path, encoding=encoding, delay=False)
        self._stderr = stream
        self._said: set = set()

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        key = getattr(exc, "errno", None) or type(exc).__name__
        if key not in self._said:
            self._said.add(key)
            print(
                f"hangwatch: cannot write the log file {self.baseFilename}: {exc} "
                "(lines go to stderr only until it can)",
                file=self._stderr,
                flush=True,
            )


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


def reopen() -> None:
    """Reopen every log file this module opened (after SIGHUP: logrotate without copytruncate)."""
    for h in _handlers:
        if isinstance(h, logging.FileHandler):
            with h.lock:
                if h.stream is not None:
                    h.stream.close()
                h.stream = h._open()
                if isinstance(h, logging.handlers.WatchedFileHandler):
                    h._statstream()
