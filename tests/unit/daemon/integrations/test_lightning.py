"""HangwatchCallback in real Lightning fits of the tiny Llama, in this process, with the environment
`hangwatch run` gives a worker (HANGWATCH_RUN_DIR, attempt, heartbeat dir) pointed at a temporary run dir.

Both `lightning.pytorch` and `pytorch_lightning` are imported before the integration, so its callback is a
Callback to either Trainer: the first fit uses lightning.pytorch, the second pytorch_lightning.
"""

from __future__ import annotations

import importlib
import json
import math
import signal
import sys
from pathlib import Path

import pytest

L = pytest.importorskip("lightning.pytorch")
pl = pytest.importorskip("pytorch_lightning")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hangwatch.common.protocol import decode_line  # noqa: E402
from hangwatch.daemon.integrations import lightning as hl  # noqa: E402

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO / "examples"))
import tiny_model  # noqa: E402

TOK = tiny_model.tokenizer()
DATA = tiny_model.TextDataset(TOK)
QUIET = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)


def module_class(base):
    class TinyLM(base.LightningModule):
        """The tiny Llama; validation generates exactly 20 tokens; `nan_at`/`fail_at`: optimizer step to break."""

        def __init__(self, nan_at=None, fail_at=None):
            super().__init__()
            self.model = tiny_model.model(TOK, seed=0)
            self.nan_at, self.fail_at = nan_at, fail_at
            self.raw_losses: dict[int, list[float]] = {}  # optimizer step → the micro-batch losses
            self.patched_during_eval = []

        def training_step(self, batch, batch_idx):
            step = self.global_step + 1
            if step == self.fail_at:
                raise RuntimeError("boom in training_step")
            loss = self.model(**batch).loss
            if step == self.nan_at:
                loss = loss * float("nan")
            self.raw_losses.setdefault(step, []).append(loss.item())
            return loss

        def validation_step(self, batch, batch_idx):
            self.patched_during_eval.append(getattr(type(self.model).generate, "__hangwatch_dispatch__", False))
            enc = TOK("question 3:", return_tensors="pt")
            self.model.generate(
                **enc, max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=TOK.pad_token_id
            )

        def predict_step(self, batch, batch_idx):
            return self.model.generate(
                input_ids=batch["input_ids"][:, :8], max_new_tokens=4, do_sample=False, pad_token_id=TOK.pad_token_id
            )

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
                    "interval": "step",
                },
            }

    return TinyLM


def loaders(batch_size=4):
    train = torch.utils.data.DataLoader(DATA, batch_size=batch_size, shuffle=False)
    val = torch.utils.data.DataLoader(torch.utils.data.Subset(DATA, range(4)), batch_size=4)
    return train, val


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv("HANGWATCH_RUN_DIR", str(run))
    monkeypatch.delenv("HANGWATCH_RESUME_FROM", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    attempt(monkeypatch, run, 1)
    return run


def attempt(monkeypatch, run: Path, n: int) -> None:
    monkeypatch.setenv("HANGWATCH_ATTEMPT", str(n))
    monkeypatch.setenv("HANGWATCH_HEARTBEAT_DIR", str(run / "attempts" / f"{n:04d}"))


def beats(run: Path, n: int) -> list[dict]:
    lines = (run / "attempts" / f"{n:04d}" / "heartbeat-rank0.jsonl").read_bytes().splitlines()
    out = [decode_line(line) for line in lines]
    assert None not in out
    return out


def release(cb) -> None:
    """What process exit does for a real worker: the dump handler and the heartbeat file go."""
    if cb.heartbeat is not None:
        cb.heartbeat.release_dump_handler()
        cb.heartbeat.close()


def phases(events: list[dict]) -> list[str]:
    return [e["phase"] for e in events if e["event"] == "phase"]


def test_a_lightning_fit_beats_steps_phases_checkpoints_and_resumes(run_dir, tmp_path, monkeypatch):
    TinyLM = module_class(L)
    module = TinyLM()
    ckpt = L.callbacks.ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        filename="step-{step}",
        every_n_train_steps=2,
        save_top_k=-1,
        auto_insert_metric_name=False,
    )
    cb = hl.HangwatchCallback(progress_every=8)
    trainer = L.Trainer(
        max_steps=4,
        accumulate_grad_batches=2,
        val_check_interval=4,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        callbacks=[ckpt, cb],
        default_root_dir=tmp_path,
        **QUIET,
    )
    try:
        trainer.fit(module, *loaders())
    finally:
        release(cb)
    ev = beats(run_dir, 1)

    assert ev[0]["event"] == "start" and ev[0]["resumed_from"] is None and ev[0]["dump_signal"] == "SIGUSR1"
    assert ev[-1]["event"] == "stop" and ev[-1]["reason"] == "finished"

    # One beat per optimizer step, two micro-batches each: the loss is their mean as training_step saw it.
    steps = [e for e in ev if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    for s in steps:
        assert s["loss"] == pytest.approx(sum(module.raw_losses[s["step"]]) / 2, rel=1e-5)
        assert len(module.raw_losses[s["step"]]) == 2 and s["examples"] == 8
        assert math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
        assert s["lr"] == pytest.approx(1e-3 / s["step"])  # the lr this step used (the scheduler steps after it)
        assert s["tokens_per_s"] > 0 and s["phase"] == "train"
    assert steps[-1]["samples"] == 32 and steps[-1]["max_steps"] == 4
    assert not [e for e in ev if e["event"] == "warn"]

    # Validation (the sanity check first) is `eval`; its generate() is `generate`, with progress beats.
    evals = [e for e in ev if e["event"] == "phase" and e["phase"] == "eval" and "stage" in e]
    assert [e["stage"] for e in evals] == ["sanity_check", "validate", "validate"]  # every 4 batches = 2 steps
    seq = phases(ev)
    assert seq[:4] == ["eval", "generate", "eval", "init"] and "train" in seq
    gen_at = [i for i, e in enumerate(ev) if e["event"] == "phase" and e["phase"] == "generate"]
    for i in gen_at:
        assert ev[i - 1]["phase"] == "eval"
        progress = [e["tokens"] for e in ev[i + 1 : i + 4] if e["event"] == "progress"]
        assert progress == [8, 16] and all(e["phase"] == "generate" for e in ev[i + 1 : i + 3])
    assert module.patched_during_eval and all(module.patched_during_eval)

    # Saves are in `checkpoint`; each file is announced after it exists, at the step it holds.
    cks = [e for e in ev if e["event"] == "checkpoint"]
    assert [c["step"] for c in cks] == [2, 4] and not any(c["good"] for c in cks)
    for c in cks:
        assert Path(c["path"]).is_file() and Path(c["path"]).name == f"step-{c['step']}.ckpt"
        i = ev.index(c)
        assert ev[i - 2]["event"] == "phase" and ev[i - 2]["phase"] == "checkpoint"
        assert ev[i - 1]["event"] == "phase" and ev[i - 1]["phase"] == "train"

    # Nothing of hangwatch is left on the trainer or the model class after the fit.
    assert "save_checkpoint" not in vars(trainer)
    assert not getattr(type(module.model).generate, "__hangwatch_dispatch__", False)

    # The next attempt resumes from the step-2 checkpoint: `resumed_from` names it, steps go on at 3.
    attempt(monkeypatch, run_dir, 2)
    path = cks[0]["path"]
    monkeypatch.setenv("HANGWATCH_RESUME_FROM", path)
    cb2 = hl.HangwatchCallback()
    trainer2 = L.Trainer(
        max_steps=3,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        callbacks=[cb2],
        default_root_dir=tmp_path,
        **QUIET,
    )
    try:
        trainer2.fit(TinyLM(), loaders()[0], ckpt_path=hl.resume_from())
    finally:
        release(cb2)
    ev2 = beats(run_dir, 2)
    assert ev2[0]["event"] == "start" and ev2[0]["resumed_from"] == path
    assert [e["step"] for e in ev2 if e["event"] == "step"] == [3]


def test_pytorch_lightning_nonfinite_loss_predict_and_a_failing_fit(run_dir, tmp_path, monkeypatch):
    TinyLM = module_class(pl)
    cb = hl.HangwatchCallback(eval_budget_s=120, predict_budget_s=60, generate_budget_s=30)
    assert isinstance(cb, pl.Callback) and isinstance(cb, L.Callback)
    # A lone callback (not in a list) is what Lightning checks with isinstance against its own package.
    trainer = pl.Trainer(
        max_steps=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        callbacks=cb,
        default_root_dir=tmp_path,
        **QUIET,
    )
    module = TinyLM(nan_at=2)
    try:
        trainer.fit(module, loaders()[0])
        predict = torch.utils.data.DataLoader(torch.utils.data.Subset(DATA, range(2)), batch_size=2)
        trainer.predict(module, predict)
    finally:
        release(cb)
    ev = beats(run_dir, 1)
    steps = [e for e in ev if e["event"] == "step"]
    assert [s["step"] for s in steps] == [1, 2]
    assert math.isfinite(steps[0]["loss"]) and math.isnan(steps[1]["loss"])
    warns = [e for e in ev if e["event"] == "warn"]
    assert len(warns) == 1 and "non-finite loss" in warns[0]["message"] and warns[0]["step"] == 2

    # fit → stop; predict afterwards is announced anew (a `stop` ends every deadline), then stopped.
    kinds = [(e["event"], e.get("reason") or e["phase"]) for e in ev if e["event"] in ("start", "stop", "phase")]
    first_stop = kinds.index(("stop", "finished"))
    after = kinds[first_stop + 1 :]
    assert after[0][0] == "start" and ("phase", "predict") in after and ("phase", "generate") in after
    assert after[-1] == ("stop", "finished")
    predict_line = next(e for e in ev if e["event"] == "phase" and e["phase"] == "predict")
    assert predict_line["budget_s"] == 60
    assert next(e for e in ev if e["event"] == "phase" and e["phase"] == "generate")["budget_s"] == 30

    # A fit that raises: stop says why, and the attempt's last words classify the error.
    attempt(monkeypatch, run_dir, 2)
    cb2 = hl.HangwatchCallback()
    trainer2 = pl.Trainer(
        max_steps=3,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        callbacks=[cb2],
        default_root_dir=tmp_path,
        **QUIET,
    )
    try:
        with pytest.raises(RuntimeError, match="boom"):
            trainer2.fit(TinyLM(fail_at=2), loaders()[0])
    finally:
        release(cb2)
    ev2 = beats(run_dir, 2)
    assert ev2[-1]["event"] == "stop" and ev2[-1]["reason"] == "error" and "boom" in ev2[-1]["error"]
    words = json.loads((run_dir / "attempts" / "0002" / "exit.json").read_text())
    assert words["kind"] == "crash" and "boom in training_step" in words["message"]


def test_outside_hangwatch_the_callback_does_nothing(tmp_path, monkeypatch):
    for name in ("HANGWATCH_RUN_DIR", "HANGWATCH_ATTEMPT", "HANGWATCH_HEARTBEAT_DIR", "HANGWATCH_RESUME_FROM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    before = signal.getsignal(signal.SIGUSR1)
    module = module_class(L)()
    cb = hl.HangwatchCallback()
    trainer = L.Trainer(
        max_steps=2,
        val_check_interval=2,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        callbacks=[cb],
        **QUIET,
    )
    trainer.fit(module, *loaders(), ckpt_path=hl.resume_from())
    assert trainer.global_step == 2 and module.patched_during_eval == [False]
    assert cb.heartbeat is None and "save_checkpoint" not in vars(trainer)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run dir, no heartbeat written anywhere
    assert signal.getsignal(signal.SIGUSR1) == before


def test_without_lightning_the_import_says_how_to_install(monkeypatch):
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # what an environment without Lightning looks like
    monkeypatch.delitem(sys.modules, "hangwatch.daemon.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install hangwatch\[lightning\]"):
        importlib.import_module("hangwatch.daemon.integrations.lightning")


@pytest.mark.parametrize(
    "imported, chosen",
    [
        ((), ("lightning.pytorch", "pytorch_lightning")),
        (("pytorch_lightning",), ("pytorch_lightning",)),
        (("lightning.pytorch",), ("lightning.pytorch",)),
        (("pytorch_lightning", "lightning.pytorch"), ("lightning.pytorch", "pytorch_lightning")),
        (iter(("pytorch_lightning", "lightning.pytorch")), ("lightning.pytorch", "pytorch_lightning")),  # read once
    ],
    ids=["none", "pytorch_lightning", "lightning", "both", "both-iterator"],
)
def test_choose_packages(imported, chosen):
    assert hl.choose_packages(imported) == chosen


def test_stop_reasons_and_losses():
    class SIGTERMException(SystemExit):  # Lightning's, by name
        pass

    assert [hl.stop_reason(e) for e in (SIGTERMException(), KeyboardInterrupt(), RuntimeError("x"))] == [
        "terminated",
        "interrupted",
        "error",
    ]
    t = torch.tensor(0.5)
    assert hl.step_loss({"loss": t}, automatic=True, accumulate=4) == 2.0  # Lightning divided it by 4
    assert hl.step_loss(t, automatic=False, accumulate=4) == 0.5  # manual optimization: as returned
    assert hl.step_loss(None, automatic=True, accumulate=1) is None
    ids = torch.ones(3, 5, dtype=torch.long)
    mask = torch.tensor([[1] * 5, [1] * 2 + [0] * 3, [0] * 5])
    assert hl.batch_size_and_tokens({"input_ids": ids, "attention_mask": mask}) == (3, 7)
    assert hl.batch_size_and_tokens({"input_ids": ids}) == (3, 15)
    assert hl.batch_size_and_tokens((torch.zeros(6, 2), torch.zeros(6))) == (6, None)
    assert hl.batch_size_and_tokens(None) == (None, None)
