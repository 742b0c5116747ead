"""A multi-rank run's per-rank state, in process: rank 0's checkpoint holds every rank's RNG states
and data position (the other ranks played by a fake world), each rank gets its own back, a real
one-rank process group trains through DDP exactly as without it, and faults and last words are per rank."""

from __future__ import annotations

import io
import json
import os
import signal
import socket

import pytest
import torch
from fixtures.fakes.workers import make_config

from hangwatch.common.config import FaultCfg, load_config
from hangwatch.common.rundir import rank_exit_path
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ShuffledEpochs, validate_file
from hangwatch.daemon.distributed import TorchWorld, World
from hangwatch.daemon.faults import FIRED_FILE, FaultPlan
from hangwatch.daemon.heartbeat import NullHeartbeat
from hangwatch.daemon.lastwords import last_words_for
from hangwatch.daemon.model import load_model
from hangwatch.daemon.signals import StopRequest
from hangwatch.daemon.trainer import state
from hangwatch.daemon.trainer.loop import Trainer
from hangwatch.daemon.trainer.ranks import rank_state


class FakeRanks(World):
    """Rank `rank` of a world of `size` whose peers are played by the test: `peers` are the states the
    other ranks would contribute to a gather.  No gradient is exchanged (nothing to exchange it with)."""

    def __init__(self, rank: int, size: int, peers: tuple = ()):
        self.rank, self.size, self.peers = rank, size, peers

    def gather(self, obj):
        return [obj, *self.peers] if self.is_main else None


def _trainer(cfg, run, world):
    bundle = load_model(cfg)
    examples, _ = validate_file(cfg.data.train, bundle.tokenizer, cfg)
    hb = NullHeartbeat(rank=world.rank)
    return Trainer(
        cfg,
        hb,
        run,
        bundle,
        ShuffledEpochs(examples, cfg.train.seed),
        [],
        FaultPlan([], run, hb),
        StopRequest(),
        out=io.StringIO(),
        world=world,
    )


def test_rank_0_writes_every_ranks_rng_and_position_once_and_each_rank_resumes_its_own(tmp_path):
    cfg = load_config(make_config(tmp_path, train={"max_steps": 2, "micro_batch_size": 2, "grad_accum": 2}))
    run = tmp_path / "run"
    state.seed_everything(4242)
    peer_rng = state.rng_state()
    peer_position = {"kind": "shuffled_epochs", "epoch": 0, "index": 8, "size": 64}
    trainer = _trainer(cfg, run, FakeRanks(0, 2, peers=(rank_state(1, peer_rng, peer_position),)))
    trainer.seed_fresh()
    for _ in range(2):
        trainer.after_step(trainer.train_step())
    assert trainer.step == 2 and trainer.samples == 2 * 2 * 2 * 2  # the world's examples: 2 steps of 8
    own_rng = state.rng_state()
    path = trainer.save_checkpoint()
    assert ckpt.validate(path) is None
    saved = ckpt.read_state(path)
    assert saved["world_size"] == 2 and saved["fingerprint"]["world_size"] == 2
    assert [r["data_position"] for r in saved["ranks"]] == [trainer.boundary_position, peer_position]
    assert torch.equal(torch.load(path / "rng.pt")["torch"], own_rng["torch"])
    assert torch.equal(torch.load(path / "rng-rank1.pt")["torch"], peer_rng["torch"])

    rank1 = _trainer(cfg, run, FakeRanks(1, 2))
    rank1.restore(path)
    assert rank1.step == 2
    assert rank1.source.position() == peer_position
    assert torch.equal(torch.get_rng_state(), peer_rng["torch"])
    rank0 = _trainer(cfg, run, FakeRanks(0, 2))
    rank0.restore(path)
    assert rank0.source.position() == trainer.boundary_position
    assert torch.equal(torch.get_rng_state(), own_rng["torch"])


def test_a_rank_the_checkpoint_holds_nothing_for_is_refused(tmp_path):
    cfg = load_config(make_config(tmp_path, train={"max_steps": 1}))
    run = tmp_path / "run"
    single = _trainer(cfg, run, World())
    single.seed_fresh()
    single.after_step(single.train_step())
    path = single.save_checkpoint()
    assert not (path / "rng-rank1.pt").exists() and ckpt.read_state(path)["world_size"] == 1
    with pytest.raises(RuntimeError, match="none for rank 1"):
        _trainer(cfg, run, FakeRanks(1, 2)).restore(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_process_group_trains_through_ddp_bit_for_bit_like_one_process(tmp_path, monkeypatch):
    """One gloo rank: the DDP wrapper, our comm hook, no_sync and the collectives change no bit."""
    cfg = load_config(make_config(tmp_path, train={"max_steps": 2}))
    plain = _trainer(cfg, tmp_path / "plain", World())
    plain.seed_fresh()
    for _ in range(2):
        plain.after_step(plain.train_step())
    for k, v in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(k, v)
    world = TorchWorld(torch.device("cpu"))
    try:
        assert world.sum([0.5, 2]) == [0.5, 2.0] and world.any(True) and not world.any(False)
        assert world.gather({"a": 1}) == [{"a": 1}] and world.broadcast(("x", 3)) == ("x", 3)
        ddp = _trainer(cfg, tmp_path / "ddp", world)
        assert type(ddp.train_module).__name__ == "DistributedDataParallel"
        ddp.seed_fresh()
        for _ in range(2):
            ddp.after_step(ddp.train_step())
    finally:
        world.close()
    a, b = plain.bundle.adapter_state(), ddp.bundle.adapter_state()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert plain.last_metrics["loss"] == ddp.last_metrics["loss"]


def test_a_fault_fires_on_its_own_rank_only_and_all_ranks_share_one_record(tmp_path):
    faults = [FaultCfg(kind="nan", at_step=1, steps=1, rank=1), FaultCfg(kind="nan", at_step=1, steps=2)]
    plans = [FaultPlan(faults, tmp_path, NullHeartbeat(rank=r), rank=r, shared=True) for r in range(2)]
    for plan in plans:
        plan.before_step(1, bundle=None)
    assert [plan.nan_remaining for plan in plans] == [2, 1]
    fired = json.loads((tmp_path / FIRED_FILE).read_text())["fired"]
    assert sorted(f["rank"] for f in fired) == [0, 1]
    # A rank-0 fault keeps the record key it had before faults had a rank (resumed old runs do not refire it).
    old_style = {k: v for k, v in faults[1].model_dump(mode="json").items() if k != "rank"}
    assert json.dumps(old_style, sort_keys=True) + "#1" in [f["key"] for f in fired]
    again = FaultPlan(faults, tmp_path, NullHeartbeat(rank=1), rank=1, shared=True)
    again.before_step(2, bundle=None)
    assert again.nan_remaining == 0  # fired once per run


def test_each_rank_leaves_its_own_last_words(tmp_path):
    assert rank_exit_path(tmp_path, 3, 0).name == "exit.json"
    assert rank_exit_path(tmp_path, 3, 2).name == "exit-rank2.json"
    try:
        raise RuntimeError("injected fault: crash at step 4")
    except RuntimeError as exc:
        kind, code, path = last_words_for(exc, tmp_path, 3, rank=1, step=4)
    words = json.loads(path.read_text())
    assert (kind, code, path.name) == ("crash", 1, "exit-rank1.json")
    assert words["rank"] == 1 and "collective_error" not in words
    try:
        raise RuntimeError("[third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")
    except RuntimeError as exc:
        _, _, path = last_words_for(exc, tmp_path, 3, rank=0)
    words = json.loads(path.read_text())
    assert path.name == "exit.json" and words["collective_error"] is True and "rank" not in words


def test_a_rank_under_torchrun_survives_being_asked_to_stop_twice():
    """torchrun forwards its SIGTERM to every rank, and a supervisor may signal the ranks too: the second
    request must not kill a rank that is finishing its step and checkpoint."""
    stop = StopRequest(repeat_kills=False).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        assert signal.getsignal(signal.SIGTERM) == stop._record
    finally:
        stop.uninstall()
    single = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert single.requested == "SIGINT"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # one process: a second request kills at once
    finally:
        single.uninstall()
