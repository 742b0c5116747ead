"""The pure parts of a multi-rank run: each rank's share of a step and of the held-out set, its seed,
the order-fixed sums, the world size from the environment, what a waiting rank beats, and refusing a
checkpoint of another world size."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.fakes.workers import make_config

from hangwatch.common.config import ConfigError, load_config
from hangwatch.daemon.distributed import World, ordered_sum, wait_beating, world_size_from_env
from hangwatch.daemon.resume_compat import check_resume_compatible, fingerprint
from hangwatch.daemon.trainer.ranks import (
    effective_batch,
    eval_shard,
    position_for,
    rank_micro_batches,
    rank_seed,
    rank_state,
    ranks_record,
    saved_world_size,
)

EXAMPLES = list(range(24))  # stand-ins: the split never looks inside an example


@pytest.mark.parametrize("world,micro", [(1, 4), (2, 2), (3, 2), (4, 1), (2, 3)])
def test_the_world_trains_the_steps_examples_in_the_single_process_order(world, micro):
    grad_accum = len(EXAMPLES) // (micro * world)
    shares = [rank_micro_batches(EXAMPLES, r, world, micro) for r in range(world)]
    assert all(len(s) == grad_accum for s in shares)  # as many forward/backward passes on every rank
    assert all(len(b) == micro for s in shares for b in s)
    # Micro-step j of every rank, in rank order, is the j-th slice of micro × world of the one order.
    rejoined = [x for j in range(grad_accum) for r in range(world) for x in shares[r][j]]
    assert rejoined == EXAMPLES


def test_a_world_of_one_splits_a_step_as_the_single_process_worker_always_did():
    assert rank_micro_batches(EXAMPLES[:10], 0, 1, 4) == [EXAMPLES[0:4], EXAMPLES[4:8], EXAMPLES[8:10]]  # partial: kept


@pytest.mark.parametrize(
    "n,rank,world,micro,error",
    [
        (10, 0, 2, 2, "does not split"),  # one rank would run fewer passes than another
        (8, 2, 2, 2, "not in a world of 2"),
        (8, -1, 2, 2, "not in a world of 2"),
    ],
)
def test_a_split_that_would_desynchronise_the_ranks_is_refused(n, rank, world, micro, error):
    with pytest.raises(ValueError, match=error):
        rank_micro_batches(EXAMPLES[:n], rank, world, micro)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 30])
def test_every_held_out_example_is_scored_by_exactly_one_rank(world):
    shards = [eval_shard(EXAMPLES, r, world) for r in range(world)]
    assert sorted(x for s in shards for x in s) == EXAMPLES


def test_rank_0_keeps_the_runs_seed_and_every_other_rank_gets_its_own_deterministic_one():
    assert rank_seed(7, 0) == 7
    seeds = [rank_seed(7, r) for r in range(1, 8)]
    assert len(set(seeds + [7])) == 8
    assert seeds == [rank_seed(7, r) for r in range(1, 8)]
    assert rank_seed(8, 1) != rank_seed(7, 1)


def test_the_checkpoint_keeps_every_ranks_position_in_rank_order_and_gives_each_rank_its_own():
    states = [rank_state(r, {"torch": r}, {"epoch": 0, "index": 8 * r}) for r in range(3)]
    record = ranks_record(states)
    assert record == [{"rank": r, "data_position": {"epoch": 0, "index": 8 * r}} for r in range(3)]
    saved = {"data_position": record[0]["data_position"], "ranks": record, "world_size": 3}
    assert [position_for(saved, r)["index"] for r in range(3)] == [0, 8, 16]
    assert saved_world_size(saved) == 3
    with pytest.raises(ValueError, match="out of order"):
        ranks_record([states[1], states[0]])
    with pytest.raises(RuntimeError, match="none for rank 3"):
        position_for(saved, 3)


def test_a_single_process_checkpoint_restores_rank_0_only():
    saved = {"data_position": {"epoch": 1, "index": 4}}  # written before checkpoints had `ranks`
    assert position_for(saved, 0) == {"epoch": 1, "index": 4}
    assert saved_world_size(saved) == 1
    with pytest.raises(RuntimeError, match="no data position for rank 1"):
        position_for(saved, 1)


def test_the_effective_batch_is_micro_times_accumulation_times_world_size():
    assert effective_batch(4, 2, 3) == {"world_size": 3, "micro_batch_size": 4, "grad_accum": 2, "effective_batch": 24}


def test_sums_are_added_in_rank_order_whatever_the_values():
    # Rank order matters in floating point: (1e16 + 1) - 1e16 is 0, 1 + (1e16 - 1e16) would be 1.
    f64 = torch.float64
    parts = [
        torch.tensor([1e16, 1.0], dtype=f64),
        torch.tensor([1.0, 1e16], dtype=f64),
        torch.tensor([-1e16, -1e16], dtype=f64),
    ]
    total = ordered_sum(parts)
    assert total.tolist() == [0.0, 0.0]
    assert parts[0].tolist() == [1e16, 1.0]  # the first part is not modified
    assert ordered_sum([0.1, 0.2, 0.3]) == (0.1 + 0.2) + 0.3


@pytest.mark.parametrize("env,size", [({}, 1), ({"WORLD_SIZE": "1"}, 1), ({"WORLD_SIZE": "4"}, 4)])
def test_the_world_size_comes_from_torchruns_environment(env, size):
    assert world_size_from_env(env) == size


@pytest.mark.parametrize("raw,error", [("two", "not a whole number"), ("0", "at least one rank")])
def test_a_bad_world_size_is_a_config_error(raw, error):
    with pytest.raises(ConfigError, match=error):
        world_size_from_env({"WORLD_SIZE": raw})


def test_the_world_of_one_process_is_the_identity():
    w = World()
    model = torch.nn.Linear(2, 2)
    assert (w.rank, w.size, w.is_main) == (0, 1, True)
    assert w.wrap(model) is model
    assert w.sum([1.5, 2]) == [1.5, 2] and w.any(True) and not w.any(False)
    assert w.gather({"a": 1}) == [{"a": 1}] and w.broadcast("x") == "x"
    assert w.on_main(None, "generate", lambda: 42) == 42


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_waiting_rank_beats_progress_every_few_seconds_until_rank_0_is_done():
    clock = FakeClock()
    beats = []
    done_at = 12.0
    n = wait_beating(
        lambda: clock.now >= done_at,
        lambda: beats.append(clock.now),
        clock=clock,
        sleep=clock.sleep,
        every_s=5.0,
        poll_s=0.5,
    )
    assert n == 2 and beats == [5.0, 10.0]
    assert wait_beating(lambda: True, lambda: beats.append("never"), clock=clock, sleep=clock.sleep) == 0


def test_a_checkpoint_of_another_world_size_is_refused_with_its_own_message(tmp_path):
    cfg = load_config(make_config(tmp_path))
    ckpt_dir = tmp_path / "step-00000004"
    ckpt_dir.mkdir()
    (ckpt_dir / "trainer_state.json").write_text(json.dumps({"fingerprint": fingerprint(cfg, 2)}))
    check_resume_compatible(cfg, ckpt_dir, 2)
    for size in (1, 4):
        with pytest.raises(ConfigError) as err:
            check_resume_compatible(cfg, ckpt_dir, size)
        assert "made by 2 rank(s)" in err.value.problems[0] and f"one of {size}" in err.value.problems[0]
        assert "worker.nproc_per_node: 2" in err.value.problems[0]
        assert len(err.value.problems) == 1  # nothing else differs
    # A single process's checkpoint (no world_size in its fingerprint) is a world of 1.
    (ckpt_dir / "trainer_state.json").write_text(json.dumps({"fingerprint": fingerprint(cfg)}))
    assert "world_size" not in fingerprint(cfg)
    check_resume_compatible(cfg, ckpt_dir)
    with pytest.raises(ConfigError, match="made by 1 rank"):
        check_resume_compatible(cfg, ckpt_dir, 2)
