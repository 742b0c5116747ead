"""The out-of-memory ladder (`common.oom_ladder`), table-tested: the one rule the supervisor's restarts
(`supervisor.rules.oom_remediation`), the worker's own process (`daemon.trainer.recovery.smaller`) and a framework
script's batch (`supervisor.concerns.framework_oom.next_setting`, without the gradient-checkpointing rung) walk."""

from __future__ import annotations

import pytest

from hangwatch.common.oom_ladder import Rung, next_rung, smaller_micro


@pytest.mark.parametrize(
    "now, after",
    [
        (Rung(4, 2), Rung(2, 4)),
        (Rung(2, 4), Rung(1, 8)),
        (Rung(1, 8), Rung(1, 8, True)),
        (Rung(1, 8, True), None),
        (Rung(3, 1), Rung(1, 3)),  # no even half: the largest divisor at most half
        (Rung(6, 1), Rung(3, 2)),
        (Rung(12, 5, True), Rung(6, 10, True)),  # configured with checkpointing: it stays on
        (Rung(1, 1), Rung(1, 1, True)),
    ],
)
def test_ladder(now, after):
    assert next_rung(now) == after
    if after is not None:
        assert after.effective == now.effective  # the effective batch never changes


@pytest.mark.parametrize(
    "now, after",
    [
        (Rung(4, 2), Rung(2, 4)),
        (Rung(9, 1), Rung(3, 3)),  # odd: the largest divisor at most half
        (Rung(7, 2), Rung(1, 14)),  # a prime: down to 1 at once
        (Rung(2, 1), Rung(1, 2)),
        (Rung(1, 8), None),  # no gradient-checkpointing rung: the ladder ends at 1
        (Rung(12, 5, True), Rung(6, 10, True)),
    ],
)
def test_ladder_without_checkpointing_ends_at_micro_batch_one(now, after):
    assert next_rung(now, checkpointing=False) == after
    if after is not None:
        assert after.effective == now.effective


@pytest.mark.parametrize(
    "micro, smaller", [(0, None), (1, None), (2, 1), (3, 1), (4, 2), (6, 3), (9, 3), (15, 5), (16, 8), (17, 1)]
)
def test_smaller_micro_is_half_or_the_largest_divisor_at_most_half(micro, smaller):
    assert smaller_micro(micro) == smaller


def test_a_rung_in_words_and_as_a_record():
    r = Rung(2, 4)
    assert r.gradient_checkpointing is False and r.effective == 8
    assert r.words() == "micro_batch_size 2 × grad_accum 4"
    assert Rung(1, 8, True).words() == "micro_batch_size 1 × grad_accum 8, gradient checkpointing"
    # remediation.json's and the worker's `oom_adapted` key order
    assert list(r.as_dict().items()) == [("micro_batch_size", 2), ("grad_accum", 4), ("gradient_checkpointing", False)]
    assert Rung(**r.as_dict()) == r


def test_every_side_walks_the_same_rule():
    from hangwatch.daemon.trainer.recovery import smaller
    from hangwatch.supervisor.concerns.framework_oom import next_setting

    for micro in range(1, 65):
        for accum in (1, 3):
            for gc in (False, True):
                r = Rung(micro, accum, gc)
                assert smaller(r) == next_rung(r)  # the worker's own process: the supervisor's restarts' rungs
            down = next_rung(Rung(micro, accum), checkpointing=False)
            assert next_setting(micro, accum) == (None if down is None else (down.micro_batch_size, down.grad_accum))
