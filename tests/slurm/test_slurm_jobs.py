"""hangwatch in real Slurm jobs on the one-host test cluster (tests/slurm/conftest.py): `sbatch` a job whose step
is `srun hangwatch run CONFIG` — the built-in worker on the tiny model — and read both the run dir and Slurm's
own record of the job.

* a hang inside a job: caught, the tree killed, a restart from the checkpoint, the job COMPLETED; `hangwatch
  status` answers from the job's node (`srun --jobid … --overlap`) while the job runs;
* `scancel`: Slurm's SIGTERM reaches the step, the worker checkpoints, state.json says `stopped` and who stopped
  it (`scancel of job N`), the job is CANCELLED; the same job script submitted again resumes from that checkpoint
  and COMPLETES;
* the time-limit warning (`--signal=USR1@50`) with `--requeue`: hangwatch checkpoints, stops and exits 75, the
  job script requeues the job (`scontrol requeue`), and the requeued job resumes from that checkpoint without a
  person; in the end the job COMPLETES with Restarts ≥ 1 and the completion log holds its requeue.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fixtures.fakes.workers import PYTHON, ROOT, make_config

from hangwatch.common.rundir import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.slurm, pytest.mark.timeout(420)]

HANGWATCH = f"{PYTHON} -m hangwatch.supervisor"


def config(tmp_path: Path, **overrides) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    settings = {
        "run_dir": str(run_dir),
        "watchdog": {
            "startup_timeout_s": 180,
            "silence_timeout_s": 60,
            "step_timeout_s": 30,
            "dump_grace_s": 2,
            "term_grace_s": 5,
            "py_spy": False,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 5},
        "checkpoint": {"every_steps": 4, "keep_last": 3, "confirm_steps": 1},
    }
    for key, value in overrides.items():
        settings[key] = {**settings.get(key, {}), **value} if isinstance(value, dict) else value
    return make_config(tmp_path, **settings), run_dir


def job_script(tmp_path: Path, cfg: Path, *, time_limit: str = "5", sbatch: tuple = (), after: str = "") -> Path:
    """`srun hangwatch run CFG` as the job's one step; output appended to job-<id>.out (a requeue's run too)."""
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=hangwatch-test",
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={tmp_path}/job-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={ROOT}",
        *[f"#SBATCH {opt}" for opt in sbatch],
        'echo "job $SLURM_JOB_ID run ${SLURM_RESTART_COUNT:-0} on $(hostname)"',
        f"srun --ntasks-per-node=1 --kill-on-bad-exit=1 {HANGWATCH} run {cfg}",
        "rc=$?",
        'echo "hangwatch exited $rc"',
        after,
        "exit $rc",
    ]
    path = tmp_path / "job.sh"
    path.write_text("\n".join(lines) + "\n")
    return path


def output(tmp_path: Path, job: str) -> str:
    f = tmp_path / f"job-{job}.out"
    return f.read_text(errors="replace") if f.exists() else ""


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def attempts(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "attempts").iterdir() if p.is_dir())


def beats(attempt: Path) -> list[dict]:
    return read_jsonl(attempt / "heartbeat-rank0.jsonl")


def first(attempt: Path, event: str) -> dict:
    return next(b for b in beats(attempt) if b.get("event") == event)


def checkpoints(attempt: Path) -> list[int]:
    return [int(b["step"]) for b in beats(attempt) if b.get("event") == "checkpoint"]


def resumed_step(attempt: Path):
    """The step of the checkpoint the attempt's start line says it resumed from (None: from scratch)."""
    path = first(attempt, "start").get("resumed_from")
    return None if path is None else int(Path(path).name.split("-")[-1])


def wait_for(pred, what: str, timeout: float, on_fail=lambda: "") -> None:
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s\n{on_fail()}")
        time.sleep(0.5)


def saved_checkpoint(run_dir: Path) -> bool:
    try:
        return state(run_dir).get("last_good_step") is not None
    except (OSError, ValueError):
        return False


def test_a_hang_inside_a_job_is_caught_and_the_job_completes(slurm, tmp_path):
    cfg, run_dir = config(
        tmp_path,
        watchdog={"step_timeout_s": 10},
        train={"max_steps": 12, "sleep_per_step_s": 0.3},
        faults=[{"kind": "busy_loop", "at_step": 7}],
    )
    job = slurm.sbatch(job_script(tmp_path, cfg))
    why = lambda: output(tmp_path, job)[-3000:] + slurm.logs()  # noqa: E731
    slurm.wait(job, states=("RUNNING",) + tuple(s for s in ("COMPLETED", "FAILED", "CANCELLED")), timeout=60)

    # `hangwatch status` from the job's node, inside the job's allocation, while the job runs
    answered = {}

    def status_answers() -> bool:
        done = slurm.run(
            "srun", f"--jobid={job}", "--overlap", "--ntasks=1", *HANGWATCH.split(), "status", "--run-dir",
            str(run_dir), "--json", timeout=60, check=False,
        )  # fmt: skip
        if done.returncode == 0 and done.stdout.strip().startswith("{"):
            reply = json.loads(done.stdout)
            if reply.get("source") != "state.json":  # the supervisor itself, over its socket: not its last record
                answered.update(reply)
                return True
        return slurm.state(job) != "RUNNING"

    wait_for(status_answers, "hangwatch status from the job's node", 120, why)
    assert answered, f"the job ended before status answered\n{why()}"
    assert answered["state"] in ("starting", "running", "stalled", "dumping", "killing", "backoff"), answered

    record = slurm.wait(job, timeout=300)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", why()
    assert slurm.completions(job) == ["COMPLETED"]
    st = state(run_dir)
    assert st["state"] == "finished", st
    first_try, second_try = attempts(run_dir)
    incidents = sorted((run_dir / "incidents").iterdir())
    assert len(incidents) == 1 and incidents[0].name.endswith("-stall"), incidents
    inc = json.loads((incidents[0] / "incident.json").read_text())
    assert inc["deadline"]["name"] == "step" and "busy loop" in inc["classification"], inc["classification"]
    assert inc["decision"]["action"] == "restart"
    assert resumed_step(second_try) == max(checkpoints(first_try)) == 4
    assert max(b.get("step", 0) for b in beats(second_try) if b.get("event") == "step") == 12


def test_scancel_stops_with_a_checkpoint_and_the_job_submitted_again_resumes(slurm, tmp_path):
    cfg, run_dir = config(tmp_path, train={"max_steps": 30, "sleep_per_step_s": 0.3})
    script = job_script(tmp_path, cfg)
    job = slurm.sbatch(script)
    why = lambda: output(tmp_path, job)[-3000:] + slurm.logs()  # noqa: E731
    wait_for(lambda: saved_checkpoint(run_dir), "a first checkpoint", 180, why)

    slurm.run("scancel", job)
    record = slurm.wait(job, timeout=120)
    assert record["JobState"] == "CANCELLED", why()
    assert slurm.completions(job) == ["CANCELLED"]
    st = state(run_dir)
    assert st["state"] == "stopped", st
    assert f"SIGTERM from Slurm (scancel of job {job})" in st["why"], st["why"]
    (only,) = attempts(run_dir)
    saved = checkpoints(only)
    stop = [b for b in beats(only) if b.get("event") == "stop"]
    assert stop and stop[-1]["reason"] == "terminated", stop  # the worker's own stop on SIGTERM, not a kill
    # the checkpoint the worker wrote on Slurm's SIGTERM, after the last periodic one: the next run's start
    assert saved and saved[-1] >= st["last_good_step"] and saved[-1] < 30, (saved, st["last_good_step"])

    again = slurm.sbatch(script)  # the same script, unedited: the run resumes
    record = slurm.wait(again, timeout=300)
    assert record["JobState"] == "COMPLETED", output(tmp_path, again)[-3000:]
    assert slurm.completions(again) == ["COMPLETED"]
    first_try, second_try = attempts(run_dir)
    assert first_try == only
    assert resumed_step(second_try) == saved[-1]
    assert state(run_dir)["state"] == "finished"


def test_the_time_limit_warning_checkpoints_stops_and_the_requeued_job_resumes(slurm, tmp_path):
    # The warning comes 50-80 s before the 2-minute limit (Slurm checks time limits every 30 s).  The training's
    # sleeps alone (480 × 0.25 s) outlast the limit, so the first run cannot finish before it is warned, however
    # fast the machine.  A requeued run that is warned again is requeued again: the test follows the job to its end.
    cfg, run_dir = config(tmp_path, train={"max_steps": 480, "sleep_per_step_s": 0.25}, checkpoint={"every_steps": 20})
    script = job_script(
        tmp_path,
        cfg,
        time_limit="2",
        sbatch=("--signal=USR1@50", "--requeue"),
        after='[ "$rc" -eq 75 ] && scontrol requeue "$SLURM_JOB_ID"',
    )
    job = slurm.sbatch(script)
    why = lambda: output(tmp_path, job)[-4000:] + slurm.logs()  # noqa: E731
    record = slurm.wait(job, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=380)
    assert record["JobState"] == "COMPLETED", why()
    restarts = int(record["Restarts"])
    assert restarts >= 1, record
    ends = slurm.completions(job)
    assert ends[-1] == "COMPLETED" and len(ends) == restarts + 1, ends  # one record per requeue, then the end
    out = output(tmp_path, job)
    assert out.count("hangwatch exited 75") == restarts, out[-3000:]

    tries = attempts(run_dir)
    assert len(tries) == restarts + 1, tries  # one attempt per run of the job: no hang, no restart within one
    for stopped, resumed in zip(tries, tries[1:]):
        stop = [b for b in beats(stopped) if b.get("event") == "stop"]
        assert stop and stop[-1]["reason"] == "terminated", stop
        assert resumed_step(resumed) == checkpoints(stopped)[-1], (stopped.name, checkpoints(stopped))
    log = [json.loads(x) for x in (run_dir / "supervisor.log").read_text().splitlines() if x.startswith("{")]
    asked = [e for e in log if e.get("event") == "stop_requested"]
    assert len(asked) == restarts and all(e["intent"] == "requeue" for e in asked), asked
    assert all(f"SIGUSR1 in Slurm job {job} (running" in e["why"] for e in asked), asked
    assert state(run_dir)["state"] == "finished"
