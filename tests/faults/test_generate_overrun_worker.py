"""A runaway eval generate() in the built-in worker (runaway_generate: EOS suppressed, no token limit), one rank and
two under torchrun, under a 5 s generate budget: ended in the worker's own process at the supervisor's order — no
restart, the run finishes, a `generate_truncated` incident per runaway, the evolution log keeps the output marked
truncated.  A generate that produces no token (hang_generate) is still killed and restarted."""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.sup_harness import incidents, run_supervisor, state
from fixtures.fakes.workers import make_config, read_beats

pytestmark = pytest.mark.slow


def _config(tmp_path, nproc: int, faults: list, **watchdog):
    return make_config(
        tmp_path,
        worker={"nproc_per_node": nproc, "env": {"OMP_NUM_THREADS": "1"}},
        train={"max_steps": 12},
        eval={
            "every_steps": 4,
            "max_new_tokens": 4,
            "progress_every_tokens": 2,
            "prompts": ["upper: cat", "reverse: dog"],
        },
        checkpoint={"every_steps": 4, "confirm_steps": 1},
        watchdog={
            "startup_timeout_s": 240,
            "silence_timeout_s": 60,
            "step_timeout_s": 30,
            "phase_budgets_s": {"eval": 120, "generate": 5, "checkpoint": 60, "load": 240},
            **watchdog,
        },
        restart={"backoff_initial_s": 0, "max_restarts": 3},
        faults=faults,
    )


def _evolution(run_dir):
    return [json.loads(line) for line in (run_dir / "evolution.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_runaway_generate_is_truncated_without_a_restart_and_training_finishes(tmp_path, nproc):
    cfg = _config(
        tmp_path, nproc, [{"kind": "runaway_generate", "at_eval": 1}, {"kind": "runaway_generate", "at_eval": 2}]
    )
    run_dir = tmp_path / "run"
    rc, out = run_supervisor(cfg, timeout=400)
    assert rc == 0, out[-5000:]
    st = state(run_dir)
    assert st["state"] == "finished" and st["attempt"] == 1 and st["restarts"] == 0
    incs = incidents(run_dir)
    assert [i["kind"] for i in incs] == ["generate_truncated", "generate_truncated"], [i["kind"] for i in incs]
    for inc, step in zip(incs, (4, 8)):
        assert inc["step"] == step and inc["ranks"] == [0] and inc["budget_s"] == 5
        assert inc["tokens"]["0"] >= inc["limit"] > 4  # far past the 4 tokens an eval normally generates
        assert inc["prompt"] == "upper: cat" and inc["output_tail"]
        assert "nothing restarted" in inc["summary"]
    # the evolution log: the first prompt of the runaway evals truncated, the other skipped; eval 3 whole again
    evo = _evolution(run_dir)
    by_step = {}
    for r in evo:
        by_step.setdefault(r["step"], []).append(r)
    for step, inc in zip((4, 8), incs):
        [rec] = by_step[step]
        assert rec["truncated"] is True and rec["tokens"] == inc["tokens"]["0"] and rec["skipped_prompts"] == 1
    assert [r["prompt"] for r in by_step[12]] == ["upper: cat", "reverse: dog"]
    assert not any(r.get("truncated") for r in by_step[12])
    # training went on in the same process: one start per rank, every step beaten once
    beats = read_beats(run_dir, 1)
    assert [b["step"] for b in beats if b["event"] == "step"] == list(range(1, 13))
    assert sum(1 for b in beats if b["event"] == "start") == 1
    if nproc == 2:  # the other rank waited for rank 0 and was not taken for stuck
        other = read_beats(run_dir, 1, rank=1)
        assert [b["step"] for b in other if b["event"] == "step"] == list(range(1, 13))


def test_a_generate_that_produces_no_tokens_is_still_killed_and_restarted(tmp_path):
    cfg = _config(tmp_path, 1, [{"kind": "hang_generate", "at_eval": 1}])
    run_dir = tmp_path / "run"
    rc, out = run_supervisor(cfg, timeout=400)
    assert rc == 0, out[-5000:]
    st = state(run_dir)
    assert st["state"] == "finished" and st["restarts"] == 1
    [inc] = incidents(run_dir)
    assert inc["kind"] == "stall" and inc["deadline"]["phase"] == "generate"
    assert not (run_dir / "attempts" / "0001" / "generate-stop.json").exists()  # no order: nothing to truncate
