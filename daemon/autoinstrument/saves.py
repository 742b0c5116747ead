"""The `checkpoint` phase around a save, and the `checkpoint` beat that announces what was saved.

Wrapped: `torch.save`, `safetensors.torch.save_file` / `save_model`, `PreTrainedModel.save_pretrained`,
peft's `PeftModel.save_pretrained`, accelerate's `Accelerator.save_state` / `save_model`, Lightning Fabric's
`Fabric.save`, and (frameworks.py) the HF Trainer's `_save_checkpoint` and Lightning's
`Trainer.save_checkpoint`.  Saves nest — `_save_checkpoint` → `save_pretrained` → `save_file`, then
`torch.save` of the optimizer — so only the OUTERMOST save of a thread counts: it puts the rank in `checkpoint`
for its length (the training thread only: a background thread that saves must not move the training thread's
phase), and once it has returned without an error announces its path — absolute, a URL as it is — at the
heartbeat's current step (good=False: the supervisor confirms it from the finite steps that follow, and hands
the last good one to the next attempt).  A save into a file object is in the phase but announced by nobody (no
path to resume from; the script may rename it into place after); a save into memory (`io.BytesIO`) is no save
at all.  The Trainer's and Lightning's saves are announced by their HangwatchCallback (which hangwatch adds to
every Trainer): not twice.  `save_pretrained(is_main_process=False)` writes nothing and announces nothing.

Standard library only at import.
"""

from __future__ import annotations

import functools
import io
import os
import sys
import threading
from typing import Any, Callable, Optional

from hangwatch.daemon.autoinstrument.context import Context, Hook

SKIP = object()  # "not a save": call through without a phase or an announcement
RESULT = object()  # "the path is what the save returns" (Accelerator.save_state's automatic naming)


class Saves:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self._local = threading.local()  # .depth: saves of this thread in progress

    def depth(self) -> int:
        return getattr(self._local, "depth", 0)

    # ---- the one wrapper ------------------------------------------------------------------------

    def bracket(self, hook: Hook, original: Callable, target: Callable[[tuple, dict], Any]) -> Callable:
        """`original` (a save) wrapped: `target(args, kwargs)` says what it saves — a path to announce, None for
        a save with nothing to announce, SKIP for no save at all."""
        saves, ctx = self, self.ctx

        @functools.wraps(original)
        def save(*args, **kwargs):
            if not hook.on or not ctx.active or saves.depth():
                return original(*args, **kwargs)
            opened = saves._open(hook, target, args, kwargs)
            saves._local.depth = 1
            try:
                result = original(*args, **kwargs)
            except BaseException:
                saves._local.depth = 0
                saves._close(hook, opened, announce=False)
                raise
            saves._local.depth = 0
            saves._close(hook, opened, announce=True, result=result)
            return result

        save.__hangwatch_original__ = original
        return save

    def _open(self, hook: Hook, target, args: tuple, kwargs: dict) -> Optional[tuple]:
        """(path to announce or None, phase to go back to or None), or None when this is no save."""
        ctx = self.ctx
        try:
            path = target(args, kwargs)
            if path is SKIP or not ctx.usable() or ctx.manual():
                return None
            hb = ctx.hb
            back = None
            if ctx.in_train_thread() and hb.current_phase != "checkpoint":
                back = (hb.current_phase, hb.current_budget_s)
                ctx.enter_phase("checkpoint")
            return path, back
        except Exception as exc:
            ctx.failed(hook, exc)
            return None

    def _close(self, hook: Hook, opened: Optional[tuple], announce: bool, result: Any = None) -> None:
        if opened is None:
            return
        path, back = opened
        ctx = self.ctx
        try:
            if path is RESULT:
                path = file_target(result) if isinstance(result, (str, os.PathLike)) else None
            hb = ctx.hb
            if hb.closed:
                return
            if back is not None and hb.current_phase == "checkpoint":
                hb.enter_phase(back[0], back[1])
            if announce and path is not None and ctx.usable():
                hb.checkpoint(path, hb.current_step, good=False, saved_by=hook.name)
        except Exception as exc:
            ctx.failed(hook, exc)

    # ---- the wrapped functions (post-import callbacks) ----------------------------------------------

    def patch_torch_save(self, module) -> None:
        """torch.serialization.save (torch/__init__ binds `torch.save` to it right after this runs)."""
        original = module.save
        wrapper = self.bracket(self.ctx.hook("torch.save"), original, lambda a, k: file_target(_arg(a, k, 1, "f")))
        module.save = wrapper
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch, "save", None) is original:  # torch was imported before hangwatch
            torch.save = wrapper

    def patch_safetensors(self, module) -> None:
        """safetensors.torch: save_file(tensors, filename), save_model(model, filename) — patched before
        transformers and peft bind them at their own import."""
        hook = self.ctx.hook("safetensors save")
        for name in ("save_file", "save_model"):
            original = getattr(module, name, None)
            if callable(original):
                setattr(module, name, self.bracket(hook, original, lambda a, k: file_target(_arg(a, k, 1, "filename"))))

    def patch_save_pretrained(self, cls, hook_name: str, main_position: Optional[int]) -> None:
        """`cls.save_pretrained(self, save_directory, …, is_main_process=True, …)`."""
        original = cls.__dict__["save_pretrained"]

        def target(a: tuple, k: dict):
            main = (
                _arg(a, k, main_position, "is_main_process", True) if main_position else k.get("is_main_process", True)
            )
            if not main:
                return None
            return file_target(_arg(a, k, 1, "save_directory"))

        cls.save_pretrained = self.bracket(self.ctx.hook(hook_name), original, target)

    def patch_modeling_utils(self, module) -> None:
        self.patch_save_pretrained(module.PreTrainedModel, "save_pretrained", 2)

    def patch_accelerate(self, module) -> None:
        """accelerate.accelerator: `Accelerator.save_state` (model, optimizer, scheduler, RNG: one directory, announced
        as one checkpoint) and `save_model`; the files inside are nested saves.  The main process announces."""
        cls = module.Accelerator

        def state_target(a: tuple, k: dict):
            if not getattr(a[0], "is_main_process", True):
                return None
            out = _arg(a, k, 1, "output_dir")
            return RESULT if out is None else file_target(out)  # None: automatic naming, returned by the call

        def model_target(a: tuple, k: dict):
            return file_target(_arg(a, k, 2, "save_directory")) if getattr(a[0], "is_main_process", True) else None

        hook = self.ctx.hook("accelerate save")
        cls.save_state = self.bracket(hook, cls.__dict__["save_state"], state_target)
        cls.save_model = self.bracket(hook, cls.__dict__["save_model"], model_target)

    def patch_fabric(self, module) -> None:
        """lightning.fabric.fabric: `Fabric.save(path, state)` (its checkpoint IO writes through a BytesIO, which is
        no announcement by itself).  Global rank 0 announces."""
        cls = module.Fabric

        def target(a: tuple, k: dict):
            return file_target(_arg(a, k, 1, "path")) if getattr(a[0], "is_global_zero", True) else None

        cls.save = self.bracket(self.ctx.hook("Fabric save"), cls.__dict__["save"], target)

    def patch_peft(self, module) -> None:
        # PeftModel.save_pretrained(self, save_directory, safe_serialization, selected_adapters, save_embedding_layers,
        # is_main_process, …): is_main_process is keyword in practice; only the keyword is read.
        self.patch_save_pretrained(module.PeftModel, "peft save_pretrained", None)


def file_target(f) -> Any:
    """What a save into `f` announces: the absolute path of a path (a URL as it is), None for a file object,
    SKIP for memory."""
    if isinstance(f, (io.BytesIO, io.StringIO)):
        return SKIP
    if isinstance(f, (str, bytes, os.PathLike)):
        path = os.fsdecode(os.fspath(f))
        return path if "://" in path else os.path.abspath(path)
    return None


def _arg(args: tuple, kwargs: dict, position: Optional[int], name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    if position is not None and len(args) > position:
        return args[position]
    return default


__all__ = ["Saves", "SKIP", "RESULT", "file_target"]
