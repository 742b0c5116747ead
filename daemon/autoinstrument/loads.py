"""Whether the script resumed from the checkpoint it was handed, seen by what it reads before its first step.

After a failure the supervisor hands each attempt the last good checkpoint (HANGWATCH_RESUME_FROM, with its step in
HANGWATCH_RESUME_STEP), and the step hook counts on from that step.  A plain script that never reads it starts again
from its step 1 — and counted on from the checkpoint's step, its steps and checkpoints would be labelled with steps
it never reached.  So, while nothing has stepped yet, every read of a file is checked against the checkpoint's path
(the file itself, or anything inside the directory): `torch.load`, safetensors' `load_file`/`load_model`/
`safe_open`, and Python's `open` (pickle, numpy, json and the like read through it).  At the first optimizer step a
script that read nothing of it did not resume: its steps are counted from 0 (its own), and one `warn` beat with
`resume_ignored` says so — the supervisor records it and points at `worker.resume_args`.  The wrappers cost a path
comparison per read and are taken off at the first step (`open`), or do nothing once it has passed.  The HF and
Lightning Trainers, which are handed the checkpoint themselves (`frameworks.py`), read it through these too.

Standard library only at import.
"""

from __future__ import annotations

import builtins
import functools
import io
import os
from typing import Any, Optional

from hangwatch.daemon.autoinstrument.context import Context


class Loads:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.hook = ctx.hook("resume check")
        self.root: Optional[str] = None
        if ctx.resume_from and ctx.resume_step > 0:
            try:
                self.root = os.path.realpath(ctx.resume_from)
            except (OSError, ValueError):
                self.root = None
        self.read = False  # something of the checkpoint was read before the first step
        self.decided = False
        self._open = None  # builtins.open as it was, while ours is in place
        self._ours = None

    @property
    def watching(self) -> bool:
        return self.root is not None and not self.decided and self.hook.on and self.ctx.active

    def saw(self, path: Any) -> None:
        """A file is about to be read: is it (inside) the checkpoint?"""
        if not self.watching or self.read:
            return
        try:
            if isinstance(path, (str, bytes, os.PathLike)):
                p = os.path.realpath(os.fsdecode(path))
                self.read = p == self.root or p.startswith(self.root + os.sep)
        except Exception as exc:
            self.ctx.failed(self.hook, exc)

    # ---- installing

    def install_open(self) -> None:
        """Python's `open` (and io.open, the same function), until the first step."""
        if self.root is None:
            return
        original = builtins.open
        loads = self

        @functools.wraps(original)
        def open(file, mode="r", *args, **kwargs):
            if loads.watching and isinstance(mode, str) and "r" in mode and "+" not in mode:
                loads.saw(file)
            return original(file, mode, *args, **kwargs)

        self._open, self._ours = original, open
        builtins.open = open
        io.open = open

    def _wrap(self, original, position: int, name: str):
        loads = self

        @functools.wraps(original)
        def read(*args, **kwargs):
            if loads.watching:
                loads.saw(kwargs.get(name, args[position] if len(args) > position else None))
            return original(*args, **kwargs)

        read.__hangwatch_original__ = original
        return read

    def patch_torch_load(self, module) -> None:
        """torch.serialization.load (torch/__init__ binds `torch.load` to it right after this runs)."""
        import sys

        original = module.load
        module.load = self._wrap(original, 0, "f")
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch, "load", None) is original:
            torch.load = module.load

    def patch_safetensors(self, module) -> None:
        """safetensors.torch: load_file(filename), load_model(model, filename)."""
        for name, position, keyword in (("load_file", 0, "filename"), ("load_model", 1, "filename")):
            original = getattr(module, name, None)
            if callable(original):
                setattr(module, name, self._wrap(original, position, keyword))

    def patch_safe_open(self, module) -> None:
        """safetensors.safe_open(filename, framework): what transformers reads weights with."""
        original = getattr(module, "safe_open", None)
        if callable(original):
            module.safe_open = self._wrap(original, 0, "filename")

    # ---- the first step

    def first_step(self) -> bool:
        """The first optimizer step: True when the script did not resume (nothing of the checkpoint was read)."""
        if self.decided or self.root is None:
            return False
        self.decided = True
        if self._ours is not None and builtins.open is self._ours:  # never undo a wrapper someone put on top
            builtins.open = self._open
            io.open = self._open
        return not self.read and self.hook.on and self.ctx.active
