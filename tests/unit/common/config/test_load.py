"""The config schema and loader: every error a user can make is one line `FILE:LINE: key: what`, the
records carry every default (the hidden ones included), paths resolve against the config file."""

from __future__ import annotations

import typing

import pytest

from hangwatch.common.config import (
    FAULT_KINDS,
    Config,
    ConfigError,
    FaultCfg,
    WatchdogCfg,
    dump_config,
    load_config,
    parse_config,
    reference_markdown,
    reference_rows,
    reference_text,
)

OWN = "worker:\n  command: [python, x.py]\n"  # a worker of one's own: no data section needed

ERRORS = [
    # (yaml, the one-line problems, with {p} for the source)
    ("watchdg: {}\n" + OWN, ["{p}:1: watchdg: unknown key (did you mean 'watchdog'?)"]),
    (
        OWN + "watchdog:\n  silence_timout_s: 10\n",
        ["{p}:4: watchdog.silence_timout_s: unknown key (did you mean 'silence_timeout_s'?)"],
    ),
    (OWN + "watchdog:\n  kill_wait: 10\n", ["{p}:4: watchdog.kill_wait: unknown key (did you mean 'kill_wait_s'?)"]),
    (
        OWN + "restart:\n  zzz: 1\n",
        [
            "{p}:4: restart.zzz: unknown key (known keys: max_restarts, window_s, backoff_initial_s, backoff_max_s, "
            "healthy_after_s, no_progress_restarts, oom_remediation, in_process, on_unkillable, prewarm)"
        ],
    ),
    (
        OWN + "faults:\n  - kind: crash\n    at_stp: 3\n",
        ["{p}:5: faults.0.at_stp: unknown key (did you mean 'at_step'?)"],
    ),
    (
        OWN + "eval:\n  prompts:\n    - {prompt: hi, refrence: x}\n",
        ["{p}:5: eval.prompts.0.refrence: unknown key (did you mean 'reference'?)"],
    ),
    (
        OWN + "watchdog:\n  startup_timeout_s: soon\n",
        [
            "{p}:4: watchdog.startup_timeout_s: Input should be a valid number, unable to parse string as a number, "
            "got 'soon'"
        ],
    ),
    (
        OWN + "watchdog:\n  phase_budgets_s: {intake: soon}\n",
        [
            "{p}:4: watchdog.phase_budgets_s.intake: Input should be a valid number, unable to parse string as a "
            "number, got 'soon'"
        ],
    ),
    (OWN + "watchdog:\n  kill_wait_s: 0\n", ["{p}:4: watchdog.kill_wait_s: Input should be greater than 0, got 0"]),
    (
        OWN + "watchdog:\n  exit_after_stop_s: -1\n",
        ["{p}:4: watchdog.exit_after_stop_s: Input should be greater than 0, got -1"],
    ),
    (
        OWN + "\ntrain:\n  max_steps: 0\n  lr: 0\n",
        [
            "{p}:5: train.max_steps: Input should be greater than or equal to 1, got 0",
            "{p}:6: train.lr: Input should be greater than 0, got 0",
        ],
    ),
    (
        OWN + "model:\n  dtype: float16\n",
        ["{p}:4: model.dtype: Input should be 'auto', 'float32' or 'bfloat16', got 'float16'"],
    ),
    (OWN + "faults:\n  - kind: crash\n", ["{p}:4: faults.0: a fault needs at_step or at_eval"]),
    ("worker:\n  command: []\n", ["{p}:2: worker.command: must be null or a non-empty argv list"]),
    (
        OWN + "watchdog:\n  step_timeout_min_s: 100\n  step_timeout_max_s: 10\n",
        [
            "{p}:4: watchdog.step_timeout_min_s: 100 exceeds watchdog.step_timeout_max_s (10): the calibrated step "
            "deadline is clamped between the two"
        ],
    ),
    (
        OWN + "model:\n  tiny: {hidden_size: 30, num_heads: 4}\n",
        ["{p}:4: model.tiny: hidden_size must be divisible by num_heads"],
    ),
    ("watchdog: {}\n", ["{p}: (top level): the built-in worker needs data.train (or data.inbox: true)"]),
    (
        "data: {train: a.jsonl, inbox: true}\n",
        [
            "{p}: (top level): data.train and data.inbox: true exclude each other: in continuous mode every training "
            "file comes through the inbox (`hangwatch submit FILE`); drop data.train"
        ],
    ),
    ("worker: [\n", ["{p}:2: not valid YAML: expected the node content, but found '<stream end>'"]),
    ("- a\n- b\n", ["{p}: expected a mapping of settings at the top level, got list"]),
]


@pytest.mark.parametrize("text,problems", ERRORS, ids=[f"e{i}" for i in range(len(ERRORS))])
def test_each_error_is_one_line_with_file_line_and_key(text, problems):
    with pytest.raises(ConfigError) as info:
        parse_config(text, "c.yaml")
    assert info.value.problems == [p.format(p="c.yaml") for p in problems]
    assert str(info.value) == "\n".join(info.value.problems)


def test_an_empty_file_is_the_defaults_and_those_need_data():
    with pytest.raises(ConfigError, match="needs data.train"):
        parse_config("", "c.yaml")
    assert parse_config(OWN).watchdog == WatchdogCfg()


def test_the_formerly_hidden_defaults_are_records():
    w = parse_config(OWN).watchdog
    assert (w.kill_wait_s, w.exit_after_stop_s) == (30, 30)
    assert w.phase_budgets_s == {"eval": 900, "predict": 900, "generate": 300, "checkpoint": 600, "intake": 600}
    # Setting one replaces the map: a user's budgets are the budgets.
    w = parse_config(OWN + "watchdog:\n  phase_budgets_s: {load: 50}\n  kill_wait_s: 5\n").watchdog
    assert w.phase_budgets_s == {
        "eval": 900,
        "predict": 900,
        "generate": 300,
        "checkpoint": 600,
        "intake": 600,
        "load": 50,
    }
    assert w.kill_wait_s == 5
    w = parse_config(OWN + "watchdog:\n  phase_budgets_s: {eval: 60, intake: null}\n").watchdog
    assert w.phase_budgets_s == {
        "eval": 60,
        "predict": 900,
        "generate": 300,
        "checkpoint": 600,
    }  # null removes a default
    docs = {key: doc for key, _, _, doc in reference_rows()}
    assert "startup_timeout_s" in docs["watchdog.phase_budgets_s"] and "intake" in docs["watchdog.phase_budgets_s"]
    assert "SIGKILL" in docs["watchdog.kill_wait_s"] and "stop" in docs["watchdog.exit_after_stop_s"]
    assert docs["train.sleep_per_step_s"].startswith("Demo knob")


def test_every_record_is_documented():
    rows = reference_rows() + reference_rows(FaultCfg, "faults[].")
    undocumented = [key for key, _, _, doc in rows if not doc.strip()]
    assert undocumented == []
    assert len({key for key, *_ in rows}) == len(rows)


def test_fault_kinds_are_the_schemas_choices():
    assert typing.get_args(FaultCfg.model_fields["kind"].annotation) == FAULT_KINDS


def test_reference_lists_every_key_in_both_forms():
    md, text = reference_markdown(), reference_text()
    for key, typ, default, _ in reference_rows():
        assert f"| `{key}` | {typ} | `{default}` |" in md
        assert f"  {key} = {default}  ({typ})" in text
    assert "| `faults[].kind` | one of hang_generate, busy_loop" in md
    assert "| `watchdog.step_timeout_s` | float or null | `null` |" in md
    assert (
        "| `watchdog.phase_budgets_s` | map of str to float | `{checkpoint: 600, eval: 900, generate: 300, intake: "
        "600, predict: 900}` |" in md
    )
    assert "| `eval.prompts` | list of str or {prompt, reference} | `[]` |" in md
    assert len(text.splitlines()) == 2 * len(reference_rows())


def test_paths_resolve_against_the_config_files_directory(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    (conf / "models" / "m").mkdir(parents=True)
    path = conf / "run.yaml"
    path.write_text(
        "run_dir: runs/a\ndata: {train: d/train.jsonl, eval: /abs/eval.jsonl}\n"
        "control: {socket: s/hw.sock}\nmodel: {name_or_path: models/m}\n"
    )
    monkeypatch.chdir(tmp_path)  # elsewhere: the working directory must not matter
    cfg = load_config(path)
    assert cfg.run_dir == str(conf / "runs" / "a")
    assert cfg.data.train == str(conf / "d" / "train.jsonl") and cfg.data.eval == "/abs/eval.jsonl"
    assert cfg.control.socket == str(conf / "s" / "hw.sock")
    assert cfg.worker.cwd == str(conf)
    assert cfg.model.name_or_path == str(conf / "models" / "m")
    assert cfg._source == path
    path.write_text(OWN + "model: {name_or_path: org/hub-model}\n")
    assert load_config(path).model.name_or_path == "org/hub-model"  # not a path here: a hub-cache id
    assert load_config(path, run_dir="other").run_dir == str(tmp_path / "other")  # --run-dir: against the cwd


def test_unreadable_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert info.value.problems == [f"{tmp_path / 'nope.yaml'}: no such config file"]
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.problems == [f"{tmp_path}: is a directory; give the config file (a .yaml) inside it"]
    with pytest.raises(ConfigError, match=r"bad\.yaml:4: watchdog\.kill_wait: unknown key"):
        (tmp_path / "bad.yaml").write_text(OWN + "watchdog:\n  kill_wait: 10\n")
        load_config(tmp_path / "bad.yaml")


def test_the_dumped_config_reads_back_the_same(tmp_path):
    cfg = parse_config(
        OWN + "faults:\n  - {kind: nan, at_step: 4}\neval:\n  prompts: [hi, {prompt: yo, reference: x}]\n",
        base_dir=tmp_path,
    )
    again = parse_config(dump_config(cfg))
    assert again == cfg and isinstance(again, Config)
