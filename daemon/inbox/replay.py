"""Replay: with probability `replay_ratio` the next example is drawn uniformly from the files
finished before the current one instead of being a fresh one.

Every random decision is a counter-based draw (`uniform(seed, k)` depends only on the seed and
the draw number), so the whole generator state is one integer that a checkpoint stores.
"""

from __future__ import annotations

import bisect
import hashlib


def uniform(seed: int, counter: int) -> float:
    """Draw number `counter` in [0, 1), a function of (seed, counter) only."""
    digest = hashlib.sha256(f"hangwatch-replay:{seed}:{counter}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


class ReplayPool:
    """Finished files with their example counts; a number below the total names one example."""

    def __init__(self) -> None:
        self._files: list[str] = []
        self._cumulative: list[int] = []

    def add(self, filename: str, count: int) -> None:
        if count > 0:
            self._files.append(filename)
            self._cumulative.append(self.total + count)

    @property
    def total(self) -> int:
        return self._cumulative[-1] if self._cumulative else 0

    def locate(self, r: int) -> tuple[str, int]:
        """(file, index of the example in it) of example number `r` of the pool."""
        k = bisect.bisect_right(self._cumulative, r)
        return self._files[k], r - (self._cumulative[k - 1] if k else 0)


class Replay:
    """Which examples are replays, and which ones.

    `draws` counts every draw made (the coin per example, the pick per replay), `count` the replays
    handed out, `unlogged` the replays [n, id, file, line] not yet in done/replay.jsonl."""

    def __init__(self, ratio: float, seed: int):
        if not 0 <= ratio < 1:
            raise ValueError(f"replay_ratio must be in [0, 1), got {ratio!r}")
        self.ratio = float(ratio)
        self.seed = int(seed)
        self.reset()

    def reset(self, draws: int = 0, count: int = 0) -> None:
        self.draws = draws
        self.count = count
        self.unlogged: list[list] = []
        self.pool = ReplayPool()

    def _draw(self) -> float:
        u = uniform(self.seed, self.draws)
        self.draws += 1
        return u

    def coin(self) -> bool:
        """Whether the next example is to be a replay (a draw is spent whenever replay is on)."""
        if self.ratio <= 0:
            return False
        return self._draw() < self.ratio and self.pool.total > 0

    def pick(self) -> tuple[str, int]:
        """(file, index) of the example to replay, uniform over the pool."""
        total = self.pool.total
        return self.pool.locate(min(int(self._draw() * total), total - 1))

    def record(self, rid: str, filename: str, line: int) -> None:
        self.count += 1
        self.unlogged.append([self.count, rid, filename, line])

    def forget_logged(self, upto_n: int) -> None:
        self.unlogged = [x for x in self.unlogged if x[0] > upto_n]
