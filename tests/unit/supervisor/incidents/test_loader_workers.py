"""A rank waiting on its DataLoader: its workers are found (forks of the rank, its spawned children, the forkserver's
forks — never a process that exec'd something else), signalled only when their own dump file exists, and the one stuck
worker is named with its frame."""

from __future__ import annotations

import io
import signal
from pathlib import Path

import pytest
from fixtures.fakes.fake_supervisor import FakeProcessTable, Harness
from rich.console import Console

from hangwatch.common.rundir import dump_path_for
from hangwatch.supervisor.cli import render
from hangwatch.supervisor.escalation.dump_collector import DumpCollector, WorkerDumps
from hangwatch.supervisor.incidents.collectives import py_spy_main_thread
from hangwatch.supervisor.incidents.dumps import main_stack
from hangwatch.supervisor.incidents.loader_workers import (
    WorkerStack,
    forked_dump_path,
    judge,
    read_worker,
    started_as,
    worker_processes,
)
from hangwatch.supervisor.processes.attempt import DumpTarget
from hangwatch.supervisor.processes.process import ProcRef

LIB = "/root/.pyenv/versions/3.11.7/lib/python3.11"
TORCH = "/venv/lib/python3.11/site-packages/torch"
TRAIN = "/srv/job/train.py"
FORKED_FROM = f"""\
  File "{LIB}/multiprocessing/process.py", line 108 in run
  File "{LIB}/multiprocessing/process.py", line 314 in _bootstrap
  File "{LIB}/multiprocessing/popen_fork.py", line 71 in _launch
  File "{TORCH}/utils/data/dataloader.py", line 1176 in __init__
  File "{TORCH}/utils/data/dataloader.py", line 505 in __iter__
  File "{TRAIN}", line 59 in main
  File "{TRAIN}", line 69 in <module>
"""
# What faulthandler wrote in the two workers of tests/fixtures/workers/dataloader_stuck.py (torch 2.13), abridged.
IDLE_DUMP = f"""Current thread 0x00007f94a7021b80 (most recent call first):
  File "{LIB}/selectors.py", line 415 in select
  File "{LIB}/multiprocessing/connection.py", line 947 in wait
  File "{LIB}/multiprocessing/connection.py", line 257 in poll
  File "{LIB}/multiprocessing/queues.py", line 113 in get
  File "{TORCH}/utils/data/_utils/worker.py", line 334 in _worker_loop
{FORKED_FROM}"""
STUCK_DUMP = f"""Thread 0x00007f94889ff6c0 (most recent call first):
  File "{LIB}/threading.py", line 327 in wait
  File "{LIB}/multiprocessing/queues.py", line 231 in _feed

Current thread 0x00007f94a7021b80 (most recent call first):
  File "{LIB}/threading.py", line 327 in wait
  File "{LIB}/threading.py", line 629 in wait
  File "{TRAIN}", line 36 in __getitem__
  File "{TORCH}/utils/data/_utils/fetch.py", line 54 in <listcomp>
  File "{TORCH}/utils/data/_utils/fetch.py", line 54 in fetch
  File "{TORCH}/utils/data/_utils/worker.py", line 374 in _worker_loop
{FORKED_FROM}"""
PY_SPY_STUCK = f"""Process 11490: /venv/bin/python {TRAIN}
Python v3.11.7 ({LIB}/bin/python3.11)

Thread 11490 (idle): "MainThread"
    Condition.wait ({LIB}/threading.py:327)
    Event.wait ({LIB}/threading.py:629)
    Rows.__getitem__ ({TRAIN}:36)
    _MapDatasetFetcher.fetch ({TORCH}/utils/data/_utils/fetch.py:54)
    _worker_loop ({TORCH}/utils/data/_utils/worker.py:374)
    BaseProcess.run ({LIB}/multiprocessing/process.py:108)
    main ({TRAIN}:59)
    <module> ({TRAIN}:69)
"""
MAIN_WAITS = f"""Current thread 0x1 (most recent call first):
  File "{LIB}/multiprocessing/queues.py", line 113 in get
  File "{TORCH}/utils/data/dataloader.py", line 1291 in _try_get_data
  File "{TORCH}/utils/data/dataloader.py", line 1464 in _get_data
  File "{TORCH}/utils/data/dataloader.py", line 1505 in _next_data
  File "{TORCH}/utils/data/dataloader.py", line 725 in __next__
  File "{TRAIN}", line 59 in main
  File "{TRAIN}", line 69 in <module>
"""
MAIN_SPINS = f"""Current thread 0x1 (most recent call first):
  File "{TRAIN}", line 88 in _poll_shard_ready
  File "{TRAIN}", line 69 in <module>
"""
CMD = ["/venv/bin/python", TRAIN]
IDLE = {"state": "S", "cpu_percent": 0.0}


def proc(pid, ppid, cmdline=CMD, **kw):
    return {
        "pid": pid,
        "ppid": ppid,
        "cmdline": cmdline,
        "state": "S",
        "cpu_percent": 0.0,
        "create_time": 1.7e9 + pid,
        **kw,
    }


PY = "/venv/bin/python"
SPAWNED = [
    PY,
    "-c",
    "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=7)",
    "--multiprocessing-fork",
]
SPAWNED_WITH_FLAGS = [
    PY,
    "-s",
    "-X",
    "faulthandler",
    "-c",
    "from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=5, pipe_handle=9)",
    "--multiprocessing-fork",
]
FORKSERVER = [PY, "-c", "from multiprocessing.forkserver import main; main(7, 8, ['__main__'], **{'sys_path': []})"]
TRACKER = [PY, "-c", "from multiprocessing.resource_tracker import main;main(5)"]


@pytest.mark.parametrize(
    "cmdline, how",
    [
        (CMD, "fork"),
        (SPAWNED, "spawn"),
        (SPAWNED_WITH_FLAGS, "spawn"),
        (FORKSERVER, "forkserver"),
        (TRACKER, None),  # multiprocessing's resource tracker: not a worker
        (["/bin/sh", "-c", "nvidia-smi"], None),  # a fork that exec'd another program
        ([PY, "-c", "print('from multiprocessing')"], None),
        ([], None),
        (None, None),
    ],
)
def test_how_a_descendant_of_the_rank_was_started(cmdline, how):
    assert started_as(cmdline, CMD) == how


def test_workers_are_the_ranks_forks_spawned_children_and_the_forkservers_forks():
    procs = [
        proc(10, 1, ["torchrun", "train.py"]),  # the launcher
        proc(20, 10),
        proc(30, 10),  # two ranks: the same command line, neither descends from the other
        proc(21, 20),
        proc(22, 20),
        proc(23, 21),  # rank 0's forks, and a fork of a fork
        proc(24, 20, ["/bin/sh", "-c", "nvidia-smi"]),  # a fork that exec'd another program
        proc(25, 20, state="Z"),
        proc(31, 30),
        proc(32, 30, TRACKER),
        proc(33, 30, SPAWNED),
        proc(34, 30, SPAWNED),  # rank 1: spawn
        proc(40, 10),
        proc(41, 40, TRACKER),
        proc(42, 40, FORKSERVER),  # rank 2: forkserver …
        proc(43, 42, FORKSERVER),
        proc(44, 42, FORKSERVER),
    ]  # … whose forks are the workers
    assert [p["pid"] for p in worker_processes(20, procs)] == [21, 22, 23]
    assert [p["pid"] for p in worker_processes(30, procs)] == [31, 33, 34]
    assert [p["pid"] for p in worker_processes(40, procs)] == [43, 44]
    assert worker_processes(99, procs) == [] and worker_processes(20, [proc(20, 1, [])]) == []


def ws(pid, text="", spy="", proc_rec=IDLE, **kw) -> WorkerStack:
    frames = main_stack(text)[0] if text else py_spy_main_thread(spy)[0]
    return WorkerStack(pid, proc_rec, frames, "faulthandler" if text else "py-spy" if spy else None, **kw)


@pytest.mark.parametrize(
    "w, activity, doing",
    [
        (ws(1, IDLE_DUMP), "idle", "waiting on its index queue"),
        (ws(2, STUCK_DUMP), "working", "at __getitem__ (train.py:36)"),
        (ws(3, spy=PY_SPY_STUCK), "working", "at Rows.__getitem__ (train.py:36)"),  # py-spy: qualified names
        (ws(4, MAIN_SPINS), "other", "not a DataLoader worker; innermost _poll_shard_ready (train.py:88)"),
        (ws(5, note="py-spy gave no Python stack"), "unknown", "unknown: no stack"),
        (ws(6, IDLE_DUMP.replace("in get", "in put")), "idle", "handing a batch over to the main process"),
    ],
)
def test_what_each_worker_is_doing(w, activity, doing):
    r = read_worker(w)
    assert (r.activity, r.doing) == (activity, doing)
    assert r.idle is (activity == "idle")
    if activity == "working":
        assert r.stuck_frame["line"] == 36 and r.stack[-1]["function"] == "_worker_loop"  # its own part of the stack
        assert r.classification == f"blocked in C (CPU 0%, state S) {doing}"


@pytest.mark.parametrize(
    "workers, stuck, why",
    [
        ([ws(41, IDLE_DUMP), ws(42, STUCK_DUMP)], 42, "the only worker not idle: pid 42 at __getitem__ (train.py:36)"),
        (
            [ws(41, STUCK_DUMP), ws(42, STUCK_DUMP)],
            None,
            "cannot tell which worker is stuck: pids 41, 42 all work on a batch",
        ),
        (
            [ws(41), ws(42, STUCK_DUMP)],
            None,
            "cannot tell which worker is stuck: pid(s) 41 gave no stack, pid 42 at __getitem__",
        ),
        ([ws(41, IDLE_DUMP), ws(42, IDLE_DUMP)], None, "every worker is idle (pids 41, 42)"),
        ([ws(41, MAIN_SPINS)], None, "no DataLoader worker process found"),
        ([ws(41, IDLE_DUMP), ws(42, spy=PY_SPY_STUCK), ws(43, MAIN_SPINS)], 42, "the only worker not idle: pid 42"),
    ],
)
def test_which_worker_is_stuck(workers, stuck, why):
    v = judge(workers)
    assert v.stuck_pid == stuck and v.why.startswith(why), v.why
    fields = v.fields()
    assert fields["stuck_worker_pid"] == stuck and [w["pid"] for w in fields["dataloader_workers"]] == sorted(
        w.pid for w in workers
    )
    if stuck:
        assert (
            v.words() == f"stuck DataLoader worker pid {stuck} at "
            f"{'Rows.' if stuck == 42 and workers[1].source == 'py-spy' else ''}__getitem__ (train.py:36)"
        )
        assert [w["idle"] for w in fields["dataloader_workers"]][0] is True


class Table(FakeProcessTable):
    """A fake table whose processes have command lines (`describe`, as psutil reads them now)."""

    def __init__(self):
        super().__init__()
        self.cmdlines: dict[int, list] = {}
        self.dumps: dict[int, str] = {}

    def describe(self, ref: ProcRef) -> dict:
        return {"pid": ref.pid, "state": "S", "cmdline": self.cmdlines.get(ref.pid)}

    def _deliver(self, p, sig):
        if sig == signal.SIGUSR1 and p.pid in self.dumps:
            with open(p.dump_path, "a") as f:
                f.write(self.dumps[p.pid])
        else:
            super()._deliver(p, sig)


def _rank_with_workers(tmp_path, main_dump: str):
    table = Table()
    rank = table.add()
    rank.dump_path = tmp_path / "stack-rank0.txt"
    table.dumps[rank.pid] = main_dump
    table.cmdlines[rank.pid] = CMD
    procs = [proc(rank.pid, 1) | {"create_time": rank.create_time}]
    workers = {}
    for name, dump, has_file, cmd_now in (
        ("idle", IDLE_DUMP, True, CMD),
        ("stuck", STUCK_DUMP, True, CMD),
        ("no file", STUCK_DUMP, False, CMD),
        ("exec'd since", STUCK_DUMP, True, ["sh"]),
    ):
        w = table.add(ppid=rank.pid)
        w.dump_path = forked_dump_path(rank.dump_path, w.pid)
        if has_file:
            w.dump_path.write_text("")
        table.dumps[w.pid], table.cmdlines[w.pid] = dump, cmd_now
        procs.append(proc(w.pid, rank.pid) | {"create_time": w.create_time})
        workers[name] = w
    dc = DumpCollector(
        [DumpTarget(0, ProcRef(rank.pid, rank.create_time), rank.dump_path)],
        grace_s=5,
        table=table,
        py_spy=False,
        out_dir=tmp_path,
        loader_workers=WorkerDumps(procs),
    )
    return table, rank, workers, dc


def _drive(dc) -> float:
    t = 0.0
    dc.begin(t)
    while not dc.advance(t):
        t = round(t + 0.1, 3)
        assert t < 20
    return t


def test_a_rank_waiting_on_its_dataloader_gets_its_forks_dumped_and_the_stuck_one_named(tmp_path):
    table, rank, w, dc = _rank_with_workers(tmp_path, MAIN_WAITS)
    _drive(dc)
    usr1 = [pid for pid, sig in table.sent if sig == signal.SIGUSR1]
    # the rank first; then only the forks with a dump file of their own that still run the rank's command line
    assert usr1 == [rank.pid, w["idle"].pid, w["stuck"].pid]
    (found,) = dc.loader_workers.stacks().values()
    by_pid = {s.pid: (s, text) for s, text in found}
    assert set(by_pid) == {w[k].pid for k in w}
    assert by_pid[w["no file"].pid][0].note.startswith(f"no stack-rank0-pid{w['no file'].pid}.txt")
    assert "no longer says it is a worker started by fork" in by_pid[w["exec'd since"].pid][0].note
    assert (
        "in __getitem__" in by_pid[w["stuck"].pid][1]
        and by_pid[w["stuck"].pid][0].dump == f"stack-rank0-pid{w['stuck'].pid}.txt"
    )
    v = judge([s for s, _ in found])
    assert v.stuck_pid is None  # two workers gave no stack: it cannot tell
    v = judge([by_pid[w["idle"].pid][0], by_pid[w["stuck"].pid][0]])
    assert v.stuck_pid == w["stuck"].pid and v.stuck.stuck_frame["function"] == "__getitem__"


def test_a_ranks_spawned_workers_are_dumped_and_its_other_children_left_alone(tmp_path):
    """Spawned workers: signalled like forks once their own file exists; multiprocessing's resource tracker and a
    second rank the first one spawned (torch's mp.spawn) are no workers, whatever files exist for them."""
    table = Table()
    rank = table.add()
    rank.dump_path = tmp_path / "stack-rank0.txt"
    table.dumps[rank.pid], table.cmdlines[rank.pid] = MAIN_WAITS, CMD
    procs = [proc(rank.pid, 1) | {"create_time": rank.create_time}]
    made = {}
    for name, cmd, dump in (
        ("idle", SPAWNED, IDLE_DUMP),
        ("stuck", SPAWNED, STUCK_DUMP),
        ("tracker", TRACKER, ""),
        ("rank 1", SPAWNED, MAIN_SPINS),
    ):
        p = table.add(ppid=rank.pid)
        p.dump_path = forked_dump_path(rank.dump_path, p.pid)
        p.dump_path.write_text("")
        table.dumps[p.pid], table.cmdlines[p.pid] = dump, cmd
        procs.append(proc(p.pid, rank.pid, cmd) | {"create_time": p.create_time})
        made[name] = p
    other_rank = DumpTarget(1, ProcRef(made["rank 1"].pid, made["rank 1"].create_time), tmp_path / "stack-rank1.txt")
    dc = DumpCollector(
        [DumpTarget(0, ProcRef(rank.pid, rank.create_time), rank.dump_path), other_rank],
        grace_s=5,
        table=table,
        py_spy=False,
        out_dir=tmp_path,
        loader_workers=WorkerDumps(procs),
    )
    _drive(dc)
    usr1 = [pid for pid, sig in table.sent if sig == signal.SIGUSR1]
    assert usr1 == [rank.pid, made["rank 1"].pid, made["idle"].pid, made["stuck"].pid]  # the ranks, then the workers
    (found,) = dc.loader_workers.stacks().values()
    assert {s.pid for s, _ in found} == {made["idle"].pid, made["stuck"].pid}
    assert {t.started for t in dc.loader_workers.targets.values()} == {"spawn"}
    v = judge([s for s, _ in found])
    assert v.stuck_pid == made["stuck"].pid and v.stuck.stuck_frame["function"] == "__getitem__"


def test_a_spawned_worker_that_exec_d_another_program_is_not_signalled(tmp_path):
    table, rank, w, dc = _rank_with_workers(tmp_path, MAIN_WAITS)
    for rec in dc.loader_workers.procs:
        if rec["pid"] == w["stuck"].pid:
            rec["cmdline"] = SPAWNED  # the snapshot saw a spawned worker …
    table.cmdlines[w["stuck"].pid] = ["/bin/sh", "-c", "true"]  # … which runs another program by the signal
    _drive(dc)
    assert w["stuck"].pid not in [pid for pid, sig in table.sent if sig == signal.SIGUSR1]
    note = next(s.note for s, _ in dc.loader_workers.stacks()[0] if s.pid == w["stuck"].pid)
    assert note.startswith("not signalled: its command line no longer says it is a worker started by spawn"), note


def test_a_rank_not_waiting_on_its_dataloader_leaves_its_forks_alone(tmp_path):
    table, rank, w, dc = _rank_with_workers(tmp_path, MAIN_SPINS)
    _drive(dc)
    assert [pid for pid, sig in table.sent if sig == signal.SIGUSR1] == [rank.pid]
    assert dc.loader_workers.stacks() == {} and dc.loader_workers.note == "no rank waits on a DataLoader"


def test_a_worker_that_never_writes_bounds_the_wait(tmp_path):
    table, rank, w, dc = _rank_with_workers(tmp_path, MAIN_WAITS)
    table.dumps[w["stuck"].pid] = ""  # it takes the signal but writes nothing (its handler writes elsewhere)
    t = _drive(dc)
    assert t == pytest.approx(5.0, abs=0.11)  # the rank's whole dump is in at once, then the workers' grace runs out
    (found,) = dc.loader_workers.stacks().values()
    assert next(s for s, _ in found if s.pid == w["stuck"].pid).note == "its faulthandler file did not grow"


def test_the_stall_incident_names_the_dataloader_wait_and_the_stuck_worker(tmp_path):
    """The whole episode on fakes: the worker's main thread waits in its DataLoader; its two forks dump into their
    own files; the incident says where the main process waits, which worker is stuck and where."""
    h = Harness(tmp_path, proc={"term": "die"})
    w = h.running()
    rank_dump = dump_path_for(w.dir, 0)
    idle, stuck = h.table.add(ppid=w.pid), h.table.add(ppid=w.pid)
    texts = {w.pid: MAIN_WAITS, idle.pid: IDLE_DUMP, stuck.pid: STUCK_DUMP}
    for p in (idle, stuck):
        p.dump_path = forked_dump_path(rank_dump, p.pid)
        p.dump_path.write_text("")  # what the heartbeat's at-fork hook creates in each fork

    def deliver(p, sig, _orig=h.table._deliver):
        if sig == signal.SIGUSR1 and p.pid in texts:
            with open(p.dump_path, "a") as f:
                f.write(texts[p.pid])
        else:
            _orig(p, sig)

    h.table._deliver = deliver
    h.table.describe = lambda ref: {"pid": ref.pid, "state": "S", "cmdline": CMD}

    class Sample:  # the worker and its forks, one command line
        def __init__(self, roots, extra=()):
            pass

        def take(self):
            return [proc(w.pid, 100) | {"create_time": w.proc.create_time}] + [
                proc(p.pid, w.pid) | {"create_time": p.create_time} for p in (idle, stuck)
            ]

    h.sup.tools = type(h.sup.tools)(**{**h.sup.tools.__dict__, "snapshot": Sample})
    h.until(lambda: h.sup.attempt == 2)
    inc = h.incident()
    assert inc["landmark"]["name"] == "DataLoader.__next__" and inc["landmark"]["kind"] == "dataloader"
    assert inc["caller_frame"] == {"file": TRAIN, "line": 59, "function": "main"}
    assert inc["summary"].startswith(
        "in DataLoader.__next__(), called from main (train.py:59); innermost get; step deadline"
    )
    assert inc["summary"].endswith(f"; stuck DataLoader worker pid {stuck.pid} at __getitem__ (train.py:36)")
    assert inc["stuck_worker_pid"] == stuck.pid
    workers = {x["pid"]: x for x in inc["dataloader_workers"]}
    assert workers[idle.pid]["idle"] and workers[idle.pid]["doing"] == "waiting on its index queue"
    assert workers[stuck.pid]["stuck_frame"]["function"] == "__getitem__" and not workers[stuck.pid]["idle"]
    assert f"stack-rank0-pid{stuck.pid}.txt" in inc["files"]
    assert not idle.alive and not stuck.alive  # the forks went down with the tree
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(render.incident_view(inc))
    assert "DataLoader.__next__ [dataloader] at _try_get_data (dataloader.py:1291)" in out.getvalue()
    assert f"STUCK pid {stuck.pid}: working, at __getitem__ (train.py:36)" in out.getvalue()


def test_a_forks_dump_file_sits_next_to_its_ranks():
    assert forked_dump_path(Path("/r/attempts/0001/stack-rank3.txt"), 42) == Path(
        "/r/attempts/0001/stack-rank3-pid42.txt"
    )


def test_a_worker_py_spy_gives_no_stack_for_falls_back_to_its_faulthandler(tmp_path, monkeypatch):
    from hangwatch.supervisor.escalation import dump_collector

    class Done:  # a py-spy that ran and wrote no stack (no ptrace permission, say)
        def poll(self):
            return 1

    def fake_py_spy(exe, pid, out, options, fs):
        out.write_text("Error: Permission Denied\n")
        return Done()

    monkeypatch.setattr(dump_collector, "start_py_spy", fake_py_spy)  # the ranks' py-spy and the workers'
    table, rank, w, dc = _rank_with_workers(tmp_path, MAIN_WAITS)
    dc.py_spy, dc.py_spy_path = True, "/fake/py-spy"  # the rank's py-spy fails too: its faulthandler dump serves
    _drive(dc)
    usr1 = [pid for pid, sig in table.sent if sig == signal.SIGUSR1]
    assert usr1 == [rank.pid, w["idle"].pid, w["stuck"].pid]  # after py-spy failed, the same rules as ever
    (found,) = dc.loader_workers.stacks().values()
    by_pid = {s.pid: s for s, _ in found}
    assert (
        by_pid[w["stuck"].pid].source == "faulthandler" and by_pid[w["stuck"].pid].note == "py-spy gave no Python stack"
    )
    assert by_pid[w["no file"].pid].note.startswith("py-spy gave no Python stack; no stack-rank0-pid")
    assert judge([by_pid[w["idle"].pid], by_pid[w["stuck"].pid]]).stuck_pid == w["stuck"].pid
