"""The worker's memory evidence for OOM remediation: what an out-of-memory failure's last words say about memory.

The trainer notes, once the model is on its device and before the first step (`note_model`), the micro-batch in
force and the weights' share: what is allocated then (the base weights, the adapter, extra modules), with the
peak that loading left.  When the worker then dies of an out-of-memory error, its last words
(`daemon.lastwords.last_words_for`) carry `evidence()` as their `memory` object, in MiB:

    {"micro_batch_size": 16, "device": "cuda:0", "weights_mb": 700.0, "loading_peak_mb": 1400.0,
     "total_mb": 81559.0, "allowed_mb": 4096.0, "allocated_mb": 3700.0, "peak_mb": 3710.0,
     "reserved_mb": 3900.0, "free_mb": 76000.0}

`allowed_mb` only when the process is capped (`torch.cuda.set_per_process_memory_fraction`).  The supervisor
estimates the micro-batch that fits from it (`supervisor.rules.oom_evidence`).

The figures come from a probe, the one seam: `CudaProbe` reads torch.cuda (nothing on another device: on the CPU
there are no figures, only what the message says); the `memory_limit` fault's fake allocator (`daemon.faults`)
is one too, and the trainer hands it in (`note_model(probe=...)`).  Gathering evidence never raises: a figure
that cannot be read is left out, and with nothing noted there is no `memory` object.  The state is the process's
(one worker, one trainer); a new trainer notes it afresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

MIB = float(1 << 20)


class Probe(Protocol):
    def figures(self, device) -> dict[str, float]:
        """Some of `total_mb`, `allowed_mb`, `allocated_mb`, `peak_mb`, `reserved_mb`, `free_mb` of `device`."""


class CudaProbe:
    """torch.cuda's figures for a CUDA device, each read on its own (one that fails is left out); {} otherwise.
    `cuda`: what to read them from (default torch.cuda)."""

    def __init__(self, cuda=None):
        self.cuda = cuda

    def figures(self, device) -> dict[str, float]:
        if getattr(device, "type", None) != "cuda":
            return {}
        cuda = self.cuda
        if cuda is None:
            import torch

            cuda = torch.cuda
        readers: dict[str, Callable[[], Optional[float]]] = {
            "total_mb": lambda: cuda.get_device_properties(device).total_memory,
            "allowed_mb": lambda: _allowed(cuda, device),
            "allocated_mb": lambda: cuda.memory_allocated(device),
            "peak_mb": lambda: cuda.max_memory_allocated(device),
            "reserved_mb": lambda: cuda.memory_reserved(device),
            "free_mb": lambda: cuda.mem_get_info(device)[0],
        }
        out = {}
        for key, read in readers.items():
            try:
                value = read()
            except Exception:  # an OOM may leave the device in any state: a figure less, never a raise
                continue
            if value is not None:
                out[key] = round(float(value) / MIB, 1)
        return out


def _allowed(cuda, device) -> Optional[float]:
    """The per-process cap in bytes (the fraction × the device's total, as the allocator computes it), or None
    when the process is not capped (fraction 1, or a torch without the getter)."""
    getter = getattr(cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    fraction = float(getter(device))
    if not 0.0 < fraction < 1.0:
        return None
    return fraction * cuda.mem_get_info(device)[1]


@dataclass
class Noted:
    device: Any
    micro_batch_size: int
    probe: Probe
    weights_mb: Optional[float] = None
    loading_peak_mb: Optional[float] = None


_noted: Optional[Noted] = None


def note_model(device, micro_batch_size: int, probe: Optional[Probe] = None) -> None:
    """Once the model is on `device`, before the first step: the micro-batch in force and the weights' share (what
    `probe`, by default torch.cuda's, sees allocated now).  Never raises."""
    global _noted
    probe = probe if probe is not None else CudaProbe()
    try:
        figures = probe.figures(device)
    except Exception:
        figures = {}
    _noted = Noted(device, int(micro_batch_size), probe, figures.get("allocated_mb"), figures.get("peak_mb"))


def note_micro(micro_batch_size: int) -> None:
    """The micro-batch changed in the process (an out-of-memory step adapted): later evidence names the new one."""
    if _noted is not None:
        _noted.micro_batch_size = int(micro_batch_size)


def forget() -> None:
    global _noted
    _noted = None


def evidence() -> Optional[dict]:
    """The `memory` object of an out-of-memory failure's last words (see the module's docstring); None when nothing
    was noted.  Never raises."""
    try:
        noted = _noted
        if noted is None:
            return None
        out: dict[str, Any] = {"micro_batch_size": noted.micro_batch_size, "device": str(noted.device)}
        if noted.weights_mb is not None:
            out["weights_mb"] = noted.weights_mb
        if noted.loading_peak_mb is not None:
            out["loading_peak_mb"] = noted.loading_peak_mb
        try:
            figures = noted.probe.figures(noted.device)
        except Exception:
            figures = {}
        out.update({k: round(float(v), 1) for k, v in figures.items() if isinstance(v, (int, float))})
        return out
    except Exception:
        return None
