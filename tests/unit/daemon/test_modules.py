"""Extra trainable modules (the tiny model's causal_projection head and a modules_to_save entry)
are trained, checkpointed, restored on resume and exported beside the adapter."""

from __future__ import annotations

import io

import pytest
import torch
from fixtures.fakes.workers import make_config, run_in_process
from safetensors.torch import load_file

from hangwatch.common.config import load_config
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.export import load_final
from hangwatch.daemon.faults import FaultPlan
from hangwatch.daemon.heartbeat import NullHeartbeat
from hangwatch.daemon.model import load_model
from hangwatch.daemon.signals import StopRequest
from hangwatch.daemon.trainer.loop import Trainer


@pytest.mark.cuda_when_present  # PEFT loads the exported adapter onto the GPU whenever torch sees one
def test_extra_modules_are_trained_saved_restored_and_exported(tmp_path):
    config = make_config(
        tmp_path,
        train={"max_steps": 6},
        lora={"modules_to_save": ["lm_head"]},
        checkpoint={"every_steps": 3, "confirm_steps": 0},
    )
    assert run_in_process(config) == 0
    step6 = tmp_path / "run" / "checkpoints" / ckpt.step_name(6)
    adapter = load_file(str(step6 / "adapter_model.safetensors"))
    extra = load_file(str(step6 / "extra_modules.safetensors"))
    assert set(extra) == {"causal_projection.proj.weight", "causal_projection.proj.bias"}
    lm_key = "base_model.model.lm_head.weight"
    assert lm_key in adapter

    cfg = load_config(config)
    bundle = load_model(cfg)
    head = bundle.extra["causal_projection"]
    trainable = {id(p) for _, p in bundle.trainable_parameters()}
    assert all(id(p) in trainable for p in head.parameters()), "PEFT wrapping froze the extra head"
    initial_head = head.proj.weight.detach().clone()
    initial_lm = bundle.adapter_state()[lm_key]
    assert not torch.equal(initial_head, extra["causal_projection.proj.weight"]), "the head did not train"
    assert not torch.equal(initial_lm, adapter[lm_key]), "lm_head did not train"

    hb = NullHeartbeat()
    trainer = Trainer(
        cfg,
        hb,
        tmp_path / "run",
        bundle,
        _source(cfg, bundle),
        [],
        FaultPlan([], tmp_path / "run", hb),
        StopRequest(),
        out=io.StringIO(),
    )
    trainer.restore(step6)
    assert trainer.step == 6
    assert torch.equal(head.proj.weight, extra["causal_projection.proj.weight"])
    assert torch.equal(head.proj.bias, extra["causal_projection.proj.bias"])
    restored = bundle.adapter_state()
    assert all(torch.equal(restored[k], adapter[k]) for k in adapter)
    # The optimizer state covers every trainable parameter, extra ones included.
    assert len(trainer.optimizer.state) == len(bundle.trainable_parameters())

    model, tok, extras = load_final(tmp_path / "run" / "final")
    assert torch.equal(extras["causal_projection"].proj.weight, extra["causal_projection.proj.weight"])
    lm = model.base_model.model.lm_head.modules_to_save["default"].weight
    assert torch.equal(lm, adapter[lm_key])
    out = model.generate(
        input_ids=torch.tensor([tok("<s><|user|>upper: cat<|assistant|>", add_special_tokens=False)["input_ids"]]),
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
    )
    assert out.shape[-1] > 0


def _source(cfg, bundle):
    from hangwatch.daemon.data import ShuffledEpochs, validate_file

    examples, _ = validate_file(cfg.data.train, bundle.tokenizer, cfg)
    return ShuffledEpochs(examples, cfg.train.seed)
