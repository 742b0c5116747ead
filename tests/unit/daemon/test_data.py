"""Data: label masking, truncation, bad lines reported with file and line, unusable data → exit 65."""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.workers import make_config, run_in_process, write_jsonl

from hangwatch.common.config import load_config
from hangwatch.daemon.data import IGNORE_INDEX, ShuffledEpochs, validate_file
from hangwatch.daemon.model import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(128)


def cfg_with(tmp_path, **data):
    return load_config(make_config(tmp_path, data=data))


def test_prompt_is_masked_and_completion_learned(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "upper: cat", "completion": "CAT"}])
    (ex,), problems = validate_file(f, tok, cfg_with(tmp_path))
    assert problems == []
    learned = [(i, t) for i, (t, l) in enumerate(zip(ex.input_ids, ex.labels)) if l != IGNORE_INDEX]
    # exactly the completion's characters and the end-of-sequence token, at the end, labelled with themselves
    assert tok.decode([t for _, t in learned]) == "CAT</s>"
    assert [i for i, _ in learned] == list(range(len(ex.input_ids) - 4, len(ex.input_ids)))
    assert all(ex.labels[i] == ex.input_ids[i] for i, _ in learned)
    assert tok.decode(ex.input_ids[: len(ex.input_ids) - 4]) == "<s><|user|>upper: cat<|assistant|>"
    assert ex.id == "d.jsonl:1" and ex.line == 1


def test_messages_learn_only_the_last_assistant_turn(tmp_path, tok):
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "ok"},
    ]
    f = write_jsonl(tmp_path / "d.jsonl", [{"messages": msgs}])
    (ex,), problems = validate_file(f, tok, cfg_with(tmp_path))
    assert problems == []
    assert tok.decode([t for t, l in zip(ex.input_ids, ex.labels) if l != IGNORE_INDEX]) == "ok</s>"
    assert "yo" in tok.decode(ex.input_ids)


def test_truncation_keeps_the_completion(tmp_path, tok):
    long_prompt = "reverse: " + "abcdefghij" * 10
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": long_prompt, "completion": "done"}])
    (ex,), problems = validate_file(f, tok, cfg_with(tmp_path, max_length=32))
    assert problems == [] and ex.truncated
    assert len(ex.input_ids) == 32
    assert tok.decode([t for t, l in zip(ex.input_ids, ex.labels) if l != IGNORE_INDEX]) == "done</s>"
    # the prompt lost its start, not its end
    assert tok.decode(ex.input_ids[:-5]).endswith("hij<|assistant|>")


def test_truncation_reject_and_completion_too_long(tmp_path, tok):
    rows = [
        {"prompt": "p" * 100, "completion": "x"},
        {"prompt": "p", "completion": "y" * 100},
        {"prompt": "ok", "completion": "fine"},
    ]
    f = write_jsonl(tmp_path / "d.jsonl", rows)
    examples, problems = validate_file(f, tok, cfg_with(tmp_path, max_length=32, truncation="reject"))
    assert [e.line for e in examples] == [3]
    assert [p.line for p in problems] == [1, 2]
    assert "data.truncation: reject" in problems[0].message
    examples, problems = validate_file(f, tok, cfg_with(tmp_path, max_length=32, truncation="keep_completion"))
    assert [e.line for e in examples] == [1, 3]
    assert [p.line for p in problems] == [2] and "completion alone" in problems[0].message


def test_bad_lines_are_reported_with_file_line_and_reason(tmp_path, tok):
    lines = [
        '{"prompt": "a", "completion": "b"}',
        '{"prompt": "a", "completion": ',  # 2: torn JSON
        '["not", "an", "object"]',  # 3
        '{"prompt": "a"}',  # 4: no completion
        '{"prompt": 3, "completion": "x"}',  # 5: wrong type
        "",  # blank: ignored
        '{"prompt": "a", "completion": "   "}',  # 7: nothing to learn
        '{"messages": [{"role": "user", "content": "q"}]}',  # 8: no assistant turn
        '{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}',  # 9
        '{"text": "hello"}',  # 10: unknown format
    ]
    f = write_jsonl(tmp_path / "mixed.jsonl", lines)
    examples, problems = validate_file(f, tok, cfg_with(tmp_path))
    assert [e.line for e in examples] == [1]
    by_line = {p.line: p.message for p in problems}
    assert sorted(by_line) == [2, 3, 4, 5, 7, 8, 9, 10]
    assert "not valid JSON" in by_line[2]
    assert "expected a JSON object" in by_line[3]
    assert "missing key 'completion'" in by_line[4]
    assert "'prompt' must be a string" in by_line[5]
    assert "nothing to learn" in by_line[7]
    assert "last message must be the assistant" in by_line[8]
    assert "robot" in by_line[9]
    assert "expected keys" in by_line[10]
    assert str(problems[0]).startswith(f"{f}:2: ")


def test_order_depends_on_seed_and_epoch_and_resumes_from_position(tmp_path, tok):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(10)])
    examples, _ = validate_file(f, tok, cfg_with(tmp_path))
    a = ShuffledEpochs(examples, seed=3)
    first = [e.id for e in a.take(25)]  # crosses two epoch boundaries
    assert sorted(first[:10]) == sorted(e.id for e in examples) and first[:10] != first[10:20]
    b = ShuffledEpochs(examples, seed=3)
    b.take(13)
    pos = json.loads(json.dumps(b.position()))
    assert pos["epoch"] == 1 and pos["index"] == 3
    c = ShuffledEpochs(examples, seed=3)
    c.restore(pos)
    assert [e.id for e in c.take(12)] == first[13:25]
    assert [e.id for e in ShuffledEpochs(examples, seed=4).take(10)] != first[:10]


def test_no_usable_example_exits_65_with_last_words(tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", ['{"prompt": 1}', "nope"])
    config = make_config(tmp_path, data={"train": str(bad)})
    assert run_in_process(config) == 65
    words = json.loads((tmp_path / "run" / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "data_error"
    assert any(p.startswith(f"{bad}:1: ") for p in words["problems"])
    assert any(p.startswith(f"{bad}:2: not valid JSON") for p in words["problems"])
