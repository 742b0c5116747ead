"""Recovery inside the worker's process (`restart.in_process`): what the trainer needs to go on after an
out-of-memory step, a non-finite streak or a stall in Python without a restart.

* `LastGood`: the state of the last good checkpoint in host memory — its files, read back once it is confirmed
  good (or at the start: the checkpoint the attempt resumed from, or the state before the first step).  Putting it
  back goes through the very loaders a restart uses (`state.Files`), so what follows is bit for bit what a restart
  from that checkpoint would do.
* `AbandonWatch`: a thread that reads the supervisor's order to abandon a stuck step (`protocol.ABANDON_NAME`) and
  raises `StepAbandoned` in the training thread, which sees it at its next bytecode; it then wakes that thread with
  SIGUSR2 (a no-op handler), so that a system call it waits in — a sleep, a read, a lock — returns and the exception
  is raised there too.  A thread in native code that retries its wait (a collective, a CUDA kernel, a mutex) runs no
  bytecode: the order goes unanswered and the supervisor kills the tree.  While the trainer is not in its loop
  (loading, exporting) the order is refused at once, said in a `warn` line.
* The out-of-memory ladder of one step (`smaller`): half the micro-batch (its largest divisor at most half, so the
  examples per optimizer step stay exact), then gradient checkpointing — the supervisor's restarts' very rule
  (`common.oom_ladder`).

Only a world of one recovers here: several ranks would have to agree on it inside a collective that one of them
may be stuck in; they restart as before.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from hangwatch.common.oom_ladder import Rung, next_rung
from hangwatch.common.protocol import ABANDON_NAME, ABANDON_REFUSED_FIELD
from hangwatch.common.rundir import read_json

POLL_S = 0.1  # how often the watch looks for an order (a stat of one file)
WAKE_SIGNAL = signal.SIGUSR2  # ends the system call the training thread waits in (SIGUSR1 is faulthandler's)


class StepAbandoned(BaseException):
    """Raised in the training thread by `AbandonWatch` (a BaseException: library code that catches Exception must
    not swallow it).  `order`: the supervisor's order number."""

    def __init__(self, order: int):
        self.order = order
        super().__init__(f"step abandoned on the supervisor's order {order}")


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (and torch.cuda.OutOfMemoryError, its alias), by name: never imports torch."""
    return any(cls.__name__ == "OutOfMemoryError" for cls in type(exc).__mro__)


def smaller(r: Rung) -> Optional[Rung]:
    """The next rung down after an out-of-memory step at `r`; None: nothing is left to try in the process."""
    return next_rung(r)


PROBE_MARGIN = 0.9  # a micro-batch picked from a probe step must fit in 90 % of the capacity


def fitting_micro(
    weights_mb: float, per_example_mb: float, capacity_mb: float, effective: int, at_most: int, margin: float
) -> int:
    """The largest micro-batch d dividing `effective`, at most `at_most`, with weights + d · per_example within
    `margin` of the capacity; 1 when none does (micro-batch 1 was measured to fit)."""
    fits = [
        d
        for d in range(1, min(at_most, effective) + 1)
        if effective % d == 0 and weights_mb + d * per_example_mb <= margin * capacity_mb
    ]
    return max(fits, default=1)


def release_memory(device) -> None:
    """After an out-of-memory error: what the failed step allocated goes back to the device (the caller dropped its
    references; the CUDA cache is emptied so that the smaller step finds it free)."""
    import gc

    gc.collect()
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()


class LastGood:
    """The last good checkpoint's files in host memory, and those committed since that wait for confirmation."""

    def __init__(self) -> None:
        from hangwatch.daemon.trainer.state import Files

        self.held: Optional[Files] = None
        self.step: Optional[int] = None
        self.provisional = False  # held is a provisional checkpoint (what a restart would resume from, until withdrawn)
        self.pending: dict[int, Files] = {}

    def hold(self, path: Path, step: int, provisional: bool = False) -> None:
        """Checkpoint `path` (of `step`) is what a restart would resume from — good, or `provisional` (a resumed
        provisional checkpoint): its files are read into memory now."""
        from hangwatch.daemon.trainer.state import Files

        files = self.pending.pop(step, None)
        self.held = files if files is not None and files.path == Path(path) else Files.read(path)
        self.step = step
        self.provisional = provisional
        self.pending = {s: f for s, f in self.pending.items() if s > step}

    def withdrawn(self) -> None:
        """Provisional checkpoints were withdrawn: a held provisional one is no longer what a restart resumes from, and
        the good one before it is not in memory — nothing is held (the restart path takes over)."""
        if self.provisional:
            self.held, self.step, self.provisional = None, None, False

    def hold_start(self, fill: Callable[[Path], None]) -> None:
        """No checkpoint yet: the state before the first step, as a checkpoint would hold it (written by `fill` into
        a temporary directory, read back, removed)."""
        from hangwatch.daemon.trainer.state import Files

        with tempfile.TemporaryDirectory(prefix="hangwatch-start-") as tmp:
            fill(Path(tmp))
            files = Files.read(Path(tmp))
        self.held = Files(None, files.held)
        self.step = 0

    def committed(self, path: Path, step: int) -> None:
        """A checkpoint was committed and waits for confirmation: read it now (its files are in the page cache)."""
        from hangwatch.daemon.trainer.state import Files

        self.pending[step] = Files.read(path)

    def drop_pending(self) -> None:
        self.pending.clear()

    @property
    def nbytes(self) -> int:
        return (self.held.nbytes if self.held else 0) + sum(f.nbytes for f in self.pending.values())


class AbandonWatch:
    """Reads the supervisor's abandon orders in `directory` and raises `StepAbandoned` in `thread_id`'s thread while
    `armed` (the trainer's loop); refuses them otherwise.  `raise_in`: the seam that raises an exception in another
    thread (CPython's PyThreadState_SetAsyncExc).  Each order is acted on once."""

    def __init__(
        self,
        directory: Path,
        hb,
        *,
        thread_id: Optional[int] = None,
        raise_in: Optional[Callable[[int, type], bool]] = None,
        wake: Optional[Callable[[int], None]] = None,
        poll_s: float = POLL_S,
    ):
        """`wake(thread_id)`: interrupts the system call that thread waits in (default: SIGUSR2 to it, with a no-op
        handler installed by `start`, which must then run in the main thread)."""
        self.path = Path(directory) / ABANDON_NAME
        self.hb = hb
        self.thread_id = thread_id if thread_id is not None else threading.main_thread().ident
        self.raise_in = raise_in or _raise_in_thread
        self.wake = wake
        self._previous_handler = None
        self.poll_s = poll_s
        self.armed = False
        self.done: set[int] = set()
        self.order: Optional[int] = None  # the order whose exception is on its way
        self.delivered: Optional[int] = None  # the last order whose exception the training thread caught
        self.raised_phase: Optional[str] = None  # the heartbeat's phase when it was raised
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._seen_mtime: Optional[float] = None
        self._thread: Optional[threading.Thread] = None
        self.errors = 0

    def start(self) -> "AbandonWatch":
        if self.wake is None:
            self._previous_handler = signal.signal(WAKE_SIGNAL, _woken)
            self.wake = _wake_thread
        self._seen_mtime = self._mtime()
        if self._seen_mtime is not None:  # an order older than this watch is not for it
            record = read_json(self.path) or {}
            if isinstance(record.get("order"), int):
                self.done.add(record["order"])
        self._thread = threading.Thread(target=self._run, name="hangwatch-abandon-watch", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self.disarm()
        if self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(WAKE_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def arm(self) -> None:
        """The training thread is in its loop: an order raises there."""
        self.armed = True

    def disarm(self) -> None:
        """The training thread leaves its loop, or caught the exception: nothing more may reach it.  An exception raised
        but not yet seen is taken back (PyThreadState_SetAsyncExc with NULL)."""
        with self._lock:
            self.armed = False
            if self.order is not None:
                exc = sys.exc_info()[1]
                if isinstance(exc, StepAbandoned) and exc.order == self.order:
                    self.delivered = self.order  # caught: this is the handler
                else:
                    self.raise_in(self.thread_id, None)
                self.order = None

    def _mtime(self) -> Optional[float]:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as exc:  # the watch never takes the worker down; said once in a while
                self.errors += 1
                if self.errors in (1, 10, 100):
                    self.hb.warn(f"abandon watch: {type(exc).__name__}: {exc}")

    def check(self) -> Optional[int]:
        """One look: the order acted on (raised or refused), or None."""
        mtime = self._mtime()
        if mtime is None or mtime == self._seen_mtime:
            return None
        self._seen_mtime = mtime
        record = read_json(self.path)
        order = record.get("order") if isinstance(record, dict) else None
        if not isinstance(order, int) or order in self.done:
            return None
        self.done.add(order)
        with self._lock:
            if self.armed:
                self.order = order
                self.raised_phase = getattr(self.hb, "current_phase", None)
                self.raise_in(self.thread_id, _exception_for(order))
                if self.wake is not None:
                    self.wake(self.thread_id)
                return order
        self.hb.warn(
            f"asked to abandon the step (order {order}), but the worker is not in its training loop",
            **{ABANDON_REFUSED_FIELD: {"order": order, "why": "not in the training loop"}},
        )
        return order


def _exception_for(order: int) -> type:
    """PyThreadState_SetAsyncExc raises a class (instantiated without arguments): one that knows its order."""
    return type("StepAbandoned", (StepAbandoned,), {"__init__": lambda self: StepAbandoned.__init__(self, order)})


def _raise_in_thread(thread_id: int, exc_type: Optional[type]) -> bool:
    """CPython: `exc_type` raised in thread `thread_id` at its next bytecode (None: a pending one taken back); False
    when no such thread."""
    exc = ctypes.py_object(exc_type) if exc_type is not None else None
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), exc)
    if n > 1:  # never: ids are unique; undo rather than raise in several
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)
        return False
    return n == 1


def _woken(signum, frame) -> None:
    """SIGUSR2's handler: nothing; running it (Python bytecode, in the training thread) is the point."""


def _wake_thread(thread_id: int) -> None:
    try:
        signal.pthread_kill(thread_id, WAKE_SIGNAL)
    except (OSError, ValueError):  # the thread is gone: nothing to wake
        pass


def landed_at(exc: BaseException) -> Optional[str]:
    """Where an abandoned step was when the exception reached it: the innermost frame, `file:line in function`."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:  # not the wake-up handler it may have been raised in
            last = tb
        tb = tb.tb_next
    if last is None:
        return None
    code = last.tb_frame.f_code
    # an exception raised asynchronously can land on an instruction without a line number (tb_lineno None): the
    # frame's own last line is where it was
    line = last.tb_lineno if last.tb_lineno is not None else last.tb_frame.f_lineno
    return (
        f"{code.co_filename}:{line} in {code.co_name}" if line is not None else f"{code.co_filename} in {code.co_name}"
    )


def monotonic() -> float:
    return time.monotonic()
