"""Continuous mode through the running worker (`python -m hangwatch.daemon`, the tiny model, the real
validator and tokenizer): intake and rejection reports, the idle phase and a file published while
idle, a graceful stop, files that arrive while the worker is down, the skip_lines choice, and the
end of a run on `data.idle_exit_s`.  And `hangwatch submit`, which checks files the same way."""

from __future__ import annotations

import json
import os
import signal

import pytest
from click.testing import CliRunner
from fixtures.fakes.continuous_support import (  # noqa: E402
    drop_all,
    example_ids,
    good_file,
    inbox_config,
    ledger,
    leftovers,
    lines_of,
    names_in,
    read_jsonl,
    report,
    sha16,
)
from fixtures.fakes.workers import read_beats, run_worker, start_worker, wait_for_beat  # noqa: E402

from hangwatch.common.inbox_layout import Stage, queue_status  # noqa: E402
from hangwatch.daemon.inbox.publish import publish  # noqa: E402

GOOD = {"prompt": "upper: cat", "completion": "CAT"}
TOO_LONG = {"prompt": "reverse: " + "abcdefghij" * 6, "completion": "x"}  # > data.max_length = 48 tokens
NOTHING_TO_LEARN = {"prompt": "upper: cat", "completion": "   "}


def bad_files() -> dict[str, bytes]:
    return {
        # one of each line-level problem; data.on_bad_lines = reject_file rejects the file whole
        "mixed.jsonl": lines_of(
            [GOOD, '{"prompt": "upper: dog", "completion": ', {"prompt": "upper: sun"}, TOO_LONG, NOTHING_TO_LEARN]
        ),
        "toolong.jsonl": lines_of([TOO_LONG, TOO_LONG]),
        "empty.jsonl": b"",
        "blob.bin": bytes(range(256)) * 4,
        "huge.jsonl": lines_of([GOOD, {"prompt": "x" * (1 << 20), "completion": "y"}]),
    }


def by_line(rep: dict) -> dict[int, str]:
    return {p["line"]: p["error"] for p in rep["problems"]}


@pytest.mark.slow
def test_worker_takes_files_rejects_bad_ones_idles_and_resumes_with_files_from_while_it_was_down(tmp_path):
    run = tmp_path / "run"
    good1, good2, good3 = good_file(6, 11), good_file(10, 12), good_file(5, 13)
    partly = lines_of(
        [
            {"prompt": "double: owl", "completion": "owlowl"},
            "{not json",
            {"prompt": "upper: fox"},
            {"prompt": "upper: bee", "completion": "BEE"},
            {"prompt": "upper: elk", "completion": "ELK"},
        ]
    )
    drop_all(run, {"good1.jsonl": good1, **bad_files()})  # there before the worker starts

    # Attempt 1: waits for files for ever (idle_exit_s null); stopped with SIGTERM.
    config = inbox_config(tmp_path)
    p = start_worker(config, log=tmp_path / "worker.log")
    try:
        # good1's 6 examples fill one step of 4 and half the next, which then waits in `idle`
        idle = wait_for_beat(run, 1, lambda b: b["event"] == "phase" and b["phase"] == "idle", p)
        assert idle["step"] == 1 and idle["waiting_examples"] == 2
        # idle beats keep coming (the silence deadline still holds there)
        wait_for_beat(run, 1, lambda b: b["event"] == "progress" and b["phase"] == "idle" and b["idle_s"] >= 2, p)
        # every bad file was taken in (and rejected) before training began
        q = queue_status(run)
        assert (q["rejected"], q["waiting"], q["processing"], q["done"]) == (5, 0, 1, 0)

        publish_path = tmp_path / "good2.jsonl"
        publish_path.write_bytes(good2)
        publish(publish_path, run)  # what `hangwatch submit` does: copy, then rename into inbox/
        wait_for_beat(
            run, 1, lambda b: b["event"] == "phase" and b["phase"] == "intake" and b["file"] == "good2.jsonl", p
        )
        # the waiting step is completed with good2's first examples, and training goes on until it is dry again
        wait_for_beat(run, 1, lambda b: b["event"] == "step" and b["step"] == 2, p)
        wait_for_beat(run, 1, lambda b: b["event"] == "phase" and b["phase"] == "idle" and b["step"] > 2, p)
        os.kill(p.pid, signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    beats1 = read_beats(run, 1)
    assert beats1[-1]["event"] == "stop" and beats1[-1]["reason"] == "terminated"
    rejected_warns = {b["file"] for b in beats1 if b["event"] == "warn" and b["message"].startswith("inbox: rejected")}
    assert rejected_warns == set(bad_files())

    # While the worker is down: two more files arrive; the restart takes a partly bad one's good lines.
    drop_all(run, {"good3.jsonl": good3, "partly.jsonl": partly})
    config2 = inbox_config(tmp_path, "config2.yaml", data={"on_bad_lines": "skip_lines", "idle_exit_s": 1.5})
    assert run_worker(config2, log=tmp_path / "worker.log", timeout=180) == 0

    beats2 = read_beats(run, 2)
    # a graceful stop loses no step: the checkpoint of the step it stopped at is resumed
    assert beats2[0]["event"] == "start" and beats2[0]["resumed_step"] == beats1[-1]["step"]
    assert {b["file"] for b in beats2 if b["event"] == "phase" and b["phase"] == "intake"} == {
        "good3.jsonl",
        "partly.jsonl",
    }
    assert beats2[-1]["event"] == "stop" and beats2[-1]["reason"] == "idle"
    assert (run / "final" / "adapter_model.safetensors").is_file()

    # Every good example trained exactly once, in the order the files came, and every file is done or rejected.
    ids = [e["id"] for e in ledger(run)]
    assert ids == (
        example_ids(good1) + example_ids(good2) + example_ids(good3) + example_ids(partly, good_lines=[1, 4, 5])
    )
    assert leftovers(run) == {}
    assert names_in(run, Stage.DONE) == ["good1.jsonl", "good2.jsonl", "good3.jsonl", "partly.jsonl"]
    replays = read_jsonl(run / "done" / "replay.jsonl")
    assert [r["n"] for r in replays] == list(range(1, len(replays) + 1))
    assert set(r["id"] for r in replays) <= set(ids)
    q = queue_status(run)
    assert (q["waiting"], q["done"], q["rejected"], q["ledger_examples"]) == (0, 4, 5, len(ids))

    # The rejection reports: each bad line, and why.
    mixed = report(run, "mixed.jsonl")
    assert [r["code"] for r in mixed["reasons"]] == ["bad_lines"] and mixed["examples_ok"] == 1
    lines = by_line(mixed)
    assert sorted(lines) == [2, 3, 4, 5]
    assert "not valid JSON" in lines[2]
    assert "missing key 'completion'" in lines[3]
    assert "longer than data.max_length=48 (data.truncation: reject)" in lines[4]
    assert "nothing to learn" in lines[5]
    toolong = report(run, "toolong.jsonl")
    assert [r["code"] for r in toolong["reasons"]] == ["no_examples"]
    assert sorted(by_line(toolong)) == [1, 2] and all("data.truncation: reject" in e for e in by_line(toolong).values())
    assert [r["code"] for r in report(run, "empty.jsonl")["reasons"]] == ["empty"]
    assert [r["code"] for r in report(run, "blob.bin")["reasons"]] == ["binary"]
    huge = report(run, "huge.jsonl")["reasons"]
    assert [(r["code"], r["line"]) for r in huge] == [("huge_line", 2)]
    for name, data in bad_files().items():
        assert (run / "rejected" / name).read_bytes() == data  # kept as it came, beside its report
    skipped = json.loads((run / "rejected" / f"{sha16(partly)}-partly.jsonl.skipped.json").read_text())
    assert skipped["action"] == "skip_lines" and sorted(by_line(skipped)) == [2, 3]


def test_submit_checks_with_the_run_tokenizer_and_publishes_good_files(tmp_path):
    config = inbox_config(tmp_path)
    run = tmp_path / "run"
    good = tmp_path / "good.jsonl"
    good.write_bytes(good_file(3, 21))
    long = tmp_path / "long.jsonl"
    long.write_bytes(lines_of([GOOD, TOO_LONG]))
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    from hangwatch.supervisor.cli.main import main

    result = CliRunner().invoke(
        main, ["submit", str(good), str(long), str(empty), "--config", str(config), "--priority", "5"]
    )
    assert result.exit_code == 65, result.output
    out = result.output.splitlines()
    assert out[0] == "accepted good.jsonl (3 examples) as inbox/p5-good.jsonl"
    assert out[1].startswith("rejected long.jsonl: 1 of 2 example line(s) are bad")
    assert "line 2: " in out[1] and "data.truncation: reject" in out[1]
    assert out[2] == "rejected empty.jsonl: empty file (0 bytes)"
    assert sorted(os.listdir(run / "inbox")) == ["p5-good.jsonl"]  # nothing half-written, nothing rejected
    assert (run / "inbox" / "p5-good.jsonl").read_bytes() == good.read_bytes()

    # By run dir alone (the config as run is read from there); the same content again is refused
    # once the worker has it.
    (run / "config.yaml").write_text(config.read_text())
    (run / "queue").mkdir()
    os.rename(run / "inbox" / "p5-good.jsonl", run / "queue" / f"00000001-{sha16(good.read_bytes())}-p5-good.jsonl")
    result = CliRunner().invoke(main, ["submit", str(good), "--run-dir", str(run)])
    assert result.exit_code == 65 and "same content" in result.output

    result = CliRunner().invoke(main, ["submit", str(good), "--run-dir", str(tmp_path / "nowhere")])
    assert result.exit_code == 78 and "no config.yaml" in result.output


def test_a_training_file_and_the_inbox_exclude_each_other(tmp_path):
    from hangwatch.common.config import ConfigError, load_config

    config = inbox_config(tmp_path, data={"train": "data/train.jsonl"})
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert "data.train and data.inbox: true exclude each other" in str(err.value)
    assert load_config(inbox_config(tmp_path, "ok.yaml")).data.train is None
