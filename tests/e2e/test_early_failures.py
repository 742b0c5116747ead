"""A command that fails before it gets anywhere, as a person meets it with `hangwatch run -- …`: not retried into
the ground, and the command's own words are where the person reads.

  * a script that is not there (`python nosuch.py`, `python -u …`, `torchrun … nosuch.py`): refused at once, the
    file and the directory it was looked up in named, nothing started;
  * an argparse typo (`--stpes 3`): at most two attempts, the usage error quoted in the incident (its summary and
    `last_output`) and in the summary on stderr at the end;
  * a script that prints its complaint and `sys.exit(3)`s before any progress: two attempts.
No config file: `hangwatch run -- …` from a fresh working directory, the venv on PATH.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import hangwatch_argv, incidents, user_env, worker_logs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TRAIN = """\
import argparse
parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()
for step in range(1, args.steps + 1):
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
"""

CONFIGURED = """\
import os, sys
print(f"loading the config (pid {os.getpid()})", flush=True)
print("config.yaml: no learning rate given (lr)", file=sys.stderr, flush=True)
sys.exit(3)
"""

USAGE_ERROR = "train.py: error: unrecognized arguments: --stpes 3"


def hangwatch_run(cwd: Path, *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [*hangwatch_argv(), "run", "--", *cmd],
            cwd=cwd,
            env=user_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"hangwatch run did not end in {timeout}s (retried into the ground?)\n{(e.stderr or '')[-3000:]}"
        ) from None


def attempts(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "attempts").glob("[0-9]" * 4))


@pytest.fixture
def here(tmp_path: Path) -> Path:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "configured.py").write_text(CONFIGURED)
    return tmp_path


@pytest.mark.parametrize(
    "cmd, word",
    [
        (["python", "nosuch.py"], "worker.command.1"),
        (["python", "-u", "nosuch.py", "--steps", "3"], "worker.command.2"),
        (["torchrun", "--nproc-per-node", "1", "nosuch.py"], "worker.command.3"),
    ],
    ids=["python", "python-u", "torchrun"],
)
def test_a_missing_script_is_refused_at_once_and_nothing_starts(here, cmd, word):
    if cmd[0] == "torchrun" and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("no torchrun in this environment")
    r = hangwatch_run(here, *cmd, timeout=60)
    assert r.returncode == 78, r.stderr
    assert f"{word}: 'nosuch.py': no such file in {here} (where the command runs: worker.cwd)" in r.stderr, r.stderr
    assert not (here / "runs").exists()  # nothing started, no run dir made


def test_an_argparse_typo_ends_at_the_second_attempt_with_the_usage_error_quoted(here):
    r = hangwatch_run(here, "python", "train.py", "--stpes", "3")
    run_dir = here / "runs" / "train"
    assert r.returncode == 2, r.stderr  # the command's own exit status
    assert len(attempts(run_dir)) == 2, (r.stderr[-3000:], worker_logs(run_dir))
    found = [inc for _, inc in incidents(run_dir)]
    assert [i["kind"] for i in found] == ["crash", "crash"], [(i["kind"], i.get("summary")) for i in found]
    last = found[-1]
    assert last["decision"]["action"] == "fail", last["decision"]
    assert "the same end twice in a row before any progress (exit code 2" in last["decision"]["reason"]
    assert last["last_output"][-2:] == ["usage: train.py [-h] [--steps STEPS]", USAGE_ERROR], last["last_output"]
    assert USAGE_ERROR in last["summary"] and last["repeated"] == found[0]["id"]
    # …and in the summary printed at the end, after the incidents
    lines = r.stderr.splitlines()
    at = lines.index(f"  its output ended (attempt 2, incident {last['id']}):")
    assert lines[at + 1 : at + 3] == ["    usage: train.py [-h] [--steps STEPS]", f"    {USAGE_ERROR}"], lines[at:]
    assert any(line.startswith(f"  incident {last['id']} [crash]") and USAGE_ERROR in line for line in lines)

    # the typo corrected: another command line, so a run dir of its own, said on the screen; the failed run's
    # attempts and incidents stay where they were
    fixed = hangwatch_run(here, "python", "train.py", "--steps", "3")
    assert fixed.returncode == 0, fixed.stderr
    assert "runs/train holds a failed run of another command or other arguments: this run goes to runs/train-2" in (
        fixed.stderr
    )
    assert fixed.stdout == "step 1 loss 1.000\nstep 2 loss 0.500\nstep 3 loss 0.333\n"
    again = here / "runs" / "train-2"
    assert len(attempts(again)) == 1 and incidents(again) == []
    assert len(attempts(run_dir)) == 2 and len(incidents(run_dir)) == 2


def test_the_same_complaint_and_exit_code_before_any_progress_twice_ends_the_run(here):
    r = hangwatch_run(here, "python", "configured.py")
    run_dir = here / "runs" / "configured"
    assert r.returncode == 3, r.stderr
    assert len(attempts(run_dir)) == 2, (r.stderr[-3000:], worker_logs(run_dir))
    last = [inc for _, inc in incidents(run_dir)][-1]
    assert "the same end twice in a row before any progress (exit code 3" in last["decision"]["reason"]
    first, said = last["last_output"]
    assert first.startswith("loading the config (pid ") and said == "config.yaml: no learning rate given (lr)"
    # its pid moved between the two attempts: the same end all the same
    assert "    config.yaml: no learning rate given (lr)" in r.stderr.splitlines()
