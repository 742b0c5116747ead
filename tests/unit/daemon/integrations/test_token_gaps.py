"""What a generate's progress beats tell the supervisor's token deadline: the longest gap between two decoding
steps since the previous beat (`token_s`), the first decoding step after the prompt left out — on a fake clock,
then through `GenerateWatch` on a real tiny model (the beats stay where they were: every `progress_every` tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hangwatch.common.protocol import decode_line
from hangwatch.daemon.heartbeat import Heartbeat
from hangwatch.daemon.integrations.generation import TOKEN_GAP_FIELD, TokenGaps


class Clock:
    def __init__(self, times):
        self.times = iter(times)

    def __call__(self) -> float:
        return next(self.times)


@pytest.mark.parametrize(
    "ticks, takes, expect",
    [
        # token 1 at 0.0 (the prompt's step), token 2 at 5.0 (a compiled decode step: left out), then 0.1 s apart
        ([0.0, 5.0, 5.1, 5.2, 5.4], [5], [{TOKEN_GAP_FIELD: 0.2}]),
        # nothing timed yet at the first take: that beat arms nothing
        ([0.0, 5.0], [2], [{}]),
        # each take starts over; the gap across a beat belongs to the next one
        ([0.0, 0.5, 0.6, 0.7, 1.7, 1.8], [4, 6], [{TOKEN_GAP_FIELD: 0.1}, {TOKEN_GAP_FIELD: 1.0}]),
    ],
)
def test_the_longest_gap_since_the_last_beat_without_the_first_decoding_step(ticks, takes, expect):
    gaps = TokenGaps(Clock(ticks))
    got = []
    for n in range(1, len(ticks) + 1):
        gaps.tick()
        if n in takes:
            got.append(gaps.take())
    assert [{k: pytest.approx(v) for k, v in g.items()} for g in got] == expect


def test_generate_watch_beats_carry_the_gaps_and_no_beat_is_added(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from hangwatch.daemon.integrations.generation import GenerateWatch

    sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples"))
    import tiny_model

    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok, seed=0)
    hb = Heartbeat(tmp_path / "heartbeat-rank0.jsonl")
    watch = GenerateWatch(hb, progress_every=8)
    watch.install(model)
    try:
        enc = tok("question 7:", return_tensors="pt", return_token_type_ids=False)
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=24, min_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        watch.uninstall()
    recs = [decode_line(x) for x in Path(hb.path).read_bytes().splitlines()]
    progress = [r for r in recs if r["event"] == "progress"]
    assert [r["tokens"] for r in progress] == [8, 16, 24]
    assert all(isinstance(r[TOKEN_GAP_FIELD], float) and 0 <= r[TOKEN_GAP_FIELD] < 5 for r in progress), progress
