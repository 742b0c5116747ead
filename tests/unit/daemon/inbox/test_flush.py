"""The partial step of a quiet continuous run and the checkpoint it leaves: the loss of a partial
step against a hand computation, the flush through the real trainer on a fake clock (partial step,
covering checkpoint, file in done/, settled good or provisional), and the settling rules."""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
from fixtures.fakes.continuous_support import good_file, inbox_config, ledger, leftovers, names_in
from fixtures.fakes.inbox_support import FakeClock, RecordingHeartbeat, ScriptedInbox
from fixtures.fakes.workers import make_config

from hangwatch.common.config import load_config
from hangwatch.common.inbox_layout import Stage
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ShuffledEpochs, validate_file
from hangwatch.daemon.faults import FaultPlan
from hangwatch.daemon.heartbeat import NullHeartbeat
from hangwatch.daemon.inbox.feed import InboxFeed
from hangwatch.daemon.inbox.source import ContinuousSource
from hangwatch.daemon.lastwords import classify
from hangwatch.daemon.model import load_model
from hangwatch.daemon.signals import StopRequest
from hangwatch.daemon.trainer.confirmation import Confirmation, NonFiniteHeldOut, Pending
from hangwatch.daemon.trainer.loop import Trainer


def test_a_partial_step_is_the_mean_over_the_label_tokens_present(tmp_path):
    """3 examples where a step holds 4 (micro-batches of 2 and 1): loss and gradient are those of the
    mean cross-entropy over the 3 examples' completion tokens, computed here one example at a time."""
    config = make_config(
        tmp_path,
        lora={"dropout": 0.0},
        model={"tiny": {"extra_head": False}},
        train={"micro_batch_size": 2, "grad_accum": 2, "max_grad_norm": 1e9},
    )
    cfg = load_config(config)
    bundle = load_model(cfg)
    examples, _ = validate_file(cfg.data.train, bundle.tokenizer, cfg)
    three = [examples[0], examples[5], examples[9]]
    assert len({len(e.input_ids) for e in three}) > 1  # padding is part of what is checked
    params = [p for _, p in bundle.trainable_parameters()]

    bundle.model.train()
    ce_sum, n_tokens = torch.zeros(()), 0
    for e in three:
        logits = bundle.model(input_ids=torch.tensor([e.input_ids])).logits[0, :-1].float()
        target = torch.tensor(e.labels[1:])
        ce_sum = ce_sum + torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
        n_tokens += int((target != -100).sum())
    by_hand = ce_sum / n_tokens
    by_hand.backward()
    by_hand = float(by_hand.detach())
    norm_by_hand = float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
    for p in params:
        p.grad = None

    hb = RecordingHeartbeat()
    trainer = Trainer(
        cfg,
        hb,
        tmp_path / "run",
        bundle,
        ShuffledEpochs(examples, 0),
        [],
        FaultPlan([], tmp_path / "run", hb),
        StopRequest(),
        out=io.StringIO(),
    )
    trainer.seed_fresh()
    m = trainer.train_step(three)
    assert (m["finite"], m["partial"], m["examples"]) == (True, True, 3)
    # Divided as if the step were full, both would come out about 3/4 of these.
    assert m["loss"] == pytest.approx(by_hand, rel=1e-5)
    assert m["grad_norm"] == pytest.approx(norm_by_hand, rel=1e-4)
    trainer.after_step(m)
    (beat,) = hb.of("step")
    assert (beat["step"], beat["partial"], beat["examples"]) == (1, True, 3)
    assert trainer.trainer_state()["last_step"] == {"examples": 3, "partial": True}
    assert trainer.partial_steps == 1


def quiet_run(tmp_path, *, with_eval: bool, snapshot_at: float):
    """The real trainer over the inbox on a fake clock: a 7-example file (a step holds 4), nothing else
    arrives; at `snapshot_at` the run dir is looked at and a stop requested."""
    overrides = {
        "data": {"replay_ratio": 0, "flush_after_s": 2.5, **({} if with_eval else {"eval": None})},
        "checkpoint": {"every_steps": 4, "confirm_steps": 1},
    }
    cfg = load_config(inbox_config(tmp_path, **overrides))
    bundle = load_model(cfg)
    run = tmp_path / "run"

    def check(path):
        return validate_file(path, bundle.tokenizer, cfg)

    clock = FakeClock()
    inbox = ScriptedInbox(run, clock, check=check)
    inbox.arrive("a.jsonl", good_file(7, 3).decode())()
    hb = RecordingHeartbeat(clock)
    stop = StopRequest()
    seen = {}

    def look_and_stop():
        newest = ckpt.list_checkpoints(ckpt.checkpoints_root(run))[0]
        seen.update(
            leftovers=leftovers(run),
            done=names_in(run, Stage.DONE),
            ledger=len(ledger(run)),
            newest=newest.name,
            good=ckpt.is_good(newest),
            provisional=ckpt.is_provisional(newest),
            state=ckpt.read_state(newest),
            marker=json.loads((newest / ckpt.GOOD).read_text()) if ckpt.is_good(newest) else None,
        )
        stop.requested = "SIGTERM"

    inbox.script[snapshot_at] = look_and_stop
    feed = InboxFeed(
        ContinuousSource(run, check, replay_ratio=0),
        inbox,
        hb,
        stop,
        flush_after_s=cfg.data.flush_after_s,
        idle_exit_s=None,
        clock=clock,
        out=io.StringIO(),
    )
    eval_examples = validate_file(cfg.data.eval, bundle.tokenizer, cfg)[0] if with_eval else []
    trainer = Trainer(cfg, hb, run, bundle, feed, eval_examples, FaultPlan([], run, hb), stop, out=io.StringIO())
    trainer.seed_fresh()
    assert trainer.run() == "terminated"
    return hb, seen


@pytest.mark.parametrize("with_eval", [True, False])
def test_a_quiet_run_trains_a_partial_step_checkpoints_it_and_the_file_is_done(tmp_path, with_eval):
    hb, seen = quiet_run(tmp_path, with_eval=with_eval, snapshot_at=4.0)
    steps = hb.of("step")
    assert [(b["step"], b["examples"], b["partial"]) for b in steps] == [(1, 4, False), (2, 3, True)]
    assert steps[1]["at"] == 2.5  # trained once flush_after_s had passed, not before
    # The covering checkpoint (off the every-4-steps schedule), written before anything else happened:
    # the file is done and recorded, processing/ is empty.
    (commit,) = hb.of("checkpoint", good=False)
    assert (commit["step"], commit["provisional"], commit["at"]) == (2, True, 2.5)
    assert seen["leftovers"] == {} and seen["done"] == ["a.jsonl"] and seen["ledger"] == 7
    assert seen["newest"] == ckpt.step_name(2)
    assert seen["state"]["partial_steps"] == 1 and seen["state"]["last_step"] == {"examples": 3, "partial": True}
    if with_eval:
        # Settled on the held-out loss of its weights, in phase eval: good, with the loss it was judged on.
        assert seen["good"] and seen["marker"]["reason"] == "idle: finite held-out loss"
        assert math.isfinite(seen["marker"]["heldout_loss"])
        assert [b["step"] for b in hb.of("checkpoint", good=True)] == [2]
        assert hb.of("phase", phase="eval")
    else:
        # No held-out data to judge it on: provisional (resume takes it), never called good.
        assert seen["provisional"] and not seen["good"] and not hb.of("checkpoint", good=True)
        assert not hb.of("phase", phase="eval")


# ---- the settling rules, on checkpoint directories without a model --------------------------------


def committed(run, step: int, *, weights_finite=True, streak=0, c: "Confirmation | None" = None) -> Pending:
    """A checkpoint committed as the trainer commits one (with `c`'s marks, when given)."""

    def fill(tmp):
        (tmp / ckpt.STATE).write_text(
            json.dumps({"step": step, "weights_finite": weights_finite, "nonfinite_streak": streak})
        )

    markers = c.commit_markers if c is not None else None
    return Pending(ckpt.commit(ckpt.checkpoints_root(run), step, fill, markers=markers), step)


def confirmation(run, *, continuous=True, confirm_steps=1) -> Confirmation:
    return Confirmation(run, NullHeartbeat(), confirm_steps, 3, lambda line: None, provisional_on_commit=continuous)


@pytest.mark.parametrize(
    "continuous,confirm_steps,weights_finite,streak,provisional",
    [
        (True, 1, True, 0, True),  # continuous: resumable from the moment it is committed
        (True, 1, False, 0, False),  # never with non-finite weights
        (True, 1, True, 2, False),  # nor when the step before it was not finite
        (False, 1, True, 0, False),  # a run over a file waits for the steps after it, as before
        (True, 0, True, 0, False),  # no confirmation asked for: good at once instead
    ],
)
def test_which_checkpoints_are_provisional_at_commit(
    tmp_path, continuous, confirm_steps, weights_finite, streak, provisional
):
    c = confirmation(tmp_path, continuous=continuous, confirm_steps=confirm_steps)
    p = committed(tmp_path, 4, weights_finite=weights_finite, streak=streak, c=c)
    assert ckpt.is_provisional(p.path) is provisional  # marked as it appeared, not a moment after
    c.committed(p, 4)
    resumable = ckpt.choose_resume(tmp_path).path == p.path
    assert resumable is (provisional or (confirm_steps == 0 and weights_finite))


def test_an_idle_checkpoint_is_confirmed_on_a_finite_held_out_loss_else_stays_provisional(tmp_path):
    c = confirmation(tmp_path)
    p = committed(tmp_path, 2, c=c)
    c.committed(p, 2)
    c.settle_idle(2, None)
    assert ckpt.is_provisional(p.path) and c.waiting_at(2) == p  # later steps may still confirm it
    c.settle_idle(2, 1.25)
    assert ckpt.is_good(p.path) and c.waiting_at(2) is None
    assert json.loads((p.path / ckpt.GOOD).read_text())["heldout_loss"] == 1.25


def test_a_non_finite_held_out_loss_withdraws_provisional_checkpoints_and_rolls_back(tmp_path):
    c = confirmation(tmp_path)
    good = committed(tmp_path, 2)
    c.committed(good, 2)
    c.confirm(3)
    assert ckpt.is_good(good.path)
    for step in (4, 6):
        p = committed(tmp_path, step, c=c)
        c.committed(p, step)
    assert ckpt.choose_resume(tmp_path).step == 6
    with pytest.raises(NonFiniteHeldOut) as err:
        c.settle_idle(6, float("nan"))
    assert classify(err.value) == ("nan", 75)  # exit 75: the supervisor restarts, the worker rolls back
    assert "held-out loss" in str(err.value)
    assert not ckpt.is_good(tmp_path / "checkpoints" / ckpt.step_name(6))
    assert ckpt.choose_resume(tmp_path).step == 2
