"""Continuous mode under the supervisor, SIGKILLed at random moments: mid-file, during a
checkpoint, just after training crossed from one file into the next.  Afterwards the ledger holds
every example id exactly once (replay draws apart, in their own log), every file is in done/ or
rejected/, and — all files being in the inbox before the start — the final weights are those of an
uninterrupted run over the same files, which runs alongside."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.continuous_support import (  # noqa: E402
    drop_all,
    example_ids,
    good_file,
    inbox_config,
    ledger,
    leftovers,
    lines_of,
    names_in,
    replay_log,
)
from fixtures.fakes.workers import ROOT, read_beats, safetensors_raw, start_worker, wait_for_beat, worker_env  # noqa: E402

from hangwatch.common.inbox_layout import Stage  # noqa: E402

pytestmark = pytest.mark.slow

N_FILES, N_LINES = 5, 12
WAIT_S = 400  # for any one awaited event, on a loaded machine


def final_weights(run_dir: Path) -> dict:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert [f.name for f in files] == ["adapter_model.safetensors", "extra_modules.safetensors"]
    return {f.name: safetensors_raw(f) for f in files}


def start_supervisor(config: Path, log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hangwatch.supervisor", "run", str(config)],
            cwd=ROOT,
            env=worker_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_random_kills_lose_nothing_train_nothing_twice_and_end_where_an_uninterrupted_run_ends(tmp_path):
    seed = int(os.environ.get("HANGWATCH_TEST_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    print(f"kill timing seed {seed} (HANGWATCH_TEST_SEED to repeat)")
    files = {f"batch-{i}.jsonl": good_file(N_LINES, 100 + i) for i in range(N_FILES)}
    files["broken.jsonl"] = lines_of(['{"prompt": "upper: cat", "completion": "CAT"', {"prompt": "no completion"}])
    run, ref = tmp_path / "run", tmp_path / "ref"
    drop_all(run, files)
    drop_all(ref, files)
    config = inbox_config(
        tmp_path,
        data={"idle_exit_s": 2},
        train={"sleep_per_step_s": 0.2},
        # generous: two shared cores can make one import of torch take a minute; no deadline is tested here
        watchdog={
            "startup_timeout_s": 600,
            "silence_timeout_s": 60,
            "step_timeout_s": 60,
            "dump_grace_s": 1,
            "term_grace_s": 2,
            "poll_interval_s": 0.1,
            "py_spy": False,
            "phase_budgets_s": {"load": 600, "checkpoint": 120, "intake": 120},
        },
        restart={"backoff_initial_s": 0, "max_restarts": 10},
    )
    assert yaml.safe_load(config.read_text())["run_dir"] == str(run)

    reference = start_worker(config, ref, log=tmp_path / "ref.log")  # uninterrupted, alongside
    sup = start_supervisor(config, tmp_path / "supervisor.out")
    try:

        def worker_of(attempt: int) -> dict:
            return wait_for_beat(run, attempt, lambda b: b["event"] == "start", sup, timeout=WAIT_S)

        def kill(attempt: int) -> None:
            os.kill(worker_of(attempt)["pid"], signal.SIGKILL)

        # 1: mid-file, at a random moment of a random early step
        worker_of(1)
        target = rng.randint(2, 4)
        wait_for_beat(
            run,
            1,
            lambda b: b["event"] == "step" and b["step"] >= target and 0 < b["index"] < b["total"],
            sup,
            timeout=WAIT_S,
        )
        time.sleep(rng.uniform(0.0, 0.15))
        kill(1)

        # 2: during a checkpoint (its files, its manifest or the ledger commit that follows it)
        target = worker_of(2)["resumed_step"] + 2 * rng.randint(1, 2)
        wait_for_beat(
            run,
            2,
            lambda b: b["event"] == "phase" and b["phase"] == "checkpoint" and b["step"] >= target,
            sup,
            timeout=WAIT_S,
        )
        time.sleep(rng.uniform(0.0, 0.02))
        kill(2)

        # 3: just after training crossed from one file into the next (the finished one still in processing/)
        target = worker_of(3)["resumed_step"] + rng.randint(1, 3)
        seen: list = []

        def crossed(b: dict) -> bool:
            if b["event"] != "step":
                return False
            seen.append(b["file"])
            return b["step"] > target and seen[-1] != seen[-2]

        wait_for_beat(run, 3, crossed, sup, timeout=WAIT_S)
        kill(3)

        # 4: runs to the end: everything trained, idle for data.idle_exit_s, stop `idle`
        assert sup.wait(timeout=WAIT_S) == 0, (tmp_path / "supervisor.out").read_text()[-3000:]
        assert reference.wait(timeout=WAIT_S) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    finally:
        for p in (sup, reference):
            if p.poll() is None:
                p.kill()
                p.wait()

    state = json.loads((run / "state.json").read_text())
    assert state["state"] == "finished"
    starts = [b for b in read_beats(run) if b["event"] == "start"]
    assert len(starts) == 4
    last = read_beats(run, 4)
    assert last[-1]["event"] == "stop" and last[-1]["reason"] == "idle"

    # Every example trained exactly once, in the uninterrupted run's order; replays logged apart.
    good = {name: data for name, data in files.items() if name != "broken.jsonl"}
    expected = [i for data in good.values() for i in example_ids(data)]
    ids = [e["id"] for e in ledger(run)]
    assert ids == [e["id"] for e in ledger(ref)] == expected
    replays = replay_log(run)
    assert replays and [r["n"] for r in replays] == list(range(1, len(replays) + 1))
    assert [(r["n"], r["id"]) for r in replays] == [(r["n"], r["id"]) for r in replay_log(ref)]

    # Every file done or rejected; nothing left in inbox/, queue/ or processing/.
    assert leftovers(run) == {}
    assert names_in(run, Stage.DONE) == sorted(good)
    assert sorted(os.listdir(run / "rejected")) == ["broken.jsonl", "broken.jsonl.error.json"]

    # The same weights, at the same step, as the run nobody killed.
    assert (
        json.loads((run / "final" / "hangwatch.json").read_text())["step"]
        == json.loads((ref / "final" / "hangwatch.json").read_text())["step"]
    )
    assert final_weights(run) == final_weights(ref)
