"""A 2-rank job behind a launcher, on fakes: the launcher (torchrun) never announces itself, each rank runs in a
session of its own.  SIGUSR1 reaches the ranks only, each rank is read from its own process and dump, the
incident names the culprit, the ranks get their SIGTERM directly, `status` shows every rank, stragglers are
warned about without a kill."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

from fixtures.fakes.fake_supervisor import FakeProc, Harness
from fixtures.fakes.torchrun_report import root_cause
from rich.console import Console

from hangwatch.common.protocol import encode
from hangwatch.common.rundir import dump_path_for, heartbeat_path
from hangwatch.supervisor.cli import render
from hangwatch.supervisor.ops import logsetup

TORCH = "/venv/lib/python3.11/site-packages/torch"
STACKS = {  # what each rank's faulthandler writes on SIGUSR1
    "all_reduce": f"""Current thread 0x1 (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "{TORCH}/distributed/c10d_logger.py", line 83 in wrapper
  File "/srv/job/train.py", line 53 in main
  File "/srv/job/train.py", line 61 in <module>

""",
    "spin": """Current thread 0x2 (most recent call first):
  File "/srv/job/train.py", line 88 in _poll_shard_ready
  File "/srv/job/train.py", line 52 in main
  File "/srv/job/train.py", line 61 in <module>

""",
}


class Rank:
    """One rank's process (child of the launcher, its own session) and its heartbeat writer."""

    def __init__(self, h: Harness, rank: int, stuck: str, cpu: float):
        launcher = h.worker
        self.h, self.rank, self.dir = h, rank, launcher.dir
        self.proc: FakeProc = h.table.add(ppid=launcher.pid)  # pgid = sid = its own pid: a session of its own
        self.proc.stuck_in, self.cpu, self.step_no = stuck, cpu, 0
        self.proc.dump_path = dump_path_for(self.dir, rank)

    def beat(self, event: str, **fields) -> None:
        rec = {
            "v": 1,
            "t": 0.0,
            "pid": self.proc.pid,
            "rank": self.rank,
            "attempt": 1,
            "event": event,
            "step": self.step_no,
            "phase": "train",
            **fields,
        }
        with open(heartbeat_path(self.dir, self.rank), "ab") as f:
            f.write(encode(rec))

    def start(self) -> None:
        self.beat("start", dump_signal="SIGUSR1", dump_path=str(self.proc.dump_path), resumed_from=None)

    def step(self, **metrics) -> None:
        self.step_no += 1
        self.beat("step", loss=1.0, **metrics)


def two_ranks(h: Harness) -> tuple[Rank, Rank]:
    h.until(lambda: h.spawn.workers)
    ranks = Rank(h, 0, "all_reduce", 0.0), Rank(h, 1, "spin", 99.0)
    by_pid = {r.proc.pid: r for r in ranks}

    def deliver(p: FakeProc, sig: int, _orig=h.table._deliver) -> None:
        if sig == signal.SIGUSR1 and p.pid in by_pid:
            with open(p.dump_path, "a") as f:
                f.write(STACKS[p.stuck_in])
        else:
            _orig(p, sig)

    h.table._deliver = deliver

    class Sample:  # each rank's own state and CPU; the launcher sleeps
        def __init__(self, roots, extra=()):
            self.pids = sorted(set(roots) | set(extra))

        def take(self):
            return [
                {
                    "pid": pid,
                    "state": "R" if pid in by_pid and by_pid[pid].cpu > 50 else "S",
                    "cpu_percent": by_pid[pid].cpu if pid in by_pid else 0.0,
                    "create_time": 1.7e9 + pid,
                }
                for pid in self.pids
            ]

    h.sup.tools = type(h.sup.tools)(**{**h.sup.tools.__dict__, "snapshot": Sample})
    for r in ranks:
        r.start()
    for _ in range(2):
        for r in ranks:
            r.step()
    h.until(lambda: h.state == "running")
    return ranks


def test_the_spinning_rank_is_the_culprit_and_only_ranks_are_signalled(tmp_path):
    h = Harness(tmp_path, proc={"term": "die"})  # the launcher: dies of SIGTERM, as torchrun does after forwarding
    r0, r1 = two_ranks(h)
    launcher = h.worker.pid
    h.until(lambda: h.sup.attempt == 2)  # the first failure after a healthy start restarts at once
    usr1 = [pid for pid, sig in h.table.sent if sig == signal.SIGUSR1]
    assert sorted(usr1) == sorted([r0.proc.pid, r1.proc.pid]) and launcher not in usr1  # never torchrun
    term = [pid for pid, sig in h.table.sent if sig == signal.SIGTERM]
    assert term[0] == -launcher and {r0.proc.pid, r1.proc.pid} <= set(term)  # the ranks get theirs directly
    assert not r0.proc.alive and not r1.proc.alive  # gone before the next attempt

    inc = h.incident()
    assert inc["culprit_rank"] == 1 and inc["dump_rank"] == 1
    assert inc["summary"].startswith(
        "rank 1: busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88); "
        "rank 0 waiting in all_reduce; step deadline 2.0s exceeded by "
    )
    assert inc["classification"] == "busy loop in Python (CPU 99%) at _poll_shard_ready (/srv/job/train.py:88)"
    roles = {
        r["rank"]: (r["role"], r["pid"], r["state"], r["cpu_percent"], r["collective"], r["step"]) for r in inc["ranks"]
    }
    assert roles == {
        0: ("victim", r0.proc.pid, "S", 0.0, "all_reduce", 2),
        1: ("culprit", r1.proc.pid, "R", 99.0, None, 2),
    }
    assert inc["stuck_frame"]["function"] == "_poll_shard_ready"
    assert {"stack-rank0.txt", "stack-rank1.txt"} <= set(inc["files"]) and inc["dumps"] == {
        "0": "stack-rank0.txt",
        "1": "stack-rank1.txt",
    }
    assert "in all_reduce" in (Path(h.sup.incidents.root) / f"{inc['id']}-stall" / "stack-rank0.txt").read_text()


def test_status_shows_every_rank_and_a_straggler_is_warned_not_killed(tmp_path):
    logsetup.configure(tmp_path / "logs", "info")
    try:
        straggler_is_warned(tmp_path)
    finally:
        logging.getLogger(logsetup.ROOT_LOGGER).handlers.clear()
        logsetup._handlers.clear()


def straggler_is_warned(tmp_path):
    h = Harness(
        tmp_path,
        proc={"term": "die"},
        watchdog={"straggler_factor": 2.0, "straggler_steps": 3, "step_timeout_s": 30, "silence_timeout_s": 60},
    )
    r0, r1 = two_ranks(h)
    for _ in range(4):  # rank 1 reports 4x rank 0's step time, step after step
        r0.step(step_time_s=0.1)
        r1.step(step_time_s=0.4)
        h.tick()
    assert h.state == "running" and not [s for _, s in h.table.sent if s in (signal.SIGTERM, signal.SIGKILL)]
    st = h.sup.desk.handle({"cmd": "status"}, h.clock())["result"]
    rows = {r["rank"]: r for r in st["ranks"]}
    assert (
        set(rows) == {0, 1} and rows[1]["pid"] == r1.proc.pid and rows[0]["step"] == 6 and rows[1]["phase"] == "train"
    )
    assert rows[0]["last_beat_age_s"] >= 0 and [d["name"] for d in rows[1]["deadlines"]] == ["silence", "step"]
    assert rows[1]["straggler"]["rank"] == 1 and rows[1]["straggler"]["others_median_s"] == 0.1
    assert rows[0]["straggler"] is None and set(st["stragglers"]) == {"1"}
    json.dumps(st)  # what `status --json` prints
    console = Console(width=220, record=True)
    console.print(render.status_view(st))
    human = console.export_text()
    assert f"rank 0  pid {r0.proc.pid}  train for" in human and f"rank 1  pid {r1.proc.pid}  train for" in human
    line1 = next(x for x in human.splitlines() if f"rank 1  pid {r1.proc.pid}" in x)
    assert "step 6" in line1 and " left of " in line1 and "straggler: 0.4s a step, 4.0× the others' median" in line1
    warned = [
        json.loads(line)
        for line in (tmp_path / "logs" / "supervisor.log").read_text().splitlines()
        if '"straggler"' in line
    ]
    assert warned and warned[0]["rank"] == 1 and warned[0]["level"] == "warning"
    h.request(cmd="restart", mode="now")  # the next incident carries the warning
    h.until(lambda: h.sup.attempt == 2)
    assert h.incident()["stragglers"][0]["rank"] == 1


ROOT_CAUSE = root_cause("train.py", pid=0).replace("(pid: 0)", "(pid: {pid})")
SEGV = """Fatal Python error: Segmentation fault

Current thread 0x3 (most recent call first):
  File "/srv/job/kernels.py", line 7 in fused_attention
  File "/srv/job/train.py", line 52 in main
  File "/srv/job/train.py", line 61 in <module>
"""


def test_an_exit_names_the_rank_with_the_fatal_dump_or_torchruns_first_failure(tmp_path):
    for how in ("segfault", "torchrun report"):
        h = Harness(tmp_path / how, proc={"term": "die"})
        r0, r1 = two_ranks(h)
        if how == "segfault":
            r1.proc.dump_path.write_text(SEGV)  # faulthandler's fatal-signal dump
            h.table.end(r1.proc.pid, sig=signal.SIGSEGV)
        else:
            h.table.end(r1.proc.pid, code=1)
            Path(h.sup.current.worker.log_path).write_text(ROOT_CAUSE.format(pid=r1.proc.pid))
        h.table.end(h.worker.pid, code=1)  # torchrun ends the others and exits 1
        h.until(lambda: h.sup.attempt == 2)
        inc = h.incident()
        assert inc["culprit_rank"] == 1, (how, inc["summary"])
        if how == "segfault":
            assert inc["stuck_frame"]["function"] == "fused_attention" and inc["dumps"] == {"1": "stack-rank1.txt"}
        else:
            assert inc["classification"].startswith("rank 1 failed first (exit code 1")
        assert not r0.proc.alive  # the ranks outside torchrun's group got SIGTERM directly
