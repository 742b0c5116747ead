"""Supervisor logging (JSON file, console lines, rotation, SIGHUP) and reading logs back."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import structlog

from hangwatch.supervisor.cli import logs as logfollow
from hangwatch.supervisor.ops import logsetup


@pytest.fixture(autouse=True)
def _restore_logging():
    yield
    root = logging.getLogger(logsetup.ROOT_LOGGER)
    for h in list(logsetup._handlers):
        root.removeHandler(h)
        h.close()
    logsetup._handlers.clear()
    structlog.reset_defaults()
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_json_lines_to_the_file_and_key_value_lines_to_a_pipe(tmp_path):
    stream = io.StringIO()
    path = logsetup.configure(tmp_path, "info", stream=stream, environ={})
    assert path == tmp_path / "supervisor.log"
    log = structlog.get_logger("hangwatch.runner")
    log.info("worker spawned", pid=123, argv=["python", "x.py"])
    log.debug("not at info level")
    try:
        raise ValueError("bad thing")
    except ValueError:
        log.exception("request failed", cmd="dump")
    lines = read_json_lines(path)
    assert [e["event"] for e in lines] == ["worker spawned", "request failed"]
    first = lines[0]
    assert list(first)[:4] == ["timestamp", "level", "logger", "event"]
    assert (first["level"], first["logger"], first["pid"], first["argv"]) == (
        "info",
        "hangwatch.runner",
        123,
        ["python", "x.py"],
    )
    assert "ValueError: bad thing" in lines[1]["exception"]
    console = stream.getvalue().splitlines()
    assert (
        console[0].split(" ", 1)[1]
        == "level=info logger=hangwatch.runner event=\"worker spawned\" pid=123 argv=\"['python', 'x.py']\""
    )
    assert "\x1b[" not in stream.getvalue()


def test_a_terminal_gets_coloured_console_lines(tmp_path):
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            logsetup.configure(tmp_path, "info", stream=tty, environ={})
            structlog.get_logger("hangwatch").info("hello", step=3)
            tty.flush()
        out = os.read(master, 4096).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert "hello" in out and "\x1b[" in out


def test_logrotate_rename_then_the_next_line_goes_to_a_new_file(tmp_path):
    path = logsetup.configure(tmp_path, "info", stream=io.StringIO(), environ={})
    log = structlog.get_logger("hangwatch")
    log.info("before rotation")
    os.rename(path, path.with_name("supervisor.log.1"))  # what logrotate does (no copytruncate)
    log.info("after rotation")
    assert [e["event"] for e in read_json_lines(path.with_name("supervisor.log.1"))] == ["before rotation"]
    assert [e["event"] for e in read_json_lines(path)] == ["after rotation"]


def test_reopen_closes_and_reopens_the_files(tmp_path):
    """What the loop does after a recorded SIGHUP (the recording itself: supervisor.wakeup's tests)."""
    path = logsetup.configure(tmp_path, "info", stream=io.StringIO(), environ={})
    log = structlog.get_logger("hangwatch")
    log.info("one")
    held = logsetup._handlers[0].stream
    logsetup.reopen()
    assert logsetup._handlers[0].stream is not held and held.closed
    log.info("two")
    assert [e["event"] for e in read_json_lines(path)] == ["one", "two"]


def test_under_systemd_the_log_lives_in_logs_directory_and_the_run_dir_links_to_it(tmp_path):
    run_dir, logs_dir = tmp_path / "state", tmp_path / "logs"
    path = logsetup.configure(run_dir, "info", stream=io.StringIO(), environ={"LOGS_DIRECTORY": str(logs_dir)})
    assert path == logs_dir / "supervisor.log"
    structlog.get_logger("hangwatch").info("under systemd")
    link = run_dir / "supervisor.log"
    assert link.is_symlink() and [e["event"] for e in read_json_lines(link)] == ["under systemd"]
    # Configured again (a restart of the service): the link stays right.
    logsetup.configure(run_dir, "info", stream=io.StringIO(), environ={"LOGS_DIRECTORY": str(logs_dir)})
    assert os.readlink(link) == str(logs_dir / "supervisor.log")


def test_a_real_log_file_in_the_run_dir_is_never_replaced_by_the_link(tmp_path):
    run_dir = tmp_path / "state"
    run_dir.mkdir()
    (run_dir / "supervisor.log").write_text('{"event": "from an earlier run"}\n')
    logsetup.configure(run_dir, "info", stream=io.StringIO(), environ={"LOGS_DIRECTORY": str(tmp_path / "logs")})
    assert not (run_dir / "supervisor.log").is_symlink()
    assert "earlier run" in (run_dir / "supervisor.log").read_text()


# ---- reading back ----------------------------------------------------------------------------------


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(text)


class Script:
    """A `sleep` for follow_log that changes the files between polls, then ends the follow."""

    def __init__(self, *actions):
        self.actions = list(actions)

    def __call__(self, _seconds):
        if not self.actions:
            raise StopIteration
        self.actions.pop(0)()


def collect(gen) -> list:
    out = []
    try:
        for item in gen:
            out.append(item if isinstance(item, Path) else item.decode())
    except RuntimeError as exc:  # StopIteration raised inside a generator
        assert isinstance(exc.__cause__, StopIteration)
    return out


def test_follow_worker_log_across_attempts(tmp_path):
    a1, a2, a3 = (logfollow.worker_log_path(tmp_path, n) for n in (1, 2, 3))
    _write(a1, "old-1\nold-2\n")
    script = Script(
        lambda: _write(a1, "a1 more\n"),
        lambda: (_write(a1, "a1 last words\n"), _write(a2, "a2 first\n")),  # a2 appears while a1 still has unread lines
        lambda: None,
        lambda: (a3.parent.mkdir(parents=True), None)[1],  # attempt dir without a log yet: stay on a2
        lambda: _write(a2, "a2 more\n"),
    )
    got = collect(logfollow.follow_log(tmp_path, follow=True, last_lines=1, sleep=script))
    assert got == [a1, "old-2\n", "a1 more\n", "a1 last words\n", a2, "a2 first\n", "a2 more\n"]


def test_follow_waits_for_the_first_log(tmp_path):
    a1 = logfollow.worker_log_path(tmp_path, 1)
    got = collect(logfollow.follow_log(tmp_path, follow=True, sleep=Script(lambda: None, lambda: _write(a1, "late\n"))))
    assert got == [a1, "late\n"]


def test_follow_supervisor_log_through_rotation_and_truncation(tmp_path):
    path = tmp_path / "supervisor.log"
    _write(path, "one\n")

    def rotate():
        _write(path, "two\n")
        os.rename(path, tmp_path / "supervisor.log.1")
        _write(path, "three\n")

    def truncate():
        with open(path, "w") as f:
            f.write("4\n")

    got = collect(
        logfollow.follow_log(tmp_path, supervisor=True, follow=True, sleep=Script(rotate, lambda: None, truncate))
    )
    assert got == [path, "one\n", "two\n", path, "three\n", "4\n"]


def test_no_log_without_follow_is_an_error(tmp_path):
    with pytest.raises(logfollow.NoLogYet, match="no worker log yet in"):
        list(logfollow.follow_log(tmp_path))
    with pytest.raises(logfollow.NoLogYet, match="no supervisor log yet in"):
        list(logfollow.follow_log(tmp_path, supervisor=True))


@pytest.mark.parametrize(
    "content,n,tail",
    [
        (b"", 3, b""),
        (b"a\nb\nc\n", 0, b""),
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),
        (b"a\nb\n", 5, b"a\nb\n"),
        (b"x" * 200000 + b"\nlast\n", 1, b"last\n"),
    ],
)
def test_tail_offset(tmp_path, content, n, tail):
    p = tmp_path / "f"
    p.write_bytes(content)
    with open(p, "rb") as f:
        assert content[logfollow._tail_offset(f, n) :] == tail
