"""What `hangwatch run` does with a run dir that holds a finished run (`cli/rerun.py`)."""

from __future__ import annotations

import json

import yaml

from hangwatch.supervisor.cli import rerun

BASE = {"run_dir": "x", "worker": {"command": ["python", "train.py", "--steps", "3"]}, "train": {"lr": 0.1}}


def recorded(d, effective, state):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(yaml.safe_dump(effective))
    (d / "state.json").write_text(json.dumps({"state": state, "step": 80, "last_good_step": 70}))


def with_(**changes):
    out = json.loads(json.dumps(BASE))
    for k, v in changes.items():
        section, key = k.split("__")
        out[section][key] = v
    return out


def test_the_same_run_finished_starts_nothing_and_names_where_it_ended(tmp_path):
    recorded(tmp_path / "runs" / "train", BASE, "finished")
    plan = rerun.plan(BASE, str(tmp_path / "runs" / "train"), ["--", "python", "train.py", "--steps", "3"])
    assert plan.finished and "already finished (at step 80" in plan.lines[0]  # the last step, not the last good one
    hint = next(line for line in plan.lines if "to run it again" in line)
    assert "hangwatch run --run-dir " in hint and hint.endswith("train-new -- python train.py --steps 3")


def test_another_command_goes_to_a_run_dir_of_its_own_the_first_free_or_its_own(tmp_path):
    base = tmp_path / "runs" / "train"
    recorded(base, BASE, "finished")
    other = with_(worker__command=["python", "train.py", "--steps", "100"])
    plan = rerun.plan(other, str(base), [])
    assert (
        not plan.finished
        and plan.run_dir == str(base) + "-2"
        and "another command or other arguments" in (plan.lines[0])
    )
    recorded(base.with_name("train-2"), other, "failed")  # that run, unfinished there: it resumes there
    assert rerun.plan(other, str(base), []).run_dir == str(base) + "-2"
    third = with_(train__lr=0.5)  # a config change: another run again, past the two taken
    recorded(base.with_name("train-2"), other, "finished")
    plan = rerun.plan(third, str(base), [])
    assert plan.run_dir == str(base) + "-3" and "another config (train.lr)" in plan.lines[0]


def test_an_unfinished_or_continuous_run_is_left_as_it_always_was(tmp_path):
    base = tmp_path / "runs" / "train"
    recorded(base, BASE, "stopped")
    other = with_(worker__command=["python", "other.py"])
    assert rerun.plan(other, str(base), []) == rerun.Plan(str(base))
    recorded(base, BASE, "finished")
    assert rerun.plan(BASE, str(base), [], continuous=True) == rerun.Plan(str(base))
