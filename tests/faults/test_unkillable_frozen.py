"""A process of the worker's tree that SIGKILL cannot end, for real: a cgroup-v1 freezer holds it in
uninterruptible sleep (state D), as a hung NFS mount or a wedged GPU driver would.

The script (tests/fixtures/user_scripts/leaves_a_child.py) starts a helper and hangs; the test freezes the helper;
the silence deadline fires and the tree is killed; the helper outlives SIGKILL.  Then:
  * `restart.on_unkillable: wait` — an `unkillable` incident names the helper's pid, state and wait channel, no
    new attempt starts while it is there; thawed, it dies, the next attempt runs and the run finishes;
  * `restart.on_unkillable: fail` — the same incident, and the run ends `failed` (exit 1) with the helper
    still frozen.
Needs root and the v1 freezer hierarchy (skipped elsewhere, saying so)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.user_shell import hangwatch_argv, incidents, user_env, worker_logs

pytestmark = pytest.mark.slow

FREEZER = Path("/sys/fs/cgroup/freezer")
SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "user_scripts" / "leaves_a_child.py"


class Frozen:
    """A freezer cgroup of our own: put a pid in, freeze, thaw, remove."""

    def __init__(self) -> None:
        self.dir = FREEZER / f"hangwatch-test-{uuid.uuid4().hex[:8]}"
        self.dir.mkdir()

    def freeze(self, pid: int) -> None:
        (self.dir / "tasks").write_text(str(pid))
        (self.dir / "freezer.state").write_text("FROZEN")
        deadline = time.monotonic() + 10
        while (self.dir / "freezer.state").read_text().strip() != "FROZEN":
            assert time.monotonic() < deadline, "the freezer did not freeze"
            time.sleep(0.05)

    def thaw(self) -> None:
        (self.dir / "freezer.state").write_text("THAWED")

    def remove(self) -> None:
        self.thaw()
        deadline = time.monotonic() + 10
        while (self.dir / "tasks").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)  # a thawed process with SIGKILL pending dies at once
        self.dir.rmdir()


def freezer_usable() -> str:
    """Why the freezer cannot be used here ('' when it can)."""
    if os.geteuid() != 0:
        return "needs root to create a freezer cgroup"
    if not (FREEZER / "freezer.state").exists() and not FREEZER.is_dir():
        return "no cgroup-v1 freezer hierarchy at /sys/fs/cgroup/freezer"
    try:
        Frozen().remove()
    except OSError as exc:
        return f"cannot create a freezer cgroup: {exc}"
    return ""


@pytest.fixture
def frozen():
    why = freezer_usable()
    if why:
        pytest.skip(why)
    f = Frozen()
    yield f
    f.remove()


@contextlib.contextmanager
def supervised(tmp_path: Path, mode: str):
    """`hangwatch run` of the script (see `start`), killed on the way out if the test left it running."""
    proc, run_dir, pidfile = start(tmp_path, mode)
    try:
        yield proc, run_dir, pidfile
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    cfg = {
        "watchdog": {
            "output_silence_timeout_s": 2,
            "startup_timeout_s": 60,
            "term_grace_s": 1,
            "stuck_term_grace_s": 1,
            "kill_wait_s": 1,
            "py_spy": False,
            "poll_interval_s": 0.1,
        },
        "worker": {"instrument": "off"},
        "restart": {"backoff_initial_s": 0, "max_restarts": 3, "on_unkillable": mode},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    pidfile = tmp_path / "helper.pid"
    proc = subprocess.Popen(
        [*hangwatch_argv(), "run", "cfg.yaml", "--run-dir", "run", "--", "python", str(SCRIPT), str(pidfile)],
        cwd=tmp_path,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, tmp_path / "run", pidfile


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, run_dir: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (hangwatch: {proc.poll()})\n{worker_logs(run_dir)}")


def unkillable_incident(run_dir: Path):
    """The unkillable incident once its file is whole (the directory comes first)."""
    for d in sorted((run_dir / "incidents").glob("*-unkillable")):
        try:
            return json.loads((d / "incident.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
    return None


def spawned(run_dir: Path) -> int:
    log = run_dir / "supervisor.log"
    return sum(1 for line in log.read_text().splitlines() if '"worker_spawned"' in line) if log.exists() else 0


def assert_names_the_helper(inc: dict, helper: int, mode: str) -> None:
    assert [s["pid"] for s in inc["survivors"]] == [helper], inc["survivors"]
    s = inc["survivors"][0]
    assert s["state"] in ("D", "disk-sleep"), s  # psutil's name for D
    # The kernel function it sleeps in, as /proc says (a frozen task keeps the one it was frozen in).
    assert (s.get("wchan") and f"waiting in {s['wchan']}" in inc["summary"]) or "wchan_unreadable" in s, s
    assert f"{helper} (" in inc["summary"] and "outlived SIGKILL" in inc["summary"], inc["summary"]
    assert inc["on_unkillable"] == mode and inc["failure_kind"], inc


def test_a_frozen_helper_holds_the_restart_until_it_is_gone(tmp_path, frozen):
    with supervised(tmp_path, "wait") as (proc, run_dir, pidfile):
        helper = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 60, "the helper", proc, run_dir))
        frozen.freeze(helper)
        inc = wait_for(lambda: unkillable_incident(run_dir), 60, "the unkillable incident", proc, run_dir)
        assert_names_the_helper(inc, helper, "wait")
        assert inc["status"] == "waiting"
        time.sleep(3)  # the supervisor's own survivor checks come every second: three of them start nothing
        assert spawned(run_dir) == 1 and proc.poll() is None, worker_logs(run_dir)
        st = json.loads((run_dir / "state.json").read_text())
        assert st["state"] == "killing", st
        frozen.thaw()  # SIGKILL, pending all along, ends it
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:] + worker_logs(run_dir)
    assert spawned(run_dir) == 2
    inc = unkillable_incident(run_dir)
    assert inc["status"] == "final" and inc["gone_after_s"] >= 3, inc
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"


def test_a_frozen_helper_ends_the_run_failed_when_asked(tmp_path, frozen):
    with supervised(tmp_path, "fail") as (proc, run_dir, pidfile):
        helper = int(wait_for(lambda: pidfile.exists() and pidfile.read_text(), 60, "the helper", proc, run_dir))
        frozen.freeze(helper)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:] + worker_logs(run_dir)
    assert spawned(run_dir) == 1
    inc = unkillable_incident(run_dir)
    assert inc is not None, [i.get("kind") for _, i in incidents(run_dir)]
    assert_names_the_helper(inc, helper, "fail")
    st = json.loads((run_dir / "state.json").read_text())
    assert st["state"] == "failed" and "outlived SIGKILL" in (st.get("why") or st.get("reason") or ""), st
    assert "outlived SIGKILL" in err, err[-3000:]
