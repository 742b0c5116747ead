"""Inbox intake: publishing, the submit pre-check, and what gets rejected with which report."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from fixtures.fakes.inbox_support import jsonl, validator, write  # noqa: E402

from hangwatch.common.inbox_layout import Stage, data_files, move, queue_order, queue_status
from hangwatch.common.transitions import IllegalTransition
from hangwatch.daemon.inbox.assess import validate_only
from hangwatch.daemon.inbox.intake import Inbox
from hangwatch.daemon.inbox.publish import publish


def start(run_dir: Path, **kw) -> Inbox:
    kw.setdefault("settle_s", 0.2)
    return Inbox(run_dir, validator, **kw).start()


def take_all(inbox: Inbox, count: int, timeout: float = 10.0) -> dict:
    """Poll until `count` files were taken; name → result."""
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        for r in inbox.poll():
            results[r.name] = r
        time.sleep(0.02)
    assert len(results) == count, f"took {sorted(results)}, expected {count} files"
    return results


def report_of(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / "rejected" / f"{name}.error.json").read_text())


# --------------------------------------------------------------------------------------------


def test_publish_copies_complete_file_under_a_free_name(tmp_path):
    run = tmp_path / "run"
    src = write(tmp_path / "data.jsonl", jsonl(3, "x"))
    first = publish(src, run)
    second = publish(src, run)
    third = publish(src, run, priority=7)
    assert first == run / "inbox" / "data.jsonl"
    assert second == run / "inbox" / "data-2.jsonl"  # the taken name is never replaced
    assert third == run / "inbox" / "p7-data.jsonl"
    assert all(p.read_bytes() == src.read_bytes() for p in (first, second, third))
    assert sorted(os.listdir(run / "inbox")) == ["data-2.jsonl", "data.jsonl", "p7-data.jsonl"]  # no .tmp- left


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"name": ".hidden.jsonl"}, "would be ignored"),
        ({"name": "upload.part"}, "would be ignored"),
        ({"name": "a/b.jsonl"}, "not a file name"),
        ({"name": "x" * 250}, "longer than 200"),
        ({"priority": 100}, "priority must be an integer from 0 to 99"),
    ],
)
def test_publish_refuses_names_the_inbox_would_not_take(tmp_path, kw, message):
    src = write(tmp_path / "data.jsonl", jsonl(1, "x"))
    with pytest.raises(ValueError, match=message):
        publish(src, tmp_path / "run", **kw)
    assert not (tmp_path / "run" / "inbox").exists() or not os.listdir(tmp_path / "run" / "inbox")


def test_validate_only_says_what_it_accepts_and_why_not(tmp_path):
    run = tmp_path / "run"
    good = write(tmp_path / "good.jsonl", jsonl(4, "g"))
    bad = write(tmp_path / "bad.jsonl", jsonl(2, "b") + "{oops\n")
    again = write(tmp_path / "again.jsonl", jsonl(4, "g"))  # same bytes as good
    verdicts = validate_only([good, bad, again, tmp_path / "missing.jsonl"], validator, run_dir=run)
    assert [v.accepted for v in verdicts] == [True, False, False, False]
    assert verdicts[0].summary() == "good.jsonl: accepted, 4 example(s)"
    assert [r["code"] for r in verdicts[1].reasons] == ["bad_lines"]
    assert verdicts[1].problems == [
        {"line": 3, "error": "not JSON: Expecting property name enclosed in double quotes (column 2)"}
    ]
    assert "line 3: not JSON" in verdicts[1].summary()
    assert verdicts[2].reasons[0]["code"] == "duplicate" and "same submission" in verdicts[2].reasons[0]["message"]
    assert verdicts[3].reasons[0]["code"] == "missing"
    # skip_lines accepts the partly bad file and says how many lines it leaves out
    [partly] = validate_only([bad], validator, on_bad_lines="skip_lines")
    assert partly.accepted and partly.summary() == "bad.jsonl: accepted, 2 example(s), 1 bad line(s) skipped"
    assert not run.exists()  # a pre-check moves and writes nothing


def test_rejections_carry_line_numbers_and_specific_reasons(tmp_path):
    run = tmp_path / "run"
    inbox_dir = run / "inbox"
    write(inbox_dir / "malformed.jsonl", jsonl(2, "m") + '{"prompt": "p", "completion": \n' + jsonl(1, "n"))
    write(inbox_dir / "fields.jsonl", '{"prompt": "only a prompt"}\n' + jsonl(1, "f") + '["a", "list"]\n')
    write(inbox_dir / "long.jsonl", jsonl(1, "l") + json.dumps({"prompt": "p" * 300, "completion": "c"}) + "\n")
    write(inbox_dir / "empty.jsonl", b"")
    write(inbox_dir / "blank.jsonl", "\n  \n\n")
    write(inbox_dir / "binary.jsonl", jsonl(2, "b").encode() + b"\x00\x01\x02PK\x03\x04\n")
    write(inbox_dir / "latin1.jsonl", jsonl(1, "u").encode() + '{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    write(inbox_dir / "huge.jsonl", jsonl(1, "h") + "x" * 5000 + "\n" + jsonl(1, "i"))
    write(inbox_dir / "big.jsonl", jsonl(300, "z"))
    inbox = start(run, max_line_bytes=4096, max_file_bytes=8000)
    try:
        results = take_all(inbox, 9)
    finally:
        inbox.stop()
    assert {r.outcome for r in results.values()} == {"rejected"}
    assert os.listdir(run / "queue") == [] and os.listdir(run / "inbox") == []

    def codes(name):
        return [r["code"] for r in report_of(run, name)["reasons"]]

    rep = report_of(run, "malformed.jsonl")
    assert codes("malformed.jsonl") == ["bad_lines"]
    assert rep["problems"] == [{"line": 3, "error": "not JSON: Expecting value (column 31)"}]
    assert rep["examples_ok"] == 3 and rep["action"] == "reject_file" and rep["rejected_as"] == "malformed.jsonl"

    assert report_of(run, "fields.jsonl")["problems"] == [
        {"line": 1, "error": "missing field(s): completion"},
        {"line": 3, "error": "expected a JSON object, got list"},
    ]
    assert report_of(run, "long.jsonl")["problems"] == [{"line": 2, "error": "example too long: 301 characters > 200"}]

    assert (
        codes("empty.jsonl") == ["empty"]
        and report_of(run, "empty.jsonl")["reasons"][0]["message"] == "empty file (0 bytes)"
    )
    assert report_of(run, "blank.jsonl")["reasons"][0]["message"] == "no data: all 3 line(s) are blank"
    assert report_of(run, "binary.jsonl")["reasons"] == [
        {"code": "binary", "message": "binary file: NUL byte on line 3", "line": 3}
    ]
    assert report_of(run, "latin1.jsonl")["reasons"] == [
        {"code": "not_utf8", "message": "not UTF-8 text: invalid byte 0xe9 on line 2, column 16", "line": 2}
    ]
    assert report_of(run, "huge.jsonl")["reasons"] == [
        {"code": "huge_line", "message": "line 2 is 5000 bytes, longer than the 4096-byte limit", "line": 2}
    ]
    big = report_of(run, "big.jsonl")
    assert (
        codes("big.jsonl") == ["too_large"] and "larger than data.max_file_bytes = 8000" in big["reasons"][0]["message"]
    )
    # nothing is lost: every rejected file keeps its bytes, next to its report
    assert (run / "rejected" / "big.jsonl").read_text() == jsonl(300, "z")
    assert queue_status(run)["rejected"] == 9


def test_partly_bad_file_with_skip_lines_is_queued_and_its_bad_lines_reported(tmp_path):
    run = tmp_path / "run"
    write(run / "inbox" / "mixed.jsonl", jsonl(2, "a") + "garbage\n" + jsonl(1, "b"))
    inbox = start(run, on_bad_lines="skip_lines")
    try:
        [result] = take_all(inbox, 1).values()
    finally:
        inbox.stop()
    assert result.outcome == "queued" and result.assessment.examples == 3
    [queued] = data_files(run, Stage.QUEUED)
    assert queued.name == "mixed.jsonl" and queued.number == 1
    report = json.loads(result.report.read_text())
    assert result.report.name == f"{queued.sha16}-mixed.jsonl.skipped.json"
    assert report["action"] == "skip_lines" and report["queued_as"] == queued.filename
    assert report["problems"] == [{"line": 3, "error": "not JSON: Expecting value (column 1)"}]
    assert queue_status(run)["rejected"] == 0  # a skipped-lines report is not a rejected file


def test_same_content_twice_is_rejected_as_duplicate_and_names_do_not_collide(tmp_path):
    run = tmp_path / "run"
    write(run / "inbox" / "one.jsonl", jsonl(2, "d"), mtime_age=3)
    inbox = start(run)
    try:
        take_all(inbox, 1)
        write(run / "inbox" / "copy.jsonl", jsonl(2, "d"))
        write(run / "inbox" / "x.jsonl", b"")
        take_all(inbox, 2)
        write(run / "inbox" / "x.jsonl", b"\n")  # same name rejected again: both reports kept
        take_all(inbox, 1)
    finally:
        inbox.stop()
    [queued] = data_files(run, Stage.QUEUED)
    dup = report_of(run, "copy.jsonl")["reasons"][0]
    assert dup["code"] == "duplicate" and f"queue/{queued.filename}" in dup["message"]
    assert sorted(os.listdir(run / "rejected")) == [
        "copy.jsonl",
        "copy.jsonl.error.json",
        "x-2.jsonl",
        "x-2.jsonl.error.json",
        "x.jsonl",
        "x.jsonl.error.json",
    ]
    assert report_of(run, "x-2.jsonl")["reasons"][0]["message"] == "no data: all 1 line(s) are blank"


def test_a_failing_validator_rejects_the_file_instead_of_crashing(tmp_path):
    def broken(path):
        raise RuntimeError("tokenizer exploded")

    run = tmp_path / "run"
    write(run / "inbox" / "a.jsonl", jsonl(1, "a"))
    inbox = Inbox(run, broken, settle_s=0)
    result = inbox.intake("a.jsonl")
    assert result.outcome == "rejected"
    assert report_of(run, "a.jsonl")["reasons"] == [
        {"code": "validator_error", "message": "validator failed: RuntimeError: tokenizer exploded"}
    ]


def test_priority_prefix_orders_the_queue_then_arrival(tmp_path):
    run = tmp_path / "run"
    inbox = Inbox(run, validator, settle_s=0)
    for i, name in enumerate(["first.jsonl", "p3-urgent.jsonl", "second.jsonl", "p3-urgent2.jsonl", "p1-soon.jsonl"]):
        write(run / "inbox" / name, jsonl(1, f"t{i}"))
        assert inbox.intake(name).outcome == "queued"
    assert [d.name for d in queue_order(run)] == [
        "p3-urgent.jsonl",
        "p3-urgent2.jsonl",
        "p1-soon.jsonl",
        "first.jsonl",
        "second.jsonl",
    ]


def test_only_legal_stage_moves_are_allowed(tmp_path):
    run = tmp_path / "run"
    write(run / "done" / "00000001-0123456789abcdef-a.jsonl", "x\n")
    with pytest.raises(IllegalTransition, match="done/ → queue/ is not a legal move"):
        move(run, "00000001-0123456789abcdef-a.jsonl", Stage.DONE, Stage.QUEUED)
    with pytest.raises(IllegalTransition):
        move(run, "x", Stage.REJECTED, Stage.INBOX)
    write(run / "processing" / "00000001-0123456789abcdef-a.jsonl", "y\n")
    with pytest.raises(FileExistsError):  # a move never replaces a file
        move(run, "00000001-0123456789abcdef-a.jsonl", Stage.PROCESSING, Stage.DONE)


def test_problems_reported_as_objects_are_written_as_line_and_error(tmp_path):
    class Problem:  # the shape of daemon.data.Problem
        def __init__(self, path, line, message):
            self.path, self.line, self.message = path, line, message

    def objects(path):
        examples, problems = validator(path)
        return examples, [Problem(str(path), p["line"], p["error"]) for p in problems]

    run = tmp_path / "run"
    write(run / "inbox" / "a.jsonl", jsonl(1, "a") + "nope\n")
    assert Inbox(run, objects, settle_s=0).intake("a.jsonl").outcome == "rejected"
    assert report_of(run, "a.jsonl")["problems"] == [{"line": 2, "error": "not JSON: Expecting value (column 1)"}]
