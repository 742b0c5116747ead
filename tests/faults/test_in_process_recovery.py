"""Recovery inside the built-in worker's process (`restart.in_process`), under the real supervisor (`python -m
hangwatch.supervisor run`, tiny model on the CPU, real processes and signals):

* a Python spin in a forward (`busy_loop`): caught by the step deadline, dumped, the stuck step abandoned in the
  process — one attempt, nothing restarted — and the final adapter bit for bit the one a run that restarts from the
  same checkpoint ends with (`restart.in_process: false`);
* a non-finite streak: rolled back in the process to the last good checkpoint's state held in memory, one attempt,
  the final adapter bit for bit the restart path's;
* a thread blocked in C (`block_c`, a mutex locked twice): the order goes unanswered, the tree is killed and
  restarted, and the incident says why;
* an out-of-memory step (`memory_limit`, a device that fails at the first allocation that does not fit): adapted in
  the process down the ladder, one attempt, the examples of every optimizer step those of a run with room, the
  adapted setting in remediation.json for later attempts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fixtures.fakes.sup_harness import attempts, incidents, run_supervisor
from fixtures.fakes.workers import make_config, read_beats

pytestmark = pytest.mark.slow

WATCH = {
    "startup_timeout_s": 120,
    "silence_timeout_s": 60,
    "step_timeout_s": 4,
    "dump_grace_s": 1,
    "abandon_grace_s": 4,
    "term_grace_s": 3,
    "py_spy": False,
    "poll_interval_s": 0.1,
}
COMMON = {
    "watchdog": WATCH,
    "train": {"max_steps": 10, "micro_batch_size": 4, "grad_accum": 2},
    "checkpoint": {"every_steps": 3, "confirm_steps": 1},
}


def run(tmp_path: Path, name: str, in_process: bool, faults: list, **over) -> Path:
    cfg = {**COMMON, **over}
    config = make_config(
        tmp_path / name,
        restart={"in_process": in_process, "backoff_initial_s": 0, "max_restarts": 5},
        faults=faults,
        **cfg,
    )
    rc, out = run_supervisor(config, timeout=240)
    assert rc == 0, out[-3000:]
    return tmp_path / name / "run"


def adapter(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "final" / "adapter_model.safetensors"))


def assert_bitwise_equal(a: dict, b: dict) -> None:
    import torch

    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_python_spin_is_abandoned_in_the_process_and_ends_bit_for_bit_as_a_restart(tmp_path):
    spin = [{"kind": "busy_loop", "at_step": 6}]
    here = run(tmp_path, "here", True, spin)
    assert len(attempts(here)) == 1  # nothing restarted
    (inc,) = [i for i in incidents(here) if i["kind"] == "stall"]
    r = inc["recovery"]
    assert r["path"] == "in_process" and r["kind"] == "stall" and r["failed_step"] == 6
    assert r["restored_step"] == 3 and r["restored_from"].endswith("step-00000003")
    assert "_select_ranges" in r["landed_at"] or "_busy_forward_hook" in r["landed_at"], r["landed_at"]
    assert inc["status"] == "handled" and inc["decision"]["action"] == "recovered_in_process"
    assert "recovered in the worker's process" in inc["summary"]
    assert inc["classification"]  # the dumps were taken and read before the order
    steps = [b["step"] for b in read_beats(here, 1) if b["event"] == "step"]
    assert steps.count(4) == 2 and steps.count(5) == 2 and steps[-1] == 10  # steps 4, 5 taken again after step 3
    goodput = json.loads((here / "goodput.json").read_text())["categories"]
    # the wait for the answer is the ledger's `abandon`; nothing was killed, no process started again
    assert goodput["abandon"] > 0 and goodput["kill"] == 0 and goodput["restart_startup"] == 0

    there = run(tmp_path, "there", False, spin)
    assert len(attempts(there)) == 2
    (inc,) = [i for i in incidents(there) if i["kind"] == "stall"]
    assert "recovery" not in inc  # off: the restart path, as before
    assert_bitwise_equal(adapter(here), adapter(there))


def test_a_nonfinite_streak_is_rolled_back_in_the_process_and_ends_bit_for_bit_as_a_restart(tmp_path):
    nan = [{"kind": "nan", "at_step": 5, "steps": 3}]
    train = {**COMMON["train"], "max_nonfinite_streak": 3}
    here = run(tmp_path, "here", True, nan, train=train)
    assert len(attempts(here)) == 1
    (inc,) = [i for i in incidents(here) if i["kind"] == "nan"]
    assert inc["recovery"]["path"] == "in_process" and inc["recovery"]["restored_step"] == 3
    assert "rolled back in the worker's process to checkpoint step 3" in inc["summary"]
    there = run(tmp_path, "there", False, nan, train=train)
    assert len(attempts(there)) == 2
    assert_bitwise_equal(adapter(here), adapter(there))


def test_a_stall_blocked_in_c_is_still_killed_and_restarted(tmp_path):
    here = run(tmp_path, "here", True, [{"kind": "block_c", "at_step": 5}])
    assert len(attempts(here)) == 2
    (inc,) = [i for i in incidents(here) if i["kind"] == "stall"]
    r = inc["recovery"]
    assert r["path"] == "restart" and r["asked"] is True and "no answer within 4 s" in r["why"], r
    assert "blocked in C" in inc["classification"]
    assert inc["decision"]["action"] == "restart"


def step_ids(beats) -> dict:
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_an_out_of_memory_step_is_adapted_in_the_process_with_the_same_examples(tmp_path):
    device = {"kind": "memory_limit", "weights_mb": 700, "per_example_mb": 1000, "capacity_mb": 4096, "at_step": 4}
    train = {"max_steps": 6, "micro_batch_size": 16, "grad_accum": 1}
    here = run(tmp_path, "here", True, [device], train=train)
    assert len(attempts(here)) == 1
    adapted = [i for i in incidents(here) if i["kind"] == "oom_adapted"]
    # 16 → 8 → 4 → 2: 4 examples need 4.7 GiB of the 4 allowed, 2 need 2.7
    assert [i["remediation"]["to"]["micro_batch_size"] for i in adapted] == [8, 4, 2]
    assert all(i["step"] == 4 and i["status"] == "handled" for i in adapted)
    assert "tried to allocate" in adapted[0]["summary"] and "4.0 GiB allowed" in adapted[0]["summary"]
    record = json.loads((here / "remediation.json").read_text())
    assert (record["micro_batch_size"], record["grad_accum"]) == (2, 8)
    assert [h["basis"] for h in record["history"]] == ["in_process"] * 3
    reference = run(tmp_path, "room", True, [], train=train)  # a device with room: no OOM
    assert step_ids(read_beats(here, 1)) == step_ids(read_beats(reference, 1))


def test_out_of_memory_while_loading_is_a_clear_failure_not_a_restart_loop(tmp_path):
    device = {"kind": "memory_limit", "weights_mb": 5000, "per_example_mb": 100, "capacity_mb": 4096}
    config = make_config(
        tmp_path / "big",
        restart={"in_process": True, "backoff_initial_s": 0, "max_restarts": 5},
        faults=[device],
        **COMMON,
    )
    rc, out = run_supervisor(config, timeout=240)
    run_dir = tmp_path / "big" / "run"
    assert rc != 0 and len(attempts(run_dir)) == 1, out[-3000:]  # no restart: the same model would not fit again
    words = json.loads((run_dir / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "oom" and words["exit_code"] == 78 and words["phase"] == "load"
    assert "out of memory while loading the model" in words["message"]
    assert "the doctor's estimate: the base weights alone take" in words["message"]
    assert "model.load_in_4bit" in words["message"]
    (inc,) = [i for i in incidents(run_dir) if i["kind"] == "oom"]
    assert "out of memory while loading the model" in json.dumps(inc)
