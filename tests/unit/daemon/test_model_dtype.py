"""Memory settings of the worker's model (daemon/model.py): the bf16 decision of `dtype: auto`, trainable
parameters kept float32, gradient checkpointing (same numbers, exact resume — on the CPU), and the 4-bit
(QLoRA) path.  No GPU is used, whatever the machine: CUDA's presence and bf16 support are faked (and its absence,
where that is the point), and so are bitsandbytes and `from_pretrained` for the 4-bit path — what is tested is what
the worker asks for, not the kernels."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from fixtures.fakes.workers import losses_by_step, make_config, read_beats, run_in_process

from hangwatch.common.config import ConfigError, load_config
from hangwatch.daemon import model as M


@pytest.mark.parametrize(
    "dtype, device, bf16, want",
    [
        ("auto", "cuda", True, torch.bfloat16),
        ("auto", "cuda", False, torch.float32),  # e.g. a V100: float32 weights
        ("auto", "cpu", False, torch.float32),
        ("float32", "cuda", True, torch.float32),
        ("bfloat16", "cpu", False, torch.bfloat16),
    ],
)
def test_base_dtype(dtype, device, bf16, want):
    assert M.base_dtype(dtype, device, bf16) is want


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch believes in a bf16-capable CUDA device (nothing is ever moved there)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_auto_on_a_bf16_gpu_loads_bf16_base_and_keeps_trainables_float32(tmp_path, fake_cuda):
    cfg = load_config(make_config(tmp_path, model={"device": "auto"}))
    device, autocast = M.pick_device(cfg)
    assert device.type == "cuda" and autocast is torch.bfloat16
    base, tok = M.load_base(cfg, 0, device)
    assert {p.dtype for p in base.parameters()} == {torch.bfloat16}
    model, extras = M.wrap_lora(base, cfg.lora)
    bundle = M.ModelBundle(model=model, tokenizer=tok, extra=extras, device=device, autocast_dtype=autocast)
    M.prepare_for_training(bundle, cfg)
    trainable = dict(bundle.trainable_parameters())
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}
    assert any("causal_projection" in n for n in trainable)  # the extra head too
    frozen = {p.dtype for p in bundle.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}


def test_gradient_checkpointing_is_turned_on(tmp_path):
    cfg = load_config(make_config(tmp_path, model={"gradient_checkpointing": True}))
    bundle = M.load_model(cfg)
    assert M.checkpointing_on(bundle.base)
    M.prepare_for_training(bundle, cfg)  # idempotent
    assert not M.checkpointing_on(M.load_model(load_config(make_config(tmp_path, _name="off.yaml"))).base)


def test_gradient_checkpointing_same_numbers_and_exact_resume(tmp_path):
    common = {"train": {"max_steps": 4}, "checkpoint": {"every_steps": 2, "confirm_steps": 0}}
    plain = make_config(tmp_path / "plain", **common)
    assert run_in_process(plain) == 0
    gc = make_config(tmp_path / "gc", model={"gradient_checkpointing": True}, **common)
    assert run_in_process(gc) == 0
    reference = losses_by_step(read_beats(tmp_path / "gc" / "run", 1))
    # Recomputation replays the RNG (dropout): the numbers are the ones without checkpointing.
    assert reference == losses_by_step(read_beats(tmp_path / "plain" / "run", 1))
    crashed = make_config(
        tmp_path / "crash", model={"gradient_checkpointing": True}, faults=[{"kind": "crash", "at_step": 3}], **common
    )
    assert run_in_process(crashed) == 1
    assert run_in_process(crashed) == 0
    resumed = read_beats(tmp_path / "crash" / "run", 2)
    assert resumed[0]["resumed_step"] == 2
    assert losses_by_step(resumed) == {3: reference[3], 4: reference[4]}


def test_4bit_is_refused_without_a_gpu(tmp_path, no_cuda):
    with pytest.raises(ConfigError, match="load_in_4bit needs a CUDA GPU"):
        load_config(make_config(tmp_path, model={"name_or_path": "some/model", "load_in_4bit": True}))
    with pytest.raises(ConfigError, match="the tiny model is built"):
        load_config(make_config(tmp_path, model={"device": "auto", "load_in_4bit": True}))
    # device auto on a machine without CUDA: refused once the worker knows, still a config error (exit 78)
    cfg = load_config(
        make_config(tmp_path, model={"device": "auto", "name_or_path": "some/model", "load_in_4bit": True})
    )
    with pytest.raises(ConfigError, match="needs a CUDA GPU and this worker runs on cpu"):
        M.load_model(cfg)


def test_4bit_refused_on_cpu_exits_78(tmp_path):
    config = make_config(tmp_path, model={"name_or_path": "some/model", "load_in_4bit": True})
    assert run_in_process(config) == 78


def test_4bit_path_asks_for_nf4_and_prepares_for_kbit_training(tmp_path, fake_cuda, monkeypatch):
    import peft
    import transformers

    cfg = load_config(
        make_config(
            tmp_path,
            model={
                "device": "auto",
                "name_or_path": str(tmp_path / "m"),
                "load_in_4bit": True,
                "gradient_checkpointing": True,
            },
        )
    )
    tok = M.build_tiny_tokenizer(cfg.model.tiny.vocab_size)
    asked = {}

    def from_pretrained(name, **kwargs):
        asked.update(kwargs, name=name)
        model = M.build_tiny_model(cfg.model.tiny, tok, 0)
        model.is_loaded_in_4bit = True
        return model

    monkeypatch.setitem(sys.modules, "bitsandbytes", types.ModuleType("bitsandbytes"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(lambda *a, **k: tok))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(from_pretrained))
    prepared = {}
    monkeypatch.setattr(peft, "prepare_model_for_kbit_training", lambda model, **kw: prepared.update(kw) or model)
    base, _ = M.load_base(cfg, 0, torch.device("cuda"))
    q = asked["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_compute_dtype is torch.bfloat16
    assert asked["device_map"] == {"": 0} and asked["local_files_only"] is True
    assert prepared == {"use_gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}}
    assert base.is_loaded_in_4bit


def test_4bit_without_bitsandbytes_names_the_extra(tmp_path, fake_cuda, monkeypatch):
    cfg = load_config(make_config(tmp_path, model={"device": "auto", "name_or_path": "x", "load_in_4bit": True}))
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails
    with pytest.raises(ConfigError, match=r"pip install 'hangwatch\[qlora\]'"):
        M.check_4bit(cfg, torch.device("cuda"))
