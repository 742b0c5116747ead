"""`logging.termination_log`: `auto`, an absolute path or '' (never) — any other value refused with one message
naming the key and its line; a path whose directory is missing warned about before the run, not found out after."""

from __future__ import annotations

from pathlib import Path

import pytest

from hangwatch.common.config import ConfigError, load_checked, parse_config

OWN = "worker:\n  command: [python, -c, pass]\nlogging:\n  termination_log: {value}\n"  # the setting: line 4


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("''", ""), ("/dev/termination-log", None)])
def test_auto_a_path_or_never(value, expected):
    cfg = parse_config(OWN.format(value=value), environ={})
    assert cfg.logging.termination_log == (expected if expected is not None else value)


def test_auto_by_default():
    assert parse_config("worker: {command: [python, -c, pass]}\n", environ={}).logging.termination_log == "auto"


@pytest.mark.parametrize("value", ["termination-log", "logs/termination-log", "null", "/var/log/", "3", "Auto"])
def test_anything_else_is_refused_with_the_key_and_its_line(value):
    with pytest.raises(ConfigError) as err:
        parse_config(OWN.format(value=value), source="k8s.yaml", environ={})
    (problem,) = err.value.problems
    assert problem.startswith("k8s.yaml:4: logging.termination_log: expected auto, an absolute path of a file"), problem
    assert "or '' (never)" in problem


def checked(tmp_path: Path, value: str) -> list[str]:
    path = tmp_path / "cfg.yaml"
    path.write_text(f"run_dir: runs/x\n{OWN.format(value=value)}")
    return load_checked(path)[1]


def test_a_path_in_a_missing_directory_is_a_warning_before_the_run(tmp_path):
    warnings = checked(tmp_path, str(tmp_path / "nowhere" / "termination-log"))
    assert any(
        f"logging.termination_log: {tmp_path / 'nowhere'}: no such directory; the run's termination message will not"
        in w
        for w in warnings
    ), warnings


def test_a_directory_is_a_warning_too(tmp_path):
    warnings = checked(tmp_path, str(tmp_path))
    assert any(f"logging.termination_log: {tmp_path}: is a directory" in w for w in warnings), warnings


@pytest.mark.parametrize("value", ["auto", "''"])
def test_auto_and_never_are_not_looked_into(tmp_path, value):
    assert not [w for w in checked(tmp_path, value) if "termination_log" in w]
