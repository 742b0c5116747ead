"""`hangwatch doctor` for real: the demo config passes (a subprocess, as a user runs it), and configs with
the mistakes users' checklists name each get a WARN or FAIL that names the problem and the fix — pad == eos,
all-masked data, sampling with max_new_tokens 2048 and an eos the model never emits, LR 1.0, a model too
big for the machine.  Those run through the doctor's Python API in this process (the same `Doctor` the
`python -m hangwatch.daemon.doctor` child runs, without paying a torch import per config); one bad config
goes through `hangwatch doctor` and `hangwatch run` to show the exit codes and that a FAIL stops the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangwatch.common.config import load_config
from hangwatch.daemon.doctor.findings import FAIL, OK, SKIP, WARN
from hangwatch.daemon.doctor.runner import Doctor

REPO = Path(__file__).resolve().parents[2]
DEMO = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_layers": 1,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_position": 128,
    "extra_head": False,
}


def env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def hangwatch(*args, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hangwatch.supervisor.cli.main", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=REPO,
    )


def write_data(path: Path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


GOOD = [{"prompt": f"upper: {w}", "completion": w.upper()} for w in ("fox", "cat", "dog", "owl", "bee", "elk")]


def config(tmp_path: Path, name: str, **sections) -> Path:
    cfg = {
        "run_dir": str(tmp_path / f"run-{name}"),
        "model": {"tiny": TINY, "device": "cpu"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "data": {"train": write_data(tmp_path / f"{name}.jsonl", GOOD), "max_length": 48},
        "train": {"max_steps": 20, "micro_batch_size": 2, "grad_accum": 1, "lr": 2e-3, "warmup_steps": 2},
        "eval": {"every_steps": 10, "max_new_tokens": 8, "prompts": ["upper: fox"]},
        "watchdog": {"py_spy": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def model_dir(tmp_path: Path, name: str, *, pad_is_eos: bool = False, suppress_eos: bool = False) -> str:
    """A local model directory as a user would have one (save_pretrained of a tiny Llama and its tokenizer)."""
    from hangwatch.common.config.schema import TinyModelCfg
    from hangwatch.daemon.model import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(TINY["vocab_size"])
    model = build_tiny_model(TinyModelCfg(**TINY), tok, 0)
    if pad_is_eos:
        tok.pad_token = tok.eos_token
        model.config.pad_token_id = tok.eos_token_id
    if suppress_eos:
        model.generation_config.suppress_tokens = [tok.eos_token_id]
    out = tmp_path / name
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return str(out)


def findings(path: Path, cheap: bool = False) -> dict:
    return {f.check: f for f in Doctor(load_config(str(path)), cheap=cheap).run()}


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the tokenizer cache of named models


def test_demo_config_passes_as_a_user_runs_it():
    done = hangwatch("doctor", "configs/demo.yaml", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    by = {f["check"]: f for f in report["findings"]}
    assert not [f for f in report["findings"] if f["status"] == FAIL]
    for check in (
        "tokenizer special tokens",
        "chat template",
        "decoded example",
        "label alignment",
        "learning rate",
        "memory estimate",
        "disk",
        "forward/backward",
        "generate / eos",
        "training data",
    ):
        assert by[check]["status"] == OK, by[check]
    assert "'tab</s>'" in "".join(by["decoded example"]["details"])  # the learned span, eos included
    fb = by["forward/backward"]["summary"]
    assert "lora 28 tensors" in fb and "modules_to_save 2 tensors" in fb and "extra 2 tensors" in fb


def test_pad_equal_to_eos_is_named_with_its_fix(tmp_path):
    path = config(tmp_path, "padeos", model={"name_or_path": model_dir(tmp_path, "m-padeos", pad_is_eos=True)})
    by = findings(path)
    special = by["tokenizer special tokens"]
    assert special.status == WARN and "pad == eos" in special.summary and "pad token" in special.fix
    assert "6/6 examples end with a learned eos" in special.summary
    assert by["batch padding"].status == OK and "2 learned eos kept" in by["batch padding"].summary
    assert by["forward/backward"].status == OK


def test_all_masked_data_fails(tmp_path):
    data = write_data(
        tmp_path / "empty-completions.jsonl", [{"prompt": f"say {i}", "completion": ""} for i in range(5)]
    )
    by = findings(config(tmp_path, "masked", data={"train": data}), cheap=True)
    f = by["training data"]
    assert (
        f.status == FAIL
        and "all-masked" in f.summary
        and "5 all-masked" in f.summary
        and "non-empty completion" in f.fix
    )


def test_sampling_2048_tokens_with_an_eos_never_emitted(tmp_path):
    path = config(
        tmp_path,
        "noeos",
        model={"name_or_path": model_dir(tmp_path, "m-noeos", suppress_eos=True)},
        eval={"do_sample": True, "max_new_tokens": 2048, "prompts": ["upper: fox", "upper: cat"]},
    )
    f = findings(path)["generate / eos"]
    assert f.status in (WARN, FAIL), f
    assert "never emitted" in f.summary and "2048" in f.summary and "suppress_tokens" in f.fix


@pytest.mark.e2e
def test_lr_one_fails_and_stops_the_run(tmp_path):
    path = config(tmp_path, "lr", train={"lr": 1.0})
    f = findings(path, cheap=True)["learning rate"]
    assert f.status == FAIL and "train.lr 1" in f.summary and "1e-4" in f.fix
    done = hangwatch("doctor", path, "--cheap")
    assert done.returncode == 1 and "train.lr 1" in done.stdout
    run = hangwatch("run", path, timeout=60)
    assert run.returncode == 78, run.stderr
    assert "FAIL learning rate" in run.stderr and "--no-doctor" in run.stderr
    assert not (tmp_path / "run-lr" / "attempts").exists()  # nothing started


def test_a_model_too_big_for_the_machine_fails_without_loading_it(tmp_path):
    huge = {
        **TINY,
        "hidden_size": 16384,
        "intermediate_size": 65536,
        "num_layers": 64,
        "num_heads": 128,
        "num_kv_heads": 8,
    }
    by = findings(config(tmp_path, "huge", model={"tiny": huge}))
    mem = by["memory estimate"]
    assert mem.status == FAIL and "does not fit" in mem.summary and "micro_batch_size" in mem.fix
    assert by["model checks"].status == SKIP and "model load" not in by  # never allocated


def test_a_config_that_does_not_load_exits_78(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {lr: -1}\n")
    done = hangwatch("doctor", bad)
    assert done.returncode == 78 and "invalid configuration" in done.stderr


def test_the_cheap_set_imports_no_torch():
    """What `hangwatch run` runs before every first attempt stays well under a second: no torch."""
    code = (
        "import sys; from hangwatch.daemon.doctor.__main__ import main; "
        "rc = main(['configs/demo.yaml', '--cheap', '--plain']); print('torch' in sys.modules, rc)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env(), cwd=REPO)
    assert done.stdout.strip().splitlines()[-1] == "False 0", done.stdout + done.stderr
    assert "11 OK" in done.stdout
