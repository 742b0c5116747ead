"""Step beats from torch's optimizer hook, with the loss the script called backward on.

Counting: torch calls every global optimizer step post-hook (`register_optimizer_step_post_hook`) after each
`optimizer.step()`, in the thread that stepped.  The first optimizer that steps is *the* optimizer: its steps
are counted on from HANGWATCH_RESUME_STEP (the step of the checkpoint this attempt resumes from) and each is
one `step` beat; another optimizer (a GAN's second one) steps uncounted, so the count is optimizer steps of
one model, not the sum.  The thread that steps it becomes the thread whose phases the other hooks follow.

lr: `param_groups[0]["lr"]` of that optimizer right after its step (what a scheduler set for the next one
is read on the next step: the lr the step used).

loss: `torch.autograd.backward` is wrapped (`Tensor.backward` calls it, looked up on the module at call time,
so one wrapper sees both spellings) to keep the last single-element tensor backward ran on; a GradScaler's
scaled loss is traced back to the unscaled one it was made from.  At the step: a CPU loss is read with
`.item()` (no device to wait for); a CUDA loss was copied at backward time, non-blocking, into a pinned host
buffer behind a CUDA event, and is reported only when that event has already completed — the hook never
synchronises the device (a sync per step would cost the run its CPU run-ahead).  Other devices: no loss.
With gradient accumulation the loss is the last micro-batch's, as the script computed it (often divided by
the accumulation steps).  A non-finite loss also beats `warn`, as the callbacks do.

Quiet: once a HangwatchCallback exists, or anyone else calls `Heartbeat.step`/`start`, the hook still counts
(the checkpoint announcements and the eval phase need the optimizer) but writes no `step` line: one source of
truth per step.

Standard library only at import; torch is touched only through what the hooks are given.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

from hangwatch.daemon.autoinstrument.context import BASE_PHASES, Context


class LossProbe:
    """The last scalar loss backward ran on, readable at the step without a device sync."""

    def __init__(self):
        self.last = None  # a CPU tensor
        self.pending = None  # (pinned host buffer, CUDA event) for a CUDA one
        self.scaled = None  # (GradScaler's output, the loss it scaled)
        self._buffers: dict = {}  # dtype → pinned host scalar
        self._events: dict = {}  # device index → CUDA event
        self._cuda = None  # torch.cuda, once a CUDA loss was seen
        self._streams: dict = {}  # device index → its current Stream, as last seen
        self._raw_stream = None  # torch._C._cuda_getCurrentStream (False where this torch has none)

    def seen(self, tensors) -> None:
        """`torch.autograd.backward(tensors, …)` is about to run (once per micro-batch: kept cheap)."""
        tensor = tensors
        if isinstance(tensors, (list, tuple)):
            if len(tensors) != 1:
                return
            tensor = tensors[0]
        numel = getattr(tensor, "numel", None)
        if numel is None or numel() != 1:
            return
        scaled = self.scaled
        if scaled is not None:
            self.scaled = None
            if scaled[0] is tensor:
                tensor = scaled[1]
        if getattr(tensor, "is_cuda", False):
            self.last = None
            self._copy_from_cuda(tensor)
        elif getattr(getattr(tensor, "device", None), "type", None) == "cpu":
            self.last, self.pending = tensor, None
        else:  # reading it would sync (XLA, MPS …): no loss
            self.last = self.pending = None

    def _copy_from_cuda(self, tensor) -> None:
        cuda = self._cuda
        if cuda is None:
            import torch  # imported long ago: a CUDA tensor exists

            cuda = self._cuda = torch.cuda
        if cuda.is_current_stream_capturing():
            self.pending = None  # no copies or events inside a CUDA graph capture
            return
        src = tensor.detach()  # the copy must not join the autograd graph
        if src.dim():
            src = src.reshape(())
        buf = self._buffers.get(src.dtype)
        if buf is None:
            import torch

            buf = self._buffers[src.dtype] = torch.empty((), dtype=src.dtype, pin_memory=True)
        index = src.get_device()
        event = self._events.get(index)
        if event is None:
            event = self._events[index] = cuda.Event()
        buf.copy_(src, non_blocking=True)  # on the current stream of the loss's device, after the forward
        event.record(self._current_stream(cuda, index))
        self.pending = (buf, event)

    def _current_stream(self, cuda, index: int):
        """`torch.cuda.current_stream(index)`, whose Stream object costs ~6 µs to build: kept per device and
        rebuilt only when the raw current-stream id changes (the script switched streams)."""
        raw = self._raw_stream
        if raw is None:
            import torch

            raw = self._raw_stream = getattr(torch._C, "_cuda_getCurrentStream", False)
        if not raw:
            return cuda.current_stream(index)
        sid = raw(index)[0]
        stream = self._streams.get(index)
        if stream is None or stream.stream_id != sid:
            stream = self._streams[index] = cuda.current_stream(index)
        return stream

    def take(self, read: bool) -> Optional[float]:
        """The loss since the last step (None when there is none, or not without waiting); forgets it."""
        last, pending = self.last, self.pending
        self.last = self.pending = self.scaled = None
        if not read:
            return None
        if last is not None:
            return float(last.item())
        if pending is not None and pending[1].query():
            return float(pending[0].item())
        return None

    def scaled_by(self, output, loss) -> None:
        """GradScaler.scale(loss) returned `output`: a backward on it is a backward on `loss`."""
        self.scaled = (output, loss)


class StepCounter:
    """The optimizer step hook (see the module docstring)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.hook = ctx.hook("optimizer step")
        self.loss_hook = ctx.hook("loss")
        self.probe = LossProbe()
        self.count = 0
        self.primary: Optional[weakref.ref] = None  # the first optimizer that stepped
        self.first_created: Optional[weakref.ref] = None  # before any step: the first one constructed
        self.on_primary: List[Callable[[], None]] = []  # told when the optimizer changes
        self.on_step: List[Callable[[], None]] = []  # told at each step of the optimizer (the thread that steps)
        self._last_t: Optional[float] = None
        self._last_phase_changes = -1
        self.handle = None
        self.loads = None  # `loads.Loads`: did the script read the checkpoint it was handed before this first step?

    @property
    def step(self) -> int:
        return self.ctx.resume_step + self.count

    def optimizer(self):
        """The optimizer that trains: the first that stepped, else the first constructed, else None."""
        for ref in (self.primary, self.first_created):
            opt = ref() if ref is not None else None
            if opt is not None:
                return opt
        return None

    # ---- installing (post-import callbacks) ---------------------------------------------------------

    def patch_optimizer_module(self, module) -> None:
        """torch.optim.optimizer: the global step hook, and the first optimizer constructed."""
        self.handle = module.register_optimizer_step_post_hook(self.after_step)
        cls = module.Optimizer
        original = cls.__init__
        counter = self

        @functools.wraps(original)
        def __init__(opt, *args, **kwargs):
            original(opt, *args, **kwargs)
            if counter.first_created is None and counter.hook.on and counter.ctx.active:
                try:
                    counter.first_created = weakref.ref(opt)
                    counter._changed()
                except Exception as exc:
                    counter.ctx.failed(counter.hook, exc)

        __init__.__hangwatch_original__ = original
        cls.__init__ = __init__

    def patch_autograd(self, module) -> None:
        """torch.autograd: `backward`, through which `Tensor.backward` goes too."""
        original = module.backward
        probe, hook, ctx = self.probe, self.loss_hook, self.ctx

        @functools.wraps(original)
        def backward(tensors, *args, **kwargs):
            if hook.on and ctx.active:
                try:
                    probe.seen(tensors)
                except Exception as exc:
                    ctx.failed(hook, exc)
            return original(tensors, *args, **kwargs)

        backward.__hangwatch_original__ = original
        module.backward = backward

    def patch_grad_scaler(self, module) -> None:
        """torch.amp.grad_scaler: remember which loss a scaled loss came from."""
        cls = module.GradScaler
        original = cls.__dict__.get("scale")
        if original is None:
            return  # torch >= 2.3's torch.cuda.amp.GradScaler: inherits the torch.amp one, wrapped already
        probe, hook, ctx = self.probe, self.loss_hook, self.ctx

        @functools.wraps(original)
        def scale(scaler, outputs, *args, **kwargs):
            result = original(scaler, outputs, *args, **kwargs)
            if hook.on and ctx.active:
                try:
                    if result is not outputs and getattr(outputs, "numel", None) is not None and outputs.numel() == 1:
                        probe.scaled_by(result, outputs)
                except Exception as exc:
                    ctx.failed(hook, exc)
            return result

        scale.__hangwatch_original__ = original
        cls.scale = scale

    # ---- the hook -----------------------------------------------------------------------------------

    def after_step(self, optimizer, args, kwargs) -> None:
        """torch's global optimizer step post-hook: runs in the thread that stepped."""
        if not self.hook.on or not self.ctx.active:
            return
        try:
            self._stepped(optimizer)
        except Exception as exc:
            self.ctx.failed(self.hook, exc)

    def _stepped(self, optimizer) -> None:
        primary = self.primary() if self.primary is not None else None
        if primary is None:  # the first step, or the optimizer that trained is gone (a second training stage)
            self.primary = weakref.ref(optimizer)
            self.ctx.train_thread = threading.get_ident()
            self._changed()
        elif primary is not optimizer:
            return
        self.count += 1
        for tell in self.on_step:
            tell()
        ctx, hb = self.ctx, self.ctx.hb
        quiet = ctx.steps_elsewhere() or not ctx.usable()
        if self.count == 1 and self.loads is not None and self.loads.first_step() and not quiet:
            self._not_resumed()
        loss = None
        if self.loss_hook.on:
            try:
                loss = self.probe.take(read=not quiet)
            except Exception as exc:
                ctx.failed(self.loss_hook, exc)
        if quiet:
            self._last_t = None
            return
        if hb.current_phase in BASE_PHASES and hb.current_phase != "train":
            ctx.enter_phase("train")
        now = time.perf_counter()
        metrics: dict = {}
        if loss is not None:
            metrics["loss"] = loss
        lr = current_lr(optimizer)
        if lr is not None:
            metrics["lr"] = lr
        if self._last_t is not None and self._last_phase_changes == hb.phase_changes:
            metrics["step_time_s"] = round(now - self._last_t, 6)
        step = self.step
        hb._step(step, **metrics)
        self._last_t = now
        self._last_phase_changes = hb.phase_changes
        if loss is not None and not math.isfinite(loss):
            hb.warn("non-finite loss (%s) at step %d" % (loss, step), loss=loss)

    def _not_resumed(self) -> None:
        """The script's first step came without a read of the checkpoint it was handed: it started again from
        scratch, so its steps are its own — counted from 0, not from the checkpoint's step — and the supervisor
        hears why (one `warn` with `resume_ignored`)."""
        ctx = self.ctx
        handed = ctx.resume_step
        ctx.resume_step = 0
        ctx.hb.warn(
            (
                "the script did not resume from the checkpoint it was given (%s, step %d): nothing of it was read "
                "before its first optimizer step, so it started again from its step 1; set worker.resume_args, or "
                "read HANGWATCH_RESUME_FROM in the script"
            )
            % (ctx.resume_from, handed),
            resume_ignored=True,
            resume_from=ctx.resume_from,
            resume_step=handed,
        )

    def _changed(self) -> None:
        for tell in self.on_primary:
            tell()


def current_lr(optimizer) -> Optional[float]:
    """lr of the first parameter group, as a float; None when it cannot be read without a device sync."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    lr: Any = groups[0].get("lr")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        return float(lr)
    device = getattr(lr, "device", None)
    if device is not None and getattr(device, "type", None) == "cpu" and lr.numel() == 1:
        return float(lr.item())
    return None


__all__ = ["StepCounter", "LossProbe", "current_lr"]
