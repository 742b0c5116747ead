"""The per-line bookkeeping made cheap keeps its meaning: the straggler watch's median of the other ranks
(kept sorted instead of sorted per line) is statistics.median's."""

from __future__ import annotations

import random
import statistics

from hangwatch.supervisor.watch.stragglers import StragglerWatch


def others_median(last: dict, rank: int):
    others = [t for r, t in last.items() if r != rank]
    return None if not others else statistics.median(others)


def test_the_other_ranks_median_is_statistics_median_whatever_the_order_of_lines():
    rnd = random.Random(3)
    for ranks in (2, 3, 8, 64):
        watch = StragglerWatch(factor=2.0, steps=3)
        last: dict[int, float] = {}
        for step in range(400):
            rank = rnd.randrange(ranks)
            took = rnd.choice((0.05, 0.1, 0.1, 0.2, 0.5, rnd.random()))
            median = others_median(last, rank)
            what, rec = watch.step(rank, step, now=float(step), reported_s=took)
            last[rank] = took
            assert sorted(watch.ordered) == sorted(last.values()) and watch.ordered == sorted(watch.ordered)
            if what == "straggler":
                assert rec.others_median_s == median and took > 2.0 * median
            if median is not None and took <= 2.0 * median:
                assert rank not in watch.streak  # not slow against the median: no streak
