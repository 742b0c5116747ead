"""`IncidentStore.open_for_run`, the one way an incident of the run is opened: the record's fields in the order the
openers always wrote them, the run's record told once the incident is written; and the incident's rename going
through the run's write seam (`FsOps`)."""

from __future__ import annotations

import errno
import json
import os

import pytest

from hangwatch.common.durable import FsOps
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.records.run_state import RunRecord


class Facts:
    """The shape `open_for_run` asks for; remembers what the record on disk held when it was noted."""

    def __init__(self, checkpoint="ckpt/step-40", last=None):
        self.last_good_checkpoint = checkpoint
        self.last_incident = last
        self.noted = []

    def note_incident(self, inc) -> None:
        self.noted.append((inc.id, json.loads((inc.dir / "incident.json").read_text())))


def on_disk(inc) -> dict:
    return json.loads((inc.dir / "incident.json").read_text())


def keys_after_stamp(record: dict) -> list[str]:
    return [k for k in record if k not in ("id", "kind", "time", "time_unix")]


def test_the_fields_come_in_the_order_the_openers_wrote_them(tmp_path):
    facts = Facts(last={"id": "0001", "kind": "crash", "summary": "s"})
    store = IncidentStore(tmp_path)
    inc = store.open_for_run(
        "crash_loop", facts, with_last_incident=True, then={"gave": 1, "up": 2}, attempt=3, summary="x", status="final"
    )
    record = on_disk(inc)
    assert keys_after_stamp(record) == [
        "attempt",
        "summary",
        "status",
        "last_incident",
        "last_good_checkpoint",
        "gave",
        "up",
    ]
    assert record["last_good_checkpoint"] == "ckpt/step-40" and record["last_incident"]["id"] == "0001"
    assert list(record)[:4] == ["id", "kind", "time", "time_unix"]


def test_the_same_record_as_create_then_note(tmp_path):
    """What the sites did before: `create(..., last_incident=…, last_good_checkpoint=…, **more)` then
    `facts.note_incident(inc)` — the same incident.json, key for key and in order, and the same note."""
    old_facts, new_facts = Facts(last={"id": "0007"}), Facts(last={"id": "0007"})
    old_store, new_store = IncidentStore(tmp_path / "old"), IncidentStore(tmp_path / "new")
    more = {"decision": None, "stragglers": [1]}
    old = old_store.create(
        "stall",
        attempt=2,
        step=9,
        summary="s",
        last_incident=old_facts.last_incident,
        last_good_checkpoint=old_facts.last_good_checkpoint,
        **more,
    )
    old_facts.note_incident(old)
    new = new_store.open_for_run("stall", new_facts, with_last_incident=True, then=more, attempt=2, step=9, summary="s")

    def without_time(d):
        return {k: v for k, v in d.items() if k not in ("time", "time_unix")}

    assert list(on_disk(old)) == list(on_disk(new))
    assert without_time(on_disk(old)) == without_time(on_disk(new))
    assert [(i, without_time(r)) for i, r in old_facts.noted] == [(i, without_time(r)) for i, r in new_facts.noted]


def test_noted_once_written_and_only_when_asked(tmp_path):
    store = IncidentStore(tmp_path)
    facts = Facts()
    inc = store.open_for_run("unkillable", facts, attempt=1, summary="pids 5 outlived SIGKILL")
    assert facts.noted == [(inc.id, on_disk(inc))]  # the record was on disk when the run's record heard of it
    episode = store.open_for_run("stall", facts, note=False, attempt=1, summary="s")
    assert [i for i, _ in facts.noted] == [inc.id] and on_disk(episode)["last_good_checkpoint"] == "ckpt/step-40"


def test_without_the_checkpoint(tmp_path):
    inc = IncidentStore(tmp_path).open_for_run("config_error", Facts(), with_checkpoint=False, attempt=1, argv=["x"])
    assert keys_after_stamp(on_disk(inc)) == ["attempt", "argv"]


def test_the_run_record_is_what_it_takes(tmp_path):
    facts = RunRecord(last_good_checkpoint="ckpt/step-8", last_good_step=8)
    inc = IncidentStore(tmp_path).open_for_run("resume_ignored", facts, with_last_incident=True, summary="w")
    assert on_disk(inc)["last_good_checkpoint"] == "ckpt/step-8" and on_disk(inc)["last_incident"] is None
    assert facts.last_incident == {"id": inc.id, "kind": "resume_ignored", "summary": "w"}
    nxt = IncidentStore(tmp_path).open_for_run("resume_diverged", facts, with_last_incident=True, summary="d")
    assert on_disk(nxt)["last_incident"] == {"id": inc.id, "kind": "resume_ignored", "summary": "w"}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"last_good_checkpoint": "mine"},
        {"with_last_incident": True, "last_incident": None},
        {"then": {"attempt": 2}},
        {"then": {"last_good_checkpoint": "mine"}},
    ],
)
def test_a_field_given_twice_is_refused_before_anything_is_written(tmp_path, kwargs):
    store = IncidentStore(tmp_path)
    facts = Facts()
    with pytest.raises(TypeError, match="multiple values"):
        store.open_for_run("stall", facts, attempt=1, **kwargs)
    assert store.dirs() == [] and facts.noted == []


class RecordingFs(FsOps):
    def __init__(self, refuse_rename: bool = False):
        self.renames = []
        self.refuse_rename = refuse_rename

    def rename(self, src, dst):
        self.renames.append((src.name, dst.name))
        if self.refuse_rename:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
        super().rename(src, dst)


def test_a_change_of_kind_renames_through_the_write_seam(tmp_path):
    fs = RecordingFs()
    store = IncidentStore(tmp_path, fs=fs)
    inc = store.create("stall", summary="x")
    inc.rekind("livelock")
    assert fs.renames == [(f"{inc.id}-stall", f"{inc.id}-livelock")]
    assert [d.name for d in store.dirs()] == [f"{inc.id}-livelock"] and inc.dir.name == f"{inc.id}-livelock"


def test_a_refused_rename_keeps_the_name_and_is_reported(tmp_path):
    refused = []
    store = IncidentStore(tmp_path, fs=RecordingFs(refuse_rename=True), on_write_error=lambda e, p: refused.append(p))
    inc = store.create("stall", summary="x")
    inc.rekind("livelock")
    assert [p.name for p in refused] == [f"{inc.id}-livelock"]
    assert inc.kind == "stall" and inc.dir.name == f"{inc.id}-stall" and inc.dir.is_dir()
