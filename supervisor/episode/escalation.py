"""The escalation ladder, as steps the main loop advances without blocking it.

    DumpCollector: SIGUSR1 to the processes that announced a dump signal (never to a launcher) and, at
                   the same moment, `py-spy dump --native --locals` per pid when installed (time-boxed
                   by `py_spy_timeout_s`); a rank's dump is in as soon as it is whole (`dump_complete`:
                   faulthandler writes synchronously and lists the main thread last), else once its
                   file stopped growing for SETTLE_S, bounded by `dump_grace_s`; py-spy holds the step
                   only while it runs.  The `gate` (the stall's process snapshot, taken while the
                   dumps are written) must be passed too; then, for a rank whose main thread waits on
                   its DataLoader, the workers' stacks (`loader_dumps.WorkerDumps`).
    TreeKiller:    SIGTERM to the process group → the grace it was given (`term_grace_s` for a
                   graceful stop, `stuck_term_grace_s` for a worker a deadline found stuck: its main
                   thread cannot run the handler) → SIGKILL to the group and to every descendant
                   that left it → the tree gone (or, after `kill_wait_s`, its survivors recorded) →
                   wait (bounded) until NVML no longer lists the dead pids as holding GPU memory.

Each has `advance(now) -> bool` (True when finished) so the loop keeps answering the control
socket and draining events while a stall is being handled.  Both see processes only through the
injected `ProcessTable`; neither reaps: the supervisor's loop reaps children in one place each pass
and records the worker's exit on `Worker`, which is what `TreeKiller` reads.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import structlog

from hangwatch.supervisor.incidents.dumps import parse_faulthandler
from hangwatch.supervisor.processes.process import ProcessTable, ProcRef, Worker

if TYPE_CHECKING:
    from hangwatch.supervisor.episode.loader_dumps import WorkerDumps

log = structlog.get_logger("hangwatch")

SETTLE_S = 0.3  # a dump that does not read as whole is complete once unchanged this long after growing


def dump_complete(text: str) -> bool:
    """Whether the text a process appended to its dump file is a whole faulthandler dump.  faulthandler
    writes the dump from its signal handler in one go, thread after thread, and CPython lists the main
    thread last (the oldest thread state): a text whose last block is the main thread's, down to its
    outermost `<module>` frame, and that ends with a newline has nothing more to come.  Anything else
    (a main thread cut at faulthandler's 100 frames, a process whose main thread is not last, a write
    caught half-way) is not whole: the caller waits for the file to stop growing instead."""
    if not text.endswith("\n"):
        return False
    threads = parse_faulthandler(text)
    return bool(threads) and threads[-1].is_main() and not threads[-1].truncated


@dataclass
class DumpTarget:
    rank: int
    ref: ProcRef
    dump_path: Path
    offset: int = 0  # size before the signal: only what is appended belongs to this dump


@dataclass
class DumpCollector:
    targets: list[DumpTarget]
    grace_s: float
    table: ProcessTable
    py_spy: bool = True
    py_spy_timeout_s: float = 20.0
    py_spy_path: Optional[str] = None  # None: find_py_spy()
    out_dir: Optional[Path] = None  # where py-spy output goes (the incident directory)
    loader_workers: Optional["WorkerDumps"] = None  # then: the DataLoader workers of a rank that waits on them
    # Evidence taken beside the dumps that must be in before the second step (the stall's process snapshot,
    # which also names the DataLoader workers): asked each pass once no py-spy holds a process stopped
    # (whether or not the dump files are in yet); True when done.
    gate: Optional[Callable[[float], bool]] = None
    started_at: float = 0.0
    signalled: dict[int, bool] = field(default_factory=dict)
    py_spy_procs: dict[int, tuple[subprocess.Popen, Path]] = field(default_factory=dict)
    py_spy_note: str = ""
    files_at: Optional[float] = None  # every rank's dump file in (whole, settled, or the grace ran out)
    py_spy_done_at: Optional[float] = None
    stacks_at: Optional[float] = None  # both: the ranks' own stacks are in
    gate_at: Optional[float] = None
    _sizes: dict[int, int] = field(default_factory=dict)
    _changed_at: dict[int, float] = field(default_factory=dict)
    _complete: dict[int, bool] = field(default_factory=dict)
    done: bool = False

    def begin(self, now: float) -> None:
        self.started_at = now
        for t in self.targets:
            try:
                t.offset = t.dump_path.stat().st_size
            except OSError:
                t.offset = 0
            self._sizes[t.rank] = t.offset
            self.signalled[t.rank] = self.table.signal(t.ref, signal.SIGUSR1)
        self._start_py_spy()

    def py_spy_exe(self) -> Optional[str]:
        return (self.py_spy_path or find_py_spy()) if self.py_spy else None

    def _start_py_spy(self) -> None:
        exe = self.py_spy_exe()
        if not self.py_spy:
            self.py_spy_note = "disabled (watchdog.py_spy: false)"
            return
        if exe is None:
            self.py_spy_note = f"not installed (looked in {Path(sys.executable).parent} and on PATH)"
            return
        if self.out_dir is None:
            return
        for t in self.targets:
            if not self.signalled.get(t.rank):
                continue
            out = self.out_dir / f"py-spy-rank{t.rank}.txt"
            try:
                f = open(out, "wb")
            except OSError as exc:  # the incident directory could not be made (a full disk): no py-spy output
                self.py_spy_note = f"not run: cannot write {out} ({exc.strerror})"
                return
            f.close()
            # --full-filenames: the user's own frames are told from libraries by their paths (landmarks)
            p = start_py_spy(exe, t.ref.pid, out, ["--native", "--locals"])
            if p is not None:
                self.py_spy_procs[t.rank] = (p, out)
        self.py_spy_note = f"ran {exe}"

    def _py_spy_running(self, now: float) -> bool:
        return py_spy_running(self.py_spy_procs.values(), now - self.started_at, self.py_spy_timeout_s)

    def advance(self, now: float) -> bool:
        """One loop pass; True once every step is done: the ranks' stacks and the gate, then the DataLoader workers."""
        if self.done:
            return True
        if self.stacks_at is None and self._stacks_in(now):
            self.stacks_at = now
        # the gate does not wait for the files, only for py-spy to have let go of the processes
        if self.gate is not None and self.gate_at is None and self.py_spy_done_at is not None and self.gate(now):
            self.gate_at = now
        if self.stacks_at is None or (self.gate is not None and self.gate_at is None):
            return False
        w = self.loader_workers
        if w is not None and not w.begun:
            w.begin(now, self)
        self.done = w is None or w.advance(now)
        return self.done

    def _stacks_in(self, now: float) -> bool:
        """Every rank's dump file is in, and no py-spy still runs (each is time-boxed)."""
        if self.files_at is None and (self._files_in(now) or now - self.started_at >= self.grace_s):
            self.files_at = now
        if self.py_spy_done_at is None and not self._py_spy_running(now):
            self.py_spy_done_at = now
        return self.files_at is not None and self.py_spy_done_at is not None

    def _files_in(self, now: float) -> bool:
        waiting = False
        for t in self.targets:
            try:
                size = t.dump_path.stat().st_size
            except OSError:
                size = t.offset
            if size != self._sizes.get(t.rank):
                self._sizes[t.rank] = size
                self._changed_at[t.rank] = now
                self._complete[t.rank] = size > t.offset and dump_complete(_read(t.dump_path, t.offset))
            if not self.signalled.get(t.rank) or self._complete.get(t.rank) or self.table.is_gone(t.ref):
                continue  # nothing to wait for: never signalled, whole already, or gone
            if size <= t.offset or now - self._changed_at[t.rank] < SETTLE_S:
                waiting = True  # not written yet, or still growing
        return not waiting

    def next_due(self) -> Optional[float]:
        """The earliest time this step has something to decide on its own clock — a dump's quiet period ends,
        the grace runs out, py-spy reaches its time box — or None.  (Growth and py-spy ending are seen by
        polling; a whole dump needs no timer.)"""
        if self.stacks_at is not None:
            return None
        due = []
        if self.files_at is None:
            due.append(self.started_at + self.grace_s)
            due += [self._changed_at[t.rank] + SETTLE_S for t in self.targets
                    if t.rank in self._changed_at and not self._complete.get(t.rank)]
        if self.py_spy_done_at is None and self.py_spy_procs:
            due.append(self.started_at + self.py_spy_timeout_s)
        return min(due) if due else None

    def timings(self) -> dict:
        """When each part was in, in seconds after the signals (None: not reached)."""
        rel = lambda x: None if x is None else round(x - self.started_at, 3)  # noqa: E731
        return {"dump_files_s": rel(self.files_at), "py_spy_s": rel(self.py_spy_done_at) if self.py_spy_procs else None,
                "stacks_s": rel(self.stacks_at)}

    def texts(self) -> dict[int, str]:
        """Only what was appended after the signal, per rank."""
        out = {}
        for t in self.targets:
            try:
                with open(t.dump_path, "rb") as f:
                    f.seek(t.offset)
                    out[t.rank] = f.read(4 << 20).decode("utf-8", "replace")
            except OSError:
                out[t.rank] = ""
        return out

    def py_spy_texts(self) -> dict[int, str]:
        out = {}
        for rank, (_, path) in self.py_spy_procs.items():
            try:
                out[rank] = path.read_text(errors="replace")
            except OSError:
                pass
        return out


def start_py_spy(exe: str, pid: int, out: Path, options: list[str]) -> Optional[subprocess.Popen]:
    """`py-spy dump … --pid PID --full-filenames` into `out` (its own error when it cannot start)."""
    try:
        with open(out, "wb") as f:
            try:
                return subprocess.Popen([exe, "dump", *options, "--pid", str(pid), "--full-filenames"], stdout=f,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            except OSError as exc:
                f.write(f"py-spy could not start: {exc}\n".encode())
    except OSError:
        pass
    return None


def py_spy_running(procs, elapsed_s: float, timeout_s: float) -> bool:
    """Whether any of the (Popen, output path) pairs still runs; one past its time box is killed (and says so)."""
    running = False
    for p, out in procs:
        if p.poll() is None:
            if elapsed_s >= timeout_s:
                p.kill()
                p.wait(timeout=5)
                with open(out, "ab") as f:
                    f.write(f"\n[py-spy killed after {timeout_s:g}s time box]\n".encode())
            else:
                running = True
    return running


def _read(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class TreeKiller:
    """Brings a worker's whole tree down; `refs` are extra processes known to belong to it."""

    worker: Worker
    refs: list[ProcRef]
    table: ProcessTable
    term_grace_s: float
    gpu_release_timeout_s: float
    kill_wait_s: float = 30.0  # after SIGKILL, how long to wait for the tree to go before recording survivors
    gpu_pids: Callable[[], Optional[set[int]]] = lambda: None
    send_term: bool = True
    term_at: Optional[float] = None
    kill_at: Optional[float] = None
    gone_at: Optional[float] = None
    done_at: Optional[float] = None
    killed: list[int] = field(default_factory=list)
    survivors: list[dict] = field(default_factory=list)
    gpu_release: dict = field(default_factory=dict)
    _dead: set[int] = field(default_factory=set)

    def _tree(self) -> list[ProcRef]:
        members = {r.pid: r for r in self.table.group_members(self.worker.pgid)}
        for r in self.refs:
            members.setdefault(r.pid, r)
        if not self.worker.exited:
            members.setdefault(self.worker.pid, self.worker.ref)
        return self.table.alive(members.values())

    def begin(self, now: float) -> None:
        self.term_at = now
        self.refs = list({r.pid: r for r in self.refs + self.table.descendants(self.worker.pid)}.values())
        self._dead = {r.pid for r in self.refs} | {self.worker.pid}
        if self.send_term:
            self.table.signal_group(self.worker.pgid, signal.SIGTERM)
        else:
            self.kill_now(now)

    def kill_now(self, now: float) -> None:
        self.kill_at = now
        # the group first, then whoever left it (setsid, double fork), each checked by start time
        self.table.signal_group(self.worker.pgid, signal.SIGKILL)
        for r in self._tree():
            self._dead.add(r.pid)
            if self.table.signal(r, signal.SIGKILL):
                self.killed.append(r.pid)

    def advance(self, now: float) -> bool:
        if self.done_at is not None:
            return True
        if self.gone_at is None:
            # new descendants may still appear until the parent dies: keep collecting them
            if not self.worker.exited:
                for r in self.table.descendants(self.worker.pid):
                    if r.pid not in {x.pid for x in self.refs}:
                        self.refs.append(r)
                        self._dead.add(r.pid)
            left = self._tree()
            if not left and self.worker.exited:
                self.gone_at = now
            elif self.kill_at is None and self.term_at is not None and now - self.term_at >= self.term_grace_s:
                log.info("sigkill", pids=[r.pid for r in left], grace_s=self.term_grace_s)
                self.kill_now(now)
                return False
            elif self.kill_at is not None and now - self.kill_at >= self.kill_wait_s:
                # SIGKILL cannot end a process in uninterruptible sleep (state D): record it and go on,
                # rather than leave the run stuck in `killing` for ever.
                self.survivors = [self.table.describe(r) for r in left]
                log.error("sigkill_survivors", survivors=self.survivors, waited_s=round(now - self.kill_at, 3))
                self.gone_at = now
            else:
                return False
        holding = self.gpu_pids()
        if holding is None:
            self.gpu_release = {"checked": False, "reason": "no GPU"}
            self.done_at = now
            return True
        still = sorted(holding & self._dead)
        if not still or now - self.gone_at >= self.gpu_release_timeout_s:
            self.gpu_release = {"checked": True, "released": not still, "waited_s": round(now - self.gone_at, 3),
                                "pids_still_holding": still}
            self.done_at = now
            return True
        return False

    def next_due(self) -> Optional[float]:
        """The earliest time this killer acts on its own clock — SIGKILL when the grace runs out, the survivors
        recorded, the GPU wait ended — or None.  (Exits are events: SIGCHLD wakes the loop.)"""
        if self.done_at is not None or self.term_at is None:
            return None
        if self.gone_at is None:
            return self.term_at + self.term_grace_s if self.kill_at is None else self.kill_at + self.kill_wait_s
        return self.gone_at + self.gpu_release_timeout_s

    def timings(self) -> dict:
        t0 = self.term_at
        rel = lambda x: None if x is None or t0 is None else round(x - t0, 3)  # noqa: E731
        return {"term_grace_s": self.term_grace_s if self.send_term else None, "sigkill_after_s": rel(self.kill_at),
                "tree_gone_after_s": rel(self.gone_at), "done_after_s": rel(self.done_at),
                "sigterm_sent": self.send_term, "sigkilled_pids": self.killed, "survivors": self.survivors}


def find_py_spy(interpreter: str = sys.executable, path: Optional[str] = None) -> Optional[str]:
    """py-spy next to the running interpreter first (`pip install py-spy` into the venv puts it in the
    venv's bin/, which a service's PATH does not include), then on PATH."""
    beside = Path(interpreter).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy", path=path)
