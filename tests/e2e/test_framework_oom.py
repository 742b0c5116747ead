"""Unedited HF Trainer, TRL SFTTrainer, Lightning and plain-loop scripts that run out of memory, under
`hangwatch run CONFIG --run-dir run -- python SCRIPT`, exactly as a user starts them.  Their device is faked on the CPU
(tests/fixtures/user_scripts/capped_device.py): it raises torch's OutOfMemoryError, in torch's words, at the first
layer's allocation that does not fit — a per-device batch of 4 fails, 2 fits.

  * HF Trainer, TRL SFTTrainer, Lightning (a `batch_size` attribute): exactly one restart; the second attempt's
    per-device batch is half and its accumulation double, as the script itself saw them (`trainer.args`,
    `trainer.accumulate_grad_batches`, the DataLoader's batch size); the same examples in each optimizer step (HF:
    every step against an uninstrumented run of the same script at batch 4; TRL and Lightning: the failed batch
    against the second attempt's first step); `framework-remediation.json`, the incident and state.json say it.
  * OOM at per-device batch 1 after one halving: the run ends, saying so.
  * Lightning with the DataLoader passed to fit(), and a plain loop: nothing to change, so the second identical OOM
    ends the run, and the incident names what to lower and the figures of the error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import incidents, run_hangwatch, user_env, worker_logs

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "fixtures" / "user_scripts"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CONFIG = {
    "watchdog": {
        "startup_timeout_s": 120,
        "silence_timeout_s": 60,
        "first_steps_timeout_s": 60,
        "dump_grace_s": 2,
        "term_grace_s": 2,
        "py_spy": False,
        "poll_interval_s": 0.1,
    },
    "restart": {"backoff_initial_s": 0, "max_restarts": 4},
}
FIGURES = "Tried to allocate 1.0 GiB; 2.5 GiB allowed; 2.0 GiB already allocated by PyTorch"


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    return f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_logs(run_dir)}"


def entries(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_process(recs: list[dict]) -> list[list[dict]]:
    """The record of each start of the script, in order."""
    out: dict[int, list[dict]] = {}
    for r in recs:
        out.setdefault(r["pid"], []).append(r)
    return list(out.values())


def steps(recs: list[dict]) -> list[list[list[int]]]:
    """The micro-batches of each optimizer step a process completed."""
    out, pending = [], []
    for r in recs:
        if r["event"] == "forward":
            pending.append(r["examples"])
        elif r["event"] == "step":
            out.append(pending)
            pending = []
    return out


def failed_batch(recs: list[dict]) -> list[int]:
    """The micro-batch of a process's last forward, which no step followed: the one the device failed."""
    forwards = [r for r in recs if r["event"] in ("forward", "step")]
    assert forwards[-1]["event"] == "forward", forwards[-3:]
    return forwards[-1]["examples"]


def setting(recs: list[dict]) -> tuple[int, int]:
    (begin,) = [r for r in recs if r["event"] == "train_begin"]
    return begin["batch"], begin["accumulation"]


def warn_beats(run_dir: Path, attempt: int) -> list[dict]:
    path = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    beats = [b for b in map(decode_line, path.read_bytes().splitlines()) if b is not None]
    return [b for b in beats if b["event"] == "warn"]


def attempts(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "attempts").iterdir())


def assert_one_halving_restart(r, run_dir: Path, recs: list[dict], framework: str, label: str, names: tuple) -> None:
    """The run finished after exactly one restart, the second start ran at half the batch and twice the
    accumulation, and the run dir records it."""
    assert r.returncode == 0, explain(r, run_dir)
    assert attempts(run_dir) == ["0001", "0002"], explain(r, run_dir)
    first, second = by_process(recs)
    assert setting(first) == (4, 1) and setting(second) == (2, 2)  # what the script itself saw
    assert all(len(step) == 2 and all(len(mb) == 2 for mb in step) for step in steps(second))
    assert steps(first) == [] and len(steps(second)) == 6  # every step, 4 examples each, as configured

    record = json.loads((run_dir / "framework-remediation.json").read_text())
    assert record["framework"] == framework and record["configured"] == {"batch": 4, "accumulation": 1}
    assert (record["batch"], record["accumulation"]) == (2, 2) and len(record["history"]) == 1
    assert record["history"][0]["oom"]["tried_mb"] == 1024.0 and record["history"][0]["oom"]["allowed_mb"] == 2560.0

    ((_, inc),) = incidents(run_dir)
    assert inc["kind"] == "oom" and inc["attempt"] == 1 and inc["phase"] == "train"
    fr = inc["framework_remediation"]
    assert fr["action"] == "restart_with" and fr["from"] == {"batch": 4, "accumulation": 1}
    assert fr["to"] == {"batch": 2, "accumulation": 2} and fr["oom_words"].startswith(FIGURES)
    assert f"out of memory in the {label} ({FIGURES}" in fr["message"]
    assert f"the next attempt trains with {names[0]} 2 × {names[1]} 2" in fr["message"]
    assert inc["decision"]["action"] == "restart" and inc["decision"]["rollback"] is True

    # the second attempt said it, on its stderr and in a beat; the first said nothing
    said = f"hangwatch: out-of-memory remedy applied to the {label}: {names[0]} 4 → 2, {names[1]} 1 → 2"
    logs = [(run_dir / "attempts" / a / "worker.log").read_text() for a in ("0001", "0002")]
    assert said not in logs[0] and said in logs[1]
    assert warn_beats(run_dir, 1) == []
    (warn,) = warn_beats(run_dir, 2)
    assert warn["framework_remediation"]["applied"] is True
    assert warn["framework_remediation"]["now"] == {"batch": 2, "accumulation": 2}

    state = json.loads((run_dir / "state.json").read_text())
    assert state["state"] == "finished" and state["framework_remediation"]["now"] == {"batch": 2, "accumulation": 2}


def test_an_hf_trainer_oom_restarts_once_with_half_the_batch_and_the_same_examples_per_step(tmp_path):
    script = SCRIPTS / "oom_trainer.py"
    # The same script outside hangwatch, on a device with room for batch 4: the order HF's sampler gives.
    ref = subprocess.run(
        [sys.executable, str(script), "--record", "bare.jsonl", "--capacity-mb", "100000"],
        cwd=tmp_path,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "hangwatch" not in ref.stderr  # outside hangwatch nothing is read, set or said
    bare = entries(tmp_path / "bare.jsonl")
    assert setting(bare) == (4, 1)
    reference = [sorted(mb) for (mb,) in steps(bare)]
    assert len(reference) == 6

    r, run_dir = run_hangwatch(tmp_path, CONFIG, ["python", str(script), "--record", "record.jsonl"])
    recs = entries(tmp_path / "record.jsonl")
    names = ("per_device_train_batch_size", "gradient_accumulation_steps")
    assert_one_halving_restart(r, run_dir, recs, "hf", "HF Trainer", names)
    first, second = by_process(recs)
    # The sampler's order does not depend on the batch: each optimizer step holds the same examples as at batch 4.
    assert sorted(failed_batch(first)) == reference[0]
    assert [sorted(mb1 + mb2) for mb1, mb2 in steps(second)] == reference


def test_a_trl_sft_trainer_oom_restarts_once_with_half_the_batch(tmp_path):
    pytest.importorskip("trl")
    r, run_dir = run_hangwatch(
        tmp_path, CONFIG, ["python", str(SCRIPTS / "oom_trainer.py"), "--trl", "--record", "record.jsonl"]
    )
    recs = entries(tmp_path / "record.jsonl")
    names = ("per_device_train_batch_size", "gradient_accumulation_steps")
    assert_one_halving_restart(r, run_dir, recs, "hf", "SFTTrainer (an HF Trainer)", names)
    first, second = by_process(recs)
    assert sorted(failed_batch(first)) == sorted(steps(second)[0][0] + steps(second)[0][1])


def test_a_lightning_oom_restarts_once_with_half_the_batch_size_attribute(tmp_path):
    pytest.importorskip("lightning")
    r, run_dir = run_hangwatch(
        tmp_path, CONFIG, ["python", str(SCRIPTS / "oom_lightning.py"), "--record", "record.jsonl"]
    )
    recs = entries(tmp_path / "record.jsonl")
    names = ("model.batch_size", "trainer.accumulate_grad_batches")
    assert_one_halving_restart(r, run_dir, recs, "lightning", "Lightning Trainer (module WithBatchSize)", names)
    first, second = by_process(recs)
    assert sorted(failed_batch(first)) == sorted(steps(second)[0][0] + steps(second)[0][1])


def test_an_oom_at_per_device_batch_1_ends_the_run_and_says_so(tmp_path):
    # 1 GiB of weights + 256 MiB per example and layer, 1.2 GiB allowed: batch 2 fails, and so does batch 1
    cmd = ["python", str(SCRIPTS / "oom_trainer.py"), "--batch", "2", "--capacity-mb", "1200", "--record", "r.jsonl"]
    r, run_dir = run_hangwatch(tmp_path, CONFIG, cmd)
    assert r.returncode != 0, explain(r, run_dir)
    assert attempts(run_dir) == ["0001", "0002"]
    assert [setting(p) for p in by_process(entries(tmp_path / "r.jsonl"))] == [(2, 1), (1, 2)]
    (_, first), (_, second) = incidents(run_dir)
    assert first["framework_remediation"]["action"] == "restart_with"
    assert second["framework_remediation"]["action"] == "failed"
    assert second["decision"]["action"] == "fail"
    assert "per_device_train_batch_size is 1 already: nothing smaller to try" in second["decision"]["reason"]
    assert "Tried to allocate 256 MiB; 1.2 GiB allowed" in second["decision"]["reason"]
    assert json.loads((run_dir / "state.json").read_text())["state"] == "failed"


def test_a_lightning_loader_passed_to_fit_is_stopped_at_the_second_identical_oom(tmp_path):
    pytest.importorskip("lightning")
    cmd = ["python", str(SCRIPTS / "oom_lightning.py"), "--loader-in-fit", "--record", "r.jsonl"]
    r, run_dir = run_hangwatch(tmp_path, CONFIG, cmd)
    assert r.returncode != 0 and attempts(run_dir) == ["0001", "0002"], explain(r, run_dir)
    assert not (run_dir / "framework-remediation.json").exists()
    (_, first), (_, second) = incidents(run_dir)
    assert first["framework_remediation"]["action"] == "none"
    assert "the train DataLoader was passed to fit() directly" in first["framework_remediation"]["why"]
    reason = second["decision"]["reason"]
    assert second["decision"]["action"] == "fail" and second["repeated"] == first["id"]
    assert "the same failure twice in a row before the first step" in reason
    assert f"({FIGURES}" in reason
    assert "lower the batch_size of the DataLoader your script builds (Lightning Trainer)" in reason


def test_a_plain_loops_identical_oom_ends_the_run_after_two_attempts_saying_what_to_change(tmp_path):
    r, run_dir = run_hangwatch(tmp_path, CONFIG, ["python", str(SCRIPTS / "oom_plain.py")])
    assert r.returncode != 0 and attempts(run_dir) == ["0001", "0002"], explain(r, run_dir)
    (_, first), (_, second) = incidents(run_dir)
    assert first["kind"] == second["kind"] == "oom" and first["decision"]["action"] == "restart"
    reason = second["decision"]["reason"]
    assert second["decision"]["action"] == "fail" and second["repeated"] == first["id"]
    assert "the same failure twice in a row before the first step" in reason
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1024.00 MiB" in reason
    assert (
        f"the same batch ran out of memory at the same step ({FIGURES}; GPU 0: 77.5 GiB free of 80.0 GiB): lower the "
        "batch size of your training loop (its DataLoader's batch_size)"
    ) in reason
    assert json.loads((run_dir / "state.json").read_text())["state"] == "failed"
