"""The world this worker is one rank of: one process (the default), or one of the ranks torchrun started.

`World` is the world of one: every collective is the identity and nothing is wrapped, so a worker
started on its own runs exactly the code it always ran.  `TorchWorld` is a rank under torchrun
(`WORLD_SIZE` > 1 in the environment): it joins the process group (gloo on CPU, NCCL on CUDA with
the local rank's device), wraps the model in DistributedDataParallel and does the few collectives
the trainer needs, each named for what it is for:

    sum(values)          per-rank partial sums → the world's, added in rank order (losses, token counts)
    any(flag)            does any rank say so (a stop request reached some ranks only)
    gather(obj)          every rank's object on rank 0 (what a checkpoint keeps of each rank)
    broadcast(obj)       rank 0's object on every rank (which checkpoint to resume)
    on_main(hb, fn)      fn on rank 0 only (generate, the checkpoint write, the export) while the
                         others wait for it in a phase of their own, `wait`

Torch is imported lazily: `world_size_from_env` runs before the worker's `start` beat.

Exactness: a gradient is the sum of the ranks' gradients, added in rank order by our own DDP comm
hook on gloo.  gloo's ring all-reduce adds each element in an order set by its offset in DDP's
bucket, and DDP rebuilds its buckets after the first iteration of every process, so a resumed
attempt would add its first step's gradients in another order than the uninterrupted run did at the
same step (different bits from three ranks on).  Gathering the buckets and adding them in rank order
makes the sum independent of the layout.  On NCCL (where bitwise exactness is not promised) the comm
hook is a plain all-reduce.  Neither divides by the world size: the trainer's loss is already
normalised by the label tokens of the whole world's step.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, TypeVar

T = TypeVar("T")

WAIT_PHASE = "wait"
WAIT_POLL_S = 0.01  # how often a waiting rank looks whether rank 0 is done
WAIT_PROGRESS_EVERY_S = 5.0  # a waiting rank is alive: `progress` beats (never steps) while it waits
# Long enough for rank 0's longest rank-0-only phase (a generate, a checkpoint of a large model); a
# rank that waits longer than the supervisor's deadlines is killed by it well before this fires.
COLLECTIVE_TIMEOUT = timedelta(hours=2)


def world_size_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    """WORLD_SIZE as torchrun sets it; 1 when absent (a worker started on its own)."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE", "1")
    try:
        size = int(raw)
    except ValueError:
        from hangwatch.common.config import ConfigError

        raise ConfigError([f"WORLD_SIZE={raw!r} in the environment is not a whole number"]) from None
    if size < 1:
        from hangwatch.common.config import ConfigError

        raise ConfigError([f"WORLD_SIZE={size} in the environment: a world has at least one rank"])
    return size


def ordered_sum(parts: list) -> Any:
    """parts[0] + parts[1] + … in rank order (tensors or floats): the same bits whatever the layout."""
    total = parts[0].clone() if hasattr(parts[0], "clone") else parts[0]
    for p in parts[1:]:
        total += p  # in place on a tensor (the clone), a new float otherwise
    return total


class World:
    """The world of one process: collectives are the identity, the model is not wrapped."""

    rank = 0
    size = 1
    local_rank = 0
    backend: Optional[str] = None  # no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model):
        """The module forward and backward go through (DDP under torchrun)."""
        return model

    def no_sync(self, module) -> contextlib.AbstractContextManager:
        """Accumulate gradients locally (a non-final micro-step): no gradient exchange."""
        return contextlib.nullcontext()

    def sum(self, values: list[float]) -> list[float]:
        return list(values)

    def any(self, flag: bool) -> bool:
        return bool(flag)

    def gather(self, obj: Any) -> Optional[list]:
        return [obj]

    def broadcast(self, obj: T) -> T:
        return obj

    def on_main(self, hb, what: str, fn: Callable[[], T]) -> Optional[T]:
        return fn()

    def close(self) -> None:
        pass


class TorchWorld(World):
    """One rank of a torchrun job: the env:// rendezvous, from the variables torchrun sets in this
    process's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)."""

    def __init__(
        self, device, *, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ):
        import torch
        import torch.distributed as dist

        env = os.environ  # init_process_group reads it too: one source for both
        self.rank = int(env["RANK"])
        self.size = int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        self.device = device
        self._clock = clock
        self._sleep = sleep
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if self.backend == "nccl":
            if self.local_rank >= torch.cuda.device_count():
                from hangwatch.common.config import ConfigError

                raise ConfigError(
                    [
                        f"worker.nproc_per_node: local rank {self.local_rank} has no GPU of its own "
                        f"(torch sees {torch.cuda.device_count()}); NCCL needs one GPU per rank"
                    ]
                )
            torch.cuda.set_device(self.local_rank)
        dist.init_process_group(self.backend, timeout=COLLECTIVE_TIMEOUT)
        # Objects and small sums travel on the CPU: a gloo group beside NCCL's (none needed on gloo).
        self.cpu_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if self.backend == "nccl" else None
        self._dist = dist
        self._torch = torch

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        params = inspect.signature(DDP).parameters
        # Buffers (rotary frequencies) are computed alike on every rank: no broadcast before each forward.
        quiet = {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        device_ids = [self.local_rank] if self.backend == "nccl" else None
        # find_unused_parameters stays off: every trainable parameter (LoRA, modules_to_save, the extra
        # head, which the loss uses after the forward) gets its gradient in every backward.
        ddp = DDP(model, device_ids=device_ids, find_unused_parameters=False, **quiet)
        ddp.register_comm_hook(None, self._ordered_sum_hook if self.backend == "gloo" else _sum_hook)
        return ddp

    def _ordered_sum_hook(self, state, bucket):
        buf = bucket.buffer()
        parts = [self._torch.empty_like(buf) for _ in range(self.size)]
        fut = self._dist.all_gather(parts, buf, async_op=True).get_future()
        return fut.then(lambda _: ordered_sum(parts))

    def no_sync(self, module):
        return module.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        torch = self._torch
        mine = torch.tensor([float(v) for v in values], dtype=torch.float64)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._dist.all_gather(parts, mine, group=self.cpu_group)
        return [float(x) for x in ordered_sum(parts)]

    def any(self, flag: bool) -> bool:
        t = self._torch.tensor([1 if flag else 0], dtype=self._torch.int32)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.MAX, group=self.cpu_group)
        return bool(t.item())

    def gather(self, obj: Any) -> Optional[list]:
        out = [None] * self.size if self.is_main else None
        self._dist.gather_object(obj, out, dst=0, group=self.cpu_group)
        return out

    def broadcast(self, obj: T) -> T:
        box = [obj if self.is_main else None]
        self._dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def on_main(self, hb, what: str, fn: Callable[[], T]) -> Optional[T]:
        """`fn` on rank 0; the other ranks wait at a barrier in phase `wait`, beating `progress` while
        they wait, so that a rank-0-only phase that hangs names rank 0 and shows the others waiting."""
        if self.is_main:
            result = fn()
            self._dist.barrier(group=self.cpu_group)
            return result
        with hb.phase(WAIT_PHASE, waiting_for=f"rank 0: {what}"):
            work = self._dist.barrier(group=self.cpu_group, async_op=True)
            wait_beating(
                work.is_completed,
                lambda: hb.progress(note=f"waiting for rank 0: {what}"),
                clock=self._clock,
                sleep=self._sleep,
            )
            work.wait()  # raises if the barrier failed (a rank died)
        return None

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def wait_beating(
    done: Callable[[], bool],
    beat: Callable[[], Any],
    *,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    every_s: float = WAIT_PROGRESS_EVERY_S,
    poll_s: float = WAIT_POLL_S,
) -> int:
    """Poll `done()` until it is true, calling `beat()` every `every_s` meanwhile (from this thread: the
    one that waits); returns how many beats it made."""
    beats = 0
    beat_at = clock() + every_s
    while not done():
        if clock() >= beat_at:
            beat()
            beats += 1
            beat_at = clock() + every_s
        sleep(poll_s)
    return beats


def _sum_hook(state, bucket):
    """NCCL: the sum of the ranks' gradients (no division: the loss is normalised over the world's step)."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda fut: fut.value()[0])


def open_world(device) -> World:
    """The world of this process: a TorchWorld when torchrun started it with WORLD_SIZE > 1."""
    if world_size_from_env() > 1:
        return TorchWorld(device)
    return World()
