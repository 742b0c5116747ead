"""`load_checked`: a config checked against the machine (data files and their first lines, the model,
worker.cwd and worker.command, the run and socket directories, the control group).  Files in tmp_path,
no processes; each row is one thing a user gets wrong, refused with the key, its line and the path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hangwatch.common.config import ConfigError, load_checked

GOOD_LINE = json.dumps({"prompt": "upper: cat", "completion": "CAT"})
CHAT_LINE = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A config directory with good data, a model directory, a hub cache, a bin dir and a program."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(GOOD_LINE + "\n" + CHAT_LINE + "\n")
    (tmp_path / "data" / "eval.jsonl").write_text(GOOD_LINE + "\n")
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text("{}")
    snap = tmp_path / "hub" / "models--org--cached" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "bin").mkdir()
    for name in ("trainer", "plain.txt"):
        (tmp_path / "bin" / name).write_text("#!/bin/sh\n")
    (tmp_path / "bin" / "trainer").chmod(0o755)
    (tmp_path / "a-file").write_text("")
    return tmp_path


ENV = {"PATH": "{site}/bin", "HF_HUB_CACHE": "{site}/hub", "HOME": "{site}"}
BASE = "run_dir: runs/x\ndata:\n  train: data/train.jsonl\n"  # lines 1-3
OWN = "run_dir: runs/x\nworker:\n  command: [trainer]\n"  # lines 1-3


def check(site: Path, text: str, env: dict = ENV):
    path = site / "c.yaml"
    path.write_text(text.format(site=site))
    return load_checked(path, environ={k: v.format(site=site) for k, v in env.items()})


PROBLEMS = [
    # data files
    (BASE.replace("data/train", "data/nope"), ["{p}:3: data.train: {site}/data/nope.jsonl: no such file"]),
    (BASE + "  eval: data/nope.jsonl\n", ["{p}:4: data.eval: {site}/data/nope.jsonl: no such file"]),
    (BASE.replace("data/train.jsonl", "data"), ["{p}:3: data.train: {site}/data: is a directory, not a JSONL file"]),
    (
        BASE.replace("data/train.jsonl", "a-file/train.jsonl"),
        ["{p}:3: data.train: {site}/a-file/train.jsonl: cannot read: Not a directory"],
    ),
    (
        BASE.replace("data/train.jsonl", "data/empty.jsonl"),
        ["{p}:3: data.train: {site}/data/empty.jsonl: empty: no example in it"],
    ),
    (
        BASE.replace("data/train.jsonl", "data/table.csv"),
        [
            "{p}:3: data.train: {site}/data/table.csv:1: not valid JSON: Expecting value: line 1 column 1 (char 0) "
            '(and every other of the first 2 line(s)): each line must be {{"prompt", "completion"}} or '
            '{{"messages": [...]}}'
        ],
    ),
    (
        BASE.replace("data/train.jsonl", "data/text.jsonl"),
        [
            "{p}:3: data.train: {site}/data/text.jsonl:2: expected keys 'prompt' and 'completion', or 'messages' "
            '(and every other of the first 1 line(s)): each line must be {{"prompt", "completion"}} or '
            '{{"messages": [...]}}'
        ],
    ),
    # model
    (
        BASE + "model:\n  name_or_path: {site}/models/gone\n",
        ["{p}:5: model.name_or_path: {site}/models/gone: no such directory"],
    ),
    (
        BASE + "model:\n  name_or_path: ./models/gone\n",
        ["{p}:5: model.name_or_path: {site}/models/gone: no such directory"],
    ),
    (
        BASE + "model:\n  name_or_path: data\n",
        ["{p}:5: model.name_or_path: {site}/data: no config.json in it: not a Hugging Face model directory"],
    ),
    (
        BASE + "model:\n  name_or_path: a-file\n",
        [
            "{p}:5: model.name_or_path: {site}/a-file: a file; expected a model directory (config.json, weights, "
            "tokenizer)"
        ],
    ),
    (
        BASE + "model:\n  name_or_path: org/uncached\n",
        [
            "{p}:5: model.name_or_path: 'org/uncached' is neither a directory (no {site}/org/uncached) nor in the "
            "Hugging Face hub cache ({site}/hub); hangwatch never downloads a model: give a model directory, or fetch "
            "it into the cache first (`hf download org/uncached`)"
        ],
    ),
    # worker
    (OWN + "  cwd: nowhere\n", ["{p}:4: worker.cwd: {site}/nowhere: no such directory"]),
    (OWN + "  cwd: a-file\n", ["{p}:4: worker.cwd: {site}/a-file: not a directory"]),
    (
        OWN.replace("[trainer]", "[no-such-program, x.py]"),
        ["{p}:3: worker.command.0: 'no-such-program': not found on the worker's PATH ({site}/bin)"],
    ),
    (OWN.replace("[trainer]", "[./bin/gone]"), ["{p}:3: worker.command.0: {site}/bin/gone: no such file"]),
    (
        OWN.replace("[trainer]", "[bin/plain.txt]"),
        ["{p}:3: worker.command.0: {site}/bin/plain.txt: not an executable file"],
    ),
    (OWN.replace("[trainer]", "[./bin]"), ["{p}:3: worker.command.0: {site}/bin: not an executable file"]),
    # directories and the control socket
    (
        OWN.replace("runs/x", "a-file/run"),
        ["{p}:1: run_dir: {site}/a-file/run: {site}/a-file is not a directory, so the run directory cannot be created"],
    ),
    (
        OWN.replace("runs/x", "a-file"),
        ["{p}:1: run_dir: {site}/a-file: {site}/a-file is not a directory, so the run directory cannot be used"],
    ),
    (
        OWN + "control:\n  socket: a-file/s/hw.sock\n",
        [
            "{p}:5: control.socket: {site}/a-file/s: {site}/a-file is not a directory, so the socket's directory "
            "cannot be created"
        ],
    ),
    (
        OWN + "control:\n  group: no-such-group-hw\n",
        ["{p}:5: control.group: no such group 'no-such-group-hw' on this machine"],
    ),
    # several: in the order of the file
    (
        "worker:\n  command: [gone]\n  cwd: bin\ndata:\n  train: data/nope.jsonl\nrun_dir: a-file\n",
        [
            "{p}:2: worker.command.0: 'gone': not found on the worker's PATH ({site}/bin)",
            "{p}:5: data.train: {site}/data/nope.jsonl: no such file",
            "{p}:6: run_dir: {site}/a-file: {site}/a-file is not a directory, so the run directory cannot be used",
        ],
    ),
]


@pytest.mark.parametrize("text,problems", PROBLEMS, ids=[f"p{i}" for i in range(len(PROBLEMS))])
def test_what_the_config_names_must_be_there(site, text, problems):
    (site / "data" / "empty.jsonl").write_text("\n\n")
    (site / "data" / "table.csv").write_text("prompt,completion\nupper: cat,CAT\n")
    (site / "data" / "text.jsonl").write_text("\n" + json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(ConfigError) as info:
        check(site, text)
    path = site / "c.yaml"
    assert info.value.problems == [p.format(p=path, site=site) for p in problems]


FINE = [
    BASE,
    BASE + "  eval: data/eval.jsonl\neval:\n  every_steps: 5\n",
    BASE + "model:\n  name_or_path: models/m\n",  # relative to the config file's directory
    BASE + "model:\n  name_or_path: {site}/models/m\n",
    BASE + "model:\n  name_or_path: org/cached\n",  # in the hub cache: loadable without a download
    OWN,
    OWN + "  cwd: bin\n",
    OWN.replace("[trainer]", "[./trainer, --flag]") + "  cwd: bin\n",  # relative to worker.cwd, as it is run
    OWN.replace("[trainer]", "[{site}/bin/trainer]"),
    OWN + "data:\n  train: bin/plain.txt\n",  # a worker of one's own reads its files its own way
    OWN + "model:\n  name_or_path: org/uncached\n",  # ... and loads its model its own way
    OWN + "control:\n  socket: sockets/deep/hw.sock\n",  # created on start
]


@pytest.mark.parametrize("text", FINE, ids=[f"ok{i}" for i in range(len(FINE))])
def test_what_is_there_passes(site, text):
    cfg, warnings = check(site, text)
    assert warnings == []
    assert cfg.run_dir == str(site / "runs" / "x")


def test_the_workers_own_environment_decides_the_path_and_the_hub_cache(site):
    (site / "other-bin").mkdir()
    (site / "other-bin" / "trainer2").write_text("#!/bin/sh\n")
    (site / "other-bin" / "trainer2").chmod(0o755)
    check(site, OWN.replace("[trainer]", "[trainer2]") + "  env: {{PATH: '{site}/other-bin'}}\n")
    hub = BASE + "model:\n  name_or_path: org/cached\n"
    no_cache = {"PATH": "/bin", "HOME": "{site}/elsewhere"}
    with pytest.raises(ConfigError, match="nor in the Hugging Face hub cache"):
        check(site, hub, env=no_cache)
    (site / "hf").mkdir()
    (site / "hub").rename(site / "hf" / "hub")
    check(site, hub + "worker:\n  env: {{HF_HOME: '{site}/hf'}}\n", env=no_cache)


def test_a_partly_bad_data_file_is_a_warning_per_bad_line(site):
    (site / "data" / "train.jsonl").write_text(
        "\n".join([GOOD_LINE, "{oops", json.dumps({"prompt": "p"}), CHAT_LINE]) + "\n"
    )
    _, warnings = check(site, BASE)
    path, data = site / "c.yaml", site / "data" / "train.jsonl"
    assert warnings == [
        f"{path}:3: data.train: {data}:2: not valid JSON: Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1); the worker will skip this line",
        f"{path}:3: data.train: {data}:3: missing key 'completion'; the worker will skip this line",
    ]


def test_advice_comes_with_the_key_and_line(site):
    _, warnings = check(site, BASE + "eval:\n  prompts: [hi]\n")
    assert warnings == [f"{site / 'c.yaml'}:5: eval.prompts: never generated: eval.every_steps is 0 (no eval runs)"]


def test_run_dir_from_the_command_line_is_not_blamed_on_the_files_line(site):
    (site / "c.yaml").write_text(OWN)
    with pytest.raises(ConfigError) as info:
        load_checked(site / "c.yaml", run_dir=str(site / "a-file" / "r"), environ={"PATH": str(site / "bin")})
    assert info.value.problems == [
        f"{site / 'c.yaml'}: run_dir: {site}/a-file/r: {site}/a-file is not a directory, so the run directory cannot "
        "be created"
    ]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the mode bits say")
def test_unreadable_and_unwritable_paths(site):
    (site / "data" / "train.jsonl").chmod(0)
    locked = site / "locked"
    locked.mkdir(mode=0o555)
    with pytest.raises(ConfigError) as info:
        check(site, BASE.replace("runs/x", "locked/run"))
    assert info.value.problems == [
        f"{site / 'c.yaml'}:1: run_dir: {locked}/run: the run directory cannot be created: {locked} is not writable "
        f"by uid {os.geteuid()}",
        f"{site / 'c.yaml'}:3: data.train: {site}/data/train.jsonl: cannot read: Permission denied",
    ]
