"""Straggler detection on a fake clock: a rank slower than factor × the others' median for N steps in a row."""

from __future__ import annotations

import pytest

from hangwatch.common.config import WatchdogCfg
from hangwatch.supervisor.watch.stragglers import StragglerWatch


def run(watch: StragglerWatch, schedule: list[tuple[int, float, float | None]]) -> list[tuple[str, int, int]]:
    """Feed (rank, now, reported step_time_s) step lines; return the (event, rank, step) the watch raised."""
    steps: dict[int, int] = {}
    out = []
    for rank, now, reported in schedule:
        steps[rank] = steps.get(rank, 0) + 1
        what, rec = watch.step(rank, steps[rank], now, reported)
        if what:
            out.append((what, rank, steps[rank]))
    return out


def lockstep(n: int, times: dict[int, float], t0: float = 0.0) -> list[tuple[int, float, float | None]]:
    """n steps of every rank; rank r's line for step k comes when its own clock says (intervals: times[r])."""
    lines = [(r, t0 + k * dt, None) for r, dt in times.items() for k in range(1, n + 1)]
    return sorted(lines, key=lambda x: (x[1], x[0]))


@pytest.mark.parametrize(
    "name, factor, steps, schedule, expected",
    [
        ("equal ranks never straggle", 2.0, 3, lockstep(10, {0: 1.0, 1: 1.0, 2: 1.0}), []),
        (
            "a rank 3x slower straggles after 3 slow steps",
            2.0,
            3,
            lockstep(6, {0: 1.0, 1: 1.0, 2: 3.0}),
            [("straggler", 2, 4)],
        ),  # its first interval is step 2's; steps 2, 3, 4 are slow in a row
        ("a rank under the factor is not a straggler", 2.0, 3, lockstep(10, {0: 1.0, 1: 1.9}), []),
        (
            "one slow step (an eval in between) is not a streak",
            2.0,
            3,
            [
                (0, 1, None),
                (1, 1, None),
                (0, 2, None),
                (1, 2, None),
                (0, 3, None),
                (1, 9, None),
                (0, 10, None),
                (1, 10, None),
                (0, 11, None),
                (1, 11, None),
            ],
            [],
        ),
        (
            "reported step times win over the intervals (DDP: every step ends together)",
            2.0,
            2,
            [(0, 1, 0.1), (1, 1, 0.5), (0, 2, 0.1), (1, 2, 0.5), (0, 3, 0.1), (1, 3, 0.5)],
            [("straggler", 1, 2)],
        ),
        (
            "a straggler that catches up is recovered",
            2.0,
            2,
            [(0, 1, 0.1), (1, 1, 0.5), (0, 2, 0.1), (1, 2, 0.5), (0, 3, 0.1), (1, 3, 0.1)],
            [("straggler", 1, 2), ("recovered", 1, 3)],
        ),
        ("one rank alone has no one to be slower than", 2.0, 1, [(0, 1, 5.0), (0, 2, 5.0)], []),
    ],
)
def test_straggler_table(name, factor, steps, schedule, expected):
    assert run(StragglerWatch(factor, steps), schedule) == expected


def test_a_straggler_is_recorded_once_with_its_figures():
    w = StragglerWatch(2.0, 2)
    run(w, [(0, 1, 0.1), (1, 1, 0.4), (0, 2, 0.1), (1, 2, 0.4), (0, 3, 0.1), (1, 3, 0.4), (1, 4, 0.4)])
    assert len(w.recorded) == 1  # still straggling, not raised again
    assert w.recorded[0].as_dict() == {
        "rank": 1,
        "step": 2,
        "step_time_s": 0.4,
        "others_median_s": 0.1,
        "factor": 2.0,
        "consecutive_steps": 2,
        "since_step": 1,
    }
    assert set(w.status()) == {1}


def test_leaving_train_does_not_count_the_time_away_as_a_step():
    w = StragglerWatch(2.0, 1)
    assert run(w, [(0, 1, None), (1, 1, None), (0, 2, None), (1, 2, None)]) == []
    w.left_train(1)  # rank 1 evaluated for a minute
    assert w.step(0, 3, 3.0)[0] is None and w.step(1, 3, 63.0)[0] is None  # no interval across the eval
    assert w.step(1, 4, 64.0)[0] is None


def test_defaults_come_from_the_config_records():
    w = StragglerWatch.from_config(WatchdogCfg())
    assert (w.factor, w.steps) == (2.0, 20)
