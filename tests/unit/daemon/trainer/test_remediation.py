"""The worker under OOM remediation (in process, the supervisor's decision made by supervisor.remediation):
an OOM at micro-batch 4 → the next attempt trains at micro-batch 2 × twice the accumulation, with exactly the
examples, per optimizer step, that an uninterrupted micro-batch-2 run has."""

from __future__ import annotations

import json

from fixtures.fakes.workers import make_config, read_beats, run_in_process

from hangwatch.common.config import load_config
from hangwatch.common.oom_ladder import Rung as Setting
from hangwatch.supervisor.concerns.oom_recovery import OomRemediation


def step_ids(beats):
    return {b["step"]: b["example_ids"] for b in beats if b["event"] == "step"}


def test_oom_restart_regroups_the_step_and_keeps_its_examples(tmp_path, capsys):
    common = {
        "train": {"max_steps": 6, "micro_batch_size": 4, "grad_accum": 2},
        "checkpoint": {"every_steps": 2, "confirm_steps": 0},
    }
    config = make_config(tmp_path / "a", faults=[{"kind": "oom", "at_step": 5}], **common)
    run = tmp_path / "a" / "run"
    assert run_in_process(config) == 1
    words = json.loads((run / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "oom"

    # The supervisor's part: decide, persist.  The config file is not touched.
    before = config.read_text()
    remedy = OomRemediation(load_config(config), run).on_failure("oom", attempt=1, step=4, incident="x")
    assert remedy.to == Setting(2, 4)
    assert run_in_process(config) == 0
    assert config.read_text() == before
    start = read_beats(run, 2)[0]
    assert (start["micro_batch_size"], start["grad_accum"], start["effective_batch"]) == (2, 4, 8)
    assert start["remediation"]["configured"]["micro_batch_size"] == 4 and start["resumed_step"] == 4
    assert (
        "OOM remediation in force (1 out-of-memory restart(s)): micro_batch_size 2 × grad_accum 4"
        in capsys.readouterr().out
    )

    # An uninterrupted run configured at micro-batch 2 × 4: the same examples in every optimizer step.
    ref_config = make_config(
        tmp_path / "b",
        train={**common["train"], "micro_batch_size": 2, "grad_accum": 4},
        checkpoint=common["checkpoint"],
    )
    assert run_in_process(ref_config) == 0
    remedied = {**step_ids(read_beats(run, 1)), **step_ids(read_beats(run, 2))}
    reference = step_ids(read_beats(tmp_path / "b" / "run", 1))
    assert sorted(remedied) == list(range(1, 7)) and remedied == reference
    assert all(len(ids) == 8 for ids in reference.values())

    # The remedied attempt's checkpoints keep the run's fingerprint: a later attempt (still remedied) resumes.
    state = json.loads((run / "checkpoints" / "step-00000006" / "trainer_state.json").read_text())
    assert state["fingerprint"]["train"]["micro_batch_size"] == 4
    assert state["accumulation"]["micro_batch_size"] == 2 and state["accumulation"]["grad_accum"] == 4


def test_a_record_for_another_batch_is_ignored_with_a_warning(tmp_path):
    config = make_config(tmp_path, train={"max_steps": 2}, checkpoint={"every_steps": 2, "confirm_steps": 0})
    run = tmp_path / "run"
    run.mkdir()
    (run / "remediation.json").write_text(
        json.dumps(
            {
                "version": 1,
                "configured": {"micro_batch_size": 8, "grad_accum": 1, "gradient_checkpointing": False},
                "micro_batch_size": 4,
                "grad_accum": 2,
                "gradient_checkpointing": False,
                "history": [],
            }
        )
    )
    assert run_in_process(config) == 0
    beats = read_beats(run, 1)
    assert beats[0]["micro_batch_size"] == 4 and "remediation" not in beats[0]
    assert any(b["event"] == "warn" and "remediation.json does not apply" in b["message"] for b in beats)
