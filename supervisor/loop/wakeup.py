"""How the supervisor's loop sleeps and what wakes it: signals, heartbeat writes, the control socket,
the earliest deadline.

The loop sleeps in one selector on:
  * a self-pipe: `signal.set_wakeup_fd` writes the signal number into it (and `poke()` a byte);
  * inotify on the current attempt's heartbeat files (`watch.beat_files.FileEvents`), read right here —
    no thread;
  * the control server's descriptor, when it has one (`extra` in `open`), so a request is answered
    at once however long the loop would sleep;
with the timeout the loop asks for: the time to its earliest deadline (`Supervisor.next_wait`), since
a hang is exactly the absence of events.

Heartbeat writes are coalesced: one pass reads every new line of every rank, and a burst of writes
(8 ranks at 20 Hz are 160 a second) wakes the loop at most once per `min_read_s`.  A write that comes
after a quiet stretch is read at once; one that comes sooner after the previous read waits for the
rest of the interval (while signals and control requests still wake the loop).  The wait costs no
detection time: a line counts from when it was written (its file's modification time,
`watch.beat_files.written_at`), and the pass at a deadline reads every pending line before it checks.
Writes to other files (worker.log) wake nothing.

The one signal recorder lives here: SIGTERM, SIGINT, SIGQUIT, SIGUSR1, SIGCHLD, SIGHUP and SIGCONT are only
*recorded* (in a deque, which appends and pops atomically — safe from a handler); the loop drains them at
the start of its next pass and acts there (stop; stop to be run again — SIGUSR1, a batch job's warning
that its time limit is near; reap; reopen the log; SIGCONT: this process was stopped, see
`deadlines.SuspensionDetector`).
"""

from __future__ import annotations

import os
import selectors
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from hangwatch.supervisor.watch.beat_files import FileEvents

RECORDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGCHLD,
    signal.SIGHUP,
    signal.SIGCONT,
)
MIN_READ_S = 0.25  # heartbeat writes wake the loop at most this often (lines are dated by their files' times)

PIPE, BEATS, EXTRA = "pipe", "beats", "extra"  # what a selector key stands for


class Wakeup:
    def __init__(
        self,
        *,
        install_signals: bool = True,
        min_read_s: float = MIN_READ_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._install_signals = install_signals
        self.min_read_s = min_read_s
        self._clock = clock  # real time on purpose: this is about when to read, not about deadlines
        self._signals: deque[int] = deque()
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._selector: Optional[selectors.BaseSelector] = None  # pipe, heartbeat events, extra
        self._quiet: Optional[selectors.BaseSelector] = None  # pipe and extra: while a read is held back
        self._events: Optional[FileEvents] = None
        self.events_problem: Optional[str] = None  # why heartbeat writes cannot wake the loop (then: a timer)
        self._old_handlers: dict[int, Any] = {}
        self._old_wakeup_fd: Optional[int] = None
        self._last_read = float("-inf")

    # ---- signals --------------------------------------------------------------------------

    def record(self, signum: int, frame: Any = None) -> None:
        """The signal handler: record, nothing else (the loop acts on it)."""
        self._signals.append(signum)

    def drain(self) -> list[int]:
        """The signals recorded since the last call, oldest first."""
        out = []
        while self._signals:
            out.append(self._signals.popleft())
        return out

    @property
    def signals_installed(self) -> bool:
        """The handlers are in place: a child's exit is heard (SIGCHLD) rather than polled for."""
        return bool(self._old_handlers)

    # ---- set-up ---------------------------------------------------------------------------

    def open(self, watch_dir: Optional[Path] = None, extra: Iterable[int] = ()) -> None:
        """Create the pipe and the selector, install the handlers (main thread only), open inotify
        (watching `watch_dir`, if given; see `watch`), and also wake on the descriptors in `extra`."""
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._quiet = selectors.DefaultSelector()
        for sel in (self._selector, self._quiet):
            sel.register(self._wake_r, selectors.EVENT_READ, PIPE)
            for fd in extra:
                sel.register(fd, selectors.EVENT_READ, EXTRA)
        if self._install_signals and threading.current_thread() is threading.main_thread():
            self._old_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
            for sig in RECORDED:
                self._old_handlers[sig] = signal.signal(sig, self.record)
        self._events, self.events_problem = FileEvents.open()
        if self._events is not None:
            self._selector.register(self._events.fileno(), selectors.EVENT_READ, BEATS)
            if watch_dir is not None:
                self.watch(watch_dir)

    def watch(self, directory: Optional[Path]) -> bool:
        """Follow the heartbeat files in `directory` (the current attempt's; None: none).  True when
        that changed: lines written before the watch existed made no event, so read once at once."""
        if self._events is None:
            return False
        return self._events.watch(directory)

    def grown(self) -> Optional[set[str]]:
        """The heartbeat files that grew since the last call (events still queued included), for a pass
        to read only those; None when it must read every file (no file events, a new watch, lost events)."""
        if self._events is None or not self._events.watching:
            return None
        return self._events.take()

    @property
    def hears_beats(self) -> bool:
        """Heartbeat writes wake the loop (inotify watches the current attempt); else the loop must read
        on a timer."""
        return self._events is not None and self._events.watching

    def poke(self) -> None:
        """Wake the loop from another thread (a byte into the pipe)."""
        if self._wake_w is not None:
            try:
                os.write(self._wake_w, b"p")
            except (BlockingIOError, OSError):
                pass  # the pipe is full: the loop is awake already

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            self._old_wakeup_fd = None
        for sel in (self._selector, self._quiet):
            if sel is not None:
                sel.close()
        self._selector = self._quiet = None
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None

    # ---- sleeping -------------------------------------------------------------------------

    def wait(self, timeout: float) -> str:
        """Sleep until something needs a pass or `timeout` seconds passed; returns what woke it: "signal"
        (the pipe), "extra" (the control socket), "beats" (a heartbeat file grew), "timeout", or
        "closed" (not opened: returns at once)."""
        if self._selector is None:
            return "closed"
        now = self._clock()
        end = now + max(0.0, timeout)
        # Right after a read, heartbeat writes wait out the rest of `min_read_s`: sleep on the pipe and
        # the extra descriptors only, then look at the heartbeat events (a busy stream has some by then,
        # so a pass costs one sleep, not one per write).
        quiet_until = min(self._last_read + self.min_read_s, end)
        if quiet_until > now:
            woke = self._select(self._quiet, quiet_until - now)
            if woke:
                return woke
        while True:
            try:
                ready = self._selector.select(max(0.0, end - self._clock()))
            except InterruptedError:
                ready = []
            kinds = {key.data for key, _mask in ready}
            if PIPE in kinds:
                self._drain_pipe()
                return "signal"
            if EXTRA in kinds:
                return "extra"
            if BEATS in kinds and self._events is not None and self._events.drain():
                return "beats"
            if self._clock() >= end:
                return "timeout"
            # only writes to other files (or a watch that went away): sleep on

    def _select(self, sel: selectors.BaseSelector, timeout: float) -> Optional[str]:
        try:
            ready = sel.select(timeout)
        except InterruptedError:
            return None
        kinds = {key.data for key, _mask in ready}
        if PIPE in kinds:
            self._drain_pipe()
            return "signal"
        return "extra" if EXTRA in kinds else None

    def _drain_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def pass_done(self, now: Optional[float] = None) -> None:
        """The loop finished a pass (it read every heartbeat line there was): the interval starts now."""
        self._last_read = self._clock() if now is None else now


FAST_PASS_S = 0.1  # loop period while escalating or stopping: prompt, yet cheap (each pass scans the tree)
IDLE_WAIT_S = 5.0  # the longest sleep with nothing due: bounds what runs only in passes (idle control clients)


def pace(
    *,
    now_due: bool,
    escalating: bool,
    episode_due: Optional[float],
    held: bool,
    dues: Iterable[Optional[float]],
    timer_s: Optional[float],
) -> float:
    """How long the loop may sleep (pure).  `now_due`: something waits for the next pass (the first attempt's spawn,
    heartbeat lines left at a read's size bound).  `escalating`: an episode, a stop or a `dump` in flight — a pass
    every FAST_PASS_S, or at the episode's own next moment (`episode_due`: snapshot interval, SIGKILL at the grace,
    a dump's quiet period) when sooner, or, for a teardown a concern holds (`held`: survivors of SIGKILL), at that
    moment however far.  `dues`: seconds until each other thing due (a deadline, the end of a backoff, the
    notifier's ping, the peer link, a concern); `timer_s`: `poll_interval_s` where a heartbeat write or a control
    request could not wake the loop.  At most IDLE_WAIT_S."""
    if now_due:
        return 0.0
    waits = [d for d in dues if d is not None]
    if escalating:
        if episode_due is None:
            waits.append(FAST_PASS_S)
        else:
            waits.append(episode_due if held else min(FAST_PASS_S, episode_due))
    else:
        waits += [IDLE_WAIT_S] + ([timer_s] if timer_s is not None else [])
    return max(0.0, min(waits))
