"""Checkpoints: atomic commit, damage of every kind falls back to the previous good checkpoint with
the reason in `start.skipped_checkpoints`, retention never deletes the newest good one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures.fakes.workers import make_config, read_beats, run_in_process
from safetensors.torch import load_file

from hangwatch.daemon import checkpoint as ckpt


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 12-step run with good checkpoints at 3, 6, 9 and 12."""
    tmp = tmp_path_factory.mktemp("base")
    config = make_config(
        tmp,
        train={"max_steps": 12},
        checkpoint={"every_steps": 3, "keep_last": 10, "confirm_steps": 1},
        lora={"modules_to_save": ["lm_head"]},
    )
    assert run_in_process(config) == 0
    run = tmp / "run"
    assert [p.name for p in ckpt.list_checkpoints(run / "checkpoints")] == [ckpt.step_name(s) for s in (12, 9, 6, 3)]
    assert all(ckpt.is_good(p) for p in ckpt.list_checkpoints(run / "checkpoints"))
    return config, run


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def half_written_save(step_dir: Path) -> None:
    """What a kill in the middle of saving step 12 leaves: a temp dir, no step-00000012."""
    tmp = step_dir.parent / f".tmp-{step_dir.name}-4242"
    tmp.mkdir()
    (tmp / "adapter_model.safetensors").write_bytes((step_dir / "adapter_model.safetensors").read_bytes()[:100])
    shutil.rmtree(step_dir)


DAMAGE = {
    "flipped_byte": (lambda d: flip_byte(d / "adapter_model.safetensors"), "does not match its sha256"),
    "truncated_file": (lambda d: truncate(d / "optimizer.pt"), "optimizer.pt has"),
    "missing_manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    "half_written_temp_dir": (half_written_save, "half-written temporary directory"),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_previous(finished_run, tmp_path, kind):
    config, base_run = finished_run
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    shutil.rmtree(run / "final")
    damage, reason = DAMAGE[kind]
    damage(run / "checkpoints" / ckpt.step_name(12))

    assert run_in_process(config, run_dir=run) == 0
    start = read_beats(run, attempt=2)[0]
    assert start["event"] == "start"
    assert start["resumed_from"] == str(run / "checkpoints" / ckpt.step_name(9))
    skipped = start["skipped_checkpoints"]
    assert len(skipped) == 1 and skipped[0]["step"] == 12 and reason in skipped[0]["reason"], skipped
    # It retrained steps 10-12 and ends exactly where the undamaged run ended.
    assert sorted(b["step"] for b in read_beats(run, attempt=2) if b["event"] == "step") == [10, 11, 12]
    for name in ("adapter_model.safetensors", "extra_modules.safetensors"):
        a, b = load_file(str(base_run / "final" / name)), load_file(str(run / "final" / name))
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert ckpt.validate(run / "checkpoints" / ckpt.step_name(12)) is None
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".")]


def test_falls_back_past_several_bad_ones(finished_run, tmp_path):
    config, base_run = finished_run
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    flip_byte(run / "checkpoints" / ckpt.step_name(12) / "rng.pt")
    (run / "checkpoints" / ckpt.step_name(9) / ckpt.GOOD).unlink()  # valid, never confirmed
    (run / "checkpoints" / ckpt.step_name(6) / "scheduler.pt").unlink()
    choice = ckpt.choose_resume(run)
    assert choice.path == run / "checkpoints" / ckpt.step_name(3)
    reasons = {s["step"]: s["reason"] for s in choice.skipped}
    assert "sha256" in reasons[12] and "not confirmed good" in reasons[9] and "scheduler.pt is missing" in reasons[6]


def _dummy(step_root: Path, step: int, good: bool) -> Path:
    path = ckpt.commit(step_root, step, lambda d: (d / "w.bin").write_bytes(bytes([step]) * 10))
    if good:
        ckpt.mark_good(path)
    return path


def test_commit_is_atomic_and_replaces_a_stale_same_step(tmp_path):
    root = tmp_path / "checkpoints"
    first = _dummy(root, 5, good=True)
    manifest = json.loads((first / ckpt.MANIFEST).read_text())
    assert manifest["step"] == 5 and set(manifest["files"]) == {"w.bin"}
    again = ckpt.commit(root, 5, lambda d: (d / "w.bin").write_bytes(b"new"))
    assert again == first and (again / "w.bin").read_bytes() == b"new"
    assert not ckpt.is_good(again)  # the replacement has to earn goodness itself
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005"]


def test_retention_keeps_last_k_and_the_newest_good(tmp_path):
    root = tmp_path / "checkpoints"
    for step in range(1, 7):
        _dummy(root, step, good=step == 2)
    broken = root / ckpt.step_name(1)
    (broken / "w.bin").write_bytes(b"x")  # invalid and older than anything kept: debris
    deleted = ckpt.apply_retention(root, keep_last=2)
    assert sorted(ckpt.step_of(p) for p in deleted) == [1, 3, 4]
    assert sorted(ckpt.step_of(p) for p in ckpt.list_checkpoints(root)) == [2, 5, 6]
    assert ckpt.choose_resume(tmp_path).path == root / ckpt.step_name(2)


def test_run_retention_never_deletes_the_newest_good(tmp_path):
    # A checkpoint every step, each confirmed 3 steps later, keep_last 1: when the run crashes at the
    # start of step 9, step 8 is the newest valid one, 6-8 await confirmation, 5 is the newest good one.
    config = make_config(
        tmp_path,
        train={"max_steps": 12},
        checkpoint={"every_steps": 1, "keep_last": 1, "confirm_steps": 3},
        faults=[{"kind": "crash", "at_step": 9}],
    )
    assert run_in_process(config) == 1
    root = tmp_path / "run" / "checkpoints"
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(root)] == [8, 7, 6, 5]
    assert ckpt.is_good(root / ckpt.step_name(5)) and not ckpt.is_good(root / ckpt.step_name(8))
    words = json.loads((tmp_path / "run" / "attempts" / "0001" / "exit.json").read_text())
    assert words["kind"] == "crash" and "injected fault: crash at step 9" in words["message"]
    # The next attempt resumes from the newest good one, not the newest valid one.
    assert ckpt.choose_resume(tmp_path / "run").path == root / ckpt.step_name(5)


def test_provisional_checkpoint_is_resumed_until_a_nonfinite_streak_withdraws_it(tmp_path):
    """A graceful stop's checkpoint is resumed from (no step lost) but never outlives a rollback."""
    root = ckpt.checkpoints_root(tmp_path)
    fill = lambda d: (d / "weights.bin").write_bytes(b"w")  # noqa: E731
    good = ckpt.commit(root, 4, fill)
    ckpt.mark_good(good)
    stopped = ckpt.commit(root, 6, fill)
    assert ckpt.choose_resume(tmp_path).path == good  # unconfirmed: skipped
    ckpt.mark_provisional(stopped, reason="graceful stop on SIGTERM")
    choice = ckpt.choose_resume(tmp_path)
    assert choice.path == stopped and choice.skipped == []
    assert ckpt.clear_provisional(root) == [stopped]
    choice = ckpt.choose_resume(tmp_path)
    assert choice.path == good and "not confirmed good" in choice.skipped[0]["reason"]


def test_a_refused_checkpoint_write_leaves_nothing_and_says_so(tmp_path):
    """A disk that refuses mid-save: no temporary directory left, the older checkpoint untouched, and the
    error is the worker's own kind with exit 74 (not a generic crash)."""
    import errno as _errno

    from hangwatch.daemon import checkpoint as ck
    from hangwatch.daemon.lastwords import classify
    from hangwatch.daemon.worker_errors import CheckpointSaveError

    root = tmp_path / "checkpoints"
    good = ck.commit(root, 10, lambda d: (d / "weights.bin").write_bytes(b"w" * 64))
    ck.mark_good(good)

    def fill(d):
        (d / "weights.bin").write_bytes(b"x" * 32)
        raise OSError(_errno.ENOSPC, "No space left on device", str(d / "optimizer.pt"))

    with pytest.raises(CheckpointSaveError) as err:
        ck.commit(root, 20, fill)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000010"]  # no .tmp-*, no step-20
    assert ck.validate(good) is None  # the last good checkpoint still checks out
    assert classify(err.value) == ("checkpoint_failed", 74)
    assert classify(CheckpointSaveError(20, str(root), PermissionError(_errno.EACCES, "denied"))) == (
        "checkpoint_failed",
        1,
    )
