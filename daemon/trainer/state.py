"""What a checkpoint holds of the training state, and how it is put back.

Everything that decides the next step's numbers: adapter and extra-module weights, optimizer and
scheduler state, the RNG states (python, numpy, torch, cuda: dropout) and the trainer's counters
and data position (`trainer_state.json`, written by the trainer).  A checkpoint is always taken on
an optimizer-step boundary; one saved mid-accumulation is refused.

A multi-rank run's checkpoint is written once, by rank 0, with every rank's RNG states: rank 0's in
`rng.pt` (the single-process file), rank R's in `rng-rank<R>.pt` (`trainer.ranks`).
"""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.model import EXTRA_FILE, ModelBundle

ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
RNG_FILE = "rng.pt"


def rng_file(rank: int) -> str:
    """The file holding rank `rank`'s RNG states in a checkpoint."""
    return RNG_FILE if rank == 0 else f"rng-rank{rank}.pt"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    torch.manual_seed(seed)


def rng_state(*, cuda: bool = False, own_device_only: bool = False) -> dict:
    """This process's RNG states; `cuda` (the worker trains on a GPU): CUDA's too — a worker on the CPU leaves
    the GPUs of its machine alone (reading their states would open a CUDA context on each), and its checkpoints
    are the same on a machine with GPUs and one without.  `own_device_only` (a rank of a multi-GPU run): the
    current CUDA device's alone, as touching every device would make each rank open a context on every GPU."""
    py = random.getstate()
    npst = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state(),
    }
    if cuda and own_device_only:
        state["cuda_current"] = torch.cuda.get_rng_state()
    elif cuda:
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "cuda_current" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_current"])


def fill(
    tmp: Path, bundle: ModelBundle, optimizer, scheduler, trainer_state: dict, rngs: Optional[list] = None
) -> None:
    """Write a checkpoint's files into `tmp` (the directory `checkpoint.commit` then makes durable);
    `rngs` are every rank's RNG states in rank order (default: this process's)."""
    from safetensors.torch import save_file

    save_file(bundle.adapter_state(), str(tmp / ADAPTER_FILE))
    bundle.model.peft_config["default"].save_pretrained(str(tmp))
    extra = bundle.extra_state()
    if extra:
        save_file(extra, str(tmp / EXTRA_FILE))
    torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
    torch.save(scheduler.state_dict(), tmp / SCHEDULER_FILE)
    for rank, rng in enumerate(rngs if rngs is not None else [rng_state(cuda=bundle.device.type == "cuda")]):
        torch.save(rng, tmp / rng_file(rank))
    (tmp / ckpt.STATE).write_text(json.dumps(trainer_state, indent=1, sort_keys=True) + "\n")


class Files:
    """A checkpoint's files as the loaders read them: from its directory, or held in host memory (`held`: name →
    bytes, read from that directory once it was confirmed good — `trainer.recovery`).  Both are read the same way,
    bytes first, so a state put back from memory is bit for bit the state a restart reads from disk."""

    def __init__(self, path: Optional[Path], held: Optional[dict[str, bytes]] = None):
        self.path = Path(path) if path is not None else None
        self.held = held

    @classmethod
    def read(cls, path: Path) -> "Files":
        """Every file of checkpoint `path`, read into memory now."""
        path = Path(path)
        return cls(path, {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()})

    def name(self) -> str:
        return str(self.path) if self.path is not None else "the state held in memory"

    def has(self, name: str) -> bool:
        if self.held is not None:
            return name in self.held
        return (self.path / name).is_file()

    def bytes(self, name: str) -> bytes:
        if self.held is not None:
            return self.held[name]
        return (self.path / name).read_bytes()

    def torch_load(self, name: str, **kw):
        return torch.load(io.BytesIO(self.bytes(name)), weights_only=True, **kw)

    def state(self) -> dict:
        return json.loads(self.bytes(ckpt.STATE))

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in (self.held or {}).values())


def load_weights(path: "Path | Files", bundle: ModelBundle, optimizer, scheduler) -> dict:
    """Put checkpoint `path`'s weights, optimizer and scheduler state back; returns its trainer state.
    `path`: its directory, or its `Files` (held in memory).

    The RNG states are left for `load_rng`, to be called last: nothing after it may draw random
    numbers before training does."""
    from safetensors.torch import load as load_safetensors

    files = path if isinstance(path, Files) else Files(path)
    where = files.name()
    state = files.state()
    accum = state["accumulation"]
    if accum["micro_step"] != 0:
        raise RuntimeError(
            f"{where}: saved mid-accumulation (micro_step {accum['micro_step']}); checkpoints are step boundaries"
        )
    bundle.load_adapter_state(load_safetensors(files.bytes(ADAPTER_FILE)))
    if files.has(EXTRA_FILE) or bundle.extra:
        if not files.has(EXTRA_FILE):
            raise RuntimeError(
                f"{where}: the model has extra trainable modules {sorted(bundle.extra)} but the checkpoint holds none"
            )
        bundle.load_extra_state(load_safetensors(files.bytes(EXTRA_FILE)))
    if not bundle.weights_finite():
        raise RuntimeError(f"{where}: restored weights are not finite")
    optimizer.load_state_dict(files.torch_load(OPTIMIZER_FILE, map_location="cpu"))
    scheduler.load_state_dict(files.torch_load(SCHEDULER_FILE))
    return state


def load_rng(path: "Path | Files", rank: int = 0) -> None:
    """Put rank `rank`'s RNG states of checkpoint `path` (its directory or its `Files`) back."""
    files = path if isinstance(path, Files) else Files(path)
    name = rng_file(rank)
    if not files.has(name):
        raise RuntimeError(f"{files.name()}: no RNG states for rank {rank} ({name} is missing)")
    set_rng_state(files.torch_load(name))
