"""HangwatchCallback on a real (tiny) `transformers.Trainer` run, in this process: the beats it writes under a
hangwatch environment, and that outside one it writes nothing and wraps nothing.

One Trainer run covers every beat: 8 optimizer steps of 2 micro-batches, eval and a checkpoint every 4
steps, a user callback that generates after each eval, a `trainer.predict` from a user callback mid-run,
and one micro-batch whose loss is NaN (its gradient is zero, so training goes on).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers import GenerationMixin, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from hangwatch.daemon.integrations.transformers import (
    HangwatchCallback,
    checkpoint_step,
    count_inputs,  # noqa: E402
    resumed_checkpoint,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "examples"))
import tiny_model  # noqa: E402

MAX_STEPS, EVERY, NAN_AT_STEP, PREDICT_AT_STEP, NEW_TOKENS, PROGRESS_EVERY = 8, 4, 6, 3, 10, 4


class Probe(TrainerCallback):
    """What a user's callbacks do: generate after eval, predict mid-run; and what `generate` was meanwhile."""

    def __init__(self, tok, eval_ds):
        self.tok, self.eval_ds, self.trainer = tok, eval_ds, None
        self.generate_patched: list[bool] = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        cls = type(model)
        self.generate_patched.append("generate" in vars(cls) or "generate" in vars(model))
        enc = self.tok("question 5:", return_tensors="pt", return_token_type_ids=False)
        model.generate(
            **enc,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=self.tok.pad_token_id,
        )

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == PREDICT_AT_STEP:
            self.trainer.predict(self.eval_ds)


def nan_once(trainer_state):
    """A loss function that is NaN for the first micro-batch of step NAN_AT_STEP, with a zero gradient."""
    seen = set()

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        loss = loss / (num_items_in_batch if num_items_in_batch is not None else (labels[:, 1:] != -100).sum())
        step = trainer_state().global_step + 1
        if step == NAN_AT_STEP and step not in seen:
            seen.add(step)
            return loss * 0 + float("nan")
        return loss

    return loss_func


def run_trainer(out_dir: Path, callback: HangwatchCallback) -> tuple[Trainer, Probe]:
    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok, seed=0)
    train_ds = tiny_model.TextDataset(tok, tiny_model.TEXTS[:32], length=32)
    eval_ds = tiny_model.TextDataset(tok, tiny_model.TEXTS[32:36], length=32)
    probe = Probe(tok, eval_ds)
    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=2,
        learning_rate=1e-3,
        eval_strategy="steps",
        eval_steps=EVERY,
        save_strategy="steps",
        save_steps=EVERY,
        logging_steps=1,
        logging_nan_inf_filter=False,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    holder: dict = {}
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=tok,
        compute_loss_func=nan_once(lambda: holder["t"].state),
        callbacks=[probe, callback],
    )
    holder["t"] = probe.trainer = trainer
    trainer.train()
    return trainer, probe


@pytest.mark.cuda_when_present  # the Trainer saves CUDA RNG states (and pins memory) whenever torch sees a GPU
def test_beats_of_a_real_trainer_run(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("HANGWATCH_RUN_DIR", str(run_dir))
    monkeypatch.setenv("HANGWATCH_ATTEMPT", "1")
    monkeypatch.delenv("HANGWATCH_HEARTBEAT_DIR", raising=False)
    monkeypatch.delenv("HANGWATCH_RESUME_FROM", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    callback = HangwatchCallback(progress_every=PROGRESS_EVERY)
    try:
        trainer, probe = run_trainer(tmp_path / "out", callback)
    finally:
        if callback.hb is not None:
            callback.hb.release_dump_handler()
            callback.hb.close()
    hb_file = run_dir / "attempts" / "0001" / "heartbeat-rank0.jsonl"
    lines = [json.loads(line) for line in hb_file.read_text().splitlines()]
    events = [r["event"] for r in lines]

    assert lines[0]["event"] == "start" and lines[0]["resumed_from"] is None and lines[0]["dump_signal"] == "SIGUSR1"
    assert lines[1]["event"] == "phase" and lines[1]["phase"] == "train"
    assert lines[-1]["event"] == "stop" and lines[-1]["reason"] == "finished" and lines[-1]["step"] == MAX_STEPS

    # One step beat per optimizer step, with the loss and grad norm the Trainer itself logged for that step.
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, MAX_STEPS + 1))
    logged = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    for r in steps:
        assert r["phase"] == "train"
        assert math.isfinite(r["lr"]) and math.isfinite(r["grad_norm"]) and r["tokens_per_s"] > 0
        assert r["samples"] == 2 * 2  # two micro-batches of two rows
        assert r["grad_norm"] == pytest.approx(logged[r["step"]]["grad_norm"], rel=1e-4)
        if r["step"] == NAN_AT_STEP:
            assert math.isnan(r["loss"])
        else:
            assert math.isfinite(r["loss"])
        if r["step"] < NAN_AT_STEP:  # the Trainer's running loss stays NaN once it has seen one: compare before
            assert r["loss"] == pytest.approx(logged[r["step"]]["loss"], rel=1e-4)
    warns = [r for r in lines if r["event"] == "warn"]
    assert len(warns) == 1 and warns[0]["step"] == NAN_AT_STEP and "non-finite loss" in warns[0]["message"]

    # Phases: eval (with a progress beat per batch) holds the user's generate (progress every 4 tokens);
    # predict and checkpoint bracket their calls; each returns to train.
    phases = [(r["step"], r["phase"]) for r in lines if r["event"] == "phase"]
    for step in (EVERY, 2 * EVERY):
        assert [p for s, p in phases if s == step] == ["eval", "generate", "eval", "train", "checkpoint", "train"]
    at = phases.index((PREDICT_AT_STEP - 1, "predict"))  # the probe runs before the step's beat
    assert phases[at + 1] == (PREDICT_AT_STEP - 1, "train") and [p for _, p in phases].count("predict") == 1
    progress = [r for r in lines if r["event"] == "progress"]
    gen = [r["tokens"] for r in progress if r["phase"] == "generate"]
    assert gen == [4, 8] * 2  # two evals, NEW_TOKENS=10 each
    assert len([r for r in progress if r["phase"] == "eval" and r["step"] == EVERY]) == 2  # 4 rows, 2 per batch
    assert [r["step"] for r in progress if r["phase"] == "predict"] == [PREDICT_AT_STEP - 1] * 2

    # Checkpoint beats: the directory the Trainer wrote, absolute, announced not-good.
    ckpts = [r for r in lines if r["event"] == "checkpoint"]
    assert [(r["step"], r["good"]) for r in ckpts] == [(EVERY, False), (2 * EVERY, False)]
    for r in ckpts:
        assert Path(r["path"]).is_absolute() and (Path(r["path"]) / "trainer_state.json").is_file()
        assert r["path"] == str((tmp_path / "out" / f"checkpoint-{r['step']}").resolve())
    assert events.index("checkpoint") > events.index("step")

    # While training, `generate` was wrapped; after train() everything is back as it was.
    assert probe.generate_patched == [True, True]
    model = trainer.model
    assert "generate" not in vars(type(model)) and type(model).generate is GenerationMixin.generate
    assert not {"training_step", "evaluate", "predict", "_save_checkpoint"} & set(vars(trainer))


@pytest.mark.cuda_when_present  # a real Trainer run, as above
def test_outside_hangwatch_it_writes_nothing_and_wraps_nothing(tmp_path, monkeypatch):
    for name in ("HANGWATCH_RUN_DIR", "HANGWATCH_ATTEMPT", "HANGWATCH_HEARTBEAT_DIR", "HANGWATCH_RESUME_FROM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # Heartbeat's fallback would write ./runs/standalone
    callback = HangwatchCallback()
    trainer, probe = run_trainer(tmp_path / "out", callback)
    assert callback.hb is None
    assert probe.generate_patched == [False, False]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert not {"training_step", "evaluate", "predict", "_save_checkpoint"} & set(vars(trainer))


@pytest.mark.parametrize(
    "step, offered, own_exists, expected",
    [
        (0, "/c/checkpoint-8", True, None),  # a fresh start resumed from nothing
        (8, "/c/checkpoint-8", True, "/c/checkpoint-8"),  # what hangwatch offered, at its step
        (12, "/c/checkpoint-8", True, "OWN"),  # the script resumed from something newer of its own
        (12, "/c/checkpoint-8", False, "/c/checkpoint-8"),  # unknown: the offer is the best we know
        (8, None, True, "OWN"),
        (8, None, False, None),
    ],
)
def test_resumed_checkpoint(tmp_path, step, offered, own_exists, expected):
    if own_exists:
        (tmp_path / f"checkpoint-{step}").mkdir()
    want = str(tmp_path / f"checkpoint-{step}") if expected == "OWN" else expected
    assert resumed_checkpoint(step, offered, str(tmp_path)) == want


@pytest.mark.parametrize(
    "path, step",
    [
        ("/x/checkpoint-120", 120),
        ("/x/checkpoint-120/", 120),
        ("/x/ckpt-3", None),
        ("/x/checkpoint-final", None),
        ("checkpoint-0", 0),
    ],
)
def test_checkpoint_step(path, step):
    assert checkpoint_step(path) == step


def test_count_inputs():
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert count_inputs({"input_ids": ids, "labels": ids}) == (15, 3)
    assert count_inputs({"chosen_input_ids": ids, "rejected_input_ids": ids[:, :2]}) == (21, 3)
    assert count_inputs({"pixel_values": torch.zeros(2, 3)}) == (0, 0)
    assert count_inputs([ids]) == (0, 0)


def test_generate_watch_peft_copies_user_criteria_and_uninstall(tmp_path):
    """One phase for PeftModel.generate → the base model's generate; the caller's stopping criteria still
    stop generation and their list is not mutated; an unwatched instance or a deep copy runs plain;
    uninstall leaves every class as it was."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers.generation import StoppingCriteria, StoppingCriteriaList

    from hangwatch.daemon.heartbeat import Heartbeat
    from hangwatch.daemon.integrations.generation import GenerateWatch

    class StopAfter(StoppingCriteria):
        def __init__(self, n):
            self.n, self.start = n, None

        def __call__(self, input_ids, scores=None, **kw):
            self.start = input_ids.shape[1] - 1 if self.start is None else self.start
            return torch.full((input_ids.shape[0],), input_ids.shape[1] - self.start >= self.n, dtype=torch.bool)

    tok = tiny_model.tokenizer()
    peft_model = get_peft_model(tiny_model.model(tok, seed=1), LoraConfig(r=2, target_modules=["q_proj"]))
    other = tiny_model.model(tok, seed=2)
    classes = {cls: vars(cls).get("generate") for m in peft_model.modules() for cls in [type(m)]}
    hb = Heartbeat(tmp_path / "hb.jsonl")
    watch = GenerateWatch(hb, progress_every=2)
    # PeftModel and the Llama inside (transformers 4.x: its LlamaModel too, which never generates); once only.
    assert watch.install(peft_model) >= 2 and watch.install(peft_model) == 0
    enc = tok("question 1:", return_tensors="pt", return_token_type_ids=False)
    user = StoppingCriteriaList([StopAfter(5)])
    out = peft_model.generate(
        **enc,
        max_new_tokens=40,
        stopping_criteria=user,
        do_sample=False,
        suppress_tokens=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
    )
    assert out.shape[1] - enc["input_ids"].shape[1] == 5 and len(user) == 1
    other.generate(**enc, max_new_tokens=3, pad_token_id=tok.pad_token_id)  # never installed
    copy.deepcopy(peft_model.get_base_model()).generate(**enc, max_new_tokens=3, pad_token_id=tok.pad_token_id)
    recs = [json.loads(line) for line in (tmp_path / "hb.jsonl").read_text().splitlines()]
    assert [(r["event"], r["phase"], r.get("tokens")) for r in recs] == [
        ("phase", "generate", None),
        ("progress", "generate", 2),
        ("progress", "generate", 4),
        ("phase", "init", None),
    ]
    watch.uninstall()
    assert {cls: vars(cls).get("generate") for cls in classes} == classes
    assert vars(type(peft_model))["generate"].__qualname__ == "PeftModel.generate"
    hb.close()


def test_driven_by_something_other_than_a_trainer_it_still_beats_steps_and_says_what_it_lacks(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    monkeypatch.setenv("HANGWATCH_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("HANGWATCH_ATTEMPT", "3")
    monkeypatch.delenv("HANGWATCH_HEARTBEAT_DIR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "out" / "checkpoint-1").mkdir(parents=True)
    args, state, control = SimpleNamespace(output_dir=str(tmp_path / "out")), TrainerState(), TrainerControl()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.25)
    cb = HangwatchCallback()
    cb.on_train_begin(args, state, control, model=None)
    state.global_step = 1
    cb.on_optimizer_step(args, state, control, optimizer=optimizer)
    cb.on_step_end(args, state, control, optimizer=optimizer)
    cb.on_save(args, state, control)
    cb.on_train_end(args, state, control)
    cb.hb.release_dump_handler()
    hb_file = tmp_path / "run" / "attempts" / "0003" / "heartbeat-rank0.jsonl"
    recs = [json.loads(x) for x in hb_file.read_text().splitlines()]
    assert [r["event"] for r in recs] == ["start", "phase", "warn", "step", "checkpoint", "stop"]
    assert "no transformers.Trainer found" in recs[2]["message"]
    assert recs[3]["lr"] == 0.25 and recs[3]["step_time_s"] > 0 and "loss" not in recs[3]
    assert recs[4]["path"] == str(tmp_path / "out" / "checkpoint-1") and recs[4]["good"] is False
