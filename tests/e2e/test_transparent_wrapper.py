"""`hangwatch run -- CMD` stands in for CMD: each test runs the same script bare and wrapped, the way a person or a
shell script would, and compares what they see — stdout and stderr apart and byte for byte, a terminal exactly where
there is one, the exit status, Ctrl-C reaching the script's KeyboardInterrupt handler, other signals passed on as
themselves — and counts hangwatch's own lines on the screen."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.fakes.terminal import in_terminal
from fixtures.fakes.user_shell import hangwatch_argv, user_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = r"""
import os, signal, sys, time
mode = sys.argv[1] if len(sys.argv) > 1 else "ok"
print("OUT line", flush=True)
print("ERR line", file=sys.stderr, flush=True)
print("tty", os.isatty(0), os.isatty(1), os.isatty(2), flush=True)
for i in range(1, 6):  # a progress bar on stderr, as tqdm draws one: carriage returns, no newline until the end
    sys.stderr.write(f"\rtrain: {i * 20:3d}%|{'#' * i}{' ' * (5 - i)}| {i}/5"); sys.stderr.flush()
    time.sleep(0.02)
sys.stderr.write("\n")
sys.stdout.write("\x1b[32mgreen\x1b[0m no newline at the end"); sys.stdout.flush()
if mode == "exit3":
    sys.exit(3)
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "wait":
    signal.signal(signal.SIGTERM, lambda *a: (print("\ngot SIGTERM, saving", flush=True), sys.exit(0)))
    print("\nready", flush=True)
    try:
        time.sleep(120)
    except KeyboardInterrupt:
        print("KeyboardInterrupt handler: saving", flush=True)
        raise
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def bare(*args: str) -> list[str]:
    return ["python", "train.py", *args]


def wrapped(*args: str, opts: tuple = ()) -> list[str]:
    return [*hangwatch_argv(), "run", *opts, "--", "python", "train.py", *args]


def piped(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=user_env(), capture_output=True, timeout=180, stdin=subprocess.DEVNULL)


def own_lines(err: bytes) -> list[bytes]:
    return [line for line in err.split(b"\n") if line.startswith(b"hangwatch: ") or line.startswith(b"  ")]


def without_own(err: bytes) -> bytes:
    return b"\n".join(line for line in err.split(b"\n") if line not in own_lines(err))


def test_in_pipes_stdout_and_stderr_stay_apart_byte_for_byte(script, tmp_path):
    b = piped(bare(), tmp_path)
    w = piped(wrapped(), tmp_path)
    assert (b.returncode, w.returncode) == (0, 0)
    assert w.stdout == b.stdout  # escape codes, the unfinished last line: as the script wrote them
    assert b"ERR" not in w.stdout and b"train:" not in w.stdout
    assert without_own(w.stderr) == b.stderr  # the bar's carriage returns included
    assert b"tty False False False" in w.stdout
    # quiet by default: where the run goes and how it ended, nothing of the structured log
    lines = own_lines(w.stderr)
    assert len(lines) == 2, w.stderr.decode()
    assert b"[info" not in w.stderr and b"level=" not in w.stderr
    assert (tmp_path / "runs" / "train" / "attempts" / "0001" / "worker.log").read_bytes().count(b"OUT line") == 1


def test_quiet_says_nothing_and_verbose_adds_the_structured_log(script, tmp_path):
    q = piped(wrapped(opts=("-q",)), tmp_path)
    assert q.returncode == 0
    assert own_lines(q.stderr) == []
    assert q.stdout == piped(bare(), tmp_path).stdout  # -q never touches the command's output
    v = piped([*hangwatch_argv(), "run", "-v", "--run-dir", "runs/v", "--", *bare()], tmp_path)
    assert v.returncode == 0
    assert b"supervisor_started" in v.stderr and b"worker_spawned" in v.stderr
    h = piped([*hangwatch_argv(), "run", "--hide-output", "--run-dir", "runs/h", "--", *bare()], tmp_path)
    assert h.returncode == 0 and h.stdout == b"" and without_own(h.stderr) == b""
    assert b"OUT line" in (tmp_path / "runs" / "h" / "attempts" / "0001" / "worker.log").read_bytes()


@pytest.mark.parametrize("mode, code", [("exit3", 3), ("sigkill", 128 + 9)])
def test_the_commands_exit_status(script, tmp_path, mode, code):
    b = piped(bare(mode), tmp_path)
    w = piped(wrapped(mode), tmp_path)
    shell_code = 128 - b.returncode if b.returncode < 0 else b.returncode
    assert shell_code == code
    assert w.returncode == code, w.stderr.decode()
    # the same failure before any progress is not retried into the ground
    attempts = sorted((tmp_path / "runs" / "train").glob("attempts/*/worker.log"))
    assert 1 <= len(attempts) <= 2
    assert w.stdout == b.stdout * len(attempts)


def test_in_a_terminal_the_command_sees_one_and_its_output_reads_the_same(script, tmp_path):
    env = user_env()
    b = in_terminal(bare(), tmp_path, env)
    w = in_terminal(wrapped(), tmp_path, env)
    assert (b.code, w.code) == (0, 0)
    assert "tty True True True" in b.text and "tty True True True" in w.text
    shown = "\n".join(line for line in w.text.split("\n") if not line.startswith("hangwatch: "))
    assert shown == b.text + "\n"  # hangwatch's summary starts a line of its own after the script's open one
    assert len([line for line in w.text.split("\n") if line.startswith("hangwatch: ")]) == 2
    # `2>err.log` in a terminal: the command's stderr is then no terminal, its stdout still is
    w2 = in_terminal(
        [*hangwatch_argv(), "run", "--run-dir", "runs/t2", "--", *bare()], tmp_path, env, stderr_to=tmp_path / "err"
    )
    assert w2.code == 0 and "tty True True False" in w2.text
    assert "train:" not in w2.text and b"\rtrain: 100%" in (tmp_path / "err").read_bytes()


def test_ctrl_c_runs_the_keyboardinterrupt_handler_and_exits_130(script, tmp_path):
    env = user_env()
    b = in_terminal(bare("wait"), tmp_path, env, keys=[(b"ready", b"\x03")])
    w = in_terminal(wrapped("wait"), tmp_path, env, keys=[(b"ready", b"\x03")])
    assert b.code == 130 and "KeyboardInterrupt handler: saving" in b.text
    assert w.code == 130, w.text
    assert "KeyboardInterrupt handler: saving" in w.text
    assert w.text.count("ready") == 1  # stopped, never restarted
    state = (tmp_path / "runs" / "train" / "state.json").read_text()
    assert '"stopped"' in state and "SIGINT" in state


def test_sigterm_is_passed_on_as_itself(script, tmp_path):
    w = subprocess.Popen(wrapped("wait"), cwd=tmp_path, env=user_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = b""
    deadline = time.monotonic() + 60
    while b"ready" not in seen and time.monotonic() < deadline:
        seen += os.read(w.stdout.fileno(), 4096)
    w.send_signal(signal.SIGTERM)
    out, err = w.communicate(timeout=60)
    assert b"got SIGTERM, saving" in seen + out
    assert w.returncode == 0, err.decode()  # its handler's own exit, as bare


def test_stdin_is_the_commands_own(tmp_path):
    (tmp_path / "ask.py").write_text("name = input('name? ')\nprint('hello', name)\n")
    w = subprocess.run(
        [*hangwatch_argv(), "run", "-q", "--", sys.executable, "ask.py"],
        cwd=tmp_path,
        env=user_env(),
        input=b"Ada\n",
        capture_output=True,
        timeout=120,
    )
    assert w.returncode == 0 and w.stdout == b"name? hello Ada\n"


def test_a_prompt_nobody_answers_is_named_so_in_status_and_the_incident(tmp_path):
    import json

    (tmp_path / "prompt.py").write_text("print('ready', flush=True)\nanswer = input('continue? [y/N] ')\n")
    (tmp_path / "cfg.yaml").write_text("watchdog:\n  silence_timeout_s: 4\n  startup_timeout_s: 4\n")
    status: dict = {}

    def ask_status():
        r = subprocess.run(
            [*hangwatch_argv(), "status", "--json"], cwd=tmp_path, env=user_env(), capture_output=True, text=True
        )
        status.update(json.loads(r.stdout))

    w = in_terminal(
        [*hangwatch_argv(), "run", "cfg.yaml", "--", "python", "prompt.py"],
        tmp_path,
        user_env(),
        keys=[(b"[y/N]", ask_status), (b"hangwatch: stall", b"\x03")],
    )
    assert status["waiting_for_input"]["terminal"].startswith("/dev/")
    assert w.code == 130
    incident = json.loads(next((tmp_path / "runs" / "prompt" / "incidents").glob("*/incident.json")).read_text())
    assert "blocked reading its terminal" in incident["classification"]
    assert "blocked in C" not in incident["classification"]
