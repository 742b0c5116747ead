"""The container's termination message (`ops/termination_message.py`): what it says for each way a run ends, the
4 KiB bound (whole characters, the most important line kept), where `logging.termination_log` sends it, and that a
write the file refuses never reaches the caller."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from hangwatch.common.durable import FsOps, write_in_place
from hangwatch.common.exitcodes import DO_NOT_RETRY, RUN_CODES
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.ops import termination_message as tm
from hangwatch.supervisor.ops.termination_message import RunEnd, compose, cut, exit_meaning, leave, target

STALL = {
    "id": "0003",
    "kind": "stall",
    "attempt": 3,
    "step": 41,
    "summary": "rank 1 is the culprit: busy loop in Python (CPU 98%) at _select (faults.py); step deadline 8.0s "
    "exceeded by 0.1s in phase 'train' at step 41",
    "culprit_rank": 1,
    "user_frame": {"function": "train_step", "file": "train.py", "line": 88},
    "stuck_frame": {"function": "_select", "file": "faults.py", "line": 12},
    "decision": {"action": "fail", "reason": "crash loop: 3 failures within 3600s (restart.max_restarts 2)"},
}


def words(code: int) -> str:
    return next(w for c, w, _ in RUN_CODES if c == code)


def text(end: RunEnd, limit: int = tm.MAX_BYTES) -> list[str]:
    return compose(end, limit).decode("utf-8").splitlines()


def failed(**kw) -> RunEnd:
    fields = dict(
        state="failed",
        why="crash loop: 3 failures within 3600s (restart.max_restarts 2)",
        exit_code=79,
        command_status=None,
        run_dir="/shared/runs/node1",
        attempt=3,
        restarts=2,
        incidents=3,
        incident=dict(STALL),
        last_good_checkpoint="/shared/ckpt/step-40",
        last_good_step=40,
    )
    return RunEnd(**{**fields, **kw})


# ---- what it says -------------------------------------------------------------------------------------------------


def test_a_failed_run_names_the_exit_codes_meaning_the_incident_its_culprit_the_decision_and_where_to_look():
    lines = text(failed(why="a stall that restarts do not get past", exit_code=79))
    assert lines[0] == f"hangwatch: run failed, exit 79: {words(79)}"
    assert lines[1] == "why: a stall that restarts do not get past"
    assert lines[2] == f"incident 0003 [stall] (attempt 3, step 41): {STALL['summary']}"
    assert lines[3] == "culprit: rank 1 at train_step (train.py:88)"  # the user's own frame before the innermost
    assert lines[4] == f"decision: fail — {STALL['decision']['reason']}"
    assert lines[5] == "last good checkpoint: /shared/ckpt/step-40 (step 40)"
    assert lines[6] == "run dir: /shared/runs/node1 (attempt 3, 2 restart(s), 3 incident(s))"
    assert len(lines) == 7


def test_a_decision_that_is_the_runs_reason_is_not_said_twice_and_a_closing_incident_names_the_failure_before():
    closing = {
        "id": "0005",
        "kind": "no_progress",
        "attempt": 4,
        "summary": "no progress: 3 restart(s) in a row ended without stepping past step 0",
        "status": "final",
        "last_incident": {"id": "0004", "kind": "crash", "summary": "exited with code 3 without last words"},
    }
    lines = text(failed(why=closing["summary"], incident=closing, last_good_checkpoint=None, last_good_step=None))
    assert lines[0].startswith("hangwatch: run failed, exit 79: do not retry: running it again would fail the same")
    assert lines[1] == f"why: {closing['summary']}"
    assert lines[2] == "incident 0005 [no_progress] (attempt 4)"  # its summary is the why above
    assert lines[3] == "after incident 0004 [crash]: exited with code 3 without last words"
    assert lines[4] == "no good checkpoint"


def test_a_finished_run():
    lines = text(RunEnd("finished", "worker exited 0: the command completed", 0, 0, "/runs/train", attempt=1))
    assert lines[0] == f"hangwatch: run finished, exit 0: {words(0)}"
    assert lines[1:] == [
        "why: worker exited 0: the command completed",
        "no good checkpoint",
        "run dir: /runs/train (attempt 1, 0 restart(s), 0 incident(s))",
    ]


def test_a_stop_to_be_requeued_says_75_and_its_checkpoint():
    end = RunEnd("stopped", "stopped to be run again (requeue) (SIGUSR1)", 75, 143, "/runs/train", 2, 1, 1,
                 last_good_checkpoint="/ckpt/step-90", last_good_step=90)  # fmt: skip
    lines = text(end)
    assert lines[0] == f"hangwatch: run stopped, exit 75: {words(75)}"
    assert "requeue me" in lines[0]
    assert lines[1] == "why: stopped to be run again (requeue) (SIGUSR1)"
    assert "last good checkpoint: /ckpt/step-90 (step 90)" in lines


@pytest.mark.parametrize(
    "code, status, expected",
    [
        (79, None, words(79)),  # hangwatch's own
        (78, 78, f"{words(78)} — do not retry"),  # the worker's own do-not-restart code is hangwatch's word too
        (65, 1, f"{words(65)} — do not retry"),  # a rank's 65 behind torchrun's 1
        (1, None, f"{words(1)} — look at the machine"),  # hangwatch could not go on
        (1, 1, "the command's own exit status, passed on"),  # torchrun's 1 is not "the machine could not go on"
        (3, 3, "the command's own exit status, passed on"),
        (137, 137, "the command's own status: it died of SIGKILL"),
        (130, None, "the command's own status: it died of SIGINT"),
    ],
)
def test_the_exit_codes_meaning_comes_from_the_one_table_and_tells_the_commands_own_status_apart(
    code, status, expected
):
    assert exit_meaning(code, status) == expected


def test_a_supervisor_that_refused_before_any_attempt_says_so():
    lines = text(RunEnd("starting", "", 74, None, "/runs/train"))
    assert (
        lines[0] == f"hangwatch: run refused before starting an attempt (starting), exit 74: {words(74)} — do not retry"
    )
    assert not any(line.startswith("why:") for line in lines)


def test_the_commands_last_lines_close_the_message_each_on_one_line():
    said = ["loading", "parsing", "usage: train.py [-h]\n  [--steps STEPS]", "train.py: error: unrecognized arguments"]
    inc = {"id": "0002", "kind": "crash", "summary": "exited with code 2", "last_output": said}
    lines = text(failed(exit_code=2, command_status=2, incident=inc))
    assert lines[0] == "hangwatch: run failed, exit 2: the command's own exit status, passed on"
    assert lines[-4:] == [  # the last OUTPUT_LINES of them
        "its output ended:",
        "  parsing",
        "  usage: train.py [-h] [--steps STEPS]",
        "  train.py: error: unrecognized arguments",
    ]


# ---- the 4 KiB bound ----------------------------------------------------------------------------------------------

WIDE = "é漢🙂"  # two, three and four bytes in UTF-8


def test_a_huge_summary_of_multibyte_characters_stays_within_4_kib_in_whole_characters_headline_first():
    inc = {**STALL, "summary": WIDE * 20_000, "decision": {"action": "fail", "reason": WIDE * 5_000},
           "last_output": [WIDE * 3_000] * 50}  # fmt: skip
    end = failed(why=WIDE * 10_000, incident=inc, run_dir="/runs/" + WIDE * 500)
    data = compose(end)
    assert len(data) <= 4096
    message = data.decode("utf-8")  # strict: a half character would raise
    lines = message.splitlines()
    assert lines[0] == f"hangwatch: run failed, exit 79: {words(79)}"
    assert lines[1].startswith("why: é漢🙂") and lines[1].endswith("…")
    assert len(lines[1].encode()) <= tm.LINE_BYTES  # one long field cannot crowd out the lines after it
    assert lines[2].startswith("incident 0003 [stall] (attempt 3, step 41): é漢🙂")
    assert "culprit: rank 1 at train_step (train.py:88)" in lines
    assert message.endswith("\n")


def test_the_lines_after_the_room_is_spent_go_and_the_one_at_the_edge_is_cut():
    end = failed(why="w" * 2000)
    whole = compose(end, limit=10_000)
    data = compose(end, limit=1200)
    assert len(data) <= 1200 and whole.startswith(data[: data.rindex(b"\n", 0, len(data) - 1)])
    lines = data.decode().splitlines()
    assert lines[0].startswith("hangwatch: run failed, exit 79") and lines[-1].endswith("…")
    assert not any(line.startswith("run dir:") for line in lines)  # the least important go first


def test_undecodable_output_read_back_from_json_still_makes_a_message():
    inc = {**STALL, "summary": "bad byte \udcff in the log", "last_output": ["\udcfe\udcff"]}
    lines = compose(failed(incident=inc)).decode("utf-8").splitlines()
    assert "incident 0003 [stall] (attempt 3, step 41): bad byte ? in the log" in lines and lines[-1] == "  ??"


@pytest.mark.parametrize("limit", range(0, 40))
def test_cut_never_splits_a_character(limit):
    out = cut(WIDE * 5, limit)
    assert len(out.encode()) <= max(limit, 0) or out == WIDE * 5
    assert out == WIDE * 5 or out.endswith("…") or limit < len("…".encode())  # no room even for the marker
    out.encode("utf-8").decode("utf-8")


# ---- where it goes ------------------------------------------------------------------------------------------------


def test_auto_writes_nothing_where_the_kubelets_file_is_absent(tmp_path):
    absent = tmp_path / "dev" / "termination-log"
    built = []

    def no_view():
        built.append(True)
        return view(tmp_path)

    assert target("auto", absent) is None
    assert leave("auto", no_view, "why", 0, IncidentStore(tmp_path), default=absent) is None
    assert not absent.exists() and not absent.parent.exists()
    assert built == []  # nothing to write: the read model is not even built


def test_auto_writes_the_kubelets_file_when_it_is_there(tmp_path):
    kubelets = tmp_path / "termination-log"
    kubelets.write_bytes(b"")  # the kubelet makes it, empty, before the container starts
    assert target("auto", kubelets) == kubelets
    assert leave("auto", lambda: view(tmp_path), "worker exited 0", 0, IncidentStore(tmp_path), default=kubelets)
    assert kubelets.read_text().startswith("hangwatch: run finished, exit 0: finished")


def test_a_path_is_always_written_and_empty_is_never(tmp_path):
    path = tmp_path / "custom-termination-message"
    assert target(str(path)) == path and target("") is None
    assert leave(str(path), lambda: view(tmp_path), "worker exited 0", 0, IncidentStore(tmp_path)) == path
    assert path.read_bytes() == compose(RunEnd.of(view(tmp_path), "worker exited 0", 0, IncidentStore(tmp_path)))
    assert leave("", lambda: view(tmp_path), "worker exited 0", 0, IncidentStore(tmp_path)) is None


def test_the_file_is_replaced_where_it_is_whole(tmp_path):
    path = tmp_path / "termination-log"
    path.write_text("an older and much longer message " * 100)
    inode = path.stat().st_ino
    write_in_place(path, b"short\n")
    assert path.read_bytes() == b"short\n" and path.stat().st_ino == inode  # no rename onto a bind mount


class FullDisk(FsOps):
    def __init__(self):
        self.tries = 0

    def write_in_place(self, path, data):
        self.tries += 1
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_refused_write_is_logged_once_and_never_raised(tmp_path):
    fs = FullDisk()
    with capture_logs() as logs:
        got = leave(str(tmp_path / "m"), lambda: view(tmp_path), "why", 1, IncidentStore(tmp_path), fs=fs)
    assert got is None and fs.tries == 1
    warned = [r for r in logs if r["event"] == "termination_message_not_written"]
    assert len(warned) == 1 and warned[0]["log_level"] == "warning"
    assert "no space left on device" in warned[0]["error"]


def test_a_missing_directory_is_a_refused_write_too(tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "termination-log"
    assert leave(str(path), lambda: view(tmp_path), "why", 1, IncidentStore(tmp_path)) is None
    assert not path.exists()


def test_a_read_model_that_cannot_be_built_costs_nothing_but_the_message(tmp_path):
    def broken():
        raise RuntimeError("a reader failed")

    with capture_logs() as logs:
        assert leave(str(tmp_path / "m"), broken, "why", 1, IncidentStore(tmp_path)) is None
    assert [r["event"] for r in logs] == ["termination_message_failed"]
    assert not (tmp_path / "m").exists()


# ---- gathered from the run ----------------------------------------------------------------------------------------


def view(run_dir: Path, last_incident=None, worker=None, **kw) -> SimpleNamespace:
    """What `RunEnd.of` reads of the loop's read model (`read_model.view.View`)."""
    fields = dict(state=SimpleNamespace(value="finished"), worker=worker, last_incident=last_incident,
                  run_dir=str(run_dir), attempt=1, restarts=0, incidents=0, last_good_checkpoint=None,
                  last_good_step=None)  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


def test_the_last_incidents_whole_record_is_read_from_the_store(tmp_path):
    store = IncidentStore(tmp_path)
    inc = store.create("crash", attempt=2, step=0, summary="exited with code 3", culprit_rank=1,
                       decision={"action": "fail", "reason": "the same end twice"})  # fmt: skip
    v = view(tmp_path, last_incident={"id": inc.id, "kind": "crash", "summary": "exited with code 3"},
             worker=SimpleNamespace(exit_code=None, exit_signal=9), state=SimpleNamespace(value="failed"))  # fmt: skip
    end = RunEnd.of(v, "the same end twice", 137, store)
    assert end.incident["decision"]["action"] == "fail" and end.command_status == 137
    assert "decision: fail" in text(end) and "culprit: rank 1" in text(end)
    assert text(end)[0] == "hangwatch: run failed, exit 137: the command's own status: it died of SIGKILL"


def test_an_incident_whose_record_is_gone_still_shows_its_summary(tmp_path):
    summary = {"id": "0007", "kind": "disk", "summary": "no space left on device at /runs/x/incidents"}
    end = RunEnd.of(view(tmp_path, last_incident=summary), "the run cannot go on", 74, IncidentStore(tmp_path))
    assert end.incident == summary
    assert "incident 0007 [disk]: no space left on device at /runs/x/incidents" in text(end)


def test_docs_exit_code_table_lists_the_same_codes_and_do_not_retry_rows():
    """docs/operations.md's table and `common.exitcodes.RUN_CODES` (what the message and `run --help` say) agree."""
    doc = (Path(__file__).resolve().parents[4] / "docs" / "operations.md").read_text()
    section = doc[doc.index("### Exit status") :]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0].isdigit():
            rows[int(cells[0])] = cells[-1]
        elif rows and not line.startswith("|"):
            break
    assert sorted(rows) == sorted(code for code, _, _ in RUN_CODES)
    assert {code for code, then in rows.items() if "not retry" in then} == set(DO_NOT_RETRY)
