"""Checkpoint directories: atomic commit, manifest, validity, goodness, retention, resume choice.

This module is the standard library and hangwatch.common only: the worker chooses where to resume
before it imports torch, so its `start` heartbeat is honest about startup time.  What goes *into* a checkpoint is
the trainer's business (`daemon.trainer.state`); here a checkpoint is a directory of files.

Commit protocol (a kill at any instant leaves either the old state or the new one):
  1. `checkpoints/.tmp-step-NNNNNNNN-<pid>/` is filled by the caller;
  2. `manifest.json` (sha256 + size per file) is written last, then every file and directory of the
     temp dir is fsynced;
  3. a stale `step-NNNNNNNN/` of an earlier attempt is moved aside, the temp dir renamed into place,
     the parent fsynced, the moved-aside one deleted.
A checkpoint is *valid* when its manifest checks out, *good* when it also carries a `GOOD` marker,
written (atomically) once its weights were finite and `confirm_steps` finite steps followed it.

A checkpoint written at a graceful stop (SIGTERM, `hangwatch restart`) cannot be confirmed by the
steps after it, since there are none yet; it gets a `PROVISIONAL` marker instead when its weights are
finite and the step before it was finite.  Resume takes it (a graceful restart must lose no step) and
the resumed attempt confirms it like any other; a non-finite streak removes every provisional marker
before the worker exits 75, so the rollback goes to the last *good* checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from hangwatch.common.durable import TMP_PREFIX, fsync_dir, fsync_file, write_atomic
from hangwatch.common.rundir import CHECKPOINTS
from hangwatch.daemon.worker_errors import CheckpointSaveError

MANIFEST = "manifest.json"
GOOD = "GOOD"
PROVISIONAL = "PROVISIONAL"
STATE = "trainer_state.json"
MANIFEST_VERSION = 1
STEP_RE = re.compile(r"^step-(\d{8})$")
TEMP_PREFIXES = (TMP_PREFIX, ".old-")


def checkpoints_root(run_dir: os.PathLike | str, configured: Optional[str] = None) -> Path:
    """Where checkpoints go: `checkpoint.dir` when configured (multi-node: a directory every node sees), else
    `<run_dir>/checkpoints`."""
    return Path(configured) if configured else Path(run_dir) / CHECKPOINTS


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: os.PathLike | str) -> Optional[int]:
    m = STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory, deepest first: done before `root` is
    renamed into place, so the rename never exposes a file whose data is not on disk."""
    paths = list(root.rglob("*"))
    for p in paths:
        if p.is_file():
            fsync_file(p)
    for d in sorted({p.parent for p in paths} | {root}, key=lambda p: -len(p.parts)):
        fsync_dir(d)


# ---- commit ------------------------------------------------------------------------------


def commit(
    root: os.PathLike | str, step: int, fill: Callable[[Path], None], markers: Optional[Callable[[Path], dict]] = None
) -> Path:
    """Write checkpoint `step` under `root` with the commit protocol; `fill(tmpdir)` writes its files.

    `markers(tmpdir)` (after the files and the manifest are written) names marker files to create
    with it, e.g. {PROVISIONAL: {...}}: they appear together with the checkpoint, so no kill can see the
    checkpoint without its mark.  Markers stay outside the manifest, so one can be withdrawn later."""
    root = Path(root)
    name = step_name(step)
    tmp = root / f"{TMP_PREFIX}{name}-{os.getpid()}"
    try:
        return _commit(root, name, step, tmp, fill, markers)
    except OSError as exc:
        # Nothing half-written is left behind (a full disk must not also be a littered one), and
        # nothing under a checkpoint's name was touched: the last good checkpoint is intact.
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(step, str(root), exc) from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _commit(
    root: Path, name: str, step: int, tmp: Path, fill: Callable[[Path], None], markers: Optional[Callable[[Path], dict]]
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    fill(tmp)
    files = {}
    for p in sorted(tmp.rglob("*")):
        if p.is_file():
            files[str(p.relative_to(tmp))] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {"version": MANIFEST_VERSION, "step": step, "created": time.time(), "files": files}
    # Not yet visible under its final name: a plain write, made durable with the rest of the tree.
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    for marker, info in (markers(tmp) if markers else {}).items():
        (tmp / marker).write_text(json.dumps({"t": time.time(), **info}, sort_keys=True) + "\n")
    fsync_tree(tmp)
    final = root / name
    old = None
    if final.exists():
        # A checkpoint of the same step from an attempt that was rolled back: same trajectory, replace it.
        old = root / f".old-{name}-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def mark_good(path: os.PathLike | str, **info) -> None:
    """Record durably that checkpoint `path` is good."""
    body = json.dumps({"t": time.time(), **info}, sort_keys=True).encode() + b"\n"
    write_atomic(Path(path) / GOOD, body)


def mark_provisional(path: os.PathLike | str, **info) -> None:
    """Record that checkpoint `path` may be resumed from before it is confirmed (graceful stop)."""
    body = json.dumps({"t": time.time(), **info}, sort_keys=True).encode() + b"\n"
    write_atomic(Path(path) / PROVISIONAL, body)


def clear_provisional(root: os.PathLike | str) -> list[Path]:
    """Withdraw every provisional marker (training went non-finite: only confirmed checkpoints count)."""
    cleared = []
    for p in list_checkpoints(root):
        marker = p / PROVISIONAL
        if marker.exists():
            marker.unlink()
            fsync_dir(p)
            cleared.append(p)
    return cleared


# ---- inspection ----------------------------------------------------------------------------


def validate(path: os.PathLike | str, *, verify_hashes: bool = True) -> Optional[str]:
    """None when the checkpoint's manifest checks out, else why not (one line)."""
    path = Path(path)
    mpath = path / MANIFEST
    if not mpath.is_file():
        return f"no {MANIFEST} (the save did not finish)"
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
        mstep = manifest["step"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        return f"{MANIFEST} is unreadable: {exc}"
    if not isinstance(files, dict) or not files:
        return f"{MANIFEST} lists no files"
    if step_of(path) is not None and mstep != step_of(path):
        return f"{MANIFEST} says step {mstep}, the directory says {step_of(path)}"
    for rel, meta in sorted(files.items()):
        p = path / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != meta.get("bytes"):
            return f"{rel} has {size} bytes, the manifest says {meta.get('bytes')} (truncated or overwritten)"
        if verify_hashes and sha256_file(p) != meta.get("sha256"):
            return f"{rel} does not match its sha256 in the manifest (corrupted)"
    return None


def is_good(path: os.PathLike | str) -> bool:
    return (Path(path) / GOOD).is_file()


def is_provisional(path: os.PathLike | str) -> bool:
    return (Path(path) / PROVISIONAL).is_file() and not is_good(path)


def read_state(path: os.PathLike | str) -> dict:
    return json.loads((Path(path) / STATE).read_text())


def list_checkpoints(root: os.PathLike | str) -> list[Path]:
    """Committed checkpoint directories, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: -step_of(p))


def clean_temporaries(root: os.PathLike | str) -> list[dict]:
    """Remove directories a killed save left behind; returns what was removed and why."""
    root = Path(root)
    removed = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        if p.is_dir() and p.name.startswith(TEMP_PREFIXES):
            why = (
                "half-written temporary directory of an interrupted save"
                if p.name.startswith(TMP_PREFIX)
                else "replaced checkpoint left by an interrupted save"
            )
            shutil.rmtree(p, ignore_errors=True)
            removed.append({"path": str(p), "step": _temp_step(p.name), "reason": f"{why}; removed"})
    return removed


def _temp_step(name: str) -> Optional[int]:
    m = re.search(r"step-(\d{8})", name)
    return int(m.group(1)) if m else None


@dataclass
class ResumeChoice:
    """Where to resume: `path` (None: from scratch) and what was passed over, with reasons."""

    path: Optional[Path] = None
    step: int = 0
    skipped: list[dict] = field(default_factory=list)


def choose_resume(run_dir: os.PathLike | str, *, clean: bool = True, configured: Optional[str] = None) -> ResumeChoice:
    """The newest good (or provisional) checkpoint; newer ones that are invalid or unconfirmed are
    listed as skipped.  `clean`: remove what interrupted saves left behind first (rank 0 of a
    multi-rank run does it; the other ranks only look, and take rank 0's choice)."""
    root = checkpoints_root(run_dir, configured)
    choice = ResumeChoice(skipped=clean_temporaries(root) if clean else [])
    for p in list_checkpoints(root):
        reason = validate(p)
        if reason is None and not is_good(p) and not is_provisional(p):
            reason = (
                "valid but not confirmed good (training after it did not stay finite long enough, or was cut short)"
            )
        if reason is None:
            choice.path, choice.step = p, step_of(p)
            return choice
        choice.skipped.append({"path": str(p), "step": step_of(p), "reason": reason})
    return choice


def apply_retention(root: os.PathLike | str, keep_last: int, *, protect: tuple = ()) -> list[Path]:
    """Keep the newest `keep_last` valid checkpoints and the newest good one; delete other valid ones,
    and invalid ones older than every kept checkpoint.  Returns what was deleted."""
    checkpoints = list_checkpoints(root)
    valid = [p for p in checkpoints if validate(p, verify_hashes=False) is None]
    keep = set(valid[:keep_last])
    newest_good = next((p for p in valid if is_good(p)), None)
    if newest_good is not None:
        keep.add(newest_good)
    keep.update(Path(p) for p in protect)
    oldest_kept = min((step_of(p) for p in keep), default=None)
    deleted = []
    for p in checkpoints:
        if p in keep:
            continue
        if p in valid or (oldest_kept is not None and step_of(p) < oldest_kept):
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted
