"""A DataLoader's worker processes, when a rank waits on its DataLoader: which worker is stuck, which are idle.

A worker is a descendant of the rank started by one of multiprocessing's start methods, each known by its
command line (`started_as`):

    fork        the rank's own command line (the default on Linux before Python 3.14): a fork that exec'd
                something else has another, and is never taken for a worker nor signalled (SIGUSR1 may kill
                a program that does not handle it);
    spawn       multiprocessing's spawn entry, `python -c 'from multiprocessing.spawn import spawn_main; …'
                --multiprocessing-fork`;
    forkserver  a fork of the forkserver (`python -c 'from multiprocessing.forkserver import main; …'`, the
                default from Python 3.14): the forkserver is the rank's child, the workers are its children with
                its command line; the forkserver itself is none.

Each worker runs torch's `_worker_loop` (torch/utils/data/_utils/worker.py): it waits on its index queue,
fetches a batch (`fetch` → the dataset's `__getitem__`), puts it on the data queue, and waits again.  From
its stack:

    idle     the frame `_worker_loop` calls is multiprocessing's queue `get` (or `put`: handing over a batch),
             or `_worker_loop` itself is innermost;
    working  anything else under `_worker_loop`: its stuck frame is the innermost frame of the user's own
             code there (the dataset's `__getitem__`, a collate function), else the innermost frame;
    unknown  no stack (neither py-spy nor faulthandler gave one);
    other    a stack without `_worker_loop`: a child of the rank that is not a DataLoader worker (a pool's).

The main process receives batches in order and hands out new indices only as it consumes them, so while it
waits for one batch the other workers run out of work and go idle: the one worker still working is the
stuck one.  When several work, or one gave no stack, the reading says it cannot tell rather than guess.

Pure: snapshot records and stacks in, readings out.  Collection is `escalation/dump_collector.WorkerDumps`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from hangwatch.common.rundir import forked_dump_path  # noqa: F401  (re-exported: the rule both sides share)
from hangwatch.supervisor.incidents.classify import process_condition
from hangwatch.supervisor.incidents.landmarks import is_own_code, short_frame, short_name

WORKER_LOOP = re.compile(r"/torch/utils/data/_utils/worker\.py$")
MP_QUEUES = re.compile(r"/multiprocessing/queues\.py$")
IDLE_CALLS = {"get": "waiting on its index queue", "put": "handing a batch over to the main process"}
MAX_ANCESTRY = 16  # how far up a worker's parents are followed to reach the rank (forks of forks)
FORK, SPAWN, FORKSERVER = "fork", "spawn", "forkserver"
SPAWN_ENTRY = re.compile(r"\bfrom multiprocessing\.spawn import spawn_main\b")
FORKSERVER_ENTRY = re.compile(r"\bfrom multiprocessing\.forkserver import main\b")

IDLE, WORKING, UNKNOWN, OTHER = "idle", "working", "unknown", "other"


def started_as(cmdline: Optional[list], rank_cmdline: Optional[list]) -> Optional[str]:
    """FORK, SPAWN or FORKSERVER (see the module docstring) for a process running `cmdline` below a rank running
    `rank_cmdline`, or None: another program (a fork that exec'd something else, multiprocessing's resource
    tracker)."""
    if not cmdline:
        return None
    if cmdline == rank_cmdline:
        return FORK
    code = " ".join(cmdline)
    if "--multiprocessing-fork" in cmdline or SPAWN_ENTRY.search(code):
        return SPAWN
    if FORKSERVER_ENTRY.search(code):
        return FORKSERVER
    return None


def worker_processes(rank_pid: int, procs: list[dict]) -> list[dict]:
    """The snapshot records of `rank_pid`'s descendants that may be its DataLoader workers, by pid: its forks, its
    spawned children and the forkserver's forks (not the forkserver itself)."""
    by_pid = {p.get("pid"): p for p in procs}
    rank = by_pid.get(rank_pid)
    if rank is None or not rank.get("cmdline"):
        return []
    out = []
    for p in procs:
        if p.get("pid") == rank_pid or p.get("state") == "Z":
            continue
        how = started_as(p.get("cmdline"), rank["cmdline"])
        if how is None:
            continue
        if how == FORKSERVER and (by_pid.get(p.get("ppid")) or {}).get("cmdline") != p.get("cmdline"):
            continue  # the forkserver itself: it only forks the workers
        if _descends_from(p, rank_pid, by_pid):
            out.append(p)
    return sorted(out, key=lambda p: p["pid"])


def _descends_from(p: dict, ancestor: int, by_pid: dict) -> bool:
    cur = p
    for _ in range(MAX_ANCESTRY):
        ppid = cur.get("ppid")
        if ppid == ancestor:
            return True
        cur = by_pid.get(ppid)
        if cur is None:
            return False
    return False


@dataclass(frozen=True)
class WorkerStack:
    """One worker's evidence: its snapshot record and its main-thread stack (innermost first)."""

    pid: int
    proc: Optional[dict]
    stack: list
    source: Optional[str] = None  # "py-spy" | "faulthandler" | None (no stack)
    dump: Optional[str] = None  # the file in the incident directory that holds it
    note: str = ""  # why there is no stack, when there is none


@dataclass(frozen=True)
class WorkerReading:
    pid: int
    activity: str  # idle | working | unknown | other
    condition: str  # process_condition: busy | blocked | io | stopped | partly | gone
    classification: str
    stuck_frame: Optional[dict]  # where a working worker is; None for the others
    doing: str  # "waiting on its index queue", "in __getitem__ (train.py:12)", …
    stack: list  # the frames from `_worker_loop` inward (the whole stack when there is none)
    source: Optional[str]
    dump: Optional[str]

    @property
    def idle(self) -> bool:
        return self.activity == IDLE

    def as_dict(self) -> dict:
        return {
            "pid": self.pid,
            "activity": self.activity,
            "idle": self.idle,
            "condition": self.condition,
            "classification": self.classification,
            "stuck_frame": self.stuck_frame,
            "doing": self.doing,
            "stack": self.stack,
            "stack_source": self.source,
            "dump": self.dump,
        }


def read_worker(w: WorkerStack) -> WorkerReading:
    condition, words = process_condition([w.proc] if w.proc else [])
    if not w.stack:
        return WorkerReading(
            w.pid,
            UNKNOWN,
            condition,
            f"{words} (no stack{': ' + w.note if w.note else ''})",
            None,
            "unknown: no stack",
            [],
            w.source,
            w.dump,
        )
    loop = next(
        (
            i
            for i, f in enumerate(w.stack)
            if short_name(f.get("function") or "") == "_worker_loop"
            and WORKER_LOOP.search("/" + (f.get("file") or "").replace("\\", "/"))
        ),
        None,
    )
    if loop is None:
        return WorkerReading(
            w.pid,
            OTHER,
            condition,
            f"{words}; not a DataLoader worker (no _worker_loop)",
            None,
            f"not a DataLoader worker; innermost {short_frame(w.stack[0])}",
            list(w.stack),
            w.source,
            w.dump,
        )
    inner = w.stack[:loop]
    mine = list(w.stack[: loop + 1])
    if not inner:
        return WorkerReading(
            w.pid, IDLE, condition, words, None, "in _worker_loop between batches", mine, w.source, w.dump
        )
    called = inner[-1]  # what `_worker_loop` called
    if MP_QUEUES.search("/" + (called.get("file") or "")) and short_name(called.get("function") or "") in IDLE_CALLS:
        return WorkerReading(
            w.pid, IDLE, condition, words, None, IDLE_CALLS[short_name(called["function"])], mine, w.source, w.dump
        )
    frame = next((f for f in inner if is_own_code(f.get("file"))), inner[0])
    return WorkerReading(
        w.pid,
        WORKING,
        condition,
        f"{words} at {short_frame(frame)}",
        frame,
        f"at {short_frame(frame)}",
        mine,
        w.source,
        w.dump,
    )


@dataclass(frozen=True)
class WorkersVerdict:
    workers: list  # WorkerReading, by pid
    stuck_pid: Optional[int]
    why: str

    @property
    def stuck(self) -> Optional[WorkerReading]:
        return next((w for w in self.workers if w.pid == self.stuck_pid), None)

    def words(self) -> str:
        """For the incident's summary: "stuck DataLoader worker pid 41 at __getitem__ (train.py:12)"."""
        s = self.stuck
        if s is not None:
            return f"stuck DataLoader worker pid {s.pid} {s.doing}"
        return f"DataLoader workers: {self.why}"

    def fields(self) -> dict:
        return {
            "dataloader_workers": [w.as_dict() for w in self.workers],
            "stuck_worker_pid": self.stuck_pid,
            "dataloader_verdict": self.why,
        }


def judge(stacks: list[WorkerStack]) -> WorkersVerdict:
    """Which of a rank's DataLoader workers is stuck (see the module docstring)."""
    readings = [read_worker(w) for w in sorted(stacks, key=lambda w: w.pid)]
    workers = [r for r in readings if r.activity != OTHER]
    working = [r for r in workers if r.activity == WORKING]
    unknown = [r for r in workers if r.activity == UNKNOWN]
    if not workers:
        return WorkersVerdict(readings, None, "no DataLoader worker process found (forked or spawned by the rank)")
    if len(working) == 1 and not unknown:
        w = working[0]
        return WorkersVerdict(readings, w.pid, f"the only worker not idle: pid {w.pid} {w.doing}")
    if len(working) > 1:
        return WorkersVerdict(
            readings, None, f"cannot tell which worker is stuck: pids {_pids(working)} all work on a batch"
        )
    if unknown:
        return WorkersVerdict(
            readings,
            None,
            f"cannot tell which worker is stuck: pid(s) {_pids(unknown)} gave no stack"
            + (f", pid {working[0].pid} {working[0].doing}" if working else ""),
        )
    return WorkersVerdict(
        readings, None, f"every worker is idle (pids {_pids(workers)}): none holds the batch waited for"
    )


def _pids(readings: list[WorkerReading]) -> str:
    return ", ".join(str(r.pid) for r in readings)
