"""The checkpoint ledger: which announced checkpoints are good, which one an attempt resumes from, and
its record in the run dir (supervisor/records/checkpoint_ledger.py).

Table-driven over beat sequences on the pure `CheckpointLedger`; then the persisted record (round
trip, a corrupt file set aside, a refused write through the FsOps seam), the facts state.json shows,
and what an attempt is handed (`attempt.worker_env`, `attempt.worker_argv`).
"""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import ENV_RESUME_FROM
from hangwatch.supervisor.processes.attempt import worker_argv, worker_env
from hangwatch.supervisor.records import checkpoint_ledger as cl
from hangwatch.supervisor.records.checkpoint_ledger import CheckpointLedger, PersistedLedger, loss_of
from hangwatch.supervisor.records.run_state import RunRecord

NAN, INF = float("nan"), float("inf")
NO_LOSS = object()


def ck(path, step, good=False, rank=0, attempt=1):
    return attempt, {"event": "checkpoint", "path": path, "step": step, "good": good, "rank": rank, "t": 1.0}


def st(step, loss=1.0, rank=0, attempt=1):
    rec = {"event": "step", "step": step, "rank": rank}
    if loss is not NO_LOSS:
        rec["loss"] = loss
    return attempt, rec


def warn(step=0, attempt=1, **fields):
    return attempt, {"event": "warn", "step": step, "rank": 0, "message": "non-finite loss", **fields}


def end(attempt=1):
    return attempt, None


def feed(beats, confirm_steps=2) -> CheckpointLedger:
    book = CheckpointLedger(confirm_steps)
    for attempt, rec in beats:
        if rec is None:
            book.attempt_ended(attempt)
        else:
            book.observe(rec, attempt)
    return book


# (id, confirm_steps, beats, {path: (status, words in `why`)}, last good)
CASES = [
    (
        "two finite steps confirm",
        2,
        [st(3), ck("a", 4), st(5), st(6, 0.9)],
        {"a": ("good", "confirmed by finite loss at steps 5, 6")},
        "a",
    ),
    ("one step is not enough", 2, [ck("a", 4), st(5)], {"a": ("pending", "")}, None),
    ("nan after it spoils it", 2, [ck("a", 4), st(5, NAN)], {"a": ("bad", "loss nan at step 5")}, None),
    ("inf spoils it too", 2, [ck("a", 4), st(5, INF)], {"a": ("bad", "loss inf at step 5")}, None),
    (
        "nan after the confirmation spoils only the newer one",
        2,
        [ck("a", 2), st(3), st(4), ck("b", 4), st(5), st(6, NAN), st(7)],
        {"a": ("good", "steps 3, 4"), "b": ("bad", "loss nan at step 6")},
        "a",
    ),
    ("nan before the checkpoint is not about it", 2, [st(3, NAN), ck("a", 4), st(5), st(6)], {"a": ("good", "")}, "a"),
    ("good=True is good at once", 2, [ck("a", 4, good=True)], {"a": ("good", "announced good by the worker")}, "a"),
    (
        "the built-in worker's confirmation of a pending one",
        2,
        [ck("a", 4), st(5), ck("a", 4, good=True)],
        {"a": ("good", "announced good by the worker")},
        "a",
    ),
    (
        "the worker's word wins over a nan the supervisor saw",
        2,
        [ck("a", 4), st(5, NAN), ck("a", 4, good=True)],
        {"a": ("good", "the supervisor had seen: loss nan at step 5")},
        "a",
    ),
    (
        "a later attempt's re-save replaces the record",
        2,
        [ck("a", 4), st(5), st(6), end(1), ck("a", 4, attempt=2)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "a re-save spoiled in the later attempt",
        2,
        [ck("a", 4), st(5), st(6), end(1), ck("a", 4, attempt=2), st(5, NAN, attempt=2)],
        {"a": ("bad", "loss nan at step 5")},
        None,
    ),
    (
        "the same checkpoint from another rank changes nothing",
        2,
        [ck("a", 4), st(5), st(6), ck("a", 4, rank=1)],
        {"a": ("good", "")},
        "a",
    ),
    (
        "a 'latest' path saved again at a newer step waits again",
        2,
        [ck("last", 4), st(5), st(6), ck("last", 8)],
        {"last": ("pending", "")},
        None,
    ),
    (
        "steps not above its own confirm nothing",
        2,
        [ck("a", 4), st(4), st(4, rank=1), st(3)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "several ranks' beats of one step count once",
        2,
        [ck("a", 4), st(5), st(5, rank=1)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "another step from any rank completes it",
        2,
        [ck("a", 4), st(5), st(5, rank=1), st(6, rank=1)],
        {"a": ("good", "steps 5, 6")},
        "a",
    ),
    (
        "a lagging rank's nan spoils it whatever the step",
        2,
        [ck("a", 4), st(5), st(3, NAN, rank=1)],
        {"a": ("bad", "loss nan at step 3")},
        None,
    ),
    (
        "lossless steps of a worker that reports losses count for nothing",
        2,
        [st(1), ck("a", 4), st(5, NO_LOSS), st(6, NO_LOSS), st(7)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "... only its reported losses do",
        2,
        [st(1), ck("a", 4), st(5, NO_LOSS), st(6, NO_LOSS), st(7), st(8, None)],
        {"a": ("pending", "")},
        None,
    ),
    ("... and confirm it", 2, [st(1), ck("a", 4), st(5, NO_LOSS), st(7), st(9)], {"a": ("good", "steps 7, 9")}, "a"),
    (
        "a worker that never reports a loss is judged on its steps",
        2,
        [ck("a", 4), st(5, NO_LOSS), st(6, NO_LOSS)],
        {"a": ("good", "this worker reports no loss")},
        "a",
    ),
    (
        "an attempt that ends first leaves it unconfirmed",
        2,
        [ck("a", 4), st(5), end(1)],
        {"a": ("unconfirmed", "attempt 1 ended before 2 later steps")},
        None,
    ),
    (
        "another attempt's steps do not confirm it",
        2,
        [ck("a", 10), st(11, attempt=2), st(12, attempt=2)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "another attempt's nan does not spoil it",
        2,
        [ck("a", 4), st(5), st(5, NAN, attempt=2)],
        {"a": ("pending", "")},
        None,
    ),
    (
        "a warn with a non-finite loss spoils it",
        2,
        [ck("a", 4), warn(5, loss=NAN)],
        {"a": ("bad", "loss nan at step 5")},
        None,
    ),
    (
        "the built-in worker withdrawing it spoils it",
        2,
        [ck("a", 4), ck("b", 6), warn(7, unconfirmed_checkpoints=["b"])],
        {"a": ("pending", ""), "b": ("bad", "the worker withdrew it: non-finite loss")},
        None,
    ),
    (
        "a tensor's string is read as its number",
        2,
        [ck("a", 4), st(5, "tensor(0.5000, grad_fn=<NllLossBackward0>)"), st(6, "tensor(nan)")],
        {"a": ("bad", "loss nan at step 6")},
        None,
    ),
    ("confirm_steps 0: good when announced", 0, [ck("a", 4)], {"a": ("good", "confirm_steps is 0")}, "a"),
    (
        "newest: highest step, then latest announced",
        2,
        [ck("a", 4, good=True), ck("b", 8, good=True), ck("c", 8, good=True), ck("d", 2, good=True)],
        {"c": ("good", "")},
        "c",
    ),
    ("a beat without a path is ignored", 2, [(1, {"event": "checkpoint", "step": 4, "good": True})], {}, None),
]


@pytest.mark.parametrize("confirm_steps, beats, expected, last", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_beat_sequences(confirm_steps, beats, expected, last):
    book = feed(beats, confirm_steps)
    for path, (status, words) in expected.items():
        e = book.entries[path]
        assert (e.status, e.good) == (status, status == "good"), (path, e)
        assert words in e.why, (path, e.why)
    good = book.last_good()
    assert (good.path if good else None) == last


@pytest.mark.parametrize(
    "raw, value",
    [
        (1.5, 1.5),
        (2, 2.0),
        (None, None),
        (True, None),
        ("nan", NAN),
        ("x", None),
        ("tensor(0.25, device='cuda:0')", 0.25),
        ({"a": 1}, None),
    ],
)
def test_loss_of(raw, value):
    got = loss_of({"loss": raw})
    assert (got is None and value is None) or (got == value or (got != got and value != value))
    assert loss_of({}) is None


def test_the_lossless_warning_is_said_once():
    book = CheckpointLedger(1)
    kinds = [
        c.kind for beat in (ck("a", 1), st(2, NO_LOSS), ck("b", 2), st(3, NO_LOSS)) for c in book.observe(beat[1], 1)
    ]
    assert kinds.count("lossless") == 1 and kinds.count("good") == 2


def test_the_resume_point_skips_good_checkpoints_that_are_gone():
    book = feed([ck("a", 4, good=True), ck("b", 8, good=True), ck("c", 12), st(13)])
    chosen, skipped = book.resume_point(lambda e: e.path == "a")
    assert chosen.path == "a" and [e.path for e in skipped] == ["b"]
    assert book.resume_point(lambda e: False) == (None, book.good())
    assert book.last_good().path == "b"  # the record itself does not look at the disk


def test_settled_records_are_pruned_but_the_newest_good_one_is_kept(monkeypatch):
    monkeypatch.setattr(cl, "MAX_KEPT", 3)
    book = feed([ck("g", 100, good=True)] + [ck(f"x{i}", i) for i in range(6)] + [end(1)] + [ck("p", 7, attempt=2)])
    settled = {p for p, e in book.entries.items() if e.status != "pending"}
    assert (
        settled == {"g", "x3", "x4", "x5"} and "p" in book.entries
    )  # the newest 3, the newest good one, the pending one
    book.observe(ck("y", 200, attempt=2)[1], 2)
    assert set(book.entries) == {"g", "x3", "x4", "x5", "p", "y"}


# ---- the record in the run dir -----------------------------------------------------------------------


def persisted(tmp_path, fs=None) -> PersistedLedger:
    led = PersistedLedger(tmp_path, 2, fs=fs)
    assert led.load() is None
    return led


def test_the_record_round_trips_and_a_new_supervisor_finds_pending_ones_unconfirmed(tmp_path):
    led = persisted(tmp_path)
    for attempt, rec in [ck("a", 2), st(3), st(4), ck("b", 4), st(5, NAN), ck("c", 6), st(7)]:
        led.observe(rec, attempt)
    data = json.loads((tmp_path / "checkpoints.json").read_text())
    assert data["last_good"] == "a" and [c["status"] for c in data["checkpoints"]] == ["good", "bad", "pending"]
    again = persisted(tmp_path)
    got = {p: (e.status, e.why) for p, e in again.ledger.entries.items()}
    assert got["a"][0] == "good" and got["b"] == ("bad", "loss nan at step 5")
    assert got["c"][0] == "unconfirmed" and "ended (with its supervisor)" in got["c"][1]
    assert again.ledger.loss_reported and again.ledger.last_good().path == "a"
    nxt = again.ledger.observe(ck("d", 9)[1], 2)  # announcement order goes on after the loaded ones
    assert nxt[0].entry.seq > max(e.seq for p, e in again.ledger.entries.items() if p != "d")


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "[]",
        json.dumps({"version": 99, "checkpoints": []}),
        json.dumps({"version": 1, "checkpoints": [{"path": "a"}]}),
        json.dumps(
            {
                "version": 1,
                "checkpoints": [{"path": "a", "step": 1, "status": "great", "attempt": 1, "rank": 0, "seq": 1}],
            }
        ),
    ],
)
def test_a_corrupt_record_is_set_aside_and_the_run_starts_empty(tmp_path, content):
    (tmp_path / "checkpoints.json").write_text(content)
    led = PersistedLedger(tmp_path, 2)
    problem = led.load()
    assert problem and "set aside as checkpoints.json.corrupt-" in problem and "unusable" in problem
    assert led.ledger.entries == {} and not (tmp_path / "checkpoints.json").exists()
    aside = list(tmp_path.glob("checkpoints.json.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_text() == content  # the evidence is kept, byte for byte
    led.observe(ck("a", 1, good=True)[1], 1)
    assert json.loads((tmp_path / "checkpoints.json").read_text())["last_good"] == "a"


class RefusingFs(FsOps):
    """Refuses every write_json and rename while `refuse` is set."""

    def __init__(self):
        self.refuse, self.refused = True, 0

    def write_json(self, path, data, durable=True):
        if self.refuse:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        super().write_json(path, data, durable)

    def rename(self, src, dst):
        if self.refuse:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(src))
        super().rename(src, dst)


def test_a_refused_write_is_logged_and_the_record_lives_on_in_memory(tmp_path):
    fs = RefusingFs()
    led = persisted(tmp_path, fs)
    with capture_logs() as logs:
        for attempt, rec in [ck("a", 2), st(3), st(4)]:
            led.observe(rec, attempt)  # no exception escapes
    assert fs.refused == 2 and led.dirty and led.ledger.last_good().path == "a"
    assert any(r["event"] == "checkpoint_ledger_not_saved" and "No space left" in r["error"] for r in logs)
    assert not (tmp_path / "checkpoints.json").exists()
    fs.refuse = False
    led.observe(ck("b", 4)[1], 1)  # the next change writes all of it
    data = json.loads((tmp_path / "checkpoints.json").read_text())
    assert not led.dirty and data["last_good"] == "a" and [c["path"] for c in data["checkpoints"]] == ["a", "b"]


def test_a_corrupt_record_that_cannot_be_set_aside_is_never_overwritten(tmp_path):
    (tmp_path / "checkpoints.json").write_text("garbage")
    fs = RefusingFs()
    led = PersistedLedger(tmp_path, 2, fs=fs)
    assert "could not be set aside" in led.load()
    fs.refuse = False
    led.observe(ck("a", 1, good=True)[1], 1)
    assert led.ledger.last_good().path == "a" and (tmp_path / "checkpoints.json").read_text() == "garbage"


# ---- what state.json shows, what an attempt is handed ---------------------------------------------------


def test_the_facts_are_the_ledgers_answer():
    book = feed([ck("a", 2, good=True), ck("b", 4), st(5, NAN)])
    facts = RunRecord(restarts=1, checkpoints=book)
    assert (facts.last_good_checkpoint, facts.last_good_step) == ("a", 2)
    book.observe(ck("c", 6, good=True)[1], 2)
    assert (facts.last_good_checkpoint, facts.last_good_step) == ("c", 6)
    # An older supervisor's state.json seeds an empty ledger only: a record of its own wins.
    seeded = RunRecord.from_previous({"last_good_checkpoint": "old", "last_good_step": 3}, CheckpointLedger())
    assert (seeded.last_good_checkpoint, seeded.last_good_step) == ("old", 3)
    assert RunRecord.from_previous({"last_good_checkpoint": "old"}, feed([ck("x", 9)])).last_good_checkpoint is None


def cfg(tmp_path, **worker) -> Config:
    return Config.model_validate({"run_dir": str(tmp_path / "run"), "worker": worker})


@pytest.mark.parametrize(
    "command, first",
    [
        (["python", "train.py"], sys.executable),
        (["python3", "-u", "train.py"], sys.executable),
        (["python3.11", "train.py"], "python3.11"),
        (["/usr/bin/python", "train.py"], "/usr/bin/python"),
        (["torchrun", "--nproc-per-node=2", "train.py"], "torchrun"),
    ],
)
def test_a_bare_python_is_the_supervisors_own_interpreter(tmp_path, command, first):
    argv = worker_argv(cfg(tmp_path, command=command), tmp_path / "run" / "config.yaml")
    assert argv == [first, *command[1:]]


def test_every_attempt_is_told_what_to_resume_from(tmp_path):
    c = cfg(tmp_path, command=["python", "train.py"], env={ENV_RESUME_FROM: "/configured"})
    assert worker_env(c, 1, environ={ENV_RESUME_FROM: "/inherited"})[ENV_RESUME_FROM] == ""
    assert worker_env(c, 2, environ={}, resume_from="/ck/step-4")[ENV_RESUME_FROM] == "/ck/step-4"


def test_relative_paths_are_the_workers(tmp_path):
    assert cl.resolved_path("out/ckpt-4", str(tmp_path)) == str(tmp_path / "out" / "ckpt-4")
    assert cl.resolved_path("/abs/../abs/x", str(tmp_path)) == "/abs/x"
    assert Path(cl.resolved_path("x", None)) == Path.cwd() / "x"


def test_the_run_summary_names_the_last_good_checkpoint_and_why_newer_ones_are_not(tmp_path):
    from hangwatch.supervisor.cli.summary import checkpoint_lines, checkpoint_text

    assert checkpoint_lines(tmp_path) == []  # no record, nothing said
    led = persisted(tmp_path)
    for attempt, rec in [ck("a", 2), st(3), st(4), ck("b", 4), st(5, NAN)]:
        led.observe(rec, attempt)
    assert checkpoint_lines(tmp_path) == [
        "  last good checkpoint: a (step 2)",
        "  checkpoint b (step 4) is not good: loss nan at step 5",
    ]
    foreign = Config.model_validate(
        {"run_dir": str(tmp_path), "worker": {"command": ["python", "t.py"]}, "checkpoint": {"confirm_steps": 3}}
    )
    assert "good after 3 later steps with a finite loss" in checkpoint_text(foreign)
