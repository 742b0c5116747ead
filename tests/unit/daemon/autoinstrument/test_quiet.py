"""One source of truth per step, one heartbeat per process: the automatic optimizer hook beats steps only while
nobody else does, and the callbacks write through the process's shared heartbeat — their own `start` a line
after the bootstrap's (daemon/heartbeat.py: Heartbeat.shared, WRITERS; daemon/autoinstrument/steps.py)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from fixtures.fakes.autoinstrument import auto_context, auto_env, beats, events, reset_process_state

from hangwatch.daemon.autoinstrument.phases import EvalPhase
from hangwatch.daemon.autoinstrument.saves import Saves
from hangwatch.daemon.autoinstrument.steps import StepCounter, current_lr
from hangwatch.daemon.heartbeat import WRITERS, Heartbeat
from hangwatch.daemon.integrations.common import heartbeat_or_none


@pytest.fixture
def ctx(tmp_path):
    reset_process_state()
    c = auto_context(tmp_path, resume_step=10)
    yield c
    c.hb.close()
    reset_process_state()


def sgd(model, lr=0.5):
    return torch.optim.SGD(model.parameters(), lr=lr)


def train_step(counter: StepCounter, model, opt, x=None):
    loss = model(torch.ones(2, 3) if x is None else x).pow(2).mean()
    counter.probe.seen(loss)  # what the wrapped torch.autograd.backward does
    loss.backward()
    opt.step()
    counter.after_step(opt, (), {})  # what torch's global post-hook does
    return loss


def test_steps_count_on_from_the_resume_step_with_lr_loss_and_the_first_optimizer_only(ctx):
    counter = StepCounter(ctx)
    model, other = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    opt, opt2 = sgd(model, 0.25), sgd(other)
    losses = [train_step(counter, model, opt).item()]
    train_step(counter, other, opt2)  # a second optimizer (a GAN's): not counted, no beat
    losses.append(train_step(counter, model, opt).item())
    steps = [b for b in beats(ctx) if b["event"] == "step"]
    assert [b["step"] for b in steps] == [11, 12]
    assert [b["loss"] for b in steps] == pytest.approx(losses)
    assert all(b["lr"] == 0.25 and b["phase"] == "train" for b in steps)
    assert "step_time_s" not in steps[0] and steps[1]["step_time_s"] >= 0
    # the first step moved the rank from `load` to `train`, once
    assert [e for e in events(ctx) if e[0] == "phase"] == [("phase", 10, "train")]
    assert counter.optimizer() is opt and ctx.hb.current_step == 12


def test_a_non_finite_loss_also_warns(ctx):
    counter = StepCounter(ctx)
    model = torch.nn.Linear(3, 1)
    opt = sgd(model)
    train_step(counter, model, opt, x=torch.full((2, 3), math.inf))
    step, warn = [b for b in beats(ctx) if b["event"] in ("step", "warn")]
    assert not math.isfinite(step["loss"]) and "non-finite loss" in warn["message"] and warn["step"] == 11


def test_a_hangwatch_callback_silences_the_step_hook_which_still_counts(ctx, tmp_path):
    from hangwatch.daemon.integrations.transformers import HangwatchCallback

    counter = StepCounter(ctx)
    model = torch.nn.Linear(3, 1)
    opt = sgd(model)
    train_step(counter, model, opt)
    HangwatchCallback(environ=auto_env(tmp_path))  # exists: it beats the steps from now on
    train_step(counter, model, opt)
    assert [b["step"] for b in beats(ctx) if b["event"] == "step"] == [11]
    assert counter.step == 12  # still counted: checkpoints and the eval phase need the optimizer


def test_heartbeat_step_from_anyone_else_silences_the_hook(ctx, tmp_path):
    counter = StepCounter(ctx)
    model = torch.nn.Linear(3, 1)
    opt = sgd(model)
    train_step(counter, model, opt)
    ctx.hb.step(42, loss=1.0)  # the script's own beat on the shared heartbeat
    train_step(counter, model, opt)
    assert [b["step"] for b in beats(ctx) if b["event"] == "step"] == [11, 42]


def test_a_callbacks_start_goes_through_the_shared_heartbeat_after_the_bootstraps(ctx, tmp_path):
    hb = heartbeat_or_none(auto_env(tmp_path))
    assert hb is ctx.hb  # the callbacks get the process's shared heartbeat: one view of phase and step
    hb.current_step = 4  # what HF's callback does: the step the Trainer resumed at
    hb.start(resumed_from="/ck/checkpoint-4", integration="transformers")
    hb.enter_phase("train")
    starts = [b for b in beats(ctx) if b["event"] == "start"]
    assert [(b.get("instrumented"), b.get("integration"), b["resumed_from"], b["step"]) for b in starts] == [
        ("auto", None, None, 10),
        (None, "transformers", "/ck/checkpoint-4", 4),
    ]
    assert WRITERS.steps_elsewhere and not WRITERS.manual  # quiet steps; phases and saves still ours


def test_a_heartbeat_of_the_scripts_own_makes_the_instrumentation_write_nothing_more(ctx, tmp_path):
    saves = Saves(ctx)
    saved = []
    save = saves.bracket(ctx.hook("torch.save"), lambda obj, f: saved.append(f), lambda a, k: str(tmp_path / "x.pt"))
    own = Heartbeat.from_env(environ=auto_env(tmp_path))  # the script's own instance, not the shared one
    own.start(install_dump=False)
    assert WRITERS.manual and ctx.manual() and ctx.phases_elsewhere()
    save("state", "x.pt")
    assert saved == ["x.pt"]
    assert [e[0] for e in events(ctx)] == ["start", "start"]  # ours, then the script's: no phase, no checkpoint
    own.close()


def test_null_heartbeat_leaves_the_bookkeeping_alone(ctx):
    from hangwatch.daemon.heartbeat import NullHeartbeat

    null = NullHeartbeat()
    null.start()
    null.step(3)
    assert not WRITERS.manual and not WRITERS.steps_elsewhere


def test_shared_heartbeats_are_per_rank_and_attempt_and_not_inherited_by_a_fork(tmp_path):
    reset_process_state()
    try:
        env = auto_env(tmp_path)
        a = Heartbeat.shared(env)
        assert Heartbeat.shared(dict(env)) is a
        other = Heartbeat.shared({**env, "RANK": "1"})
        assert other is not a and other.path.name == "heartbeat-rank1.jsonl"
        assert Heartbeat.shared(env) is a  # the other rank's did not take its place
        a.close()
        b = Heartbeat.shared(env)  # closed: a new one is the shared one
        assert b is not a and b.is_shared()
        import os
        import sys

        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its first call makes its own
            ok = Heartbeat.shared(env) is not b and not WRITERS.steps_elsewhere
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
        os.waitpid(pid, 0)
        assert os.read(r, 1) == b"1"
        other.close()
        b.close()
        del sys
    finally:
        reset_process_state()


def test_eval_phase_follows_the_trained_model_only_and_ignores_the_recursion(ctx, monkeypatch):
    counter = StepCounter(ctx)
    evals = EvalPhase(ctx, counter)
    monkeypatch.setattr(torch.nn.Module, "train", torch.nn.Module.train)  # both restored after the test
    monkeypatch.setattr(torch.optim.Optimizer, "__init__", torch.optim.Optimizer.__init__)
    evals.patch(torch.nn.modules.module)
    counter.patch_optimizer_module(importlib.import_module("torch.optim.optimizer"))
    counter.handle.remove()  # the global step hook: this test calls after_step itself
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    frozen = torch.nn.Linear(3, 3)
    model.eval()  # no optimizer yet: no trained model, no phase
    model.train()
    opt = sgd(model)
    model.eval()  # before the first step: the first optimizer constructed says which model trains
    model.train()
    frozen.eval()  # holds no trained parameter: no phase
    frozen.train()
    train_step(counter, model, opt)
    model.train()  # every step: nothing
    model.eval()
    model[0].eval()  # a part of it, already in eval: nothing more
    model.train()
    phases = [e[2] for e in events(ctx) if e[0] == "phase"]
    assert phases == ["eval", "load", "train", "eval", "train"]


def test_a_script_that_trains_in_eval_mode_is_not_left_in_eval(ctx, monkeypatch):
    counter = StepCounter(ctx)
    evals = EvalPhase(ctx, counter)
    monkeypatch.setattr(torch.nn.Module, "train", torch.nn.Module.train)
    evals.patch(torch.nn.modules.module)
    model = torch.nn.Linear(3, 1)
    opt = sgd(model)
    for _ in range(4):
        model.eval()  # dropout off, every step
        train_step(counter, model, opt)
    phases = [e[2] for e in events(ctx) if e[0] == "phase"]
    # the first eval came before any optimizer stepped (no trained model known yet); then each step closes the
    # eval it opened, and after the second such step eval detection gives up
    assert phases == ["train", "eval", "train", "eval", "train"]
    assert ctx.hb.current_phase == "train" and not evals.hook.on and "eval phase" not in ctx.errors


def test_current_lr_reads_numbers_and_cpu_tensors_only():
    class Opt:
        def __init__(self, lr):
            self.param_groups = [{"lr": lr}]

    assert current_lr(Opt(0.1)) == 0.1
    assert current_lr(Opt(torch.tensor(0.2))) == pytest.approx(0.2)
    assert current_lr(Opt(None)) is None
    assert current_lr(object()) is None


def test_nothing_more_after_the_scripts_own_stop(ctx, tmp_path):
    """HF's HangwatchCallback added by the script says `stop` at train end; a `trainer.save_model(final)` after it
    is no checkpoint of the watched run, and no step or phase of it either."""
    saves = Saves(ctx)
    save = saves.bracket(ctx.hook("save_pretrained"), lambda model, d: None, lambda a, k: str(tmp_path / "final"))
    counter = StepCounter(ctx)
    ctx.hb.start(integration="transformers")
    ctx.hb.stop("finished")
    save(None, "final")
    counter.after_step(FakeOpt(), (), {})
    assert [e[0] for e in events(ctx)][-1] == "stop"
    ctx.hb.start()  # trainer.test() after the fit: a new start, and the bootstrap's hooks write again
    save(None, "final")
    assert [e[0] for e in events(ctx)][-4:] == ["start", "phase", "phase", "checkpoint"]


class FakeOpt:
    param_groups = [{"lr": 0.1}]
