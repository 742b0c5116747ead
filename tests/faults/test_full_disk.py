"""A full disk on a real small filesystem (tmpfs): the supervisor survives and ends the run `failed`
(exit 74) naming the disk, and state.json says so (rewritten in the blocks it holds: the atomic
replace has no block for its temporary); the last good checkpoint still validates; no temporary is
left presented as a checkpoint; and once space returns, `hangwatch run` resumes from that checkpoint
and finishes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.fakes.workers import make_config

from hangwatch.common.durable import TMP_PREFIX
from hangwatch.common.exitcodes import EXIT_IOERR
from hangwatch.daemon import checkpoint as ck
from hangwatch.supervisor.records import run_state

pytestmark = pytest.mark.slow

DISK_MB = 8


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def beats(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted(run_dir.glob("attempts/*/heartbeat-rank0.jsonl")):
        for line in f.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def fill(path: Path) -> None:
    """Write until the filesystem refuses."""
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (64 * 1024)
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass


def hangwatch_run(cfg: Path) -> subprocess.Popen:
    """`hangwatch run -v --hide-output CFG`: the supervisor's own lines only (the worker's output stays in
    worker.log)."""
    return subprocess.Popen(
        [sys.executable, "-m", "hangwatch.supervisor", "run", "-v", "--hide-output", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_full_disk_ends_the_run_cleanly_and_it_resumes_once_space_returns(small_disk, tmp_path):
    run_dir = small_disk / "run"
    cfg = make_config(
        tmp_path,
        run_dir=str(run_dir),
        train={"max_steps": 400, "sleep_per_step_s": 0.02},
        checkpoint={"every_steps": 5, "keep_last": 2, "confirm_steps": 1},
    )
    sup = hangwatch_run(cfg)
    try:
        deadline = time.monotonic() + 120
        while not any(b["event"] == "checkpoint" and b.get("good") for b in beats(run_dir)):
            assert sup.poll() is None and time.monotonic() < deadline, "no good checkpoint before the disk filled"
            time.sleep(0.1)
        fill(small_disk / "filler")
        out, _ = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == EXIT_IOERR, out[-4000:]
    assert "Traceback" not in out  # the supervisor itself never raised (the worker's output is in worker.log)
    assert "no space left on device" in out.lower() or "the disk refused a write" in out, out[-4000:]
    state, problem = run_state.read(run_dir / "state.json")
    assert problem is None and state["state"] == "failed" and state["exit_code"] == EXIT_IOERR, state
    assert "no space left on device" in state["why"], state["why"]

    root = run_dir / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names and all(n.startswith("step-") for n in names), names  # no .tmp-* left among the checkpoints
    good = ck.newest_good(root) if hasattr(ck, "newest_good") else None
    goods = [root / n for n in names if (root / n / ck.GOOD).exists()]
    assert goods, names
    last_good = goods[-1] if good is None else good
    assert ck.validate(last_good) is None  # its manifest still checks out, hash by hash
    good_step = int(last_good.name.split("-")[1])

    (small_disk / "filler").unlink()  # space returns
    again = hangwatch_run(cfg)
    out2, _ = again.communicate(timeout=300)
    assert again.returncode == 0, out2[-4000:]
    starts = [b for b in beats(run_dir) if b["event"] == "start"]
    resumed = starts[-1].get("resumed_from") or ""
    assert Path(resumed).name.startswith("step-") and int(Path(resumed).name.split("-")[1]) >= good_step, starts[-1]
    assert any(b["event"] == "stop" and b.get("reason") == "finished" for b in beats(run_dir))


def test_state_json_takes_a_final_record_on_a_disk_with_no_block_left(small_disk):
    path = small_disk / "state.json"
    running = {"state": "running", "attempt": 1, "descendants": [{"pid": n, "create_time": 1.5} for n in range(40)]}
    run_state.write(path, running)
    fill(small_disk / "filler")
    with pytest.raises(OSError) as refused:  # no block for the temporary: still reported, the disk is full
        run_state.write(
            path,
            {
                "state": "failed",
                "attempt": 1,
                "exit_code": EXIT_IOERR,
                "why": f"no space left on device at {small_disk / 'ckpt'}",
                "descendants": [],
            },
        )
    assert refused.value.errno == 28
    state, problem = run_state.read(path)
    assert problem is None and state["state"] == "failed" and state["why"].startswith("no space left"), state
    assert not list(small_disk.glob(f"{TMP_PREFIX}*"))
    bigger = {"state": "failed", "why": "x" * (path.stat().st_size + 1)}
    with pytest.raises(OSError):  # news that does not fit is not written at all: the file keeps the last record
        run_state.write(path, bigger)
    assert run_state.read(path)[0]["state"] == "failed"
    (small_disk / "filler").unlink()
    run_state.write(path, {"state": "starting", "attempt": 2})  # room again: the atomic replace as before
    assert run_state.read(path)[0] == {"version": run_state.FORMAT_VERSION, "state": "starting", "attempt": 2}
