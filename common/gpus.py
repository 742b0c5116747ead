"""The GPUs a worker will see: NVML's count on this machine, narrowed by CUDA_VISIBLE_DEVICES of the worker's
environment (the supervisor's with `worker.env` over it), read as CUDA reads it — and whether the built-in
worker's ranks then each get one (NCCL, which the built-in worker uses on CUDA, needs a GPU per rank).

CUDA_VISIBLE_DEVICES, as CUDA reads it: comma-separated entries, each a device index, a `GPU-<uuid>` (or a
unique prefix of one) or a `MIG-<uuid>`; the list ends at the first entry that names no device (an index out of
range, `-1`, an unknown or ambiguous UUID, a device already listed), so `""` and `-1` leave none visible and
`0,-1,1` leaves one.  A MIG instance is not among NVML's devices: it counts as one, unchecked.

No NVML (no driver, no library, an init error) means nothing is known: nothing is refused.  The NVML reader is
the seam (`nvml_uuids`); the rest is pure.  pynvml is imported only when asked: the standard library otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

ENV = "CUDA_VISIBLE_DEVICES"


def nvml_uuids() -> Optional[list[str]]:
    """The UUIDs of the GPUs NVML sees on this machine, in its index order ("" where a UUID cannot be read: the
    count still stands); None without NVML."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # pynvml raises NVMLError subclasses: no library, no driver, driver/library mismatch, …
        return None
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            except Exception:
                uuid = ""
            out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return out
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()  # reference-counted: another user of NVML in this process keeps its own
        except Exception:
            pass


def visible_count(value: Optional[str], uuids: Sequence[str]) -> int:
    """How many of the machine's GPUs (`uuids`, NVML's) a CUDA_VISIBLE_DEVICES value leaves visible (None: not set,
    all of them)."""
    if value is None:
        return len(uuids)
    seen: set = set()
    for entry in value.split(","):
        device = _device(entry.strip(), uuids)
        if device is None or device in seen:
            break
        seen.add(device)
    return len(seen)


def _device(entry: str, uuids: Sequence[str]):
    """The device an entry names (its NVML index, or the MIG entry itself), or None: it names none."""
    if entry.startswith("MIG-"):
        return entry
    if entry.startswith("GPU-"):
        hits = [i for i, u in enumerate(uuids) if u and u.startswith(entry)]
        return hits[0] if len(hits) == 1 else None
    try:
        index = int(entry)
    except ValueError:
        return None
    return index if 0 <= index < len(uuids) else None


@dataclass(frozen=True)
class WorkerGpus:
    visible: int  # GPUs the worker sees
    machine: int  # GPUs NVML counts on this machine
    value: Optional[str]  # the worker's CUDA_VISIBLE_DEVICES (None: not set)
    source: str  # where it comes from: "worker.env", "the environment" or "" (not set)

    def where(self) -> str:
        """`CUDA_VISIBLE_DEVICES=0 in worker.env; NVML counts 4 on this machine`."""
        if self.value is None:
            env = f"{ENV} not set"
        else:
            shown = self.value if self.value and self.value.strip() == self.value else repr(self.value)
            env = f"{ENV}={shown} in {self.source}"
        return f"{env}; NVML counts {self.machine} on this machine"


def worker_gpus(
    environ: Mapping[str, str], worker_env: Mapping[str, str], uuids: Optional[Sequence[str]]
) -> Optional[WorkerGpus]:
    """The GPUs the worker will see (`environ`: the supervisor's; `worker_env`: the config's `worker.env`, which
    wins); None without NVML (`uuids` None)."""
    if uuids is None:
        return None
    if ENV in worker_env:
        value, source = worker_env[ENV], "worker.env"
    elif ENV in environ:
        value, source = environ[ENV], "the environment"
    else:
        value, source = None, ""
    return WorkerGpus(visible_count(value, uuids), len(uuids), value, source)


class Placement(NamedTuple):
    """Why the built-in worker's ranks cannot each have a GPU: the key at fault, what is wrong, the fix."""

    key: tuple
    problem: str
    fix: str

    def text(self) -> str:
        return f"{self.problem}; {self.fix}"


def placement_problem(device: str, nproc: int, gpus: Optional[WorkerGpus]) -> Optional[Placement]:
    """What stops the built-in worker's ranks from each having a GPU of their own; None when they can, when they run
    on the CPU (`cpu`, or `auto` with no GPU visible: gloo), or when nothing is known (no NVML)."""
    if gpus is None or device == "cpu":
        return None
    if gpus.visible == 0:
        if device == "auto":
            return None
        return Placement(
            ("model", "device"),
            f"cuda, but the worker sees no GPU ({gpus.where()})",
            "set model.device: cpu (or auto), or make a GPU visible",
        )
    if nproc > gpus.visible:
        plural = "" if gpus.visible == 1 else "s"
        return Placement(
            ("worker", "nproc_per_node"),
            f"{nproc}, but the worker sees {gpus.visible} GPU{plural} ({gpus.where()}): NCCL needs one GPU per rank",
            f"set worker.nproc_per_node: {gpus.visible} or make more GPUs visible",
        )
    return None
