"""py-spy's output files go through the run's `FsOps` like every other write in the run dir: opened through it (a
full disk refuses them, and the stall's dumps go on without py-spy, saying why), and its time-box note appended
through it."""

from __future__ import annotations

import os
import signal
import time

from fixtures.fakes.failing_fs import FailingFs
from fixtures.fakes.fake_supervisor import FakeProcessTable

from hangwatch.common.durable import FsOps
from hangwatch.supervisor.escalation.dump_collector import DumpCollector
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes.attempt import DumpTarget


class Recording(FsOps):
    def __init__(self):
        self.opened, self.appended = [], []

    def open_output(self, path):
        self.opened.append(path.name)
        return super().open_output(path)

    def append(self, path, data):
        self.appended.append(path.name)
        super().append(path, data)


def stand_in(tmp_path, body: str):
    """An executable in py-spy's place (`py-spy dump … --pid PID …`): `body` is its shell script."""
    exe = tmp_path / "py-spy"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def collector(tmp_path, fs, exe, timeout_s=20.0):
    table = FakeProcessTable()
    rank = table.add()
    rank.dump_path = tmp_path / "stack-rank0.txt"
    out = tmp_path / "incident"
    out.mkdir()
    target = DumpTarget(0, process.ProcRef(rank.pid, rank.create_time), rank.dump_path)
    dc = DumpCollector(
        [target], grace_s=5, table=table, py_spy_path=exe, py_spy_timeout_s=timeout_s, out_dir=out, fs=fs
    )
    return table, rank, dc, out


def wait_done(dc, step: float = 0.05, limit_s: float = 10.0) -> float:
    t, deadline = 0.0, time.monotonic() + limit_s
    while not dc.advance(t):
        assert time.monotonic() < deadline, "the dumps never came in"
        time.sleep(step)
        t = round(t + step, 3)
    return t


def test_py_spys_output_is_opened_through_the_runs_fsops(tmp_path):
    fs = Recording()
    exe = stand_in(tmp_path, 'echo "Thread 1 (idle): MainThread"; echo "    block_in_c (x.py:3)"')
    table, rank, dc, out = collector(tmp_path, fs, exe)
    dc.begin(0.0)
    wait_done(dc)
    assert table.sent == [(rank.pid, signal.SIGUSR1)]
    assert fs.opened == ["py-spy-rank0.txt", "py-spy-rank0.txt"]  # made at once, then py-spy's stdout
    assert "block_in_c" in (out / "py-spy-rank0.txt").read_text() and dc.py_spy_note.startswith("ran ")


def test_a_disk_that_refuses_py_spys_file_leaves_the_dumps_without_py_spy_and_says_why(tmp_path):
    fs = FailingFs(lambda p: p.name.startswith("py-spy"))
    exe = stand_in(tmp_path, "echo should not run > " + str(tmp_path / "ran"))
    table, rank, dc, out = collector(tmp_path, fs, exe)
    dc.begin(0.0)
    assert table.sent == [(rank.pid, signal.SIGUSR1)]  # the rank's own dump is still asked for
    assert dc.py_spy_note == f"not run: cannot write {out / 'py-spy-rank0.txt'} (No space left on device)"
    assert not dc.py_spy_procs and not (tmp_path / "ran").exists() and os.listdir(out) == []
    rank.dump_path.write_text('Thread 0x1 (most recent call first):\n  File "x.py", line 3 in <module>\n')
    wait_done(dc)
    assert "x.py" in dc.texts()[0]


def test_a_py_spy_past_its_time_box_is_killed_and_its_file_says_so_through_fsops(tmp_path):
    fs = Recording()
    exe = stand_in(tmp_path, "echo started; exec sleep 30")
    _, _, dc, out = collector(tmp_path, fs, exe, timeout_s=0.2)
    dc.begin(0.0)
    wait_done(dc)
    assert fs.appended == ["py-spy-rank0.txt"]
    assert "[py-spy killed after 0.2s time box]" in (out / "py-spy-rank0.txt").read_text()
