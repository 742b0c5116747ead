"""End to end: `hangwatch run` started as a user would, driven only through the `hangwatch` CLI.

Most tests use a worker that speaks the heartbeat protocol and nothing else (no torch, so a
restart costs a fraction of a second); one runs the built-in worker on the tiny model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# A worker with resumable state and a ledger of every step it completes, so a test can tell a lost
# or repeated step.  SIGTERM is handled like the real worker: finish the step, checkpoint, exit 0.
FAKE_WORKER = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from hangwatch.daemon.heartbeat import Heartbeat

    MAX_STEPS = int(os.environ["FAKE_MAX_STEPS"])
    EVERY = int(os.environ["FAKE_CKPT_EVERY"])
    hb = Heartbeat.from_env()
    run_dir = Path(os.environ["HANGWATCH_RUN_DIR"])
    state = run_dir / "fake-checkpoint.json"
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))

    def save(step):
        tmp = state.with_suffix(".tmp")
        tmp.write_text(json.dumps({"step": step}))
        os.replace(tmp, state)
        hb.checkpoint(str(state), step, good=True)

    step = json.loads(state.read_text())["step"] if state.exists() else 0
    hb.start(resumed_from=str(state) if step else None, resumed_step=step)
    hb.current_step = step
    print(f"attempt {hb.attempt}: resuming at step {step}", flush=True)
    with hb.phase("train"):
        while step < MAX_STEPS:
            time.sleep(0.1)
            step += 1
            with open(run_dir / "steps.log", "a") as f:
                f.write(f"{hb.attempt} {step}\\n")
            hb.step(step, loss=1.0 / step, lr=1e-3, tokens_per_s=512.0, max_steps=MAX_STEPS)
            print(f"attempt {hb.attempt}: step {step}", flush=True)
            if step % EVERY == 0 or stop:
                save(step)
            if stop:
                hb.stop("terminated")
                sys.exit(0)
    hb.stop("finished")
""")


def hangwatch_argv() -> list[str]:
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor.cli.main"]


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("HANGWATCH_RUN_DIR", "HANGWATCH_SOCKET", "NOTIFY_SOCKET")}
    e["PYTHONPATH"] = str(REPO)
    e.update(extra)
    return e


def hw(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*hangwatch_argv(), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env(), cwd=REPO
    )


def wait_for(what: str, check: Callable[[], Optional[object]], timeout: float = 60, every: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what} (last: {last!r})")


class Run:
    """`hangwatch run CONFIG` in the background, as a user (or systemd) starts it."""

    def __init__(self, tmp_path: Path, config: Path, run_dir: Path, **extra_env):
        self.run_dir = run_dir
        self.stderr_path = tmp_path / f"supervisor-stderr-{time.monotonic_ns()}.txt"
        self._stderr = open(self.stderr_path, "w")
        self.proc = subprocess.Popen(
            [*hangwatch_argv(), "run", "-v", str(config), "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env=env(**extra_env),
            cwd=REPO,
        )

    def status(self) -> Optional[dict]:
        r = hw("status", "--json", "--run-dir", self.run_dir)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def wait_status(self, what: str, pred: Callable[[dict], bool], timeout: float = 60) -> dict:
        def check():
            assert self.proc.poll() is None, f"supervisor exited {self.proc.returncode}: {self.stderr()}"
            st = self.status()
            return st if st and pred(st) else None

        return wait_for(what, check, timeout)

    def stderr(self) -> str:
        if not self._stderr.closed:
            self._stderr.flush()
        return self.stderr_path.read_text()

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._stderr.close()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._stderr.close()


def fake_config(tmp_path: Path, *, max_steps=100000, every=10) -> Path:
    worker = tmp_path / "fake_worker.py"
    worker.write_text(FAKE_WORKER)
    cfg = {
        "run_dir": "run",
        "worker": {
            "command": [sys.executable, str(worker)],
            "env": {"FAKE_MAX_STEPS": str(max_steps), "FAKE_CKPT_EVERY": str(every)},
        },
        "watchdog": {
            "startup_timeout_s": 30,
            "silence_timeout_s": 30,
            "first_steps_timeout_s": 30,
            "dump_grace_s": 2,
            "term_grace_s": 5,
            "py_spy": False,
            "poll_interval_s": 0.1,
        },
        "restart": {"backoff_initial_s": 0},
    }
    path = tmp_path / "fake.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ledger(run_dir: Path) -> list[tuple[int, int]]:
    """(attempt, step) for every step completed so far; a line still being written is left out."""
    p = run_dir / "steps.log"
    text = p.read_text() if p.exists() else ""
    return [tuple(map(int, line.split())) for line in text[: text.rfind("\n") + 1].splitlines()]


def beats(run_dir: Path, attempt: int, event: str) -> list[dict]:
    """The complete heartbeat lines of one event (a line being written is skipped, as the supervisor does); the
    worker's own, not the bootstrap's `start` (instrumented: auto) that precedes it."""
    p = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [
        r
        for r in map(decode_line, p.read_bytes().splitlines())
        if r is not None and r["event"] == event and r.get("instrumented") != "auto"
    ]


class NotifySocket:
    """Stands in for systemd's notify socket; a thread keeps reading, as the manager does."""

    def __init__(self, path: Path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                continue

    def saw(self, prefix: str) -> bool:
        return any(line.startswith(prefix) for m in list(self.messages) for line in m.splitlines())

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def test_operating_a_run_through_the_cli(tmp_path):
    config = fake_config(tmp_path)
    run_dir = tmp_path / "run"
    notify = NotifySocket(tmp_path / "notify.sock")
    run = Run(tmp_path, config, run_dir, NOTIFY_SOCKET=str(notify.path), WATCHDOG_USEC="1000000")
    follower = None
    try:
        # --- status while it trains
        st = run.wait_status("training to start", lambda s: s["state"] == "running" and (s["step"] or 0) >= 3)
        assert st["attempt"] == 1 and st["max_steps"] == 100000 and st["pid"] == st["pids"]["0"]
        assert st["last_beat_age_s"] < 30 and st["restarts"] == 0 and st["incidents"] == 0
        human = hw("status", "--run-dir", run_dir)
        assert human.returncode == 0
        for expected in ["running", "attempt 1", f"pid {st['pid']}", "train", "/ 100000", "512.0 tokens/s", "restarts"]:
            assert expected in human.stdout, human.stdout
        # systemd heard READY, STATUS and watchdog pings
        wait_for(
            "READY/STATUS/WATCHDOG notifications",
            lambda: notify.saw("READY=1") and notify.saw("STATUS=") and notify.saw("WATCHDOG=1"),
        )
        assert oct(os.stat(run_dir / "hangwatch.sock").st_mode & 0o777) == "0o600"

        follower = subprocess.Popen(
            [*hangwatch_argv(), "logs", "-f", "--run-dir", str(run_dir)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(),
            cwd=REPO,
        )
        followed: list[str] = []
        threading.Thread(target=lambda: followed.extend(follower.stdout), daemon=True).start()

        # --- bad requests get JSON errors; the daemon carries on
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(str(run_dir / "hangwatch.sock"))
        s.sendall(b'garbage\n{"cmd": "frobnicate"}\n{"cmd": "restart", "mode": "sideways"}\n{"cmd": "status"}\n')
        buf = b""
        while buf.count(b"\n") < 4:
            buf += s.recv(65536)
        s.close()
        replies = [json.loads(x) for x in buf.splitlines()]
        assert [r["ok"] for r in replies] == [False, False, False, True]
        assert "not valid JSON" in replies[0]["error"] and "unknown command 'frobnicate'" in replies[1]["error"]
        assert "sideways" in replies[2]["error"]

        # --- a second supervisor on the same run dir refuses to start, names the holder, changes nothing
        second = hw("run", config, "--run-dir", run_dir)
        assert second.returncode == 73
        assert f"another hangwatch (pid {run.status()['supervisor_pid']}) is supervising {run_dir}" in second.stderr

        # --- dump: fresh stacks, nothing stops
        d = hw("dump", "--run-dir", run_dir)
        assert d.returncode == 0, d.stderr
        assert d.stdout.startswith("=== rank 0 ===") and "fake_worker.py" in d.stdout
        assert run.status()["attempt"] == 1

        # --- graceful restart: the worker checkpoints first, no step is lost or repeated
        r = hw("restart", "--run-dir", run_dir)
        assert (r.returncode, r.stdout) == (0, "restart accepted (graceful)\n")
        run.wait_status(
            "attempt 2 stepping", lambda s: s["attempt"] == 2 and s["state"] == "running" and (s["step"] or 0) > 0
        )
        first = [step for a, step in ledger(run_dir) if a == 1]
        second_steps = wait_for("attempt 2 steps", lambda: [step for a, step in ledger(run_dir) if a == 2])
        assert second_steps[0] == first[-1] + 1
        assert beats(run_dir, 2, "start")[0]["resumed_step"] == first[-1]
        steps = [step for _, step in ledger(run_dir)]
        assert steps == list(range(1, len(steps) + 1))  # no gap, no repeat

        # --- restart --now: dump and kill, recorded as an incident with the stacks
        r = hw("restart", "--now", "--run-dir", run_dir)
        assert r.returncode == 0 and r.stdout.startswith("restart accepted (now)"), r.stdout + r.stderr
        st = run.wait_status(
            "attempt 3 stepping", lambda s: s["attempt"] == 3 and s["state"] == "running" and (s["step"] or 0) > 0
        )
        assert st["restarts"] == 2 and st["incidents"] == 1 and st["last_incident"]["id"] == "0001"
        inc = hw("incidents", "--json", "--run-dir", run_dir)
        assert [i["attempt"] for i in json.loads(inc.stdout)] == [2]
        one = json.loads(hw("incidents", "0001", "--json", "--run-dir", run_dir).stdout)
        inc_dir = next((run_dir / "incidents").glob("0001-*"))
        assert one["id"] == "0001" and any("fake_worker.py" in p.read_text() for p in inc_dir.glob("stack-rank*.txt"))

        # --- logs -f followed the worker log across both restarts
        wait_for(
            "logs -f to reach attempt 3", lambda: any(line.startswith("attempt 3: step") for line in list(followed))
        )
        text = "".join(followed)
        assert text.index("attempt 1: step 1\n") < text.index("attempt 2: resuming") < text.index("attempt 3: resuming")

        # --- stop: the worker checkpoints, the supervisor exits 0 and removes its socket
        r = hw("stop", "--run-dir", run_dir)
        assert r.returncode == 0, r.stderr
        assert run.wait_exit(60) == 0
        assert not (run_dir / "hangwatch.sock").exists()
        assert notify.saw("STOPPING=1")
        gone = hw("status", "--run-dir", run_dir)  # no supervisor: what it recorded, which says how the run ended
        assert gone.returncode == 0, gone.stderr
        assert "stopped" in gone.stdout and "recorded" in (gone.stdout + gone.stderr)
        assert json.loads((run_dir / "fake-checkpoint.json").read_text())["step"] == ledger(run_dir)[-1][1]
    finally:
        if follower is not None:
            follower.send_signal(signal.SIGINT)
            follower.wait(10)
        run.kill()
        notify.close()

    # The supervisor's own log: JSON lines in the run dir, readable lines on (non-TTY) stderr.
    events = [json.loads(line) for line in (run_dir / "supervisor.log").read_text().splitlines()]
    asked = [e["cmd"] for e in events if e["event"] == "control request"]
    assert asked == ["frobnicate", "restart", "dump", "restart", "restart", "stop"]
    assert "level=info logger=hangwatch" in run.stderr() and "event=supervisor_started" in run.stderr()
    assert "Traceback" not in run.stderr()


def test_with_systemd_directories_a_killed_supervisors_socket_is_replaced(tmp_path):
    """As under the unit: the socket in $RUNTIME_DIRECTORY (recorded in the run dir), the log in
    $LOGS_DIRECTORY (linked from the run dir).  A SIGKILLed supervisor leaves its socket behind; the
    next one replaces it."""
    config = fake_config(tmp_path)
    run_dir, runtime, logs_dir = tmp_path / "run", tmp_path / "runtime", tmp_path / "logs"
    runtime.mkdir()
    dirs = dict(RUNTIME_DIRECTORY=str(runtime), LOGS_DIRECTORY=str(logs_dir))
    sock = runtime / "hangwatch.sock"
    run = Run(tmp_path, config, run_dir, **dirs)
    try:
        run.wait_status("training", lambda s: s["state"] == "running" and (s["step"] or 0) > 0)
        assert (run_dir / "socket-path").read_text().strip() == str(sock)
        assert hw("status", "--json", "--socket", sock).returncode == 0
        assert (run_dir / "supervisor.log").resolve() == logs_dir / "supervisor.log"
        assert "supervisor_started" in hw("logs", "--supervisor", "--run-dir", run_dir).stdout
    finally:
        run.proc.send_signal(signal.SIGKILL)
        run.wait_exit(10)
    assert sock.exists()
    r = hw("status", "--run-dir", run_dir)
    assert (r.returncode, r.stderr) == (69, f"hangwatch: no hangwatch running at {sock} (connection refused)\n")
    again = Run(tmp_path, config, run_dir, **dirs)
    try:
        st = again.wait_status("the new supervisor training", lambda s: s["state"] == "running" and s["attempt"] == 2)
        assert st["supervisor_pid"] == again.proc.pid
        assert hw("stop", "--run-dir", run_dir).returncode == 0
        assert again.wait_exit(60) == 0
    finally:
        again.kill()
    assert not sock.exists()


def _tiny_config(tmp_path: Path) -> Path:
    """The demo config (tiny model, CPU), shortened and without the injected fault."""
    demo = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    demo["data"]["train"] = str(REPO / "configs" / demo["data"]["train"])
    demo["data"]["eval"] = str(REPO / "configs" / demo["data"]["eval"])
    demo["faults"] = []
    demo["eval"]["every_steps"] = 0
    demo["train"].update(max_steps=400, sleep_per_step_s=0.05)
    demo["checkpoint"]["every_steps"] = 1000  # only the checkpoint a graceful stop makes
    # A checkpoint counts as good only once `confirm_steps` finite steps followed it, and resume takes
    # the newest good one; the checkpoint written on the way out can be good at once only with 0.
    demo["checkpoint"]["confirm_steps"] = 0
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(demo))
    return path


def test_built_in_worker_graceful_restart_loses_no_step(tmp_path):
    config = _tiny_config(tmp_path)
    run_dir = tmp_path / "run"
    run = Run(tmp_path, config, run_dir)
    try:
        st = run.wait_status(
            "the tiny model training", lambda s: s["state"] == "running" and (s["step"] or 0) >= 3, timeout=120
        )
        assert st["max_steps"] == 400 and isinstance(st["loss"], float) and st["phase"] == "train"
        r = hw("restart", "--run-dir", run_dir)
        assert r.returncode == 0, r.stderr
        run.wait_status(
            "attempt 2 training",
            lambda s: s["attempt"] == 2 and s["state"] == "running" and (s["step"] or 0) > 0,
            timeout=120,
        )
        last_step_1 = max(b["step"] for b in beats(run_dir, 1, "step"))
        start2 = beats(run_dir, 2, "start")[0]
        assert start2["resumed_from"] and start2["resumed_from"].endswith(f"step-{last_step_1:08d}")
        steps2 = wait_for("a step in attempt 2", lambda: [b["step"] for b in beats(run_dir, 2, "step")], timeout=120)
        assert steps2[0] == last_step_1 + 1
        assert hw("stop", "--run-dir", run_dir).returncode == 0
        assert run.wait_exit(120) == 0
    finally:
        run.kill()
