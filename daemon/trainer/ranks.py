"""What each rank of a multi-rank run takes of a step, and what a checkpoint keeps of each rank.

Pure functions (no torch, no process group), so that they are table-tested with fake ranks.

Data order.  Every rank holds the whole training set and the one seeded order (`ShuffledEpochs`) and
takes the *world's* step from it: micro_batch_size × grad_accum × world size examples.  The step's
micro-batch j is its examples [j·m·W, (j+1)·m·W), split in rank order: rank r trains on
[j·m·W + r·m, j·m·W + (r+1)·m).  So the world trains on exactly the examples, in exactly the order,
that one process with micro_batch_size m·W would, and the data position after a step is the same on
every rank.  With W = 1 this is the single-process split, unchanged.

Per-rank state.  Dropout must differ between ranks, so each rank seeds its RNGs from (seed, rank)
(rank 0 from the seed itself, as a single process does), and a checkpoint keeps every rank's RNG
states and data position: rank 0 gathers them and writes `rng.pt` (its own, the single-process file)
and `rng-rank<R>.pt` for the others, and `ranks` in trainer_state.json: [{rank, data_position}].
"""

from __future__ import annotations

from typing import Any, Optional, Sequence


def rank_micro_batches(examples: Sequence, rank: int, world: int, micro: int) -> list[list]:
    """Rank `rank`'s micro-batches of one optimizer step whose examples (the whole world's) are `examples`."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    per_micro = micro * world
    if world > 1 and len(examples) % per_micro:
        # Every rank must run as many forward/backward passes as the others, or their gradient
        # exchanges would not pair up.
        raise ValueError(
            f"a step of {len(examples)} examples does not split into micro-batches of {micro} on each of {world} ranks"
        )
    return [list(examples[i + rank * micro : i + (rank + 1) * micro]) for i in range(0, len(examples), per_micro)]


def eval_shard(examples: Sequence, rank: int, world: int) -> list:
    """The held-out examples rank `rank` scores (every world-th, from its own index)."""
    return list(examples[rank::world])


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank `rank`'s RNGs (dropout): the run's seed on rank 0, a derived one elsewhere."""
    if rank == 0:
        return seed
    import numpy as np

    return int(np.random.SeedSequence([seed & 0xFFFFFFFF, rank]).generate_state(1)[0])


def rank_state(rank: int, rng: dict, data_position: dict) -> dict:
    """What a checkpoint keeps of one rank (gathered on rank 0)."""
    return {"rank": rank, "rng": rng, "data_position": data_position}


def ranks_record(states: Sequence[dict]) -> list[dict]:
    """trainer_state.json's `ranks`: every rank's data position, in rank order (the RNG states go to files)."""
    for i, s in enumerate(states):
        if s["rank"] != i:
            raise ValueError(f"rank states out of order: entry {i} is rank {s['rank']}")
    return [{"rank": s["rank"], "data_position": s["data_position"]} for s in states]


def position_for(saved: dict, rank: int) -> Optional[dict]:
    """Rank `rank`'s data position in a checkpoint's trainer state (a single-process one has one only)."""
    ranks = saved.get("ranks")
    if ranks is None:
        if rank != 0:
            raise RuntimeError(f"the checkpoint was written by one process and holds no data position for rank {rank}")
        return saved.get("data_position")
    if rank >= len(ranks) or ranks[rank].get("rank") != rank:
        raise RuntimeError(f"the checkpoint holds the data positions of {len(ranks)} rank(s), none for rank {rank}")
    return ranks[rank]["data_position"]


def saved_world_size(saved: dict) -> int:
    """The world size a checkpoint's trainer state was written by (1 for checkpoints older than the field)."""
    return int(saved.get("world_size", 1))


def effective_batch(micro: int, grad_accum: int, world: int) -> dict[str, Any]:
    """The numbers the start beat and log report: examples per optimizer step, and how they come about."""
    return {
        "world_size": world,
        "micro_batch_size": micro,
        "grad_accum": grad_accum,
        "effective_batch": micro * grad_accum * world,
    }
