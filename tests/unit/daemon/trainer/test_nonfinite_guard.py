"""The non-finite guard (skip, warn, count; a streak exits 75 with last words) and config errors (78)."""

from __future__ import annotations

import json
import math

from fixtures.fakes.workers import make_config, read_beats, run_in_process


def exit_words(run, attempt=1):
    return json.loads((run / "attempts" / f"{attempt:04d}" / "exit.json").read_text())


def test_nonfinite_streak_exits_75_then_resumes_from_the_last_good(tmp_path):
    config = make_config(
        tmp_path,
        train={"max_steps": 10, "max_nonfinite_streak": 3},
        checkpoint={"every_steps": 2, "confirm_steps": 1},
        faults=[{"kind": "nan", "at_step": 6, "steps": 5}],
    )
    run = tmp_path / "run"
    assert run_in_process(config) == 75
    words = exit_words(run)
    assert words["kind"] == "nan" and words["exit_code"] == 75 and "3 non-finite" in words["message"]
    beats = read_beats(run, 1)
    warns = [b for b in beats if b["event"] == "warn" and "non-finite" in b["message"]]
    assert [w["streak"] for w in warns] == [1, 2, 3]
    assert all(math.isnan(w["loss"]) for w in warns)
    assert max(b["step"] for b in beats if b["event"] == "step") == 5
    # The checkpoint at 4 was confirmed by step 5; nothing after it was saved.
    assert [b["step"] for b in beats if b["event"] == "checkpoint" and b["good"]] == [2, 4]

    # The fault fired once per run: the next attempt resumes from step 4 and trains to the end.
    assert run_in_process(config) == 0
    beats2 = read_beats(run, 2)
    assert beats2[0]["resumed_from"].endswith("step-00000004")
    assert [b["step"] for b in beats2 if b["event"] == "step"] == list(range(5, 11))
    assert not [b for b in beats2 if b["event"] == "warn" and "non-finite" in b["message"]]


def test_short_nonfinite_burst_is_skipped_and_unconfirms_the_pending_checkpoint(tmp_path):
    config = make_config(
        tmp_path,
        train={"max_steps": 8, "max_nonfinite_streak": 3},
        checkpoint={"every_steps": 4, "confirm_steps": 2},
        faults=[{"kind": "nan", "at_step": 6, "steps": 2}],
    )
    run = tmp_path / "run"
    assert run_in_process(config) == 0
    beats = read_beats(run, 1)
    assert len([b for b in beats if b["event"] == "warn" and "non-finite" in b["message"]]) == 2
    # Skipped steps are not optimizer steps: the counter still runs 1..8 without gaps.
    assert [b["step"] for b in beats if b["event"] == "step"] == list(range(1, 9))
    assert all(math.isfinite(b["loss"]) for b in beats if b["event"] == "step")
    # Step 4's checkpoint was awaiting its 2 confirming steps when the loss went non-finite: never good.
    assert [b["step"] for b in beats if b["event"] == "checkpoint" and b["good"]] == [8]
    assert beats[-1]["event"] == "stop" and beats[-1]["reason"] == "finished"


def test_config_error_exits_78_with_problems(tmp_path, capsys):
    config = make_config(tmp_path, train={"max_stpes": 3})
    run = tmp_path / "run"
    assert run_in_process(config, run_dir=run) == 78
    words = exit_words(run)
    assert words["kind"] == "config_error"
    assert any("train.max_stpes: unknown key (did you mean 'max_steps'?)" in p for p in words["problems"])
    assert "did you mean 'max_steps'" in capsys.readouterr().err


def test_bad_fault_environment_is_a_config_error(tmp_path):
    config = make_config(tmp_path)
    run = tmp_path / "run"
    code = run_in_process(config, environ={"HANGWATCH_FAULTS": '[{"kind": "explode", "at_step": 1}]'})
    assert code == 78
    words = exit_words(run)
    assert words["kind"] == "config_error" and any(p.startswith("HANGWATCH_FAULTS[0].kind") for p in words["problems"])


def test_changed_settings_refuse_to_resume(tmp_path):
    run = tmp_path / "run"
    assert run_in_process(make_config(tmp_path, train={"max_steps": 4})) == 0
    changed = make_config(tmp_path, train={"max_steps": 4, "lr": 1e-3}, _name="changed.yaml")
    assert run_in_process(changed) == 78
    words = exit_words(run, 2)
    assert any("train.lr: 0.005 → 0.001" in p for p in words["problems"])
