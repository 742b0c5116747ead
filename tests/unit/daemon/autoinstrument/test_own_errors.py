"""The automatic instrumentation never breaks the run: a hook whose own code fails reports it once (a `warn` beat)
and is switched off; the script's own exceptions pass through the wrappers untouched; saves nest, and only
the outermost one is a phase and an announcement (daemon/autoinstrument/{context,saves,frameworks}.py)."""

from __future__ import annotations

import io
import os
import types

import pytest
from fixtures.fakes.autoinstrument import auto_context, beats, events, reset_process_state

from hangwatch.daemon.autoinstrument.frameworks import (
    KEEP,
    PASS,
    WARN,
    Frameworks,
    hf_checkpoint,
    lightning_checkpoint,
    resume_decision,
)
from hangwatch.daemon.autoinstrument.imports import PostImportHooks
from hangwatch.daemon.autoinstrument.saves import SKIP, Saves, file_target
from hangwatch.daemon.autoinstrument.steps import StepCounter


@pytest.fixture
def ctx(tmp_path):
    reset_process_state()
    c = auto_context(tmp_path, resume_step=4, resume_from=str(tmp_path / "good"))
    yield c
    c.hb.close()
    reset_process_state()


class FakeOptimizer:
    param_groups = [{"lr": 0.1}]


def warns(ctx) -> list[str]:
    return [b["message"] for b in beats(ctx) if b["event"] == "warn"]


def test_a_failing_hook_warns_once_and_is_switched_off(ctx, monkeypatch):
    counter = StepCounter(ctx)
    opt = FakeOptimizer()
    counter.after_step(opt, (), {})

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ctx.hb, "_step", broken)
    counter.after_step(opt, (), {})  # must not raise into optimizer.step()
    counter.after_step(opt, (), {})
    assert warns(ctx) == ["instrumentation error in optimizer step: OSError: [Errno 28] No space left on device"]
    assert not counter.hook.on and ctx.errors["optimizer step"].startswith("instrumentation error")
    assert [b["step"] for b in beats(ctx) if b["event"] == "step"] == [5]


def test_a_warn_that_cannot_be_written_goes_to_stderr(ctx, capsys, monkeypatch):
    hook = ctx.hook("torch.save")

    def no_warn(*a, **k):
        raise OSError("read-only file system")

    monkeypatch.setattr(ctx.hb, "warn", no_warn)
    ctx.failed(hook, ValueError("bad"))
    ctx.failed(hook, ValueError("again"))  # off already: said once
    assert capsys.readouterr().err == "hangwatch: instrumentation error in torch.save: ValueError: bad\n"


def test_the_users_exception_passes_through_a_save_untouched(ctx, tmp_path):
    saves = Saves(ctx)
    hook = ctx.hook("torch.save")
    boom = RuntimeError("disk full, says the script")

    def save(obj, f):
        raise boom

    wrapped = saves.bracket(hook, save, lambda a, k: file_target(a[1]))
    ctx.hb.enter_phase("train")
    with pytest.raises(RuntimeError) as info:
        wrapped({}, str(tmp_path / "x.pt"))
    assert info.value is boom
    assert hook.on and warns(ctx) == []
    assert [e[2] for e in events(ctx) if e[0] == "phase"] == ["train", "checkpoint", "train"]
    assert not [b for b in beats(ctx) if b["event"] == "checkpoint"]  # a save that failed is no checkpoint
    assert saves.depth() == 0


def test_hangwatchs_own_error_in_a_save_wrapper_does_not_stop_the_save(ctx, tmp_path):
    saves = Saves(ctx)
    hook = ctx.hook("safetensors save")

    def target(a, k):
        raise TypeError("unexpected signature")

    wrapped = saves.bracket(hook, lambda tensors, filename: ("written", filename), target)
    assert wrapped({}, "m.safetensors") == ("written", "m.safetensors")
    assert wrapped({}, "n.safetensors") == ("written", "n.safetensors")
    assert warns(ctx) == ["instrumentation error in safetensors save: TypeError: unexpected signature"]


def test_only_the_outermost_save_is_a_phase_and_an_announcement(ctx, tmp_path):
    saves = Saves(ctx)
    inner_hook, outer_hook = ctx.hook("torch.save"), ctx.hook("save_pretrained")
    written = []
    torch_save = saves.bracket(inner_hook, lambda obj, f: written.append(f), lambda a, k: file_target(a[1]))

    def save_pretrained(model, directory):
        os.makedirs(directory, exist_ok=True)
        torch_save({}, os.path.join(directory, "a.bin"))
        torch_save({}, os.path.join(directory, "b.bin"))

    pretrained = saves.bracket(outer_hook, save_pretrained, lambda a, k: file_target(a[1]))
    ctx.hb.enter_phase("train")
    ctx.hb.current_step = 7
    pretrained(None, "out/final")
    torch_save({}, io.BytesIO())  # memory: no save at all
    with open(tmp_path / "f.pt", "wb") as f:
        torch_save({}, f)  # a file object: the phase, nobody to announce
    assert len(written) == 4
    lines = [(b["event"], b.get("phase"), b.get("path")) for b in beats(ctx)][2:]
    assert lines == [
        ("phase", "checkpoint", None),
        ("phase", "train", None),
        ("checkpoint", "train", os.path.abspath("out/final")),
        ("phase", "checkpoint", None),
        ("phase", "train", None),
    ]
    ckpt = [b for b in beats(ctx) if b["event"] == "checkpoint"][0]
    assert (ckpt["step"], ckpt["good"], ckpt["saved_by"]) == (7, False, "save_pretrained")


def test_what_a_save_announces():
    assert file_target("x.pt") == os.path.abspath("x.pt")
    assert file_target(b"x.pt") == os.path.abspath("x.pt")
    assert file_target("s3://bucket/x.ckpt") == "s3://bucket/x.ckpt"
    assert file_target(io.BytesIO()) is SKIP
    assert file_target(open(os.devnull, "wb")) is None


def test_a_failing_post_import_callback_is_one_warning(ctx):
    hooks = PostImportHooks(on_error=lambda name, cb, exc: ctx.failed(ctx.hook("patching " + name), exc))

    def patch(module):
        raise AttributeError("module 'json' has no attribute 'Trainer'")

    hooks.register("json", patch)  # imported already: at once
    assert warns(ctx) == [
        "instrumentation error in patching json: AttributeError: module 'json' has no attribute 'Trainer'"
    ]


# ---- Trainers: the callback and the resume ---------------------------------------------------------------


def fake_trainer_module(init_error=None):
    class Trainer:
        def __init__(self, name="t", callbacks=None):
            if init_error is not None:
                raise init_error
            self.name = name
            self.calls = []
            self.callback_handler = types.SimpleNamespace(callbacks=list(callbacks or []))

        def add_callback(self, cb):
            self.callback_handler.callbacks.append(cb)

        def train(self, resume_from_checkpoint=None, trial=None):
            self.calls.append(resume_from_checkpoint)
            return resume_from_checkpoint

        def _save_checkpoint(self, model, trial):
            return "saved"

    return types.SimpleNamespace(Trainer=Trainer, __name__="transformers.trainer")


def test_the_trainers_init_error_is_the_users_and_ours_is_a_warning(ctx, monkeypatch):
    frameworks = Frameworks(ctx, Saves(ctx))
    boom = ValueError("bad TrainingArguments")
    module = fake_trainer_module(boom)
    frameworks.patch_hf_trainer(module)
    with pytest.raises(ValueError) as info:
        module.Trainer()
    assert info.value is boom and warns(ctx) == []

    module = fake_trainer_module()
    frameworks.patch_hf_trainer(module)
    import hangwatch.daemon.integrations.transformers as hf

    monkeypatch.setattr(hf, "HangwatchCallback", None)  # "calling" it fails: hangwatch's error, not the script's
    trainer = module.Trainer("kept")
    assert trainer.name == "kept"
    assert warns(ctx) == ["instrumentation error in HF Trainer callback: TypeError: 'NoneType' object is not callable"]


def test_a_trainer_gets_one_hangwatch_callback(ctx, tmp_path):
    frameworks = Frameworks(ctx, Saves(ctx))
    module = fake_trainer_module()
    frameworks.patch_hf_trainer(module)
    trainer = module.Trainer()
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks] == ["HangwatchCallback"]
    assert trainer.callback_handler.callbacks[0].stop_beat is False

    class Sub(module.Trainer):  # TRL's SFTTrainer and the like: through the base class's __init__
        def __init__(self):
            super().__init__("sub")
            assert len(self.callback_handler.callbacks) == 1

    assert len(Sub().callback_handler.callbacks) == 1

    class HangwatchCallback:  # the script's own: any class of that name
        pass

    own = module.Trainer(callbacks=[HangwatchCallback()])
    assert [type(c) for c in own.callback_handler.callbacks] == [HangwatchCallback]
    assert warns(ctx) == []


def test_trainer_train_resumes_from_the_last_good_checkpoint(ctx, tmp_path, capsys):
    good = tmp_path / "good"
    good.mkdir()
    (good / "trainer_state.json").write_text("{}")
    frameworks = Frameworks(ctx, Saves(ctx))
    module = fake_trainer_module()
    frameworks.patch_hf_trainer(module)
    trainer = module.Trainer()
    assert trainer.train() == str(good)
    assert trainer.train(None) == str(good)  # positional None too
    assert trainer.train(resume_from_checkpoint=True) is True
    assert trainer.train(False) is False
    assert trainer.train(str(good)) == str(good) and warns(ctx) == []
    assert trainer.train(str(tmp_path / "other")) == str(tmp_path / "other")
    assert warns(ctx) == [f"resume_from_checkpoint={tmp_path / 'other'} is not the last good checkpoint {good}"]
    assert "resuming from the last good checkpoint" in capsys.readouterr().err


@pytest.mark.parametrize(
    "given,expect",
    [
        (None, (PASS, "/ck/good")),
        (True, (KEEP, None)),
        (False, (KEEP, None)),
        ("/ck/good", (KEEP, None)),
        ("/ck/good/", (KEEP, None)),
        ("last", (KEEP, None)),
        ("registry:model:latest", (KEEP, None)),
        ("/ck/older", (WARN, "resume_from_checkpoint=/ck/older is not the last good checkpoint /ck/good")),
    ],
)
def test_resume_decisions(given, expect):
    assert resume_decision(given, "/ck/good", lambda p: True, ("last", "best", "hpc", "registry")) == expect


def test_nothing_offered_or_nothing_usable(tmp_path):
    assert resume_decision(None, None, lambda p: True) == (KEEP, None)
    assert resume_decision(None, "", lambda p: True) == (KEEP, None)
    what, message = resume_decision(None, str(tmp_path / "x.pt"), hf_checkpoint)
    assert what == WARN and "cannot be resumed from here" in message
    assert hf_checkpoint(str(tmp_path)) is False and lightning_checkpoint(str(tmp_path)) is True
    assert lightning_checkpoint("s3://b/last.ckpt") is True


def test_a_framework_version_that_does_not_fit_one_piece_loses_that_piece_only(ctx):
    module = fake_trainer_module()
    del module.Trainer._save_checkpoint  # "renamed in this version"
    Frameworks(ctx, Saves(ctx)).patch_hf_trainer(module)
    assert warns(ctx) == ["instrumentation error in HF Trainer save: KeyError: '_save_checkpoint'"]
    trainer = module.Trainer()
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks] == ["HangwatchCallback"]
    assert "__hangwatch_original__" in vars(module.Trainer.train)
