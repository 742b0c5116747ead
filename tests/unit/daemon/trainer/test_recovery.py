"""Recovery in the worker's process (`daemon.trainer.recovery`): the ladder of one step, the pick from a measured
step, the abandon order's watch (with the real CPython async exception in a real thread, and with a fake one), the
last good state held in memory, an eval batch halved on an out-of-memory error."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from hangwatch.common.protocol import ABANDON_NAME, ABANDON_REFUSED_FIELD
from hangwatch.daemon.trainer.recovery import (
    AbandonWatch,
    LastGood,
    Rung,
    StepAbandoned,
    fitting_micro,
    is_oom,
    landed_at,
    smaller,
)


@pytest.mark.parametrize(
    "now, after",
    [
        (Rung(16, 1, False), Rung(8, 2, False)),
        (Rung(12, 2, False), Rung(6, 4, False)),
        (Rung(6, 1, False), Rung(3, 2, False)),
        (Rung(3, 4, False), Rung(1, 12, False)),  # 3's largest divisor at most half: 1
        (Rung(1, 16, False), Rung(1, 16, True)),
        (Rung(1, 16, True), None),
    ],
)
def test_the_ladder_keeps_the_examples_per_step(now, after):
    got = smaller(now)
    assert got == after
    if got is not None:
        assert got.micro_batch_size * got.grad_accum == now.micro_batch_size * now.grad_accum


@pytest.mark.parametrize(
    "weights, per_example, capacity, effective, at_most, pick",
    [
        (700.0, 1000.0, 4096.0, 16, 8, 2),  # 700 + 2 × 1000 ≤ 3686, 700 + 4 × 1000 is not
        (700.0, 1000.0, 4096.0, 12, 6, 2),
        (1000.0, 500.0, 4000.0, 24, 6, 4),  # 5.2 fit the margin: 24's divisors ≤ 5 → 4
        (1000.0, 500.0, 40000.0, 24, 6, 6),  # never above the rung it was started at
        (3600.0, 300.0, 4096.0, 16, 8, 1),  # nothing fits the margin: 1, which the probe step itself fitted
    ],
)
def test_the_measured_pick(weights, per_example, capacity, effective, at_most, pick):
    assert fitting_micro(weights, per_example, capacity, effective, at_most, 0.9) == pick


def test_is_oom_by_name():
    import torch

    assert is_oom(torch.OutOfMemoryError("x")) and is_oom(torch.cuda.OutOfMemoryError("x"))
    assert not is_oom(RuntimeError("CUDA out of memory"))


class Beats:
    def __init__(self):
        self.lines = []
        self.current_phase = "train"

    def warn(self, message, **fields):
        self.lines.append({"message": message, **fields})


def order(directory, n: int) -> None:
    path = directory / ABANDON_NAME
    path.write_text(json.dumps({"order": n, "issued_unix": time.time(), "step": 3}))
    # a new mtime even on a coarse clock
    stamp = time.time_ns() + n * 1_000_000
    import os

    os.utime(path, ns=(stamp, stamp))


def test_the_watch_raises_once_per_order_while_armed_and_refuses_otherwise(tmp_path):
    raised = []
    hb = Beats()
    watch = AbandonWatch(
        tmp_path, hb, thread_id=42, raise_in=lambda tid, exc: raised.append((tid, exc)) or True, wake=lambda tid: None
    )
    order(tmp_path, 1)  # there before the watch: not its order
    watch.start()
    watch.close()  # no thread needed: `check` is the one look
    watch.arm()
    assert watch.check() is None and raised == []
    order(tmp_path, 2)
    assert watch.check() == 2 and raised[0][0] == 42
    exc = raised[0][1]()
    assert isinstance(exc, StepAbandoned) and exc.order == 2 and watch.raised_phase == "train"
    assert watch.check() is None and len(raised) == 1  # acted on once
    watch.disarm()  # not in the handler: the exception on its way is taken back
    assert raised[-1] == (42, None) and watch.order is None
    order(tmp_path, 3)
    assert watch.check() == 3 and len(raised) == 2  # disarmed: refused, said in a warn line
    assert hb.lines[-1][ABANDON_REFUSED_FIELD] == {"order": 3, "why": "not in the training loop"}


def test_a_sleep_is_woken_and_abandoned(tmp_path):
    """A thread waiting in a system call (a long sleep) is woken by the watch's signal: the exception comes there."""
    hb = Beats()
    watch = AbandonWatch(tmp_path, hb, poll_s=0.02).start()  # the main thread: the wake-up handler is installed
    watch.arm()
    started = time.monotonic()
    try:
        threading.Timer(0.2, order, (tmp_path, 9)).start()
        with pytest.raises(StepAbandoned) as info:
            time.sleep(30)
        watch.disarm()
    finally:
        watch.close()
    assert info.value.order == 9 and time.monotonic() - started < 20


def test_a_real_python_loop_is_abandoned_at_its_next_bytecode(tmp_path):
    hb = Beats()
    got = {}
    ready = threading.Event()

    def spin():
        watch.thread_id = threading.get_ident()
        watch.arm()
        ready.set()
        try:
            n = 0
            while True:  # a pure-Python spin: no call returns control to anyone
                n += 1
        except StepAbandoned as exc:
            watch.disarm()
            got["order"], got["where"] = exc.order, landed_at(exc)

    watch = AbandonWatch(tmp_path, hb, poll_s=0.02).start()
    t = threading.Thread(target=spin, daemon=True)
    t.start()
    ready.wait(5)
    order(tmp_path, 7)
    t.join(10)
    watch.close()
    assert not t.is_alive(), "the spin was not abandoned"
    assert got["order"] == 7 and watch.delivered == 7 and "in spin" in got["where"]


def test_the_last_good_state_is_held_and_pending_ones_wait_for_confirmation(tmp_path):
    from hangwatch.daemon.trainer.state import Files

    def checkpoint(step: int):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        (d / "trainer_state.json").write_text(json.dumps({"step": step}))
        (d / "adapter_model.safetensors").write_bytes(bytes([step]) * 10)
        return d

    held = LastGood()
    held.hold_start(lambda tmp: (tmp / "trainer_state.json").write_text('{"step": 0}'))
    assert held.step == 0 and held.held.path is None and held.held.state() == {"step": 0}
    c2, c4 = checkpoint(2), checkpoint(4)
    held.committed(c2, 2)
    held.committed(c4, 4)
    assert held.step == 0 and set(held.pending) == {2, 4}
    held.hold(c2, 2)  # confirmed: its files, as read at commit
    assert (
        held.step == 2 and held.held.bytes("adapter_model.safetensors") == bytes([2]) * 10 and set(held.pending) == {4}
    )
    (c2 / "adapter_model.safetensors").write_bytes(b"changed on disk later")
    assert held.held.bytes("adapter_model.safetensors") == bytes([2]) * 10  # memory, not the directory
    held.drop_pending()
    assert held.pending == {} and held.nbytes == sum(len(b) for b in held.held.held.values())
    assert Files(c4).state() == {"step": 4} and Files(c4).has("adapter_model.safetensors")


class OomAbove:
    """compute_loss of a model that runs out of memory above `limit` rows, as a capped device does: the error is
    raised before any result; below it, the sum of the rows' own losses (1 per label token)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.device = SimpleNamespace(type="cpu")
        self.tokenizer = SimpleNamespace(pad_token_id=0)
        self.calls = []

    def compute_loss(self, batch, n):
        import torch

        rows = int(batch["input_ids"].shape[0])
        self.calls.append(rows)
        if rows > self.limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {rows} GiB.")
        return None, float(n), 0.0


def test_an_eval_batch_that_runs_out_of_memory_is_halved_and_the_loss_is_the_same():
    from hangwatch.daemon.data import Example
    from hangwatch.daemon.evaluate import eval_loss

    examples = [Example(f"e{i}", [1, 2, 3, i + 4], [-100, -100, 3, i + 4]) for i in range(10)]
    told = []
    model = OomAbove(limit=2)
    loss = eval_loss(model, examples, 8, on_oom=lambda a, b, m: told.append((a, b)))
    assert told == [(8, 4), (4, 2)] and loss == 1.0
    assert sum(r for r in model.calls if r <= 2) == 10  # every example scored once
    with pytest.raises(Exception) as info:  # without the in-process recovery: the error, as before
        eval_loss(OomAbove(limit=2), examples, 8)
    assert is_oom(info.value)
