"""A stall's stack dumps, as steps the main loop advances without blocking it.

    DumpCollector: SIGUSR1 to the processes that announced a dump signal (never to a launcher) and, at
                   the same moment, `py-spy dump --native --locals` per pid when installed (time-boxed
                   by `py_spy_timeout_s`); a rank's dump is in as soon as it is whole (`dump_complete`:
                   faulthandler writes synchronously and lists the main thread last), else once its
                   file stopped growing for SETTLE_S, bounded by `dump_grace_s`; py-spy holds the step
                   only while it runs.  The `gate` (the stall's process snapshot, taken while the
                   dumps are written) must be passed too; then, for a rank whose main thread waits on
                   its DataLoader, the workers' stacks (`WorkerDumps`).
    StallDumps:    the same, together with the NCCL flight recorder's dumps (`flight_recorder.FlightDumps`).
    WorkerDumps:   the second step: the stacks of a rank's DataLoader workers, when its main thread waits on
                   them — py-spy per worker, time-boxed, or faulthandler, which the heartbeat registers in every
                   worker the rank forks or spawns, a worker's dump in as soon as it is whole (a fork keeps the
                   stack of the thread that forked it, down to `<module>` when that was the main thread) or once
                   its file stopped growing.
                   What the stacks say (which worker is stuck) is `incidents/loader_workers.py`.

Each has `advance(now) -> bool` (True when finished) so the loop keeps answering the control socket
and draining events while a stall is being handled.  Processes are seen only through the injected
`ProcessTable`; nothing here reaps or kills (that is `tree_killer`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import structlog

from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import forked_dump_path
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread
from hangwatch.supervisor.incidents.dumps import main_stack, parse_faulthandler
from hangwatch.supervisor.incidents.landmarks import read_stack
from hangwatch.supervisor.incidents.loader_workers import WorkerStack, started_as, worker_processes
from hangwatch.supervisor.processes.attempt import DumpTarget
from hangwatch.supervisor.processes.process import ProcessTable, ProcRef


class SideDumps(Protocol):
    """Dumps taken beside the stacks within the same grace (the NCCL flight recorder's)."""

    def trigger(self, now: float) -> None: ...

    def settled(self, now: float) -> bool: ...


log = structlog.get_logger("hangwatch")

MAX_UNANNOUNCED = 16  # unannounced Python processes py-spy reads at one stall (each is a process stopped briefly)
SETTLE_S = 0.3  # a dump that does not read as whole is complete once unchanged this long after growing
# ... unless it stops inside a thread's stack (neither at `<module>`, nor at faulthandler's frame limit, nor at a
# thread's bootstrap): the writer was most likely preempted half-way (a loaded machine), so it gets this long.
PARTIAL_SETTLE_S = 2.0


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


def settle_s(text: str) -> float:
    """How long a dump that is not whole must stay unchanged to be taken as it is: SETTLE_S when it ends where a
    thread's stack can end (cut at faulthandler's frame limit, a thread started by `threading`, a main thread
    down to `<module>`), PARTIAL_SETTLE_S when it stops in the middle of one — faulthandler writes frame by frame,
    and a writer preempted there would leave an incident with the innermost frames only, without the call the
    process is stuck in."""
    threads = parse_faulthandler(text) if text.endswith("\n") else []
    if not threads:
        return PARTIAL_SETTLE_S
    last = threads[-1]
    outer = last.frames[-1]
    if (
        last.truncated
        or last.is_main()
        or (outer["function"] in ("_bootstrap", "_bootstrap_inner") and outer["file"].endswith("threading.py"))
    ):
        return SETTLE_S
    return PARTIAL_SETTLE_S


@dataclass
class DumpCollector:
    targets: list[DumpTarget]
    grace_s: float
    table: ProcessTable
    py_spy: bool = True
    py_spy_timeout_s: float = 20.0
    py_spy_path: Optional[str] = None  # None: find_py_spy()
    out_dir: Optional[Path] = None  # where py-spy output goes (the incident directory)
    fs: FsOps = field(default_factory=FsOps)  # the run's write seam: py-spy's output files are opened through it
    loader_workers: Optional["WorkerDumps"] = None  # then: the DataLoader workers of a rank that waits on them
    # Evidence taken beside the dumps that must be in before the second step (the stall's process snapshot,
    # which also names the DataLoader workers): asked each pass once no py-spy holds a process stopped
    # (whether or not the dump files are in yet); True when done.
    gate: Optional[Callable[[float], bool]] = None
    # Python processes of the tree that never announced themselves (an uninstrumented worker, a launcher, a
    # shell script's python): no signal reaches them, py-spy alone reads their stacks (`py-spy-pid<PID>.txt`)
    unannounced: list[ProcRef] = field(default_factory=list)
    py_spy_pids: dict[int, tuple[subprocess.Popen, Path]] = field(default_factory=dict)
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
    _settle: dict[int, float] = field(default_factory=dict)  # the quiet time its text needs (`settle_s`)
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
                self.fs.open_output(out).close()
            except OSError as exc:  # the incident directory could not be made (a full disk): no py-spy output
                self.py_spy_note = f"not run: cannot write {out} ({exc.strerror})"
                return
            # --full-filenames: the user's own frames are told from libraries by their paths (landmarks)
            p = start_py_spy(exe, t.ref.pid, out, ["--native", "--locals"], self.fs)
            if p is not None:
                self.py_spy_procs[t.rank] = (p, out)
        tried = len([t for t in self.targets if self.signalled.get(t.rank)])
        for ref in self.unannounced[:MAX_UNANNOUNCED]:
            out = self.out_dir / f"py-spy-pid{ref.pid}.txt"
            p = start_py_spy(exe, ref.pid, out, ["--locals"], self.fs)
            tried += 1
            if p is not None:
                self.py_spy_pids[ref.pid] = (p, out)
        # a py-spy that cannot be executed leaves no C stack: the verdict must know it had none
        started = self.py_spy_procs or self.py_spy_pids
        self.py_spy_note = (
            f"ran {exe}" if started or not tried else f"could not start {exe} (its error is in the py-spy files)"
        )

    def _py_spy_running(self, now: float) -> bool:
        procs = [*self.py_spy_procs.values(), *self.py_spy_pids.values()]
        return py_spy_running(procs, now - self.started_at, self.py_spy_timeout_s, self.fs)

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
                text = read_appended(t.dump_path, t.offset) if size > t.offset else ""
                self._complete[t.rank] = bool(text) and dump_complete(text)
                self._settle[t.rank] = settle_s(text)
            if not self.signalled.get(t.rank) or self._complete.get(t.rank) or self.table.is_gone(t.ref):
                continue  # nothing to wait for: never signalled, whole already, or gone
            if size <= t.offset or now - self._changed_at[t.rank] < self._settle.get(t.rank, SETTLE_S):
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
            due += [
                self._changed_at[t.rank] + self._settle.get(t.rank, SETTLE_S)
                for t in self.targets
                if t.rank in self._changed_at and not self._complete.get(t.rank)
            ]
        if self.py_spy_done_at is None and (self.py_spy_procs or self.py_spy_pids):
            due.append(self.started_at + self.py_spy_timeout_s)
        return min(due) if due else None

    def timings(self) -> dict:
        """When each part was in, in seconds after the signals (None: not reached)."""
        rel = lambda x: None if x is None else round(x - self.started_at, 3)  # noqa: E731
        spied = self.py_spy_procs or self.py_spy_pids
        return {
            "dump_files_s": rel(self.files_at),
            "py_spy_s": rel(self.py_spy_done_at) if spied else None,
            "stacks_s": rel(self.stacks_at),
        }

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

    def pid_texts(self) -> dict[int, str]:
        """py-spy's stacks of the unannounced Python processes, by pid."""
        return _outputs(self.py_spy_pids)

    def py_spy_texts(self) -> dict[int, str]:
        """py-spy's stacks of the ranks, by rank."""
        return _outputs(self.py_spy_procs)


def _outputs(procs: dict[int, tuple[subprocess.Popen, Path]]) -> dict[int, str]:
    """What each py-spy run wrote, by its key (those whose file cannot be read are left out)."""
    out = {}
    for key, (_, path) in procs.items():
        try:
            out[key] = path.read_text(errors="replace")
        except OSError:
            pass
    return out


def start_py_spy(exe: str, pid: int, out: Path, options: list[str], fs: FsOps) -> Optional[subprocess.Popen]:
    """`py-spy dump … --pid PID --full-filenames` into `out`, opened through the run's `fs` (its own error when it
    cannot start)."""
    try:
        with fs.open_output(out) as f:
            try:
                return subprocess.Popen(
                    [exe, "dump", *options, "--pid", str(pid), "--full-filenames"],
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            except OSError as exc:
                f.write(f"py-spy could not start: {exc}\n".encode())
    except OSError:
        pass
    return None


def py_spy_running(procs, elapsed_s: float, timeout_s: float, fs: FsOps) -> bool:
    """Whether any of the (Popen, output path) pairs still runs; one past its time box is killed (and says so, through
    `fs`)."""
    running = False
    for p, out in procs:
        if p.poll() is None:
            if elapsed_s >= timeout_s:
                p.kill()
                p.wait(timeout=5)
                try:
                    fs.append(out, f"\n[py-spy killed after {timeout_s:g}s time box]\n".encode())
                except OSError:  # a full disk: the file says less, the dump is read all the same
                    pass
            else:
                running = True
    return running


def read_appended(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(4 << 20).decode("utf-8", "replace")
    except OSError:
        return ""


@dataclass
class StallDumps(DumpCollector):
    """The stack dumps of a stall together with the flight-recorder dumps (`flight_recorder.FlightDumps`): both
    within `grace_s`."""

    flight: Optional[SideDumps] = None

    def begin(self, now: float) -> None:
        super().begin(now)
        if self.flight is not None:
            self.flight.trigger(now)

    def advance(self, now: float) -> bool:
        if self.done:
            return True
        stacks = super().advance(now)
        if stacks and self.flight is not None and now - self.started_at < self.grace_s and not self.flight.settled(now):
            self.done = False  # the stacks are in; the flight recorder is still writing (bounded by grace_s)
            return False
        return stacks


def find_py_spy(interpreter: str = sys.executable, path: Optional[str] = None) -> Optional[str]:
    """py-spy next to the running interpreter first (`pip install py-spy` into the venv puts it in the
    venv's bin/, which a service's PATH does not include), then on PATH."""
    beside = Path(interpreter).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy", path=path)


@dataclass
class WorkerTarget:
    rank: DumpTarget  # the rank it works for
    ref: ProcRef
    via: str  # "py-spy" | "faulthandler" | "none"
    started: str = "fork"  # how the rank started it (`loader_workers.started_as`): fork | spawn | forkserver
    dump_path: Optional[Path] = None  # its own faulthandler file (via faulthandler)
    offset: int = 0
    spy: Optional[tuple[subprocess.Popen, Path]] = None
    note: str = ""

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


@dataclass
class WorkerDumps:
    """The second step of a stall's dumps: the DataLoader workers of each rank whose main thread waits on its
    DataLoader (its landmark, `landmarks.read_stack`).  Workers are the rank's forks and multiprocessing children
    (spawn, forkserver) in the stall's process snapshot (`loader_workers.worker_processes`), other ranks never.
    py-spy dumps each (time-boxed) when enabled and found; else faulthandler: the heartbeat registers it in every
    child a rank forks (its at-fork hook) or starts with spawn or forkserver (the data multiprocessing sends the
    child), into a file of its own — a worker is signalled only when that file exists for its pid AND its command
    line still says how it was started, checked again just before the signal (a fork that exec'd something else
    may die of SIGUSR1).
    A worker py-spy gave no Python stack for falls back to faulthandler.  Bounded like the ranks' dumps:
    `grace_s` for the files (from the last signal), the py-spy time box for py-spy."""

    procs: list[dict]
    landmarks: tuple = ()  # the user's (watchdog.landmarks) as `landmarks.Landmark` entries
    targets: dict[int, WorkerTarget] = field(default_factory=dict)  # by pid
    begun: bool = False
    started_at: float = 0.0
    note: str = ""
    _table: Optional[ProcessTable] = None
    _grace_s: float = 0.0
    _py_spy_timeout_s: float = 0.0
    _fs: FsOps = field(default_factory=FsOps)
    _sizes: dict[int, int] = field(default_factory=dict)
    _changed_at: dict[int, float] = field(default_factory=dict)
    _complete: dict[int, bool] = field(default_factory=dict)
    _settle: dict[int, float] = field(default_factory=dict)  # the quiet time its text needs (`settle_s`)

    def begin(self, now: float, dc: DumpCollector) -> None:
        self.begun = True
        self.started_at = now
        self._table, self._grace_s, self._py_spy_timeout_s = dc.table, dc.grace_s, dc.py_spy_timeout_s
        self._fs = dc.fs
        texts, spy = dc.texts(), dc.py_spy_texts()
        exe = dc.py_spy_exe()
        ranks = {t.ref.pid for t in dc.targets}  # ranks that multiprocessing started (torch's mp.spawn) are no workers
        notes = []
        for t in dc.targets:
            stack, truncated = main_stack(texts.get(t.rank, ""))
            spy_stack, native = py_spy_main_thread(spy.get(t.rank, ""))
            reading = read_stack(
                stack or spy_stack, native=native, extra=self.landmarks, truncated=truncated and not spy_stack
            )
            if reading.kind != "dataloader":
                continue
            workers = [rec for rec in worker_processes(t.ref.pid, self.procs) if rec["pid"] not in ranks]
            notes.append(f"rank {t.rank}: {len(workers)} worker(s)")
            for rec in workers:
                self._start(t, rec, exe, dc.out_dir)
        self.note = "; ".join(notes) or "no rank waits on a DataLoader"

    def _start(self, rank: DumpTarget, rec: dict, exe: Optional[str], out_dir: Optional[Path]) -> None:
        pid = rec["pid"]
        ref = ProcRef(pid, rec["create_time"]) if rec.get("create_time") else self._table.ref_of(pid)
        if ref is None:
            return
        rank_rec = next((p for p in self.procs if p.get("pid") == rank.ref.pid), {})
        target = self.targets[pid] = WorkerTarget(
            rank, ref, "none", started_as(rec.get("cmdline"), rank_rec.get("cmdline")) or "fork"
        )
        out = out_dir / f"py-spy-rank{rank.rank}-pid{pid}.txt" if out_dir is not None else None
        spy = start_py_spy(exe, pid, out, [], self._fs) if exe is not None and out is not None else None
        if spy is not None:
            target.via, target.spy = "py-spy", (spy, out)
        else:
            self._faulthandler(target)

    def _faulthandler(self, target: WorkerTarget) -> None:
        path = forked_dump_path(target.rank.dump_path, target.ref.pid)
        if not path.exists():
            target.add_note(
                f"no {path.name}: no faulthandler was registered in it (hangwatch's heartbeat registers one "
                f"in every worker a rank forks or spawns)"
            )
        elif not self._still_a_worker(target):
            target.add_note(
                f"not signalled: its command line no longer says it is a worker started by {target.started} "
                f"(it may have exec'd another program)"
            )
        else:
            target.dump_path, target.offset = path, path.stat().st_size
            self._sizes[target.ref.pid] = target.offset
            target.via = "faulthandler" if self._table.signal(target.ref, signal.SIGUSR1) else "none"
            if target.via == "none":
                target.add_note("gone before its signal")

    def _still_a_worker(self, target: WorkerTarget) -> bool:
        """The worker's command line now says what it said in the snapshot (a fork: the rank's; a spawned child:
        multiprocessing's entry), both still the processes recorded."""
        rank, worker = target.rank.ref, target.ref
        if not (self._table.matches(rank) and self._table.matches(worker)):
            return False
        mine, theirs = self._table.describe(worker).get("cmdline"), self._table.describe(rank).get("cmdline")
        return started_as(mine, theirs) == target.started

    def advance(self, now: float) -> bool:
        elapsed = now - self.started_at
        spies = [t.spy for t in self.targets.values() if t.spy]
        spying = py_spy_running(spies, elapsed, self._py_spy_timeout_s, self._fs)
        for t in self.targets.values():
            if (
                t.via == "py-spy"
                and t.spy[0].poll() is not None
                and not py_spy_main_thread(read_appended(t.spy[1], 0))[0]
            ):
                t.via, t.spy = "none", None
                t.add_note("py-spy gave no Python stack")  # e.g. no ptrace permission: faulthandler instead
                self._faulthandler(t)
                self.started_at = now  # its grace starts with its signal
        waiting = False
        for pid, t in self.targets.items():
            if t.via != "faulthandler":
                continue
            try:
                size = t.dump_path.stat().st_size
            except OSError:
                size = t.offset
            if size != self._sizes.get(pid):
                self._sizes[pid] = size
                self._changed_at[pid] = now
                text = read_appended(t.dump_path, t.offset) if size > t.offset else ""
                self._complete[pid] = bool(text) and dump_complete(text)
                self._settle[pid] = settle_s(text)
            if self._complete.get(pid) or self._table.is_gone(t.ref):
                continue
            if size <= t.offset or now - self._changed_at[pid] < self._settle.get(pid, SETTLE_S):
                waiting = True  # not written yet, or still growing
        return (not waiting or now - self.started_at >= self._grace_s) and not spying

    def stacks(self) -> dict[int, list[tuple[WorkerStack, str]]]:
        """Per rank: each worker's evidence and the raw text of its dump (to keep in the incident)."""
        by_pid = {p.get("pid"): p for p in self.procs}
        out: dict[int, list[tuple[WorkerStack, str]]] = {}
        for pid, t in sorted(self.targets.items()):
            text, frames, dump, missing = "", [], None, ""
            if t.via == "py-spy":
                dump, text = t.spy[1].name, read_appended(t.spy[1], 0)
                frames, missing = py_spy_main_thread(text)[0], "py-spy gave no Python stack"
            elif t.via == "faulthandler":
                dump, text = f"stack-rank{t.rank.rank}-pid{pid}.txt", read_appended(t.dump_path, t.offset)
                frames, missing = main_stack(text)[0], "its faulthandler file did not grow"
            note = t.note if frames or not missing else (f"{t.note}; {missing}" if t.note else missing)
            out.setdefault(t.rank.rank, []).append(
                (WorkerStack(pid, by_pid.get(pid), frames, t.via if frames else None, dump, note), text)
            )
        return out
