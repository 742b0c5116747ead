"""The `eval` and `generate` phases of an unedited script.

eval: `torch.nn.Module.train` is wrapped (`eval()` calls `train(False)`).  When *the trained model* — a
module holding a parameter of the optimizer that trains (`StepCounter.optimizer()`) — goes to eval mode, the
rank enters `eval` (the eval budget applies, no step deadline); back in train mode it returns to the phase it
left: `train`, or `load` for an eval before the first step.
Only the outermost call counts (`train()` recurses into every child module through the same method), the
answer "is this the trained model" is cached per module, and the common call — `model.train()` every step
while no eval is open — returns after two attribute reads.  Only the thread that trains moves the phase.
A script that trains in eval mode (dropout off: `model.eval()` once, then steps) would otherwise spend its
run in `eval`: a step of the optimizer while our eval is open closes it, and after the second such step the
eval detection stays off.  While a callback drives phases (HangwatchCallback between its start and end), or
the script its own heartbeat, the hook leaves the phase alone.

generate: `GenerationMixin.generate` is wrapped for every model through `GenerateWatch` (the `generate` phase
with its budget, a `progress` beat every 8 new tokens carrying the longest gap between them: the supervisor's token
deadline).  A call already watched — a HangwatchCallback's or the
script's own GenerateWatch on the instance, `PeftModel.generate` → the base model's — is one phase, not two.

Standard library only at import.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Optional

from hangwatch.daemon.autoinstrument.context import BASE_PHASES, Context
from hangwatch.daemon.autoinstrument.steps import StepCounter

CACHE_LIMIT = 1024  # modules remembered; past it the cache starts afresh (ids of dead modules are reused)
TRAINED_IN_EVAL_LIMIT = 2  # optimizer steps taken while our eval was open before eval detection gives up
PROGRESS_EVERY = 8


class EvalPhase:
    def __init__(self, ctx: Context, steps: StepCounter):
        self.ctx = ctx
        self.steps = steps
        self.hook = ctx.hook("eval phase")
        self.entered: Optional[tuple] = None  # (phase, budget) we left for eval, while our eval is open
        self.nested = False  # inside an outermost train() of the training thread
        self.trained_in_eval = 0
        self._cache: dict = {}  # id(module) → (weakref to it, holds a trained parameter)
        self._ids: Optional[tuple] = None  # (weakref to the optimizer, ids of its parameters)
        steps.on_primary.append(self._forget)
        steps.on_step.append(self.stepped)

    def patch(self, module) -> None:
        """torch.nn.modules.module: Module.train."""
        cls = module.Module
        original = cls.train
        phase = self

        @functools.wraps(original)
        def train(this, mode=True):
            if phase.nested or not phase.hook.on or threading.get_ident() != phase.ctx.train_thread:
                return original(this, mode)
            phase.nested = True
            try:
                result = original(this, mode)
            finally:
                phase.nested = False
            if mode and phase.entered is None:
                return result  # training on, no eval of ours open: the every-step call ends here
            try:
                phase.switched(this, bool(mode))
            except Exception as exc:
                phase.ctx.failed(phase.hook, exc)
            return result

        train.__hangwatch_original__ = original
        cls.train = train

    def switched(self, module, training: bool) -> None:
        ctx = self.ctx
        if not ctx.usable() or ctx.phases_elsewhere() or not self.trained(module):
            return
        hb = ctx.hb
        if not training:
            if self.entered is None and hb.current_phase in BASE_PHASES:
                self.entered = (hb.current_phase, hb.current_budget_s)
                ctx.enter_phase("eval")
        elif self.entered is not None:
            back, self.entered = self.entered, None
            if hb.current_phase == "eval":
                ctx.enter_phase(back[0], back[1])  # `train`; `load` when the eval came before the first step

    def stepped(self) -> None:
        """The optimizer stepped (in the training thread): an eval of ours still open is no eval."""
        if self.entered is None:
            return
        self.entered = None
        self.trained_in_eval += 1
        hb = self.ctx.hb
        if hb.current_phase == "eval" and self.ctx.usable():
            self.ctx.enter_phase("train")
        if self.trained_in_eval >= TRAINED_IN_EVAL_LIMIT:
            self.hook.on = False  # the script trains in eval mode: not an error, nothing to report

    def trained(self, module) -> bool:
        """Whether `module` holds a parameter of the optimizer that trains (cached per module)."""
        opt = self.steps.optimizer()
        if opt is None:
            return False
        if self._ids is None or self._ids[0]() is not opt:
            self._ids = (weakref.ref(opt), frozenset(id(p) for g in opt.param_groups for p in g["params"]))
            self._cache.clear()
        entry = self._cache.get(id(module))
        if entry is not None and entry[0]() is module:
            return entry[1]
        ids = self._ids[1]
        answer = any(id(p) in ids for p in module.parameters())
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        try:
            self._cache[id(module)] = (weakref.ref(module), answer)
        except TypeError:
            pass  # not weakly referenceable: asked again next time
        return answer

    def _forget(self) -> None:
        self._ids = None
        self._cache.clear()


class GeneratePhase:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.hook = ctx.hook("generate phase")
        self.watch = None

    def patch(self, module) -> None:
        """transformers.generation.utils: GenerationMixin.generate."""
        from hangwatch.daemon.integrations import generation

        cls = module.GenerationMixin
        original = cls.__dict__["generate"]
        ctx, hook = self.ctx, self.hook
        watch = self.watch = generation.GenerateWatch(
            ctx.hb, budget_s=None, progress_every=PROGRESS_EVERY, on_error=lambda exc: ctx.failed(hook, exc)
        )
        generating = generation.generating

        @functools.wraps(original)
        def generate(this, *args, **kwargs):
            if (
                not hook.on
                or generating()
                or not ctx.usable()
                or ctx.manual()
                or threading.get_ident() != ctx.train_thread
            ):
                return original(this, *args, **kwargs)
            return watch.call(functools.partial(original, this), args, kwargs, True)

        generate.__hangwatch_original__ = original
        cls.generate = generate


__all__ = ["EvalPhase", "GeneratePhase"]
