"""The run summary quotes the command's last words when its own failure ended the run (`summary.output_lines`): the
reason where a person reads it when `hangwatch run` returns, not only in worker.log."""

from __future__ import annotations

import json

import pytest

from hangwatch.supervisor.cli.summary import run_summary
from hangwatch.supervisor.incidents import IncidentStore

USAGE = ["usage: train.py [-h] [--steps STEPS]", "train.py: error: unrecognized arguments: --stpes 3"]


def run_dir(tmp_path, state: str, *incidents: dict):
    (tmp_path / "state.json").write_text(json.dumps({"state": state, "attempt": len(incidents)}))
    store = IncidentStore(tmp_path)
    for n, fields in enumerate(incidents, 1):
        store.create(fields.pop("kind", "crash"), attempt=n, summary="exited with code 2 without last words", **fields)
    return str(tmp_path)


def test_a_failed_run_quotes_the_last_lines_of_the_failure_that_ended_it(tmp_path):
    lines = run_summary(run_dir(tmp_path, "failed", {"last_output": USAGE}, {"last_output": USAGE}), 2)
    at = lines.index("  its output ended (attempt 2, incident 0002):")
    assert lines[at + 1 :][:2] == [f"    {line}" for line in USAGE]
    assert all(line.startswith("  incident ") for line in lines[1:at])  # after the incidents it belongs to


@pytest.mark.parametrize(
    "state, incidents, quoted",
    [
        ("failed", [{"last_output": USAGE}, {"kind": "no_progress", "status": "final"}], True),  # the failure before
        ("failed", [{"last_output": USAGE}, {"kind": "stall"}], False),  # a later failure quotes nothing
        ("finished", [{"last_output": USAGE}], False),  # it recovered: the incident line says it
        ("stopped", [{"last_output": USAGE}], False),
        ("failed", [], False),
    ],
)
def test_when_it_quotes(tmp_path, state, incidents, quoted):
    lines = run_summary(run_dir(tmp_path, state, *incidents), 1)
    assert any("its output ended" in line for line in lines) is quoted
