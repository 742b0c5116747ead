"""HF `transformers.Trainer` and Lightning `Trainer` in an unedited script: the HangwatchCallback added, the
last good checkpoint resumed from, the Trainers' own saves in the `checkpoint` phase.

Callbacks: the base classes' `__init__` is wrapped (TRL's SFTTrainer and every other subclass goes through
it via `super().__init__`): after the original, a `HangwatchCallback(stop_beat=False)` is added unless one —
an instance of a class named HangwatchCallback, the script's own — is there.  The callback beats the steps
(with the Trainer's own loss, grad norm, tokens/s), the phases and the checkpoints; hangwatch's optimizer hook
then stays quiet.  `stop_beat=False`: an unedited script may do anything after `train()`/`fit()` returns
(evaluate, save, push), so no `stop` line bounds that time; the supervisor judges the exit.  Lightning keeps
its ModelCheckpoint callbacks last (`_CallbackConnector._reorder_callbacks`, as its own __init__ does).

Resume: `Trainer.train(resume_from_checkpoint=None)` (absent or None) gets HANGWATCH_RESUME_FROM — the
supervisor's last good checkpoint — when it is a Trainer checkpoint (a directory with trainer_state.json; a
path announced by a plain `save_pretrained` is not one, and the Trainer would fail on it).  An explicit path
that differs is respected and a `warn` beat says so; `True` (the Trainer's own "latest") is left alone.
Lightning: `fit(..., ckpt_path=None)` likewise (`"last"`, `"best"`, `"hpc"`, `"registry…"` are left alone).

The per-device batch after an out-of-memory failure (`oom_batch`): at the entry of `Trainer.train()` (HF) and
`Trainer.fit()` (Lightning), before the train DataLoader is built, the supervisor's smaller batch and larger
accumulation are set on the framework's own arguments, and what the Trainer trains with is written for the supervisor.

Standard library only at import; the integrations (which import transformers or Lightning) are imported when
a Trainer is built, by which time the script has imported its framework.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional

from hangwatch.daemon.autoinstrument.context import Context
from hangwatch.daemon.autoinstrument.oom_batch import OomBatch
from hangwatch.daemon.autoinstrument.saves import Saves, file_target

CALLBACK_NAME = "HangwatchCallback"
TRAINER_STATE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME, stable since v3
LIGHTNING_KEYWORDS = ("last", "best", "hpc", "registry")

PASS, KEEP, WARN = "pass", "keep", "warn"


def resume_decision(given: Any, offered: Optional[str], usable: Callable[[str], bool], keywords: tuple = ()) -> tuple:
    """What to do with the checkpoint argument `given` a script passed, when hangwatch offers `offered`:
    (PASS, offered) — pass it; (KEEP, None) — leave the call alone; (WARN, message) — leave it and say why."""
    if not offered:
        return KEEP, None
    if given is None:
        if usable(offered):
            return PASS, offered
        return WARN, "HANGWATCH_RESUME_FROM=%s cannot be resumed from here; starting without it" % offered
    if isinstance(given, bool):
        return KEEP, None
    if isinstance(given, str) and (given in keywords or given.startswith(tuple(k + ":" for k in keywords))):
        return KEEP, None
    if isinstance(given, (str, os.PathLike)):
        if _same_path(os.fspath(given), offered):
            return KEEP, None
        return WARN, "resume_from_checkpoint=%s is not the last good checkpoint %s" % (os.fspath(given), offered)
    return KEEP, None


def hf_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, TRAINER_STATE))


def lightning_checkpoint(path: str) -> bool:
    return "://" in path or os.path.exists(path)


def has_callback(callbacks) -> bool:
    return any((cb if isinstance(cb, type) else type(cb)).__name__ == CALLBACK_NAME for cb in (callbacks or ()))


class Frameworks:
    def __init__(self, ctx: Context, saves: Saves):
        self.ctx = ctx
        self.saves = saves
        self.batches = OomBatch(ctx)

    # ---- transformers.trainer -------------------------------------------------------------------------

    def patch_hf_trainer(self, module) -> None:
        cls = module.Trainer
        ctx = self.ctx

        def add(trainer) -> None:
            handler = getattr(trainer, "callback_handler", None)
            if handler is None or has_callback(handler.callbacks):
                return
            from hangwatch.daemon.integrations.generation import tokenizer_of
            from hangwatch.daemon.integrations.transformers import HangwatchCallback

            # The tokenizer decodes the prompt and output of a generate the supervisor ends, for its report.
            tokenizer = tokenizer_of(getattr(trainer, "processing_class", None))
            trainer.add_callback(HangwatchCallback(stop_beat=False, tokenizer=tokenizer))

        self._each(ctx.hook("HF Trainer callback"), lambda hook: self._after_init(cls, hook, add))
        self._each(
            ctx.hook("HF Trainer resume"),
            lambda hook: self._resume(cls, "train", hook, "resume_from_checkpoint", hf_checkpoint, ()),
        )

        def target(a: tuple, k: dict):
            trainer = a[0]
            handler = getattr(trainer, "callback_handler", None)
            if handler is not None and has_callback(handler.callbacks):
                return None  # its callback announces the checkpoint (on_save), from the local main process
            if not trainer.is_local_process_zero():
                return None
            from hangwatch.daemon.integrations.transformers import _output_dir, checkpoint_dir

            trial = a[2] if len(a) > 2 else k.get("trial")
            return file_target(checkpoint_dir(_output_dir(trainer, trial), int(trainer.state.global_step)))

        def save(hook) -> None:
            cls._save_checkpoint = self.saves.bracket(hook, cls.__dict__["_save_checkpoint"], target)

        self._each(ctx.hook("HF Trainer save"), save)
        self._each(
            self.batches.hook,
            lambda hook: self._before(cls, "train", hook, lambda trainer, bound: self.batches.hf_train(trainer)),
        )

    # ---- lightning.pytorch / pytorch_lightning .trainer.trainer --------------------------------------------

    def patch_lightning_trainer(self, module) -> None:
        cls = module.Trainer
        callback_base = getattr(module, "Callback", None)
        ctx = self.ctx

        def add(trainer) -> None:
            callbacks = getattr(trainer, "callbacks", None)
            if not isinstance(callbacks, list) or has_callback(callbacks):
                return
            from hangwatch.daemon.integrations.lightning import HangwatchCallback

            cb = HangwatchCallback(stop_beat=False)
            if callback_base is not None and not isinstance(cb, callback_base):
                raise TypeError(
                    "hangwatch's Lightning callback is no %s.Callback (the other Lightning package "
                    "was imported first)" % module.__name__.split(".trainer")[0]
                )
            connector = getattr(trainer, "_callback_connector", None)
            reorder = getattr(type(connector), "_reorder_callbacks", None) if connector is not None else None
            # ModelCheckpoint callbacks run last, as Lightning's own __init__ arranges them.
            trainer.callbacks = reorder(callbacks + [cb]) if callable(reorder) else _checkpoints_last(callbacks + [cb])

        self._each(ctx.hook("Lightning callback"), lambda hook: self._after_init(cls, hook, add))
        self._each(
            ctx.hook("Lightning resume"),
            lambda hook: self._resume(cls, "fit", hook, "ckpt_path", lightning_checkpoint, LIGHTNING_KEYWORDS),
        )

        def target(a: tuple, k: dict):
            trainer = a[0]
            if has_callback(getattr(trainer, "callbacks", None)):
                return None  # its callback announces the file once it exists
            if not getattr(trainer, "is_global_zero", True):
                return None
            return file_target(a[1] if len(a) > 1 else k.get("filepath"))

        def save(hook) -> None:
            cls.save_checkpoint = self.saves.bracket(hook, cls.__dict__["save_checkpoint"], target)

        self._each(ctx.hook("Lightning save"), save)

        def batch(trainer, bound: dict) -> None:
            model = bound.get("model")
            self.batches.lightning_fit(trainer, model, bound.get("train_dataloaders"), bound.get("datamodule"))

        self._each(self.batches.hook, lambda hook: self._before(cls, "fit", hook, batch))

    # ---- the wrappers -------------------------------------------------------------------------------------

    def _each(self, hook, patch: Callable[[Any], None]) -> None:
        """One piece of a framework's patching, on its own: a piece this version of the framework does not fit
        (a method renamed) is that hook's one warning, and the other pieces still go in."""
        try:
            patch(hook)
        except Exception as exc:
            self.ctx.failed(hook, exc)

    def _after_init(self, cls: type, hook, then: Callable[[Any], None]) -> None:
        original = cls.__dict__["__init__"]
        ctx = self.ctx

        @functools.wraps(original)
        def __init__(trainer, *args, **kwargs):
            original(trainer, *args, **kwargs)
            if hook.on and ctx.active:
                try:
                    then(trainer)
                except Exception as exc:
                    ctx.failed(hook, exc)

        __init__.__hangwatch_original__ = original
        cls.__init__ = __init__

    def _before(self, cls: type, method: str, hook, then: Callable[[Any, dict], None]) -> None:
        """`then(trainer, arguments)` before each call of `cls.method` (its arguments by name, defaults left out)."""
        import inspect

        original = getattr(cls, method)  # the resume wrapper, when it went in first: it hands over the arguments
        signature = inspect.signature(getattr(original, "__hangwatch_original__", original))
        ctx = self.ctx

        @functools.wraps(original)
        def wrapper(trainer, *args, **kwargs):
            if hook.on and ctx.active:
                try:
                    then(trainer, dict(signature.bind_partial(trainer, *args, **kwargs).arguments))
                except Exception as exc:
                    ctx.failed(hook, exc)
            return original(trainer, *args, **kwargs)

        wrapper.__hangwatch_original__ = getattr(original, "__hangwatch_original__", original)
        setattr(cls, method, wrapper)

    def _resume(
        self, cls: type, method: str, hook, parameter: str, usable: Callable[[str], bool], keywords: tuple
    ) -> None:
        import inspect  # here, not at start-up: the framework importing us has loaded it already

        original = cls.__dict__[method]
        ctx = self.ctx
        signature = inspect.signature(original)
        names = list(signature.parameters)
        position = names.index(parameter) if parameter in names else None  # counting `self`

        @functools.wraps(original)
        def wrapper(trainer, *args, **kwargs):
            if hook.on and ctx.active and ctx.resume_from:
                try:
                    args, kwargs = self._resumed(hook, args, kwargs, parameter, position, usable, keywords, method)
                except Exception as exc:
                    ctx.failed(hook, exc)
            return original(trainer, *args, **kwargs)

        wrapper.__hangwatch_original__ = original
        setattr(cls, method, wrapper)

    def _resumed(
        self,
        hook,
        args: tuple,
        kwargs: dict,
        parameter: str,
        position: Optional[int],
        usable: Callable[[str], bool],
        keywords: tuple,
        method: str,
    ) -> tuple:
        at = position - 1 if position is not None else None  # in `args`, which lack `self`
        if parameter in kwargs:
            given = kwargs[parameter]
        elif at is not None and len(args) > at:
            given = args[at]
        else:
            given = None
        what, value = resume_decision(given, self.ctx.resume_from, usable, keywords)
        if what == PASS:
            if parameter not in kwargs and at is not None and len(args) > at:
                args = args[:at] + (value,) + args[at + 1 :]
            else:
                kwargs = dict(kwargs, **{parameter: value})
            _say(
                "%s(%s=%r): resuming from the last good checkpoint (HANGWATCH_RESUME_FROM)" % (method, parameter, value)
            )
        elif what == WARN:
            if not self.ctx.hb.closed:
                self.ctx.hb.warn(value, hook=hook.name)
        return args, kwargs


def _checkpoints_last(callbacks: list) -> list:
    def is_checkpoint(cb) -> bool:
        return any(c.__name__ == "Checkpoint" for c in type(cb).__mro__)

    return [c for c in callbacks if not is_checkpoint(c)] + [c for c in callbacks if is_checkpoint(c)]


def _same_path(a: str, b: str) -> bool:
    if "://" in a or "://" in b:
        return a.rstrip("/") == b.rstrip("/")
    return os.path.realpath(a) == os.path.realpath(b)


def _say(message: str) -> None:
    try:
        sys.stderr.write("hangwatch: %s\n" % message)
        sys.stderr.flush()
    except Exception:
        pass


__all__ = ["Frameworks", "resume_decision", "hf_checkpoint", "lightning_checkpoint", "has_callback"]
