"""`hangwatch run -- CMD` as a person runs it in a terminal (a real pseudo-terminal): it behaves like CMD.

  * the script's own output is on the screen as it runs, a line says where attempt 2 began, and it is in
    worker.log too; `--hide-output` keeps it off the screen, `-q` keeps hangwatch's own lines off;
  * the exit status: 0 finished, 79 (do not retry) when the same error twice ended it at the second;
  * a rerun with other arguments goes to a run dir of its own (`runs/<script>-2`); the same command again after it
    finished runs again in a run dir of its own (said), and started again by systemd it is reported, not trained
    again (exit 0), with a hint that works as printed;
  * `status`, `logs`, `incidents` find the run without `--run-dir`, and `status` of a finished run exits 0;
  * a `generate()` that hangs after a few quick ones is caught within the budget the run taught it (seconds), not
    the default 300 s.
No config file anywhere: `hangwatch run -- …` from a fresh working directory, the venv on PATH.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from fixtures.fakes.user_shell import hangwatch_argv, incidents, user_env

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "fixtures" / "user_scripts"
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCRIPT = """\
import os, sys, time
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 3
attempt = int(os.environ.get("HANGWATCH_ATTEMPT", "1"))
print(f"hello from the script, attempt {attempt}", flush=True)
for step in range(1, steps + 1):
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
    time.sleep(0.05)
if "--fail-once" in sys.argv and attempt == 1:
    raise RuntimeError("the first attempt fails")
if "--always-fail" in sys.argv:
    open(os.environ.get("MISSING_FILE", "data/trian.jsonl"))  # a typo'd path: the same error every time
print("done", flush=True)
"""


def person_env() -> dict:
    """A person's shell: nothing that says a service manager or a batch scheduler started us (`cli.rerun`)."""
    return {k: v for k, v in user_env().items() if k not in ("INVOCATION_ID", "JOURNAL_STREAM") and "SLURM" not in k}


def in_terminal(argv: list[str], cwd: Path, timeout: float = 180, env: Optional[dict] = None) -> tuple[int, str]:
    """Run `argv` with a pseudo-terminal as its stdin, stdout and stderr, as a shell runs it; (exit status, the
    screen's text)."""
    master, slave = pty.openpty()
    env = person_env() if env is None else env
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
                raise AssertionError(f"{argv} did not end in {timeout}s:\n" + b"".join(chunks).decode(errors="replace"))
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the terminal's other end is closed
                    data = b""
                if not data and proc.poll() is not None:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                continue  # drain what is left, then EIO ends it
    finally:
        os.close(master)
    return proc.wait(), b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def plain(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """A client command as a user types it, in `cwd` (no --run-dir)."""
    return subprocess.run(
        [*hangwatch_argv(), *args], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(SCRIPT)
    return tmp_path


def run(here: Path, *cmd: str, options: tuple = (), env: Optional[dict] = None) -> tuple[int, str]:
    return in_terminal([*hangwatch_argv(), "run", *options, "--", sys.executable, "train.py", *cmd], here, env=env)


def test_the_scripts_output_is_on_the_screen_and_attempt_two_says_where_it_began(here):
    rc, screen = run(here, "--steps", "3", "--fail-once")
    assert rc == 0, screen
    first = screen.index("hello from the script, attempt 1")
    for line in ("step 1 loss 1.000", "step 3 loss 0.333", "RuntimeError: the first attempt fails"):
        assert line in screen, screen
    second = screen.index("hangwatch: ──── attempt 2 ────")
    assert first < screen.index("RuntimeError: the first attempt fails") < second
    assert second < screen.index("hello from the script, attempt 2") < screen.index("done")
    assert "run finished (exit 0) after 2 attempt(s)" in screen  # the summary comes after all of the output
    assert screen.index("done") < screen.index("run finished (exit 0)")
    log = (here / "runs" / "train" / "attempts" / "0002" / "worker.log").read_text()
    assert "hello from the script, attempt 2" in log and "done" in log  # …and the log has it as before
    # --hide-output: the summary, not the script's output; -q: the script's output, no word of hangwatch's
    rc, hidden = run(here, "--steps", "2", options=("--hide-output", "--run-dir", "runs/hidden"))
    assert rc == 0, hidden
    assert "hello from the script" not in hidden and "run finished (exit 0)" in hidden
    rc, quiet = run(here, "--steps", "2", options=("-q", "--run-dir", "runs/quiet"))
    assert rc == 0, quiet
    assert "hello from the script" in quiet and "hangwatch" not in quiet


def test_the_exit_status_is_the_runs_and_the_same_error_twice_ends_it(here):
    rc, screen = run(here, "--steps", "2", "--always-fail")
    assert rc == 79, screen
    assert screen.count("FileNotFoundError") >= 2, screen  # both attempts' own tracebacks, on the screen
    found = [inc for _, inc in incidents(here / "runs" / "train")]
    assert [i["kind"] for i in found] == ["crash", "crash"], [(i["kind"], i.get("summary")) for i in found]
    assert "the same failure twice in a row" in found[1]["decision"]["reason"], found[1]["decision"]
    assert "data/trian.jsonl" in found[1]["decision"]["reason"]
    status = plain(here, "status")
    assert status.returncode == 0 and "failed" in status.stdout, (status.stdout, status.stderr)


def test_reruns_tell_the_truth_and_clients_find_the_run_without_run_dir(here):
    rc, first = run(here, "--steps", "3")
    assert rc == 0, first
    # other arguments: a run of its own, said on the screen
    rc, other = run(here, "--steps", "5")
    assert rc == 0, other
    assert "runs/train holds a finished run of another command or other arguments: this run goes to runs/train-2" in (
        other
    )
    assert "step 5 loss" in other and json.loads((here / "runs/train-2/state.json").read_text())["state"] == "finished"
    # the same command again, typed by a person: it runs again, in a run dir of its own, said first
    rc, again = run(here, "--steps", "5")
    assert rc == 0, again
    assert "runs/train-2 holds this same run, finished (at step 5" in again and "it runs again, in runs/train-3" in (
        again
    )
    assert "step 5 loss" in again and json.loads((here / "runs/train-3/state.json").read_text())["state"] == "finished"
    # started again by systemd: reported, not trained again, exit 0; a hint that works as printed
    rc, service = run(here, "--steps", "5", env={**person_env(), "INVOCATION_ID": "0123456789abcdef"})
    assert rc == 0, service
    assert "runs/train-3 already finished (at step 5" in service and "started again by systemd" in service, service
    assert "nothing started" in service and "hello from the script" not in service
    hint = next(line for line in service.splitlines() if "to run it again from the start:" in line)
    argv = hint.split("to run it again from the start: ", 1)[1].split()
    assert argv[:4] == ["hangwatch", "run", "--run-dir", "runs/train-3-new"] and argv[4] == "--", hint
    rc, fresh = in_terminal([*hangwatch_argv(), *argv[1:]], here)
    assert rc == 0 and "step 5 loss" in fresh, fresh

    # the clients, told nothing: the most recent run, said which; status of a finished run exits 0
    status = plain(here, "status")
    assert status.returncode == 0, (status.stdout, status.stderr)
    assert "finished" in status.stdout and "runs/train-3-new" in status.stderr, (status.stdout, status.stderr)
    logs = plain(here, "logs")
    assert logs.returncode == 0 and "step 5 loss" in logs.stdout and "done" in logs.stdout, logs.stderr
    listed = plain(here, "incidents")
    assert listed.returncode == 0 and "no incidents" in listed.stdout, (listed.stdout, listed.stderr)
    nothing = plain(here / "runs", "status")  # no ./runs/ there: the error says what to pass
    assert nothing.returncode == 64 and "--run-dir" in nothing.stderr, nothing.stderr


def test_a_hung_generate_is_caught_within_the_budget_the_run_taught_it(tmp_path):
    pytest.importorskip("transformers")
    script = SCRIPTS / "generate_loop.py"
    cmd = [sys.executable, str(script), "--steps", "14", "--sample-every", "2", "--hang-on", "4", "--marker", "m"]
    rc, screen = in_terminal([*hangwatch_argv(), "run", "--", *cmd], tmp_path, timeout=240)
    assert rc == 0, screen
    (stall,) = [inc for _, inc in incidents(tmp_path / "runs" / "generate_loop")]
    deadline = stall["deadline"]
    assert stall["phase"] == "generate" and deadline["name"] == "phase", stall.get("summary")
    # three quick generates taught it: a budget of seconds (5 × the longest, at least 10 s), not the default 300 s
    assert deadline["source"].startswith("learned: 5 × longest"), deadline
    assert deadline["budget_s"] < 30, deadline
    assert "in generate()" in stall["summary"], stall["summary"]
    assert "sample 7:" in screen  # the run went on and finished
