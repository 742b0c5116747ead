"""The `generate` phase wherever `model.generate` runs: a phase with a budget, and `progress` beats every N new tokens.

    watch = GenerateWatch(hb, budget_s=None, progress_every=8)
    watch.install(model)      # model and every submodule whose `generate` is callable
    ...                       # model.generate(...) anywhere: eval callbacks, GRPO rollouts, the user's own code
    watch.uninstall()

A `generate()` that never returns (EOS suppressed, a huge `max_new_tokens`) looks like progress to nothing
else: no optimizer step, no eval batch.  Inside `generate` the phase has its own budget (`budget_s`, or the
supervisor's `watchdog.phase_budgets_s["generate"]` when None), and a stopping criterion added to the call
beats `progress` every `progress_every` new tokens: proof of liveness (the silence deadline), never of
progress, so the phase budget still fires on a generation that runs forever.  The criterion never stops
anything: it returns "not done" for every row, and it is merged with the caller's `stopping_criteria`, never
replacing them.  It runs in the generating thread, once per decoding step, so the beats stop exactly when
generation stops advancing (no timer thread: a timer would hide the hang).

Re-entrant calls — `PeftModel.generate` → the base model's `generate`, a LightningModule's own `generate`
calling its transformer's — make one phase, not two: the outermost watched call owns the phase, and the
first inner call that takes a `stopping_criteria` argument carries the criterion.

How `generate` is wrapped: the method is replaced on the instance's class by a dispatcher that looks the
instance up in a weak registry, so only installed instances are watched (another instance of the same class
runs the original), and copies of a model (`copy.deepcopy`, pickling) carry nothing of hangwatch.  A
`generate` set on the instance itself (monkeypatched by someone else) is wrapped on the instance.
`uninstall` puts every attribute back the way it was.
"""
from __future__ import annotations

import functools
import inspect
import threading
import weakref
from typing import Any, Callable, Optional

_lock = threading.RLock()
_owners: "weakref.WeakKeyDictionary[Any, GenerateWatch]" = weakref.WeakKeyDictionary()  # watched instance → its watch
_patched: dict[type, "_ClassPatch"] = {}
_local = threading.local()  # .active: the criterion of this thread's outermost watched generate (None: none running)


class GenerateWatch:
    """Puts every `generate` call of the installed modules in the `generate` phase, with progress beats."""

    def __init__(self, hb, *, budget_s: Optional[float] = None, progress_every: int = 8,
                 on_error: Optional[Callable[[BaseException], None]] = None):
        """`on_error`: None — an error of the watch's own (a heartbeat that cannot be written) propagates, as a
        callback the script added should fail loudly; a callable — the error is handed to it and the call runs
        on unwatched (the automatic instrumentation, which must never break a run)."""
        if progress_every < 1:
            raise ValueError(f"progress_every must be at least 1 (got {progress_every})")
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 or None for the supervisor's default (got {budget_s})")
        self.hb = hb
        self.budget_s = budget_s
        self.progress_every = int(progress_every)
        self.on_error = on_error
        self._classed: "weakref.WeakSet[Any]" = weakref.WeakSet()   # instances watched through their class
        self._own: list[tuple[weakref.ref, Callable]] = []          # instances whose own attribute was wrapped

    # ---- installing ------------------------------------------------------------------------

    def install(self, module) -> int:
        """Watch `generate` on `module` and on each of its submodules; returns how many were newly wrapped."""
        wrapped = 0
        with _lock:
            for obj in _targets(module):
                if _generate_of(obj) is None or _owned(obj) or _is_own_wrapper(obj):
                    continue
                if "generate" in _instance_dict(obj):
                    original = _instance_dict(obj)["generate"]
                    setattr(obj, "generate", _instance_wrapper(self, original))
                    self._own.append((weakref.ref(obj), original))
                else:
                    try:
                        _owners[obj] = self
                    except TypeError:  # not weakly referenceable: nothing safe to attach to
                        continue
                    _ClassPatch.ensure(type(obj)).instances.add(obj)
                    self._classed.add(obj)
                wrapped += 1
        return wrapped

    def uninstall(self) -> None:
        """Restore every `generate` this watch wrapped."""
        with _lock:
            for obj in list(self._classed):
                if _owners.get(obj) is self:
                    del _owners[obj]
                patch = _patched.get(type(obj))
                if patch is not None:
                    patch.instances.discard(obj)
                    if not patch.instances:
                        patch.restore()
            self._classed = weakref.WeakSet()
            for ref, original in self._own:
                obj = ref()
                if obj is not None and _is_own_wrapper(obj):
                    setattr(obj, "generate", original)
            self._own = []
        # Classes whose watched instances were garbage-collected keep no dispatcher once nothing is watched.
        with _lock:
            for patch in [p for p in _patched.values() if not p.instances]:
                patch.restore()

    # ---- one call ----------------------------------------------------------------------------

    def call(self, fn: Callable, args: tuple, kwargs: dict, takes_criteria: bool) -> Any:
        """Run `fn(*args, **kwargs)` (a watched `generate`) in the `generate` phase."""
        if self.on_error is not None:
            return self._call_guarded(fn, args, kwargs, takes_criteria)
        active = getattr(_local, "active", None)
        if active is not None:  # an inner generate of a call already watched: same phase, same criterion
            if takes_criteria:
                args, kwargs = with_criterion(args, kwargs, active)
            return fn(*args, **kwargs)
        if getattr(self.hb, "closed", False):
            return fn(*args, **kwargs)
        criterion = make_progress_criterion(self.hb, self.progress_every)
        if takes_criteria:
            args, kwargs = with_criterion(args, kwargs, criterion)
        _local.active = criterion
        try:
            with self.hb.phase("generate", self.budget_s):
                return fn(*args, **kwargs)
        finally:
            _local.active = None

    def _call_guarded(self, fn: Callable, args: tuple, kwargs: dict, takes_criteria: bool) -> Any:
        """`call` for a watch with `on_error`: the watch's own work (the criterion, the phase lines) is fenced
        off from `fn`, whose exceptions propagate untouched; an error of the watch's own goes to `on_error`
        and `fn` runs (or goes on) unwatched."""
        active = getattr(_local, "active", None)
        if active is not None:
            if takes_criteria:
                try:
                    args, kwargs = with_criterion(args, kwargs, active)
                except Exception as exc:
                    self.on_error(exc)
            return fn(*args, **kwargs)
        if getattr(self.hb, "closed", False):
            return fn(*args, **kwargs)
        try:
            criterion = make_progress_criterion(self.hb, self.progress_every, self.on_error)
            watched_args, watched_kwargs = with_criterion(args, kwargs, criterion) if takes_criteria else (args, kwargs)
            phase = self.hb.phase("generate", self.budget_s)
            phase.__enter__()
        except Exception as exc:
            self.on_error(exc)
            return fn(*args, **kwargs)
        _local.active = criterion
        try:
            result = fn(*watched_args, **watched_kwargs)
        except BaseException as user_error:
            _local.active = None
            try:
                phase.__exit__(type(user_error), user_error, user_error.__traceback__)
            except BaseException as exc:  # the phase line failed (the user's own error is re-raised below)
                if exc is not user_error and isinstance(exc, Exception):
                    self.on_error(exc)
            raise
        _local.active = None
        try:
            phase.__exit__(None, None, None)
        except Exception as exc:
            self.on_error(exc)
        return result


def generating() -> bool:
    """Whether this thread is inside a watched `generate` (any watch's): an inner one adds no phase."""
    return getattr(_local, "active", None) is not None


# ---- the stopping criterion ---------------------------------------------------------------------

def with_criterion(args: tuple, kwargs: dict, criterion) -> tuple[tuple, dict]:
    """`generate`'s arguments with `criterion` added to its `stopping_criteria` (the caller's list is not mutated).

    `generate(inputs, generation_config, logits_processor, stopping_criteria, ...)`: a list passed fourth
    positionally is merged where it is.  Continuous batching (`cache_implementation="paged"`) refuses any
    stopping criterion, so such a call gets none (the phase still applies)."""
    if kwargs.get("cache_implementation") == "paged":
        return args, kwargs
    if "stopping_criteria" not in kwargs and len(args) >= 4 and (args[3] is None or isinstance(args[3], list)):
        merged = _merged(args[3], criterion)
        return args[:3] + (merged,) + args[4:], kwargs
    merged = _merged(kwargs.get("stopping_criteria"), criterion)
    return args, {**kwargs, "stopping_criteria": merged}


def _merged(user, criterion):
    from transformers.generation import StoppingCriteriaList

    out = StoppingCriteriaList(list(user) if user is not None else [])
    if not any(c is criterion for c in out):
        out.append(criterion)
    return out


def make_progress_criterion(hb, every: int, on_error: Optional[Callable[[BaseException], None]] = None):
    """The criterion that beats `progress` every `every` new tokens; with `on_error`, a beat that fails is handed
    to it and the criterion beats no more (generation goes on), else the error propagates."""
    return _criterion_class()(hb, every, on_error)


@functools.lru_cache(maxsize=1)
def _criterion_class():
    # Defined on first use: transformers (and torch) are imported only once a model that generates exists.
    import torch
    from transformers.generation import StoppingCriteria

    class ProgressCriterion(StoppingCriteria):
        """Beats `progress` (tokens=N) every `every` new tokens; never says stop."""

        def __init__(self, hb, every: int, on_error=None):
            self.hb = hb
            self.every = every
            self.on_error = on_error
            self.prompt_len: Optional[int] = None
            self.next_at = every
            self._no = None

        def __call__(self, input_ids, scores=None, **kwargs):
            length = int(input_ids.shape[-1])
            if self.prompt_len is None:  # first call: one token has been generated
                self.prompt_len = length - 1
            new = length - self.prompt_len
            if new >= self.next_at and self.hb is not None and not getattr(self.hb, "closed", False):
                self.next_at = (new // self.every + 1) * self.every
                if self.on_error is None:
                    self.hb.progress(tokens=new)
                else:
                    try:
                        self.hb.progress(tokens=new)
                    except Exception as exc:
                        self.hb = None  # reported once; generation goes on without beats
                        self.on_error(exc)
            rows = int(input_ids.shape[0])
            no = self._no
            if no is None or no.shape[0] != rows or no.device != input_ids.device:
                # Reused: StoppingCriteriaList ORs it into a fresh tensor, so sharing it is safe.
                no = self._no = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
            return no

    return ProgressCriterion


# ---- wrapping ----------------------------------------------------------------------------------

class _ClassPatch:
    """One class whose `generate` dispatches to the watch of the instance (or to the original)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.had_own = "generate" in cls.__dict__
        self.raw = cls.__dict__.get("generate")
        original = getattr(cls, "generate")
        takes = _takes_criteria(original)

        @functools.wraps(original)
        def generate(obj, *args, **kwargs):
            watch = _owners.get(obj)
            if watch is None:
                return original(obj, *args, **kwargs)
            return watch.call(functools.partial(original, obj), args, kwargs, takes)

        generate.__hangwatch_dispatch__ = True
        self.instances: "weakref.WeakSet[Any]" = weakref.WeakSet()
        setattr(cls, "generate", generate)

    @classmethod
    def ensure(cls, klass: type) -> "_ClassPatch":
        patch = _patched.get(klass)
        if patch is None:
            patch = _patched[klass] = cls(klass)
        return patch

    def restore(self) -> None:
        if _patched.get(self.cls) is not self:
            return
        if self.had_own:
            setattr(self.cls, "generate", self.raw)
        else:
            delattr(self.cls, "generate")
        del _patched[self.cls]


def _instance_wrapper(watch: GenerateWatch, original: Callable) -> Callable:
    takes = _takes_criteria(original)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        return watch.call(original, args, kwargs, takes)

    generate.__hangwatch_own__ = True
    return generate


def _takes_criteria(fn: Callable) -> bool:
    """Whether `fn` names a `stopping_criteria` parameter (GenerationMixin.generate does; a `*args, **kwargs`
    pass-through such as PeftModel.generate does not: the watched call inside it gets the criterion)."""
    try:
        return "stopping_criteria" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _targets(module) -> list:
    seen, out = set(), []
    modules = getattr(module, "modules", None)
    candidates = [module] + (list(modules()) if callable(modules) else [])
    for obj in candidates:
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    return out


def _generate_of(obj) -> Optional[Callable]:
    if "generate" not in _instance_dict(obj) and not hasattr(type(obj), "generate"):
        return None  # only reached through `__getattr__` (peft's LoraModel → its model): that one is wrapped itself
    try:
        gen = getattr(obj, "generate", None)
    except Exception:  # a property that raises: not a generate method
        return None
    if not callable(gen) or hasattr(gen, "forward"):  # a submodule called `generate` is not a method
        return None
    return gen


def _owned(obj) -> bool:
    try:
        return obj in _owners
    except TypeError:  # not weakly referenceable or not hashable
        return False


def _instance_dict(obj) -> dict:
    try:
        return vars(obj)
    except TypeError:
        return {}


def _is_own_wrapper(obj) -> bool:
    return getattr(_instance_dict(obj).get("generate"), "__hangwatch_own__", False)


__all__ = ["GenerateWatch", "generating", "make_progress_criterion", "with_criterion"]
