"""Did the script resume from the checkpoint it was handed?  What it reads before its first optimizer step says
(daemon/autoinstrument/loads.py): a script that read any of it counts on from the checkpoint's step; one that read
nothing started again from its step 1 — its steps are its own, and one `warn` with `resume_ignored` says so."""

from __future__ import annotations

import builtins
import pickle

import pytest
import torch
from fixtures.fakes.autoinstrument import auto_context, beats, reset_process_state

from hangwatch.daemon.autoinstrument.loads import Loads
from hangwatch.daemon.autoinstrument.steps import StepCounter


@pytest.fixture
def checkpoint(tmp_path):
    d = tmp_path / "ckpts" / "step-4"
    d.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, d / "state.pt")
    (d / "meta.pkl").write_bytes(pickle.dumps({"step": 4}))
    return d


@pytest.fixture
def make(tmp_path):
    made = []

    def _make(resume_from: str, resume_step: int = 4):
        reset_process_state()
        ctx = auto_context(tmp_path / f"hb{len(made)}", resume_step=resume_step, resume_from=resume_from)
        loads = Loads(ctx)
        loads.install_open()
        counter = StepCounter(ctx)
        counter.loads = loads
        made.append((ctx, loads))
        return ctx, loads, counter

    yield _make
    for ctx, loads in made:
        loads.first_step()  # puts `open` back if a test left it wrapped
        ctx.hb.close()
    reset_process_state()


def step(counter: StepCounter, model, opt) -> None:
    loss = model(torch.ones(2, 3)).pow(2).mean()
    counter.probe.seen(loss)
    loss.backward()
    opt.step()
    counter.after_step(opt, (), {})


def train(counter: StepCounter, n: int = 2) -> None:
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        step(counter, model, opt)


@pytest.mark.parametrize(
    "read",
    [
        lambda d: torch.load(d / "state.pt"),  # the checkpoint's file, through torch.load
        lambda d: pickle.loads(open(d / "meta.pkl", "rb").read()),  # any file inside it, through open()
        lambda d: open(str(d / "meta.pkl"), "rb").close(),  # a str path
    ],
)
def test_a_script_that_reads_its_checkpoint_counts_on_from_its_step(make, checkpoint, read):
    ctx, loads, counter = make(str(checkpoint))
    torch.serialization.load = loads._wrap(torch.serialization.load, 0, "f")  # what the post-import hook does
    try:
        read(checkpoint)
        train(counter)
    finally:
        torch.serialization.load = torch.serialization.load.__hangwatch_original__
    assert [b["step"] for b in beats(ctx) if b["event"] == "step"] == [5, 6]
    assert not [b for b in beats(ctx) if b.get("resume_ignored")]


def test_a_script_that_reads_none_of_it_started_again_and_its_steps_are_its_own(make, checkpoint, tmp_path):
    ctx, loads, counter = make(str(checkpoint))
    (tmp_path / "data.txt").write_text("x")
    open(tmp_path / "data.txt").read()  # its data, not the checkpoint
    train(counter, 3)
    lines = beats(ctx)
    assert [b["step"] for b in lines if b["event"] == "step"] == [1, 2, 3]  # not 5, 6, 7
    (warn,) = [b for b in lines if b.get("resume_ignored")]
    assert warn["event"] == "warn" and warn["resume_step"] == 4 and warn["resume_from"] == str(checkpoint)
    assert "did not resume from the checkpoint it was given" in warn["message"]


def test_open_is_wrapped_only_until_the_first_step_and_only_when_there_is_a_resume_point(make, checkpoint):
    original = builtins.open
    _, loads, counter = make(str(checkpoint))
    assert builtins.open is not original  # watching reads, before the first step
    train(counter, 1)
    assert builtins.open is original  # given back at the first step
    _, none, _ = make("", resume_step=0)  # a first attempt: nothing handed, nothing wrapped
    assert builtins.open is original and none.root is None and none.first_step() is False


def test_a_forked_child_is_not_the_rank(make, checkpoint):
    ctx, loads, _ = make(str(checkpoint))
    ctx.active = False  # what os.register_at_fork(after_in_child=…) does in a DataLoader worker
    open(checkpoint / "meta.pkl", "rb").close()
    assert loads.read is False
