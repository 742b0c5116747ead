"""What an out-of-memory failure of the built-in worker says about memory, and what micro-batch it points to.
Pure: the parser, the evidence, the estimate; the reader of the attempt's files that gathers the evidence is
`records.memory_evidence.gather`.

The evidence, in MiB:

  * the OOM message (torch's `OutOfMemoryError`, written by c10/cuda/CUDACachingAllocator.cpp; sizes printed by
    its `format_size`: "512 bytes", "20.00 KiB", "3.61 MiB", "75.31 GiB"):

        CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB of which
        1.02 GiB is free. Including non-PyTorch memory, this process has 78.06 GiB memory in use. Of the
        allocated memory 75.31 GiB is allocated by PyTorch, and 1.93 GiB is reserved by PyTorch but
        unallocated. If reserved but unallocated memory is large try setting …

    with "4.00 GiB allowed; " before "Of the allocated memory" when the process is capped
    (`torch.cuda.set_per_process_memory_fraction`; some torch versions compute it and leave it out), other
    processes as "Process 1234 has 1.00 GiB memory in use. ", CUDA graphs' pools as "with 1.00 GiB allocated in
    private pools (e.g., CUDA Graphs), ", and torch 1.x's older form "Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB
    total capacity; 14.56 GiB already allocated; 3.44 MiB free; 14.71 GiB reserved in total by PyTorch)".
    `parse_oom_message` reads any of them; anything else (the injected `oom` fault's words) is None;
  * the worker's last words' `memory` object (`daemon.trainer.memory`): the micro-batch in force, the weights'
    share (allocated once the model was on the device, before the first step), the peak by then, and at the
    failure the device's total, the per-process cap, allocated, peak, reserved and free;
  * the failed attempt's step beats: `max_mem_allocated_mb`, the process's peak so far (CUDA only).

The estimate (`estimate`) is a straight line, need(m) ≈ W + m·k: W the weights' share, k the memory of one example
of the micro-batch.  The failed micro-batch m_f needed at least N, the largest of: allocated + requested at the
failure (the message), the peak at the failure and the steps' peak (each only when above the peak the loading left,
which would say nothing about training); so k = (N − W) / m_f.  The capacity C is the smallest of: the cap
("allowed"), what PyTorch holds plus what is free on the device (what other processes and the CUDA context take
is not there), the device's total.  A micro-batch d fits when W + d·k ≤ MARGIN · C: the margin leaves room for
fragmentation, for a step with longer sequences than the failed one, and for what the straight line misses.

N is a lower bound of the step's real need (the allocation that failed is the first that did not fit, not the
step's peak), so k is too, and a pick can still be too large; `supervisor.rules.oom_remediation` then goes on down
the halving ladder from it, and never takes a pick above the ladder's own next rung.  Evidence that does not hold
together — an OOM outside a training step (an eval's, a generate()'s), no weights' share, no capacity, no figure
of the need, a need that fits in the margin although the step failed, weights above the need, a micro-batch other
than the setting's — gives no estimate but the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

MARGIN = 0.9  # a pick must fit in 90 % of the capacity
TRAIN_PHASE = "train"  # the heartbeat phase of training steps: an OOM elsewhere (eval, generate) says little of them
MIB = float(1 << 20)
_UNITS = {"bytes": 1.0, "KiB": 1024.0, "MiB": MIB, "GiB": MIB * 1024.0}
_SIZE = r"(\d+(?:\.\d+)?) (bytes|KiB|MiB|GiB)"
_HEAD = re.compile(
    rf"out of memory\. Tried to allocate {_SIZE}\. GPU (\d+) has a total capacity of {_SIZE} of which "
    rf"{_SIZE} is free\.",
    re.I,
)
_OLD_HEAD = re.compile(rf"out of memory\. Tried to allocate {_SIZE} \(GPU (\d+); ([^)]*)\)", re.I)
_OLD_PARTS = {
    "total_mb": rf"^{_SIZE} total capacity$",
    "allocated_mb": rf"^{_SIZE} already allocated$",
    "free_mb": rf"^{_SIZE} free$",
    "allowed_mb": rf"^{_SIZE} allowed$",
    "reserved_mb": rf"^{_SIZE} reserved in total by PyTorch$",
}


def size_mb(number: str, unit: str) -> float:
    """One of format_size's sizes, in MiB."""
    return float(number) * _UNITS[unit] / MIB


def parse_oom_message(text: Optional[str]) -> Optional[dict]:
    """The figures of torch's CUDA out-of-memory message, in MiB: `tried_mb`, `gpu`, `total_mb`, `free_mb`, and where
    the message has them `in_use_mb` (this process, non-PyTorch memory included), `others_mb` (other processes),
    `allowed_mb` (the per-process cap), `allocated_mb` (by PyTorch, private pools included), `unallocated_mb`
    (reserved by PyTorch but unallocated), `reserved_mb`; None when `text` is not such a message."""
    if not isinstance(text, str):
        return None
    m = _HEAD.search(text)
    if m is None:
        return _parse_old(text)
    out: dict[str, Any] = {
        "tried_mb": size_mb(m[1], m[2]),
        "gpu": int(m[3]),
        "total_mb": size_mb(m[4], m[5]),
        "free_mb": size_mb(m[6], m[7]),
    }
    tail = text[m.end() :]
    found = re.search(rf"this process has {_SIZE} memory in use\.", tail)
    if found:
        out["in_use_mb"] = size_mb(found[1], found[2])
    others = re.findall(rf"Process \d+ has {_SIZE} memory in use\.", tail)
    if others:
        out["others_mb"] = sum(size_mb(n, u) for n, u in others)
    found = re.search(rf"{_SIZE} allowed;", tail)
    if found:
        out["allowed_mb"] = size_mb(found[1], found[2])
    found = re.search(rf"Of the allocated memory {_SIZE} is allocated by PyTorch,", tail)
    if found:
        out["allocated_mb"] = size_mb(found[1], found[2])
    found = re.search(rf"and {_SIZE} is reserved by PyTorch but unallocated", tail)
    if found:
        out["unallocated_mb"] = size_mb(found[1], found[2])
        if "allocated_mb" in out:
            out["reserved_mb"] = out["allocated_mb"] + out["unallocated_mb"]
    return out


def _parse_old(text: str) -> Optional[dict]:
    """torch 1.x: "Tried to allocate X (GPU 0; T total capacity; A already allocated; F free; [C allowed; ]R reserved
    in total by PyTorch)"."""
    m = _OLD_HEAD.search(text)
    if m is None:
        return None
    out: dict[str, Any] = {"tried_mb": size_mb(m[1], m[2]), "gpu": int(m[3])}
    for part in (p.strip() for p in m[4].split(";")):
        for key, pattern in _OLD_PARTS.items():
            found = re.match(pattern, part)
            if found:
                out[key] = size_mb(found[1], found[2])
    if "total_mb" not in out or "free_mb" not in out:
        return None
    return out


# ---- the evidence of one attempt ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """What the failed attempt left: the failing rank's last words' message and `memory`, its steps' peak (read by
    `records.memory_evidence.gather`)."""

    rank: int = 0
    message: Optional[str] = None
    memory: Optional[dict] = None
    steps_peak_mb: Optional[float] = None
    phase: Optional[str] = None  # where the worker was (`train`: a training step)


# ---- the estimate ------------------------------------------------------------------------------------------

_NEED_WORDS = {
    "oom": "{allocated} allocated + {tried} requested",
    "allocated": "{allocated} allocated",
    "peak": "a peak of {need}",
    "steps": "a peak of {need} in its steps",
}
_CAPACITY_WORDS = {
    "allowed": "of {capacity} allowed",
    "usable": "of {capacity} usable (free + held by PyTorch)",
    "total": "of the device's {capacity}",
}


@dataclass(frozen=True)
class Estimate:
    """need(m) ≈ weights + m · per_example (MiB), from the failure at `micro`; fits within `margin` of `capacity`."""

    micro: int
    weights_mb: float
    per_example_mb: float
    capacity_mb: float
    capacity_from: str  # allowed | usable | total
    need_mb: float  # what micro-batch `micro` needed at least
    need_from: str  # oom | allocated | peak | steps
    margin: float = MARGIN
    allocated_mb: Optional[float] = None  # the message's figures, for the words
    tried_mb: Optional[float] = None

    def need(self, micro: int) -> float:
        return self.weights_mb + micro * self.per_example_mb

    @property
    def budget_mb(self) -> float:
        return self.margin * self.capacity_mb

    def fits(self, micro: int) -> bool:
        return self.need(micro) <= self.budget_mb

    def fields(self) -> dict:
        """For remediation.json's history and the incident."""
        return {
            "micro_batch_size": self.micro,
            "weights_mb": round(self.weights_mb, 1),
            "need_mb": round(self.need_mb, 1),
            "need_from": self.need_from,
            "capacity_mb": round(self.capacity_mb, 1),
            "capacity_from": self.capacity_from,
            "per_example_mb": round(self.per_example_mb, 2),
            "margin": self.margin,
            "budget_mb": round(self.budget_mb, 1),
        }

    def words(self) -> str:
        """ "out of memory at micro-batch 16: 700 MiB allocated + 15.6 GiB requested of 4.0 GiB allowed, weights
        700 MiB → about 0.98 GiB per example"."""
        need = _NEED_WORDS[self.need_from].format(
            allocated=gib(self.allocated_mb or 0.0), tried=gib(self.tried_mb or 0.0), need=gib(self.need_mb)
        )
        capacity = _CAPACITY_WORDS[self.capacity_from].format(capacity=gib(self.capacity_mb))
        return (
            f"out of memory at micro-batch {self.micro}: {need} {capacity}, weights {gib(self.weights_mb)} → about "
            f"{gib(self.per_example_mb, fine=True)} per example"
        )


def gib(mb: float, fine: bool = False) -> str:
    """A size for words: "3.6 GiB", "0.21 GiB" (`fine`), "640 MiB"."""
    if mb >= 1024 or (fine and mb >= 102.4):
        return f"{mb / 1024:.{2 if fine else 1}f} GiB"
    return f"{mb:.1f} MiB" if mb < 10 else f"{mb:.0f} MiB"


def figure(value) -> Optional[float]:
    """A memory figure (MiB): a non-negative number, else None (a bool, NaN, a string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value < 0:
        return None
    return float(value)


def estimate(ev: Optional[Evidence], micro: int, margin: float = MARGIN) -> tuple[Optional[Estimate], str]:
    """(the estimate, "") from the evidence of a failure at micro-batch `micro`, or (None, why there is none)."""
    if ev is None:
        return None, "no evidence was read"
    if ev.phase not in (None, TRAIN_PHASE):
        return (
            None,
            f"it ran out of memory in phase '{ev.phase}', not in a training step: the micro-batch is not all of it",
        )
    mem = ev.memory or {}
    msg = parse_oom_message(ev.message)
    if not mem and msg is None:
        return None, "neither the message nor the worker gave memory figures"
    reported = mem.get("micro_batch_size")
    if reported is not None and reported != micro:
        return None, f"the worker reports micro-batch {reported}, the setting was {micro}"
    weights = figure(mem.get("weights_mb"))
    if not weights:
        return None, "no weights' share was recorded: no memory figures on this device, or the model never reached it"

    def fig(key: str) -> Optional[float]:  # the message's figure, else the worker's
        value = figure((msg or {}).get(key))
        return value if value is not None else figure(mem.get(key))

    capacities = {}
    if fig("allowed_mb"):
        capacities["allowed"] = fig("allowed_mb")
    if msg is not None and figure(msg.get("reserved_mb")) is not None:
        capacities["usable"] = msg["reserved_mb"] + msg["free_mb"]
    elif figure(mem.get("reserved_mb")) is not None and figure(mem.get("free_mb")) is not None:
        capacities["usable"] = mem["reserved_mb"] + mem["free_mb"]
    if fig("total_mb"):
        capacities["total"] = fig("total_mb")
    if not capacities:
        return None, "no capacity figure (total, free or allowed)"
    capacity_from = min(capacities, key=capacities.get)
    capacity = capacities[capacity_from]

    needs = {}
    allocated = tried = None
    if msg is not None and figure(msg.get("allocated_mb")) is not None:
        allocated, tried = msg["allocated_mb"], msg["tried_mb"]
        needs["oom"] = allocated + tried
    elif figure(mem.get("allocated_mb")) is not None:
        allocated = mem["allocated_mb"]
        needs["allocated"] = allocated
    loading = figure(mem.get("loading_peak_mb"))
    if loading is not None:  # a peak says something about training only when training set it
        peak = figure(mem.get("peak_mb"))
        if peak is not None and peak > loading:
            needs["peak"] = peak
        if ev.steps_peak_mb is not None and ev.steps_peak_mb > loading:
            needs["steps"] = ev.steps_peak_mb
    if not needs:
        return None, "no figure of what the failed step needed"
    need_from = max(needs, key=needs.get)
    need = needs[need_from]
    est = Estimate(
        micro, weights, (need - weights) / micro, capacity, capacity_from, need, need_from, margin, allocated, tried
    )
    if need <= weights:
        return None, f"inconsistent: the weights ({gib(weights)}) are not below what the step needed ({gib(need)})"
    if est.fits(micro):
        return None, (
            f"inconsistent: micro-batch {micro} would fit ({gib(need)} needed, {gib(est.budget_mb)} usable "
            f"within the margin), yet it ran out of memory"
        )
    return est, ""
