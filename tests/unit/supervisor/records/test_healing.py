"""Self-healing's records in the run dir (`supervisor/records/healing.py`): remediation.json written through the
run's `FsOps` exactly as before, the quarantine's view, state.json's fields from the files alone."""

import json
from pathlib import Path

import pytest
from fixtures.fakes.oom_config import oom_cfg as cfg

from hangwatch.common.durable import FsOps, write_json_atomic
from hangwatch.supervisor.concerns.oom_recovery import OomRemediation
from hangwatch.supervisor.records import healing


def test_quarantine_view(tmp_path):
    assert healing.read_quarantine(tmp_path) == [] and healing.quarantine_summary([]) is None
    assert healing.quarantine_fields(tmp_path, 1) == {}
    lines = [{"id": f"t.jsonl:{i}", "reason": "r", "step": 3, "attempt": 1 if i < 25 else 2, "t": 0} for i in range(30)]
    (tmp_path / healing.QUARANTINE_NAME).write_text(
        "".join(__import__("json").dumps(r) + "\n" for r in lines) + '{"id": '
    )
    s = healing.quarantine_summary(healing.read_quarantine(tmp_path))
    assert s["count"] == 30 and len(s["ids"]) == 20 and s["more"] == 10
    assert [r["id"] for r in healing.quarantine_fields(tmp_path, 2)["quarantined"]] == [
        f"t.jsonl:{i}" for i in range(25, 30)
    ]


def test_state_fields_from_the_files_alone(tmp_path):
    assert healing.state_fields(tmp_path) == {"remediation": None, "quarantine": None}
    OomRemediation(cfg(4, 2), tmp_path).on_failure("oom", attempt=1, step=2, incident="i")
    (tmp_path / "quarantine.jsonl").write_text('{"id": "t.jsonl:3", "reason": "r", "step": 3, "attempt": 1}\n')
    f = healing.state_fields(tmp_path)
    assert f["remediation"]["words"] == "micro_batch_size 4 × grad_accum 2 → micro_batch_size 2 × grad_accum 4 (OOM)"
    assert f["quarantine"]["ids"] == ["t.jsonl:3"]


class RecordingFs(FsOps):
    """The real writes, and the paths each went through."""

    def __init__(self):
        self.written: list[Path] = []

    def write_file(self, path, data, durable=True):
        self.written.append(Path(path))
        super().write_file(path, data, durable)

    def write_json(self, path, data, durable=True):
        self.written.append(Path(path))
        super().write_json(path, data, durable)


def test_remediation_json_goes_through_the_runs_fsops_byte_for_byte_as_before(tmp_path):
    record = {"version": 1, "configured": {"micro_batch_size": 4}, "history": [{"t": 1.5, "why": "é"}]}
    fs = RecordingFs()
    assert healing.save(tmp_path, record, fs) == tmp_path / "remediation.json"
    assert fs.written == [tmp_path / "remediation.json"]
    before = write_json_atomic(tmp_path / "before.json", record, indent=2)  # what the file always held
    assert (tmp_path / "remediation.json").read_bytes() == before.read_bytes()
    assert healing.load(tmp_path) == record
    healing.save(tmp_path, {**record, "version": 1}, None)  # no seam handed: the real one
    assert healing.load(tmp_path) == record


def test_a_refused_remediation_write_raises_and_leaves_the_old_record(tmp_path):
    class FullDisk(FsOps):
        def write_file(self, path, data, durable=True):
            raise OSError(28, "No space left on device", str(path))

    healing.save(tmp_path, {"version": 1}, FsOps())
    with pytest.raises(OSError):
        healing.save(tmp_path, {"version": 2}, FullDisk())
    assert json.loads((tmp_path / "remediation.json").read_text()) == {"version": 1}
