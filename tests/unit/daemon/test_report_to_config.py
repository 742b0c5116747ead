"""`train.report_to` and `train.run_name`: HF's tracker names, `none` and `all`, and one line per mistake with the
nearest known name."""

from __future__ import annotations

import pytest

from hangwatch.common.config import ConfigError, parse_config, reference_markdown

OWN = "worker:\n  command: [python, x.py]\n"  # no data section needed


def report_to(value: str):
    return parse_config(OWN + f"train:\n  report_to: {value}\n", "c.yaml").train


@pytest.mark.parametrize(
    "value, names",
    [
        ("[wandb, mlflow, tensorboard]", ["wandb", "mlflow", "tensorboard"]),
        ("[tensorboard]", ["tensorboard"]),
        ("mlflow", ["mlflow"]),  # one name, as HF takes it
        ("[wandb, wandb]", ["wandb"]),
        ("none", []),
        ("[none]", []),
        ("null", []),
        ("[]", []),
        ("all", ["wandb", "mlflow", "tensorboard"]),
        ("[all]", ["wandb", "mlflow", "tensorboard"]),
    ],
)
def test_names(value, names):
    assert report_to(value).report_to == names


def test_defaults():
    train = parse_config(OWN, "c.yaml").train
    assert train.report_to == [] and train.run_name is None
    assert report_to("[wandb]\n  run_name: lora-7").run_name == "lora-7"


@pytest.mark.parametrize(
    "value, problem",
    [
        (
            "[wandb, tensorbord]",
            "c.yaml:4: train.report_to: unknown tracker 'tensorbord' (did you mean 'tensorboard'? known: wandb, "
            "mlflow, tensorboard; or none, or all)",
        ),
        ("[ml-flow]", "c.yaml:4: train.report_to: unknown tracker 'ml-flow' (did you mean 'mlflow'?"),
        ("[WandB]", "c.yaml:4: train.report_to: unknown tracker 'WandB' (did you mean 'wandb'?"),
        ("[comet_ml]", "c.yaml:4: train.report_to: unknown tracker 'comet_ml' (known: wandb, mlflow, tensorboard;"),
        ("wandbb", "c.yaml:4: train.report_to: unknown tracker 'wandbb' (did you mean 'wandb'?"),
        ("[wandb, none]", "c.yaml:4: train.report_to: none stands alone (report_to: none)"),
        ("[all, mlflow]", "c.yaml:4: train.report_to: all stands alone"),
        ("{wandb: true}", "c.yaml:4: train.report_to: expected a list of wandb, mlflow, tensorboard (or none, or all)"),
    ],
)
def test_mistakes_are_one_line_with_the_nearest_name(value, problem):
    with pytest.raises(ConfigError) as err:
        report_to(value)
    (line,) = err.value.problems
    assert line.startswith(problem), line


def test_an_empty_run_name_is_refused():
    with pytest.raises(ConfigError) as err:
        report_to("[]\n  run_name: ''")
    (line,) = err.value.problems
    assert line.startswith("c.yaml:5: train.run_name: String should have at least 1 character"), line


def test_in_the_reference():
    md = reference_markdown()
    assert "| `train.report_to` | list of one of wandb, mlflow, tensorboard or none or all | `[]` |" in md
    assert "| `train.run_name` | str or null | `null` | The tracker run's name" in md
