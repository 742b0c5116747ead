"""The worker's small parts: the null heartbeat and the dump handler's release, the one
resume-compatibility rule, the declared data-source protocols, the learning-rate schedule."""

from __future__ import annotations

import faulthandler
import inspect
import json
import signal

import pytest
from fixtures.fakes.workers import make_config

from hangwatch.common.config import ConfigError, load_config
from hangwatch.daemon.data import ContinuousDataSource, ShuffledEpochs
from hangwatch.daemon.heartbeat import Heartbeat, NullHeartbeat
from hangwatch.daemon.resume_compat import check_resume_compatible, fingerprint, fingerprint_differences
from hangwatch.daemon.trainer.schedule import WarmupCosine


def public_methods(cls) -> set[str]:
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}


def test_the_null_heartbeat_has_the_heartbeats_interface_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert public_methods(Heartbeat) <= public_methods(NullHeartbeat)
    hb = NullHeartbeat()
    assert hb.start(resumed_from=None) == {}
    with hb.phase("eval", budget_s=5):
        assert hb.current_phase == "eval"
    assert hb.current_phase == "init"
    hb.step(7, loss=1.0)
    assert hb.current_step == 7
    with pytest.raises(ValueError):
        hb.emit("nonsense")
    hb.release_dump_handler()
    hb.close()
    assert list(tmp_path.iterdir()) == []


def test_release_dump_handler_undoes_start(tmp_path):
    hb = Heartbeat(tmp_path / "heartbeat-rank0.jsonl")
    line = hb.start()
    assert line["dump_signal"] == "SIGUSR1"
    dump_file = hb._dump_file
    hb.release_dump_handler()
    assert dump_file.closed and hb._dump_file is None
    assert faulthandler.unregister(signal.SIGUSR1) is False  # nothing left registered
    hb.release_dump_handler()  # twice is harmless
    hb.close()


@pytest.mark.parametrize(
    "saved,current,diffs",
    [
        ({"train": {"lr": 1}}, {"train": {"lr": 1}}, []),
        ({"train": {"lr": 1}}, {"train": {"lr": 2}}, ["train.lr: 1 → 2"]),
        ({"train": {"sleep_per_step_s": 0}}, {"train": {"sleep_per_step_s": 1}}, []),  # free to differ
        ({"train": {"max_nonfinite_streak": 5}}, {"train": {"max_nonfinite_streak": 9}}, []),
        ({"lora": {"r": 8}}, {"lora": {"r": 8, "alpha": 16}}, ["lora.alpha: None → 16"]),
        ({"data": {"max_length": 48}}, {"data": {"max_length": 64}}, ["data.max_length: 48 → 64"]),
    ],
)
def test_fingerprint_differences(saved, current, diffs):
    assert fingerprint_differences(saved, current) == diffs


def test_fingerprint_holds_model_lora_train_and_the_data_settings_that_shape_examples(tmp_path):
    fp = fingerprint(load_config(make_config(tmp_path)))
    assert set(fp) == {"model", "lora", "train", "data"}
    assert set(fp["data"]) == {"max_length", "truncation"}


def test_resume_is_refused_when_settings_changed(tmp_path):
    cfg = load_config(make_config(tmp_path, train={"lr": 0.01}))
    ckpt_dir = tmp_path / "step-00000002"
    ckpt_dir.mkdir()
    (ckpt_dir / "trainer_state.json").write_text(json.dumps({"fingerprint": fingerprint(cfg)}))
    check_resume_compatible(cfg, ckpt_dir)
    changed = load_config(make_config(tmp_path, train={"lr": 0.02}, _name="changed.yaml"))
    with pytest.raises(ConfigError) as err:
        check_resume_compatible(changed, ckpt_dir)
    assert any("train.lr: 0.01 → 0.02" in p for p in err.value.problems)


def test_only_a_source_with_take_step_commit_and_close_is_continuous():
    class Feed:
        def take(self, n):
            return []

        def position(self):
            return {}

        def restore(self, position, step=None):
            pass

        def progress(self):
            return {}

        def take_step(self, n):
            return [], None

        def commit(self, position, step):
            pass

        def close(self):
            pass

    assert isinstance(Feed(), ContinuousDataSource)
    assert not isinstance(ShuffledEpochs([object()], seed=0), ContinuousDataSource)


@pytest.mark.parametrize("s,factor", [(0, 1 / 3), (1, 2 / 3), (2, 1.0), (7, 0.5), (12, 0.0), (20, 0.0)])
def test_warmup_then_cosine(s, factor):
    assert WarmupCosine(warmup=2, total=12)(s) == pytest.approx(factor)
