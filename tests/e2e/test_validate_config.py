"""`hangwatch validate-config` and `hangwatch run` as a user meets them: a config that cannot work is
refused (exit 78, the key, its line) before any worker starts; a directory as CONFIG is a config error,
not a usage error; a finished run typed again runs again in a run dir of its own, and started again by systemd it
is reported, not trained again (exit 0, with how to start afresh); a failed or stopped one continues."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

from fixtures.fakes.sup_harness import attempts, state, write_config
from fixtures.fakes.workers import make_config

REPO = Path(__file__).resolve().parents[2]


# What says a machine, not a person, started us (`cli.rerun.started_by`): never inherited from the test's own start
STARTERS = ("HANGWATCH_", "NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "SLURM_")


def hangwatch(
    *args, cwd: Path = REPO, timeout: float = 120, extra_env: Optional[dict] = None
) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "hangwatch"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(STARTERS)}
    env.update(extra_env or {})
    return subprocess.run([*argv, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_a_missing_train_file_is_refused_before_anything_starts(tmp_path):
    cfg = make_config(tmp_path, data={"train": str(tmp_path / "data" / "gone.jsonl")})
    run_dir = tmp_path / "run"
    line = next(i for i, text in enumerate(cfg.read_text().splitlines(), 1) if "gone.jsonl" in text)
    for command in ("validate-config", "run"):
        r = hangwatch(command, cfg)
        assert r.returncode == 78, r.stderr
        assert r.stderr.splitlines() == [
            "hangwatch: invalid configuration (1 problem):",
            f"  {cfg}:{line}: data.train: {tmp_path / 'data' / 'gone.jsonl'}: no such file",
        ]
        assert not run_dir.exists()  # no worker, no attempts/, not even a run dir


def test_validate_config_reports_every_problem_in_file_order(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "run_dir: runs/x\nrestart:\n  backoff_initial_s: 100\n  backoff_max_s: 1\ndata:\n  train: train.jsonl\n"
    )
    r = hangwatch("validate-config", cfg)
    assert (r.returncode, r.stdout) == (78, "")
    assert r.stderr.splitlines()[1:] == [
        f"  {cfg}:3: restart.backoff_initial_s: 100 exceeds restart.backoff_max_s (1): the first backoff delay cannot "
        "be larger than the cap it doubles towards"
    ]
    cfg.write_text(
        "run_dir: runs/x\nmodel:\n  name_or_path: models/none\ndata:\n  train: train.jsonl\n  eval: eval.jsonl\n"
    )
    r = hangwatch("validate-config", cfg)
    assert r.returncode == 78
    assert [ln.split(": ", 2)[:2] for ln in r.stderr.splitlines()[1:]] == [
        [f"  {cfg}:3", "model.name_or_path"],
        [f"  {cfg}:5", "data.train"],
        [f"  {cfg}:6", "data.eval"],
    ]
    assert "hangwatch never downloads a model" in r.stderr


def test_duplicate_keys_exit_78_with_both_lines(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("worker:\n  command: [python3, x.py]\nwatchdog:\n  silence_timeout_s: 10\n  silence_timeout_s: 20\n")
    r = hangwatch("validate-config", cfg)
    assert r.returncode == 78
    assert r.stderr.splitlines()[1] == (
        f"  {cfg}:5: watchdog.silence_timeout_s: duplicate key (first at line 4); YAML "
        "would silently keep only the last one: remove one of them"
    )


def test_a_directory_or_a_missing_file_as_config_exits_78_not_64(tmp_path):
    for command in ("validate-config", "run"):
        r = hangwatch(command, tmp_path)
        assert (r.returncode, r.stderr) == (
            78,
            "hangwatch: invalid configuration (1 problem):\n"
            f"  {tmp_path}: is a directory; give the config file (a .yaml) inside it\n",
        )
        r = hangwatch(command, tmp_path / "nope.yaml")
        assert r.returncode == 78 and f"{tmp_path / 'nope.yaml'}: no such config file" in r.stderr


def test_warnings_go_to_stderr_and_the_config_is_still_ok(tmp_path):
    cfg = make_config(tmp_path)  # eval.prompts with eval.every_steps 0: legal, but never used
    r = hangwatch("validate-config", cfg)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK: {cfg}\n")
    assert "hangwatch: warning: " in r.stderr and "eval.prompts: never generated: eval.every_steps is 0" in r.stderr


def test_a_finished_run_is_reported_to_systemd_and_runs_again_for_a_person(tmp_path):
    cfg, run_dir = write_config(tmp_path, "ok")
    first = hangwatch("run", cfg)
    assert first.returncode == 0, first.stderr[-3000:]
    assert state(run_dir)["state"] == "finished"
    before = (len(attempts(run_dir)), (run_dir / "state.json").read_bytes())
    # systemd starts it again (Restart=always, a reboot): reported, not trained again, and not a failure
    again = hangwatch("run", cfg, cwd=tmp_path, extra_env={"INVOCATION_ID": "0123456789abcdef"})
    assert again.returncode == 0, again.stderr
    first_line = again.stderr.splitlines()[0]
    assert first_line.startswith("hangwatch: run already finished (at step ") and (
        "this same run, started again by systemd — reported, nothing started." in first_line
    ), first_line
    hint = next(line for line in again.stderr.splitlines() if "to run it again from the start:" in line)
    assert hint.endswith(f"hangwatch run --run-dir run-new {cfg}"), hint
    assert (len(attempts(run_dir)), (run_dir / "state.json").read_bytes()) == before  # nothing ran, nothing changed
    # a person types it again: it runs again, from the start, in a run dir of its own — said first
    person = hangwatch("run", cfg, cwd=tmp_path)
    assert person.returncode == 0, person.stderr[-3000:]
    assert person.stderr.splitlines()[0].startswith("hangwatch: run holds this same run, finished (at step "), (
        person.stderr[:600]
    )
    assert "it runs again, in run-2" in person.stderr.splitlines()[0]
    assert state(tmp_path / "run-2")["state"] == "finished" and len(attempts(tmp_path / "run-2")) == 1
    assert (len(attempts(run_dir)), (run_dir / "state.json").read_bytes()) == before


def test_a_stopped_or_failed_run_continues_and_says_so(tmp_path):
    cfg, run_dir = write_config(tmp_path, "ok")
    run_dir.mkdir()
    for previous, attempt in (("stopped", 1), ("failed", 2)):
        (run_dir / "state.json").write_text(json.dumps({"state": previous, "attempt": attempt}))
        r = hangwatch("run", cfg, cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        where = "the start" if attempt == 1 else "ckpt-"  # the second: the first's last good checkpoint
        assert r.stderr.splitlines()[0].startswith(
            f"hangwatch: continuing the {previous} run in run: attempt {attempt}, from {where}"
        ), r.stderr[:600]
        assert state(run_dir)["state"] == "finished"
    assert len(attempts(run_dir)) == 2


def test_a_finished_continuous_run_takes_new_inbox_files(tmp_path):
    """In continuous mode a finished run can have new work (files in the inbox): no hint, it runs."""
    from hangwatch.common.config import load_config
    from hangwatch.supervisor.cli import rerun

    cfg_path = make_config(tmp_path, data={"train": None, "inbox": True})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "state.json").write_text(json.dumps({"state": "finished", "last_good_step": 7}))
    inbox = load_config(cfg_path)
    service = {"INVOCATION_ID": "1"}
    assert not rerun.plan(inbox.model_dump(mode="json"), inbox.run_dir, [str(cfg_path)], True, service).finished
    plain = load_config(make_config(tmp_path, "plain.yaml"))
    where = rerun.plan(plain.model_dump(mode="json"), plain.run_dir, ["plain.yaml"], environ=service)
    assert where.finished and f"{run_dir} already finished (at step 7)" in where.lines[0]


# ---- the built-in worker's ranks against the GPUs it will see (NVML faked by a `pynvml` first on PYTHONPATH) -------

FAKE_PYNVML = '''"""A stand-in for nvidia-ml-py: this machine has {n} GPUs ({init})."""
class NVMLError(Exception):
    pass
UUIDS = ["GPU-%08x-0000-0000-0000-000000000000" % i for i in range({n})]
def nvmlInit():
    if {fails!r}:
        raise NVMLError("Driver Not Loaded")
def nvmlShutdown():
    pass
def nvmlDeviceGetCount():
    return len(UUIDS)
def nvmlDeviceGetHandleByIndex(i):
    return i
def nvmlDeviceGetUUID(handle):
    return UUIDS[handle]
'''


def with_nvml(tmp_path: Path, n: int, fails: bool = False) -> dict:
    """The environment of a hangwatch whose `import pynvml` finds a machine with `n` GPUs (or no driver)."""
    where = tmp_path / "fake-nvml"
    where.mkdir(exist_ok=True)
    (where / "pynvml.py").write_text(FAKE_PYNVML.format(n=n, fails=fails, init="no driver" if fails else "NVML works"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGWATCH_", "NOTIFY_SOCKET", "CUDA_VISIBLE"))}
    env["PYTHONPATH"] = os.pathsep.join([str(where), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def hangwatch_with(env: dict, *args) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "hangwatch"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]
    return subprocess.run([*argv, *map(str, args)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_more_ranks_than_the_worker_sees_gpus_is_refused_before_anything_starts(tmp_path):
    cfg = make_config(
        tmp_path, model={"device": "cuda"}, worker={"nproc_per_node": 2, "env": {"CUDA_VISIBLE_DEVICES": "0"}}
    )
    line = next(i for i, text in enumerate(cfg.read_text().splitlines(), 1) if "nproc_per_node" in text)
    env = with_nvml(tmp_path, 4)
    words = (
        "worker.nproc_per_node: 2, but the worker sees 1 GPU (CUDA_VISIBLE_DEVICES=0 in worker.env; NVML counts 4 "
        "on this machine): NCCL needs one GPU per rank"
    )
    for command in ("validate-config", "run"):
        r = hangwatch_with(env, command, cfg)
        assert r.returncode == 78, r.stderr
        assert r.stderr.splitlines() == [
            "hangwatch: invalid configuration (1 problem):",
            f"  {cfg}:{line}: {words}; set worker.nproc_per_node: 1 or make more GPUs visible",
        ]
        assert not (tmp_path / "run").exists()  # nothing started
    r = hangwatch_with(env, "doctor", cfg, "--cheap", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    placement = next(f for f in json.loads(r.stdout)["findings"] if f["check"] == "device placement")
    assert (placement["status"], placement["summary"]) == ("FAIL", words)


def test_enough_gpus_or_no_nvml_is_accepted(tmp_path):
    cfg = make_config(
        tmp_path, model={"device": "cuda"}, worker={"nproc_per_node": 2, "env": {"CUDA_VISIBLE_DEVICES": "1,3"}}
    )
    r = hangwatch_with(with_nvml(tmp_path, 4), "validate-config", cfg)
    assert r.returncode == 0 and r.stdout.startswith(f"OK: {cfg}"), r.stderr
    r = hangwatch_with(with_nvml(tmp_path, 4, fails=True), "validate-config", cfg)  # no driver: nothing is known
    assert r.returncode == 0 and r.stdout.startswith(f"OK: {cfg}"), r.stderr
