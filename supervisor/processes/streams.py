"""The command's standard streams: its stdout on ours, its stderr on ours, a terminal where we have one.

`hangwatch run -- CMD` in the foreground is to behave like CMD.  So an attempt's stdout and stderr are not a file
the command writes into but a pipe each — or, where hangwatch's own stream is a terminal, a pseudo-terminal — that
one thread (the relay) reads: every chunk goes, as it came (carriage returns, escape codes, half lines), to
hangwatch's own stream of the same name and into the attempt's worker.log, both streams there in the order they
were read.  The file stays the record: `hangwatch logs`, the output tail and the incidents read it.

* A terminal exactly where there was one: the command's stdout is a pty when our stdout is a terminal, its stderr
  when our stderr is; both share one pty when both are the same terminal (on a screen their bytes share one order
  anyway).  A pty starts with our terminal's settings and window size, output processing off (the bytes read are
  the bytes written; our terminal translates newlines as it would for the bare command), and follows our window:
  SIGWINCH — its handler only pokes the relay — makes the relay copy the new size onto each pty and pass SIGWINCH
  to the command's process group (a pty that is no session's controlling terminal signals no one by itself).
* stdin is ours, inherited: a prompt can be answered, a pipe read.  The command runs in a session of its own
  (hangwatch ends its tree by group), so no pty is its controlling terminal and /dev/tty does not open there: a
  password prompt (getpass) falls back to stdin, which is our terminal.
* hangwatch's own lines (`say`) go to our stderr through the same thread, so they never land inside a line of the
  command's: a line it left open on the same screen (a progress bar) is ended first.
* A reader that went away (`| head`): that stream's read end is closed, so the command's next write fails as it
  would have bare (EPIPE, SIGPIPE); the other stream and worker.log go on.  A log the disk refuses loses those
  bytes from the file only (said once in supervisor.log); the screen goes on.
"""

from __future__ import annotations

import errno
import fcntl
import os
import select
import signal
import stat
import struct
import termios
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import structlog

log = structlog.get_logger("hangwatch")

CHUNK = 1 << 16
IDLE_S = 1.0  # the relay's longest sleep with nothing to read (a poke or a byte wakes it at once)
DRAIN_QUIET_S = 0.2  # at the end: a stream that gave nothing for this long while closing is let go
WINSIZE = struct.pack("HHHH", 0, 0, 0, 0)


def is_terminal(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def hangup_is_the_terminals(fds: tuple = (0, 1, 2), disposition=None) -> bool:
    """Whether a SIGHUP to this process means its terminal went away: one of `fds` is a terminal, and SIGHUP was not
    ignored when it started (`nohup` ignores it, and an ignored signal is inherited across exec).  Elsewhere (files,
    pipes) a SIGHUP is the daemon convention's: reopen the log files (`rules.stop_signals`)."""
    ignored = (disposition if disposition is not None else signal.getsignal(signal.SIGHUP)) == signal.SIG_IGN
    return not ignored and any(is_terminal(fd) for fd in fds)


def screen_of(fd: int) -> object:
    """What two descriptors share when their bytes end on one screen: a terminal's device, else the descriptor."""
    try:
        st = os.fstat(fd)
    except OSError:
        return fd
    return ("tty", st.st_rdev) if stat.S_ISCHR(st.st_mode) and is_terminal(fd) else fd


@dataclass
class _Stream:
    """One read end the relay follows: a pipe's or a pty master's, copied to `dest` and to the attempt's log."""

    fd: int
    dest: Optional[int]  # hangwatch's own descriptor (1 or 2); None: the log only
    log: "_Log"
    pty: bool = False
    pgid: int = 0

    def winsize_from_dest(self) -> None:
        if not self.pty or self.dest is None:
            return
        try:
            size = fcntl.ioctl(self.dest, termios.TIOCGWINSZ, WINSIZE)
            fcntl.ioctl(self.fd, termios.TIOCSWINSZ, size)
        except OSError:
            pass


@dataclass
class _Log:
    """worker.log of one attempt, shared by its streams; closed when the last of them ends."""

    fd: int
    path: Path
    users: int = 0
    refused: Optional[str] = None

    def write(self, data: bytes) -> None:
        if self.refused is not None:
            return
        try:
            _write_all(self.fd, data)
        except OSError as exc:
            self.refused = exc.strerror or str(exc)
            log.warning(
                "worker_log_refused", path=str(self.path), error=self.refused, note="the output is still relayed"
            )

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            os.close(self.fd)


@dataclass
class Ends:
    """One attempt's streams before its process exists: what the child gets, what the relay keeps."""

    stdout: int
    stderr: int
    child_fds: list[int]
    streams: list[_Stream]
    log: _Log
    heading: Optional[str] = None

    def abandon(self) -> None:
        """The spawn failed: close everything."""
        for fd in {*self.child_fds, *(s.fd for s in self.streams)}:
            os.close(fd)
        os.close(self.log.fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except InterruptedError:
            continue
        except BlockingIOError:  # a descriptor someone made non-blocking: wait until it takes more
            select.select([], [fd], [], 1.0)
            continue
        view = view[n:]


class Relay:
    """The command's output on hangwatch's own streams, and hangwatch's own lines between it (see the module).

    `out`, `err`: hangwatch's descriptors (1 and 2).  `show`: False keeps the command's output in worker.log only
    (`hangwatch run --hide-output`); the command then gets plain pipes.  `killpg`: how SIGWINCH reaches the
    command's group (a seam)."""

    def __init__(
        self,
        out: int = 1,
        err: int = 2,
        *,
        show: bool = True,
        killpg: Callable[[int, int], None] = os.killpg,
    ):
        self.out, self.err, self.show = out, err, show
        self.tty = {fd: show and is_terminal(fd) for fd in (out, err)}  # (one entry when out is err)
        self.screens = {fd: screen_of(fd) for fd in (out, err)}
        self.shared = self.tty[out] and self.tty[err] and self.screens[out] == self.screens[err]
        self._killpg = killpg
        self._lock = threading.Lock()
        self._streams: list[_Stream] = []
        self._said: deque[bytes] = deque()
        self._open_line: dict[object, bool] = {}  # screen → the last byte written there ended no line
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._resize = threading.Event()
        self._attached = 0
        self._thread = threading.Thread(target=self._run, name="hangwatch-relay", daemon=True)
        self._thread.start()
        self._old_winch = None
        self.gone: set[int] = set()  # our descriptors whose reader went away

    # ---- the loop's side (any thread)

    def follow_window(self) -> None:
        """Install the SIGWINCH handler (main thread only); it only pokes the relay."""
        if any(s for s in self.tty.values()) and threading.current_thread() is threading.main_thread():
            self._old_winch = signal.signal(signal.SIGWINCH, self._winch)

    def _winch(self, signum, frame) -> None:
        self._resize.set()
        self._poke()

    def open(self, log_path: Path) -> Ends:
        """Pipes or ptys for one attempt's stdout and stderr, and its worker.log opened for appending."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        lf = _Log(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644), log_path)
        child: list[int] = []  # the child's stdout, then its stderr
        streams: list[_Stream] = []
        made: list[int] = []
        try:
            if self.shared:
                master, slave = self._pty(self.out)
                made += [master, slave]
                child = [slave, slave]
                streams.append(_Stream(master, self.out, lf, pty=True))
            else:
                for fd in (self.out, self.err):
                    r, w = self._pty(fd) if self.tty[fd] else os.pipe()
                    made += [r, w]
                    child.append(w)
                    streams.append(_Stream(r, fd if self.show else None, lf, pty=self.tty[fd]))
        except OSError:
            for fd in made:
                os.close(fd)
            os.close(lf.fd)
            raise
        lf.users = len(streams)
        number = log_path.parent.name
        heading = f"──── attempt {int(number)} ────" if number.isdigit() else None
        return Ends(child[0], child[1], sorted(set(child)), streams, lf, heading)

    def _pty(self, like: int) -> tuple[int, int]:
        master, slave = os.openpty()
        try:
            attrs = termios.tcgetattr(like)
            attrs[1] &= ~termios.OPOST  # oflag: the bytes read are the bytes written
            termios.tcsetattr(slave, termios.TCSANOW, attrs)
        except termios.error:
            pass
        try:
            fcntl.ioctl(slave, termios.TIOCSWINSZ, fcntl.ioctl(like, termios.TIOCGWINSZ, WINSIZE))
        except OSError:
            pass
        return master, slave

    def attach(self, ends: Ends, pgid: int) -> None:
        """The attempt's process exists: the parent's copies of the child's ends are closed (so its exit is the
        streams' end), and the relay follows the read ends; from the second attempt on, a separator line first."""
        for fd in ends.child_fds:
            os.close(fd)
        with self._lock:
            self._attached += 1
            if self._attached > 1 and ends.heading:
                self._said.append(ends.heading.encode())
            for s in ends.streams:
                s.pgid = pgid
            self._streams.extend(ends.streams)
        self._poke()

    def following(self, ends: Ends) -> bool:
        """Some of that attempt's streams are still open: bytes may be on their way into its worker.log."""
        with self._lock:
            return any(s in self._streams for s in ends.streams)

    def say(self, text: str) -> None:
        """One of hangwatch's own lines on stderr, in order with the command's output."""
        with self._lock:
            self._said.append(text.encode(errors="replace"))
        self._poke()

    def close(self, timeout_s: float = 5.0) -> None:
        """Copy what is left (the last attempt's last bytes, lines said), then stop."""
        self._stop.set()
        self._poke()
        self._thread.join(timeout_s)
        if self._old_winch is not None:
            signal.signal(signal.SIGWINCH, self._old_winch)
            self._old_winch = None
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def end_line(self) -> None:
        """After `close`: end a line the command left open on stderr's screen, for hangwatch's summary to follow."""
        if self._open_line.get(self.screens[self.err]) and self.err not in self.gone:
            try:
                _write_all(self.err, b"\n")
            except OSError:
                pass
        self._open_line.clear()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # full (the relay is awake anyway) or closed (it has ended)
            pass

    # ---- the thread

    def _run(self) -> None:
        quiet_since: Optional[float] = None
        while True:
            with self._lock:
                streams = list(self._streams)
                said = list(self._said)
                self._said.clear()
            for line in said:
                self._say_now(line)
            if self._resize.is_set():
                self._resize.clear()
                self._follow_size(streams)
            stopping = self._stop.is_set()
            if stopping and not streams:
                return
            try:
                ready, _, _ = select.select([s.fd for s in streams] + [self._wake_r], [], [], IDLE_S)
            except (OSError, ValueError):  # a descriptor closed under us: look again
                ready = []
            if self._wake_r in ready:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except OSError:
                    pass
            got = False
            for s in streams:
                if s.fd in ready:
                    got = self._pump(s) or got
            if stopping:
                if got or ready:
                    quiet_since = None
                else:
                    now = time.monotonic()
                    quiet_since = quiet_since or now
                    if now - quiet_since >= DRAIN_QUIET_S:  # a descendant holding the stream: let it go
                        for s in streams:
                            self._end(s)

    def _pump(self, s: _Stream) -> bool:
        try:
            data = os.read(s.fd, CHUNK)
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EBADF):  # EIO: a pty whose other end is closed
                log.warning("relay_read_failed", error=str(exc))
            data = b""
        if not data:
            self._end(s)
            return False
        s.log.write(data)
        if s.dest is not None and s.dest not in self.gone:
            try:
                _write_all(s.dest, data)
                self._open_line[self.screens[s.dest]] = not data.endswith(b"\n")
            except OSError as exc:
                self.gone.add(s.dest)
                log.warning("relay_reader_gone", fd=s.dest, error=str(exc), note="the output is still in worker.log")
                if not s.pty:  # the command's next write fails as it would have bare
                    self._end(s)
                    return True
        return True

    def _end(self, s: _Stream) -> None:
        with self._lock:
            if s not in self._streams:
                return
            self._streams.remove(s)
        try:
            os.close(s.fd)
        except OSError:
            pass
        s.log.release()

    def _say_now(self, line: bytes) -> None:
        if self.err in self.gone:
            return
        screen = self.screens[self.err]
        lead = b"\n" if self._open_line.get(screen) else b""
        try:
            _write_all(self.err, lead + b"hangwatch: " + line + b"\n")
            self._open_line[screen] = False
        except OSError:
            self.gone.add(self.err)

    def _follow_size(self, streams: list[_Stream]) -> None:
        groups = set()
        for s in streams:
            if s.pty:
                s.winsize_from_dest()
                groups.add(s.pgid)
        for pgid in groups:
            try:
                self._killpg(pgid, signal.SIGWINCH)
            except OSError:
                pass
