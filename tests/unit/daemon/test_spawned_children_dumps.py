"""A rank's dump handler reaches the processes multiprocessing starts for it with `spawn` and `forkserver` (a
DataLoader's workers under those start methods), which inherit nothing of their parent: each registers faulthandler
into a file of its own, `stack-rank<R>-pid<PID>.txt`, as a forked worker does — and it is never the reason a child
fails to start.  Real processes: a rank that starts one child and signals it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

RANK = textwrap.dedent("""\
    import json, multiprocessing as mp, os, signal, sys, time
    from pathlib import Path
    from hangwatch.daemon.heartbeat import Heartbeat

    def work(started, go):
        started.put(os.getpid())
        go.get()  # blocks until the rank has looked at it

    if __name__ == "__main__":
        method, directory, case = sys.argv[1:]
        hb = Heartbeat(Path(directory) / "heartbeat-rank0.jsonl")
        hb.start()
        if case == "released":
            hb.release_dump_handler()
        if case == "unwritable":
            os.rename(directory, directory + ".gone")  # the child cannot create its file
        ctx = mp.get_context(method)
        started, go = ctx.Queue(), ctx.Queue()
        child = ctx.Process(target=work, args=(started, go))
        child.start()
        pid = started.get(timeout=60)
        path = Path(directory) / f"stack-rank0-pid{pid}.txt"
        out = {"pid": pid, "file": path.exists(), "dump": ""}
        if out["file"]:
            os.kill(pid, signal.SIGUSR1)  # without a handler of its own this would kill it
            deadline = time.monotonic() + 10
            while "in work" not in out["dump"] and time.monotonic() < deadline:
                time.sleep(0.05)
                out["dump"] = path.read_text()
        go.put("go")
        child.join(30)
        out["exitcode"] = child.exitcode
        print(json.dumps(out))
""")


def run_rank(tmp_path, method: str, case: str = "") -> dict:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    directory = tmp_path / "attempt"
    directory.mkdir()
    p = subprocess.run(
        [sys.executable, str(script), method, str(directory), case],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_spawned_child_of_a_rank_dumps_its_own_stack_into_a_file_of_its_own(tmp_path, method):
    out = run_rank(tmp_path, method)
    assert out["file"], out
    # the child's own stack, not the rank's: its target under multiprocessing's entry
    assert re.search(
        r'rank\.py", line \d+ in work\n.*multiprocessing/spawn\.py", line \d+ in _main', out["dump"], re.S
    ), out

    assert out["exitcode"] == 0  # SIGUSR1 dumped and left it running


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_child_that_cannot_create_its_dump_file_starts_all_the_same(tmp_path, method):
    out = run_rank(tmp_path, method, "unwritable")
    assert not out["file"] and out["exitcode"] == 0, out


def test_once_the_rank_released_its_handler_its_children_get_none(tmp_path):
    out = run_rank(tmp_path, "spawn", "released")
    assert not out["file"] and out["exitcode"] == 0, out
