"""A configuration, data or disk error on one rank of a torchrun job ends the run at once, with that rank's code.

torchrun exits 1 whatever its failed rank exited with; the supervisor reads the ranks' last words
(`exit-rank<R>.json`) and torchrun's root-cause report instead, so `hangwatch run` exits 78, 65 or 74 after one
attempt, its state `failed`, and the incident and the summary it prints carry the rank's own message.

  * a torchrun job of one's own (tests/fixtures/user_scripts/rank_refuses.py, no torch) whose rank 1 leaves its
    last words and exits 78, 65 or 74 while rank 0 waits for it;
  * the same job whose rank 1 exits 78 without last words: torchrun's root-cause report decides;
  * the built-in worker under `worker.nproc_per_node: 2`, gloo on CPU, whose ranks refuse to resume a checkpoint
    one process wrote (a configuration error, exit 78, on every rank that reaches the check).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.user_shell import VENV_BIN, hangwatch_argv, incidents, run_hangwatch, user_env, worker_logs
from fixtures.fakes.workers import make_config, run_worker

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "user_scripts" / "rank_refuses.py"
KINDS = {78: "config_error", 65: "data_error", 74: "disk"}
MESSAGES = {
    78: "ConfigError: train.lr: -0.1 must be positive",
    65: "DataError: shard-3.jsonl: no usable example (412 lines, all without a completion)",
    74: "OSError: [Errno 28] No space left on device: '/scratch/ckpt/step-40.tmp'",
}


def launcher() -> list[str]:
    return ["torchrun"] if (VENV_BIN / "torchrun").exists() else ["python", "-m", "torch.distributed.run"]


def config() -> dict:
    return {
        "watchdog": {
            "startup_timeout_s": 180,
            "silence_timeout_s": 120,
            "term_grace_s": 3,
            "py_spy": False,
            "poll_interval_s": 0.1,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 3},
    }


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    return f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_logs(run_dir)}"


def spawned(run_dir: Path) -> int:
    """How many workers this supervisor spawned (its log's `worker_spawned` records)."""
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    return sum(1 for line in lines if json.loads(line).get("event") == "worker_spawned")


def summary_line(stderr: str, kind: str) -> str:
    """The line of the printed end summary that lists the incident."""
    found = [line for line in stderr.splitlines() if line.startswith("  incident ") and f"[{kind}]" in line]
    assert len(found) == 1, stderr[-4000:]
    return found[0]


def assert_failed_at_once(r: subprocess.CompletedProcess, run_dir: Path, code: int) -> dict:
    """Exit `code` after one attempt, no restart; returns the one incident."""
    why = explain(r, run_dir)
    assert r.returncode == code, why
    st = json.loads((run_dir / "state.json").read_text())
    assert (st["state"], st["exit_code"], st["restarts"]) == ("failed", code, 0), why
    assert spawned(run_dir) == 1, why
    assert f"run failed (exit {code})" in r.stderr, why
    found = incidents(run_dir)
    assert len(found) == 1, [(d.name, inc.get("summary")) for d, inc in found]
    inc = found[0][1]
    assert inc["kind"] == KINDS[code] and inc["culprit_rank"] == 1, inc.get("summary")
    assert inc["exit"]["code"] == 1, inc["exit"]  # torchrun's own exit: what the decision looked past
    assert inc["decision"]["action"] == "fail" and inc["decision"]["exit_code"] == code, inc["decision"]
    assert inc["decision"]["reason"].startswith(f"rank 1 exited {code}: "), inc["decision"]
    return inc


@pytest.mark.parametrize("code", [78, 65, 74])
def test_a_ranks_last_words_end_the_run_with_its_code(tmp_path, code):
    message = MESSAGES[code]
    r, run_dir = run_hangwatch(
        tmp_path,
        config(),
        [*launcher(), "--standalone", "--nproc-per-node", "2", str(SCRIPT), "--code", str(code), "--message", message],
        timeout=300,
    )
    inc = assert_failed_at_once(r, run_dir, code)
    assert (run_dir / "attempts" / "0001" / "exit-rank1.json").is_file()
    assert inc["summary"].startswith("rank 1: ") and message in inc["summary"], inc["summary"]
    assert inc["last_words_by_rank"]["1"]["message"] == message
    assert message in inc["decision"]["reason"]
    assert message in summary_line(r.stderr, KINDS[code])


def test_without_last_words_torchruns_report_names_the_rank_and_its_code(tmp_path):
    r, run_dir = run_hangwatch(
        tmp_path,
        config(),
        [
            *launcher(),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            "--code",
            "78",
            "--message",
            "refusing the config",
            "--no-last-words",
        ],
        timeout=300,
    )
    inc = assert_failed_at_once(r, run_dir, 78)
    assert not list((run_dir / "attempts" / "0001").glob("exit*.json"))
    words = "exit 78 (EX_CONFIG) per torchrun's root-cause report, no last words"
    assert inc["summary"] == f"rank 1: configuration error: {words}", inc["summary"]
    assert words in summary_line(r.stderr, "config_error")


def test_the_built_in_workers_ranks_refusing_a_resume_end_the_run_with_78(tmp_path):
    """A checkpoint of one process, then the same run dir with `worker.nproc_per_node: 2`: every rank that reaches
    the check refuses (the first refusal makes torchrun end the other rank), before any `start` beat."""
    path = make_config(
        tmp_path, train={"max_steps": 2, "warmup_steps": 1}, checkpoint={"every_steps": 2, "confirm_steps": 0}
    )
    run_dir = tmp_path / "run"
    assert run_worker(path, run_dir, log=tmp_path / "one.log") == 0, (tmp_path / "one.log").read_text()[-3000:]
    cfg = yaml.safe_load(path.read_text())
    cfg["worker"] = {"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}}
    cfg["watchdog"].update(startup_timeout_s=240, term_grace_s=3, poll_interval_s=0.1)
    cfg["restart"] = {"backoff_initial_s": 0, "max_restarts": 3}
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump(cfg))
    try:
        r = subprocess.run(  # --run-dir: this very run dir, though the config differs (continued, as asked)
            [*hangwatch_argv(), "run", str(two), "--run-dir", str(run_dir)],
            cwd=tmp_path,
            env=user_env(),
            capture_output=True,
            text=True,
            timeout=400,
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(
            f"hangwatch run did not finish\n{(e.stderr or '')[-3000:]}\n{worker_logs(run_dir)}"
        ) from None
    why = explain(r, run_dir)
    assert r.returncode == 78, why
    st = json.loads((run_dir / "state.json").read_text())
    assert (st["state"], st["exit_code"], st["restarts"]) == ("failed", 78, 0), why
    assert spawned(run_dir) == 1, why  # attempt 1 was the lone process's, outside the supervisor
    found = incidents(run_dir)
    assert len(found) == 1, [(d.name, inc.get("summary")) for d, inc in found]
    inc = found[0][1]
    refusal = "this run's checkpoints were made by 1 rank(s) and this worker is one of 2"
    assert inc["kind"] == "config_error" and refusal in inc["summary"], inc["summary"]
    assert inc["decision"]["exit_code"] == 78 and refusal in inc["decision"]["reason"], inc["decision"]
    assert refusal in summary_line(r.stderr, "config_error")
