"""The rank's side of a script's OOM batch (`daemon.autoinstrument.oom_batch`): the run dir's record read (a bad one
is a clear warning and ignored), the pure choice of what to apply, and the application at an HF Trainer's train() and
a Lightning fit() — on stand-ins with the frameworks' attribute names, so no framework is imported here (the real
ones run in tests/e2e/test_framework_oom.py)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
from fixtures.fakes.autoinstrument import beats, context_fixture

from hangwatch.common.rundir import FRAMEWORK_REMEDIATION_NAME
from hangwatch.daemon.autoinstrument import oom_batch
from hangwatch.daemon.autoinstrument.frameworks import Frameworks
from hangwatch.daemon.autoinstrument.oom_batch import HF, LIGHTNING, OomBatch, invalid, plan, read_remedy
from hangwatch.daemon.autoinstrument.saves import Saves
from hangwatch.supervisor.concerns import framework_oom


@pytest.fixture
def ctx(tmp_path):
    yield from context_fixture(tmp_path)


def record(framework=HF, configured=(4, 1), now=(2, 2), **extra) -> dict:
    return {
        "version": 1,
        "framework": framework,
        "configured": {"batch": configured[0], "accumulation": configured[1]},
        "batch": now[0],
        "accumulation": now[1],
        "history": [],
        **extra,
    }


def write(ctx, data) -> Path:
    path = Path(ctx.run_dir) / FRAMEWORK_REMEDIATION_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def warns(ctx) -> list[dict]:
    return [b for b in beats(ctx) if b["event"] == "warn"]


def found(ctx) -> dict:
    return json.loads((Path(ctx.hb.path).parent / "framework-rank0.json").read_text())


def test_the_record_format_is_the_supervisors():
    assert oom_batch.FORMAT_VERSION == framework_oom.FORMAT_VERSION
    assert oom_batch.LABELS == framework_oom.LABELS


@pytest.mark.parametrize(
    "data, why",
    [
        ([], "not a JSON object"),
        ({**record(), "version": 2}, "version 2, not 1"),
        ({**record(), "framework": "keras"}, "framework 'keras' is none of hf, lightning"),
        ({**record(), "configured": {"batch": 0, "accumulation": 1}}, "`configured` is not a batch"),
        ({**record(), "batch": "2"}, "`batch` and `accumulation` are not ints"),
        ({**record(), "batch": True}, "`batch` and `accumulation` are not ints"),
        (record(now=(2, 1)), "does not keep the configured effective batch 4 × 1"),
        (record(), None),
    ],
)
def test_what_makes_a_record_unusable(data, why):
    got = invalid(data)
    assert (got is None) if why is None else why in got


def test_reading_the_record(tmp_path):
    assert read_remedy(None) == (None, None)
    assert read_remedy(str(tmp_path)) == (None, None)  # none yet
    path = tmp_path / FRAMEWORK_REMEDIATION_NAME
    path.write_text("{not json")
    got, why = read_remedy(str(tmp_path))
    assert got is None and why.startswith(f"{path} is not JSON") and why.endswith("; ignored")
    path.write_text(json.dumps(record(now=(3, 1))))
    got, why = read_remedy(str(tmp_path))
    assert (
        got is None
        and why == f"{path} ignored: batch 3 × accumulation 1 does not keep the configured effective batch 4 × 1"
    )
    path.write_text(json.dumps(record()))
    assert read_remedy(str(tmp_path)) == (record(), None)


ASKED = {"batch": 4, "accumulation": 1}


@pytest.mark.parametrize(
    "rec, framework, asked, fixed, expect",
    [
        (None, HF, ASKED, None, (None, None)),  # nothing recorded: the script's own setting
        (record(), HF, ASKED, None, ({"batch": 2, "accumulation": 2}, None)),
        (record(LIGHTNING), LIGHTNING, ASKED, None, ({"batch": 2, "accumulation": 2}, None)),
        (record(LIGHTNING), HF, ASKED, None, (None, "it was made for a Lightning Trainer, this is a HF Trainer")),
        (record(), HF, ASKED, "DeepSpeed: …", (None, "DeepSpeed: …")),
        (
            record(),
            HF,
            {"batch": 8, "accumulation": 1},
            None,
            (
                None,
                "it was made for per_device_train_batch_size 4 × gradient_accumulation_steps 1; the script now asks "
                "for per_device_train_batch_size 8 × gradient_accumulation_steps 1",
            ),
        ),
    ],
)
def test_what_is_applied(rec, framework, asked, fixed, expect):
    assert plan(rec, framework, asked, fixed) == expect


class Args(types.SimpleNamespace):
    n_gpu = 1

    @property
    def train_batch_size(self):
        return self.per_device_train_batch_size * self.n_gpu


class Trainer:  # transformers.Trainer's name and attributes
    def __init__(self, **args):
        self.args = Args(per_device_train_batch_size=4, gradient_accumulation_steps=1, deepspeed=None, **args)
        self._train_batch_size = self.args.train_batch_size


def test_an_hf_trainer_gets_the_recorded_batch_before_training_and_says_so(ctx, capsys):
    write(ctx, record())
    trainer = Trainer()
    OomBatch(ctx).hf_train(trainer)
    assert (trainer.args.per_device_train_batch_size, trainer.args.gradient_accumulation_steps) == (2, 2)
    assert trainer._train_batch_size == 2  # what train() builds its DataLoader from
    said = (
        "out-of-memory remedy applied to the HF Trainer: per_device_train_batch_size 4 → 2, "
        "gradient_accumulation_steps 1 → 2 (4 examples per optimizer step, as before) [framework-remediation.json]"
    )
    assert f"hangwatch: {said}" in capsys.readouterr().err
    (warn,) = warns(ctx)
    assert warn["message"] == said and warn["framework_remediation"]["applied"] is True
    assert warn["framework_remediation"]["now"] == {"batch": 2, "accumulation": 2}
    got = found(ctx)
    assert got["asked"] == ASKED and got["now"] == {"batch": 2, "accumulation": 2} and got["applied"] is True
    assert got["arguments"] == {"batch": "per_device_train_batch_size", "accumulation": "gradient_accumulation_steps"}
    OomBatch(ctx).hf_train(trainer)  # train() again: already set, nothing more
    assert trainer.args.per_device_train_batch_size == 2 and len(warns(ctx)) == 1


def test_without_a_record_the_trainer_is_left_alone_and_what_it_trains_with_is_written(ctx, capsys):
    trainer = Trainer()
    OomBatch(ctx).hf_train(trainer)
    assert trainer.args.per_device_train_batch_size == 4 and warns(ctx) == []
    assert "hangwatch" not in capsys.readouterr().err
    got = found(ctx)
    assert got["now"] == ASKED and got["applied"] is None and got["changeable"] is True


@pytest.mark.parametrize(
    "content, words",
    [
        ("{torn", "is not JSON"),
        (json.dumps(record(now=(3, 1))), "does not keep the configured effective batch"),
        (json.dumps({**record(), "version": 9}), "version 9, not 1"),
    ],
)
def test_a_bad_record_is_a_warning_and_ignored(ctx, capsys, content, words):
    write(ctx, content)
    trainer = Trainer()
    OomBatch(ctx).hf_train(trainer)
    assert trainer.args.per_device_train_batch_size == 4  # the script's own setting: the run goes on
    (warn,) = warns(ctx)
    assert words in warn["message"] and FRAMEWORK_REMEDIATION_NAME in warn["message"]
    assert warn["framework_remediation"]["applied"] is False
    assert words in capsys.readouterr().err
    assert found(ctx)["applied"] is None


def test_a_remedy_made_for_another_setting_or_deepspeed_is_not_applied_and_said_why(ctx, capsys):
    write(ctx, record(configured=(8, 1), now=(4, 2)))
    trainer = Trainer()
    OomBatch(ctx).hf_train(trainer)
    assert trainer.args.per_device_train_batch_size == 4
    (warn,) = warns(ctx)
    assert "not applied to the HF Trainer: it was made for per_device_train_batch_size 8" in warn["message"]
    assert found(ctx)["applied"] is False and "the script now asks for" in found(ctx)["why_not_applied"]

    write(ctx, record())
    deep = Trainer()
    deep.args.deepspeed = "ds.json"
    OomBatch(ctx).hf_train(deep)
    assert deep.args.per_device_train_batch_size == 4
    assert found(ctx)["changeable"] is False and found(ctx)["why_fixed"].startswith("DeepSpeed")


class Module:
    """A LightningModule stand-in: Lightning's finder looks for `batch_size` on it and in its hparams."""

    automatic_optimization = True

    def __init__(self, batch_size=None, hparams=None):
        if batch_size is not None:
            self.batch_size = batch_size
        self.hparams = hparams if hparams is not None else {}


class DataModule:
    def __init__(self, batch_size):
        self.batch_size = batch_size
        self.hparams = {}


def lightning_trainer(accumulation=1, callbacks=()):
    return types.SimpleNamespace(accumulate_grad_batches=accumulation, callbacks=list(callbacks))


def test_lightning_sets_every_holder_of_batch_size_and_the_accumulation(ctx, capsys):
    write(ctx, record(LIGHTNING))
    model, dm, trainer = Module(4, {"batch_size": 4}), DataModule(4), lightning_trainer()
    OomBatch(ctx).lightning_fit(trainer, model, None, dm)
    assert (model.batch_size, model.hparams["batch_size"], dm.batch_size) == (2, 2, 2)
    assert trainer.accumulate_grad_batches == 2
    got = found(ctx)
    assert got["arguments"] == {
        "batch": "model.batch_size, model.hparams.batch_size, datamodule.batch_size",
        "accumulation": "trainer.accumulate_grad_batches",
    }
    assert "accumulate_grad_batches 1 → 2" in capsys.readouterr().err


def test_a_datamodule_passed_as_fits_second_argument_is_the_datamodule(ctx):
    write(ctx, record(LIGHTNING))

    class LightningDataModule(DataModule):  # the class name is what fit() goes by
        pass

    dm = LightningDataModule(4)
    OomBatch(ctx).lightning_fit(lightning_trainer(), Module(), dm, None)
    assert dm.batch_size == 2 and found(ctx)["arguments"]["batch"] == "datamodule.batch_size"


class GradientAccumulationScheduler:
    pass


@pytest.mark.parametrize(
    "model, loader, callbacks, why",
    [
        (Module(), None, (), "no `batch_size` attribute on the LightningModule"),
        (Module(4), object(), (), "the train DataLoader was passed to fit() directly"),
        (Module(4), None, (GradientAccumulationScheduler(),), "a GradientAccumulationScheduler sets"),
        (Module(4, {"batch_size": 8}), None, (), "are not one int ≥ 1"),
    ],
)
def test_a_lightning_batch_hangwatch_cannot_change_is_left_and_said(ctx, model, loader, callbacks, why):
    write(ctx, record(LIGHTNING))
    trainer = lightning_trainer(callbacks=callbacks)
    OomBatch(ctx).lightning_fit(trainer, model, loader, None)
    assert trainer.accumulate_grad_batches == 1 and getattr(model, "batch_size", 4) == 4
    got = found(ctx)
    assert got["changeable"] is False and why in got["why_fixed"] and got["applied"] is False
    (warn,) = warns(ctx)
    assert "out-of-memory remedy not applied to the Lightning Trainer (module Module)" in warn["message"]


def test_manual_optimization_keeps_its_batch(ctx):
    model = Module(4)
    model.automatic_optimization = False
    OomBatch(ctx).lightning_fit(lightning_trainer(), model, None, None)
    assert found(ctx)["why_fixed"].startswith("manual optimization")


def test_through_the_trainers_train_an_error_of_ours_is_a_warning_and_training_goes_on(ctx, monkeypatch):
    calls = []

    class HfTrainer:  # transformers.trainer's Trainer, with what the patches touch
        def __init__(self):
            self.args = Args(per_device_train_batch_size=4, gradient_accumulation_steps=1, deepspeed=None)
            self.callback_handler = types.SimpleNamespace(callbacks=[])

        def add_callback(self, cb):
            self.callback_handler.callbacks.append(cb)

        def train(self, resume_from_checkpoint=None, trial=None):
            calls.append(self.args.per_device_train_batch_size)
            return "trained"

        def _save_checkpoint(self, model, trial):
            pass

    module = types.SimpleNamespace(Trainer=HfTrainer, __name__="transformers.trainer")
    Frameworks(ctx, Saves(ctx)).patch_hf_trainer(module)
    write(ctx, record())
    assert module.Trainer().train() == "trained" and calls == [2]  # applied before the original ran

    def boom(*a, **k):
        raise RuntimeError("surprise")

    monkeypatch.setattr(oom_batch, "read_remedy", boom)
    assert module.Trainer().train() == "trained" and calls == [2, 4]
    assert warns(ctx)[-1]["message"] == "instrumentation error in OOM batch: RuntimeError: surprise"


def test_a_setting_that_fails_part_way_is_put_back_and_the_error_is_ours(ctx):
    write(ctx, record(LIGHTNING))

    class Stubborn:  # a trainer whose accumulate_grad_batches cannot be set, after the batch was
        callbacks: list = []

        @property
        def accumulate_grad_batches(self):
            return 1

    model = Module(4, {"batch_size": 4})
    with pytest.raises(AttributeError):
        OomBatch(ctx).lightning_fit(Stubborn(), model, None, None)
    assert (model.batch_size, model.hparams["batch_size"]) == (4, 4)  # not half applied
