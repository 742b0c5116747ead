"""restart.prewarm on a real run: the built-in worker (the demo's tiny model) hangs in C; the supervisor spawns
the next attempt's standby at detection, releases it once the stuck tree is gone, and the run finishes from
the last good checkpoint — in exactly the weights of an uninterrupted run of the same config (which runs
alongside).  What shows that the second attempt came from the standby: the supervisor's log
(`standby_spawned` → `tree_gone` → `standby_released` → `worker_spawned prewarmed`, one pid throughout), the
attempt's `start` beat (`prewarmed: true`, first line of its heartbeat file) and `load` progress (what the
standby preloaded), and its worker.log, which
begins with the standby's own lines."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from fixtures.fakes.sup_harness import PY, ROOT, env, incidents, state, wait_no_strays
from fixtures.fakes.workers import safetensors_raw

pytestmark = pytest.mark.slow

DEMO = ROOT / "configs" / "demo.yaml"


def config(tmp_path: Path, name: str, faults: list) -> tuple[Path, Path]:
    """The demo's tiny model, 12 steps, checkpoints every 2 confirmed after 1, prewarm on."""
    cfg = yaml.safe_load(DEMO.read_text())
    run_dir = tmp_path / name
    cfg.update(
        run_dir=str(run_dir),
        data={"train": str(ROOT / "configs/data/train.jsonl"), "eval": str(ROOT / "configs/data/eval.jsonl"),
              "max_length": 64},
        faults=faults,
        # a step takes ~0.2 s; the step deadline only has to stay out of the way of a slow, healthy step
        watchdog={"startup_timeout_s": 300, "silence_timeout_s": 60, "step_timeout_s": 8, "first_steps_timeout_s": 120,
                  "dump_grace_s": 2, "term_grace_s": 2, "poll_interval_s": 0.1, "py_spy": False,
                  "phase_budgets_s": {"eval": 120, "generate": 30, "checkpoint": 120}},
        restart={"backoff_initial_s": 0, "max_restarts": 3, "prewarm": True},
    )
    cfg["train"].update(max_steps=12, sleep_per_step_s=0.0)
    cfg["eval"].update(every_steps=0)
    cfg["checkpoint"].update(every_steps=2, confirm_steps=1, keep_last=3)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def start(cfg_path: Path, out: Path) -> subprocess.Popen:
    with open(out, "w") as f:
        return subprocess.Popen([PY, "-m", "hangwatch.supervisor", "run", str(cfg_path)], cwd=ROOT, env=env(),
                                stdout=f, stderr=subprocess.STDOUT)


def finish(p: subprocess.Popen, run_dir: Path, out: Path, timeout: float = 400) -> None:
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError(f"supervisor did not finish in {timeout}s:\n{out.read_text()[-5000:]}")
    assert rc == 0, out.read_text()[-6000:]
    assert state(run_dir)["state"] == "finished", out.read_text()[-6000:]


def events(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "supervisor.log").read_text().splitlines() if x.startswith("{")]


def beats(run_dir: Path, attempt: int) -> list[dict]:
    f = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]


def final_weights(run_dir: Path) -> dict:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {run_dir / 'final'}"
    return {f.name: safetensors_raw(f) for f in files}


@pytest.mark.timeout(600)
def test_a_hang_restarts_from_the_standby_and_ends_in_the_uninterrupted_weights(tmp_path):
    ref_cfg, ref_dir = config(tmp_path, "reference", [])
    hang_cfg, run_dir = config(tmp_path, "hang", [{"kind": "block_c", "at_step": 7}])
    ref, hang = start(ref_cfg, tmp_path / "reference.out"), start(hang_cfg, tmp_path / "hang.out")
    finish(hang, run_dir, tmp_path / "hang.out")
    finish(ref, ref_dir, tmp_path / "reference.out")

    (inc,) = incidents(run_dir)
    assert inc["kind"] == "stall" and inc["deadline"]["name"] == "step" and inc["attempt"] == 1
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001", "0002"]

    # The supervisor's account: spawned at detection, released after the stuck tree was gone, as attempt 2.
    log = events(run_dir)
    names = [e["event"] for e in log]
    spawned = next(e for e in log if e["event"] == "standby_spawned")
    released = next(e for e in log if e["event"] == "standby_released")
    worker_2 = next(e for e in log if e["event"] == "worker_spawned" and e["attempt"] == 2)
    assert names.index("stall_detected") < names.index("standby_spawned") < names.index("tree_gone") \
        < names.index("standby_released") < names.index("worker_spawned", names.index("tree_gone"))
    assert spawned["attempt"] == released["attempt"] == 2 and spawned["why"] == "stall"
    assert spawned["pid"] == released["pid"] == worker_2["pid"] and worker_2["prewarmed"] is True
    assert "standby_discarded" not in names and "standby_died" not in names
    assert released["resume_from"] == inc["last_good_checkpoint"]  # decided at the release: the last good one

    # The worker's account: its first line is its `start`, after the release, and it resumed where it was told.
    second = beats(run_dir, 2)
    first = second[0]
    assert first["event"] == "start" and first["pid"] == released["pid"] and first["prewarmed"] is True
    assert first["resumed_from"] == released["resume_from"]
    loaded = next(b for b in second if b["event"] == "progress" and b["phase"] == "load")  # its preload, waited for
    assert loaded["prewarmed"] is True and loaded["standby_preload_error"] is None
    assert (run_dir / "attempts" / "0002" / "worker.log").read_text().startswith("standby for attempt 2")
    assert not (run_dir / "standby.log").exists()
    assert beats(run_dir, 1)[0].get("prewarmed") is None  # the first attempt was a cold spawn

    left = wait_no_strays(str(run_dir))
    assert not left, f"survivors: {[(p.pid, p.cmdline()) for p in left]}"
    assert final_weights(run_dir) == final_weights(ref_dir)  # bit for bit: the standby consumed nothing early
