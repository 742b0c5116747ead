"""The second step of a stall's dumps: the stacks of a rank's DataLoader workers, when its main thread waits on them.

Collected like the ranks' own dumps (`escalation.DumpCollector`): py-spy per worker, time-boxed, or faulthandler
through the heartbeat's at-fork hook, a worker's dump in as soon as it is whole (`escalation.dump_complete`: a fork
keeps the stack of the thread that forked it, down to `<module>` when that was the main thread) or once its file
stopped growing; advanced by the loop, never blocking it.  What the stacks say (which worker
is stuck) is `incidents/loader_workers.py`.
"""
from __future__ import annotations

import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hangwatch.common.rundir import forked_dump_path
from hangwatch.supervisor.episode.escalation import (SETTLE_S, DumpCollector, DumpTarget, _read, dump_complete, py_spy_running,
                                               start_py_spy)
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread
from hangwatch.supervisor.incidents.dumps import main_stack
from hangwatch.supervisor.incidents.landmarks import read_stack
from hangwatch.supervisor.incidents.loader_workers import WorkerStack, forked_workers
from hangwatch.supervisor.processes.process import ProcessTable, ProcRef


@dataclass
class WorkerTarget:
    rank: DumpTarget  # the rank it was forked from
    ref: ProcRef
    via: str  # "py-spy" | "faulthandler" | "none"
    dump_path: Optional[Path] = None  # its own faulthandler file (via faulthandler)
    offset: int = 0
    spy: Optional[tuple[subprocess.Popen, Path]] = None
    note: str = ""

    def add_note(self, text: str) -> None:
        self.note = f"{self.note}; {text}" if self.note else text


@dataclass
class WorkerDumps:
    """The second step of a stall's dumps: the DataLoader workers of each rank whose main thread waits on its
    DataLoader (its landmark, `landmarks.read_stack`).  Workers are the rank's forks in the stall's process
    snapshot (`loader_workers.forked_workers`).  py-spy dumps each (time-boxed) when enabled and found; else
    faulthandler: the heartbeat's at-fork hook registers it in every child forked from a rank, into a file of
    its own — a worker is signalled only when that file exists for its pid AND it still runs the rank's
    command line, checked again just before the signal (a fork that exec'd something else may die of SIGUSR1).
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
    _sizes: dict[int, int] = field(default_factory=dict)
    _changed_at: dict[int, float] = field(default_factory=dict)
    _complete: dict[int, bool] = field(default_factory=dict)

    def begin(self, now: float, dc: DumpCollector) -> None:
        self.begun = True
        self.started_at = now
        self._table, self._grace_s, self._py_spy_timeout_s = dc.table, dc.grace_s, dc.py_spy_timeout_s
        texts, spy = dc.texts(), dc.py_spy_texts()
        exe = dc.py_spy_exe()
        notes = []
        for t in dc.targets:
            stack, truncated = main_stack(texts.get(t.rank, ""))
            spy_stack, native = py_spy_main_thread(spy.get(t.rank, ""))
            reading = read_stack(stack or spy_stack, native=native, extra=self.landmarks,
                                 truncated=truncated and not spy_stack)
            if reading.kind != "dataloader":
                continue
            workers = forked_workers(t.ref.pid, self.procs)
            notes.append(f"rank {t.rank}: {len(workers)} worker(s)")
            for rec in workers:
                self._start(t, rec, exe, dc.out_dir)
        self.note = "; ".join(notes) or "no rank waits on a DataLoader"

    def _start(self, rank: DumpTarget, rec: dict, exe: Optional[str], out_dir: Optional[Path]) -> None:
        pid = rec["pid"]
        ref = ProcRef(pid, rec["create_time"]) if rec.get("create_time") else self._table.ref_of(pid)
        if ref is None:
            return
        target = self.targets[pid] = WorkerTarget(rank, ref, "none")
        out = out_dir / f"py-spy-rank{rank.rank}-pid{pid}.txt" if out_dir is not None else None
        spy = start_py_spy(exe, pid, out, []) if exe is not None and out is not None else None
        if spy is not None:
            target.via, target.spy = "py-spy", (spy, out)
        else:
            self._faulthandler(target)

    def _faulthandler(self, target: WorkerTarget) -> None:
        path = forked_dump_path(target.rank.dump_path, target.ref.pid)
        if not path.exists():
            target.add_note(f"no {path.name}: the rank did not register faulthandler for its forks (hangwatch's heartbeat does)")
        elif not self._still_a_fork(target.rank.ref, target.ref):
            target.add_note("not signalled: its command line is no longer the rank's (it may have exec'd another program)")
        else:
            target.dump_path, target.offset = path, path.stat().st_size
            self._sizes[target.ref.pid] = target.offset
            target.via = "faulthandler" if self._table.signal(target.ref, signal.SIGUSR1) else "none"
            if target.via == "none":
                target.add_note("gone before its signal")

    def _still_a_fork(self, rank: ProcRef, worker: ProcRef) -> bool:
        """The worker runs the rank's command line now, both still the processes recorded."""
        if not (self._table.matches(rank) and self._table.matches(worker)):
            return False
        mine, theirs = self._table.describe(worker).get("cmdline"), self._table.describe(rank).get("cmdline")
        return bool(mine) and mine == theirs

    def advance(self, now: float) -> bool:
        elapsed = now - self.started_at
        spying = py_spy_running([t.spy for t in self.targets.values() if t.spy], elapsed, self._py_spy_timeout_s)
        for t in self.targets.values():
            if t.via == "py-spy" and t.spy[0].poll() is not None and not py_spy_main_thread(_read(t.spy[1], 0))[0]:
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
                self._complete[pid] = size > t.offset and dump_complete(_read(t.dump_path, t.offset))
            if self._complete.get(pid) or self._table.is_gone(t.ref):
                continue
            if size <= t.offset or now - self._changed_at[pid] < SETTLE_S:
                waiting = True  # not written yet, or still growing
        return (not waiting or now - self.started_at >= self._grace_s) and not spying

    def stacks(self) -> dict[int, list[tuple[WorkerStack, str]]]:
        """Per rank: each worker's evidence and the raw text of its dump (to keep in the incident)."""
        by_pid = {p.get("pid"): p for p in self.procs}
        out: dict[int, list[tuple[WorkerStack, str]]] = {}
        for pid, t in sorted(self.targets.items()):
            text, frames, dump, missing = "", [], None, ""
            if t.via == "py-spy":
                dump, text = t.spy[1].name, _read(t.spy[1], 0)
                frames, missing = py_spy_main_thread(text)[0], "py-spy gave no Python stack"
            elif t.via == "faulthandler":
                dump, text = f"stack-rank{t.rank.rank}-pid{pid}.txt", _read(t.dump_path, t.offset)
                frames, missing = main_stack(text)[0], "its faulthandler file did not grow"
            note = t.note if frames or not missing else (f"{t.note}; {missing}" if t.note else missing)
            out.setdefault(t.rank.rank, []).append(
                (WorkerStack(pid, by_pid.get(pid), frames, t.via if frames else None, dump, note), text))
        return out
