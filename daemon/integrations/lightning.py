"""`HangwatchCallback` for Lightning (`lightning.pytorch` or `pytorch_lightning`): the beats and phases
hangwatch needs from a Lightning script, in three added lines.

    from hangwatch.daemon.integrations.lightning import HangwatchCallback, resume_from
    trainer = L.Trainer(..., callbacks=[checkpointing, HangwatchCallback()])
    trainer.fit(module, train_loader, val_loader, ckpt_path=resume_from())

Under `hangwatch run` it writes, from the thread that does the work:
  start       at fit start, `resumed_from` = the checkpoint the fit restored (`trainer.ckpt_path`);
  step        once per optimizer step (`trainer.global_step`; the micro-batches of gradient accumulation
              make one beat) with the mean loss of its micro-batches, lr, grad norm, tokens/s when the
              batch has `input_ids`; a `warn` when the loss is not finite;
  phases      `train`; `eval` for validation (the sanity check included) and test; `predict`;
              `checkpoint` around the save itself; `generate` with `progress` beats every N new tokens
              wherever `generate` runs on the LightningModule or a model inside it (GenerateWatch);
  checkpoint  the file's path and step once it exists (good=False: the supervisor confirms it from the
              finite steps that follow, and hands the last good one to the next attempt as
              HANGWATCH_RESUME_FROM, which `resume_from()` returns);
  stop        `finished` at fit end; `terminated` (SIGTERM), `interrupted` or `error` when the fit raises,
              the error's last words in the attempt's exit.json (with `stop_beat=False`, as hangwatch adds
              the callback to an unedited script: the last words, no `stop` line: the exit is judged).
Outside hangwatch (no HANGWATCH_RUN_DIR) it does nothing at all: no file, no signal handler, no patch.

Checkpoints: `ModelCheckpoint(every_n_train_steps=N, save_top_k=-1)` keeps one file per step, so the last
good one is still there to resume from; a `last.ckpt` rewritten in place is announced too, but resuming
from it gives its newest content, good or not.

Which Lightning: both packages are one code base under two names, and each recognises only its own
`Callback` (`Trainer(callbacks=cb)` with the other package's callback fails with "'…' object is not
iterable"; `LightningCLI` checks subclasses).  The class therefore derives from the `Callback` of every
Lightning package the script has already imported, or of every one installed when none is imported yet,
so it is a Callback to either Trainer.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional

from hangwatch.daemon.heartbeat import WRITERS, claim_steps
from hangwatch.daemon.integrations import resume_from
from hangwatch.daemon.integrations.common import as_float, heartbeat_or_none, nonfinite, supervised
from hangwatch.daemon.integrations.generation import GenerateWatch, tokenizer_of

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
INSTALL_HINT = (
    "hangwatch.daemon.integrations.lightning needs Lightning: pip install hangwatch[lightning] "
    "(or `pip install lightning`; `pytorch_lightning` works too)"
)


def choose_packages(imported: Iterable[str]) -> tuple[str, ...]:
    """The Lightning packages whose Callback the class derives from: those the script already imported
    (the Trainer it builds comes from one of them), else every one we know of (whichever is installed)."""
    imported = set(imported)
    already = tuple(p for p in PACKAGES if p in imported)
    return already or PACKAGES


def _callback_bases() -> tuple[type, ...]:
    bases = []
    for name in choose_packages(p for p in PACKAGES if sys.modules.get(p) is not None):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and (name == exc.name or name.startswith(exc.name + ".")):
                continue  # not installed; a module missing *inside* an installed Lightning propagates
            raise
        bases.append(module.Callback)
    if not bases:
        raise ImportError(INSTALL_HINT)
    return tuple(bases)


def stop_reason(exc: BaseException) -> str:
    """The `stop` reason for an exception that ends a fit: Lightning turns SIGTERM into SIGTERMException."""
    if any(cls.__name__ == "SIGTERMException" for cls in type(exc).__mro__):
        return "terminated"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    return "error"


def step_loss(outputs: Any, automatic: bool, accumulate: int) -> Optional[float]:
    """The micro-batch's loss from `on_train_batch_end`'s outputs.  Automatic optimization hands the loss
    divided by `accumulate_grad_batches` (what backward saw); the loss the user computed is that times N."""
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    value = as_float(loss)
    if value is not None and automatic:
        value *= max(1, int(accumulate or 1))
    return value


def batch_size_and_tokens(batch: Any) -> tuple[Optional[int], Optional[int]]:
    """(rows, tokens) of a batch: tokens only for a mapping with `input_ids` (the attention mask's ones when
    there is a mask, so padding is not counted); rows from the first tensor found."""
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if ids is not None and hasattr(ids, "shape"):
            mask = batch.get("attention_mask")
            tokens = int(mask.sum().item()) if mask is not None and hasattr(mask, "sum") else int(ids.numel())
            return (int(ids.shape[0]) if len(ids.shape) else 1), tokens
        values = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        values = list(batch)
    else:
        values = [batch]
    for v in values:
        shape = getattr(v, "shape", None)
        if shape is not None and len(shape):
            return int(shape[0]), None
    return None, None


def grad_norm(parameters: Iterable[Any]) -> Optional[float]:
    """L2 norm of all gradients (before any clipping: Lightning clips after `on_before_optimizer_step`)."""
    import torch

    grads = [p.grad.detach() for p in parameters if getattr(p, "grad", None) is not None]
    if not grads:
        return None
    total_norm = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6: foreach, any devices
    if total_norm is not None:
        return float(total_norm(grads, 2.0))
    norms = [torch.linalg.vector_norm(g.float()) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])).item())


def _memory(device: Any) -> dict:
    if getattr(device, "type", None) != "cuda":
        return {}
    import torch

    mb = 1 << 20
    return {
        "mem_allocated_mb": round(torch.cuda.memory_allocated(device) / mb, 1),
        "max_mem_allocated_mb": round(torch.cuda.max_memory_allocated(device) / mb, 1),
    }


@dataclass
class _Window:
    """The micro-batches of the optimizer step in progress."""

    started: Optional[float] = None
    losses: list = field(default_factory=list)
    rows: int = 0
    tokens: Optional[int] = None

    def add(self, loss: Optional[float], rows: Optional[int], tokens: Optional[int]) -> None:
        if loss is not None:
            self.losses.append(loss)
        self.rows += rows or 0
        if tokens is not None:
            self.tokens = (self.tokens or 0) + tokens


class HangwatchCallback(*_callback_bases()):
    """Heartbeats for a Lightning run under hangwatch; a no-op outside it.

    Budgets (seconds) for the phases it enters; None leaves each to the supervisor's
    `watchdog.phase_budgets_s` (`eval` covers validation and test).  `progress_every`: new tokens
    between `progress` beats inside `generate`.  `stop_beat`: say `stop` when the fit ends (False: the
    supervisor judges the process by its exit, as when hangwatch added the callback itself)."""

    def __init__(
        self,
        *,
        eval_budget_s: Optional[float] = None,
        predict_budget_s: Optional[float] = None,
        checkpoint_budget_s: Optional[float] = None,
        generate_budget_s: Optional[float] = None,
        progress_every: int = 8,
        stop_beat: bool = True,
    ):
        super().__init__()
        for name, value in (
            ("eval_budget_s", eval_budget_s),
            ("predict_budget_s", predict_budget_s),
            ("checkpoint_budget_s", checkpoint_budget_s),
            ("generate_budget_s", generate_budget_s),
        ):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 or None for the supervisor's default (got {value})")
        if progress_every < 1:
            raise ValueError(f"progress_every must be at least 1 (got {progress_every})")
        self.budgets = {"eval": eval_budget_s, "predict": predict_budget_s, "checkpoint": checkpoint_budget_s}
        self.generate_budget_s = generate_budget_s
        self.progress_every = progress_every
        self.stop_beat = stop_beat
        if supervised():
            claim_steps()  # this callback beats the steps: the automatic optimizer hook stays quiet
        self._hb = None
        self._live = False  # between our `start` and `stop`
        self._watch: Optional[GenerateWatch] = None
        self._returns: list[tuple[str, str]] = []  # (phase entered, phase to return to)
        self._window = _Window()
        self._last_step = 0
        self._samples = 0
        self._tokens = 0
        self._opt: dict = {}  # lr and grad norm of the optimizer step being taken
        self._pending: list[tuple[str, int]] = []  # saved, file not there yet (asynchronous checkpoint IO)

    @property
    def heartbeat(self):
        """The heartbeat this callback writes (None outside hangwatch or before the Trainer set it up)."""
        return self._hb

    # ---- life cycle --------------------------------------------------------------------------

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self._hb is None:
            env = dict(os.environ)
            env.setdefault("RANK", str(getattr(trainer, "global_rank", 0)))  # Lightning's own DDP sets no RANK
            self._hb = heartbeat_or_none(env)
        if self._hb is None:
            return
        self._watch = self._watch or GenerateWatch(
            self._hb, budget_s=self.generate_budget_s, progress_every=self.progress_every
        )
        if self._watch.tokenizer is None:  # decodes what a generate the supervisor ended was given and made
            try:
                self._watch.tokenizer = tokenizer_of(getattr(pl_module, "tokenizer", None))
            except Exception:  # the module's own property raised: no text in that report, nothing else lost
                pass
        self._watch.install(pl_module)
        self._wrap_save(trainer)
        if stage != "fit":
            self._start(None)  # trainer.validate / test / predict on their own

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._hb is not None:
            ckpt = getattr(trainer, "ckpt_path", None)
            self._start(os.fspath(ckpt) if ckpt else None)

    def on_train_start(self, trainer, pl_module) -> None:
        if self._hb is None:
            return
        self._last_step = self._hb.current_step = int(trainer.global_step)  # restored by now, on a resume
        self._window = _Window()
        self._hb.enter_phase("train")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._finish("finished")

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._hb is None:
            return
        self._finish("finished")
        self._release(trainer)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self._hb is None:
            return
        reason = stop_reason(exception)
        if reason == "error" and self._live:
            from hangwatch.daemon.lastwords import last_words_for

            run_dir = os.environ.get("HANGWATCH_RUN_DIR")
            if run_dir:
                last_words_for(exception, run_dir, self._hb.attempt, rank=self._hb.rank)
        self._finish(reason, error=f"{type(exception).__name__}: {exception}"[:500])
        self._release(trainer)  # Lightning calls no teardown hook after an exception

    # ---- training ----------------------------------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._hb is not None and self._window.started is None:
            self._window.started = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self._hb is None:
            return
        groups = getattr(optimizer, "param_groups", None) or [{}]
        self._opt = {"lr": as_float(groups[0].get("lr")), "grad_norm": grad_norm(pl_module.parameters())}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._hb is None:
            return
        rows, tokens = batch_size_and_tokens(batch)
        self._window.add(
            step_loss(
                outputs,
                bool(getattr(pl_module, "automatic_optimization", True)),
                getattr(trainer, "accumulate_grad_batches", 1),
            ),
            rows,
            tokens,
        )
        step = int(trainer.global_step)
        if step > self._last_step:
            self._beat_step(trainer, pl_module, step)
        self._announce_pending()

    def _beat_step(self, trainer, pl_module, step: int) -> None:
        w, self._window = self._window, _Window()
        self._last_step = step
        elapsed = time.perf_counter() - w.started if w.started is not None else None
        self._samples += w.rows
        self._tokens += w.tokens or 0
        loss = sum(w.losses) / len(w.losses) if w.losses else None
        metrics: dict = {
            "loss": loss,
            **{k: v for k, v in self._opt.items() if v is not None},
            "examples": w.rows,
            "samples": self._samples,
            "epoch": int(trainer.current_epoch),
        }
        if elapsed:
            metrics["step_s"] = round(elapsed, 4)
            if w.tokens:
                metrics["tokens_per_s"] = round(w.tokens / elapsed, 1)
                metrics["tokens"] = self._tokens
        if getattr(trainer, "max_steps", -1) and trainer.max_steps > 0:
            metrics["max_steps"] = int(trainer.max_steps)
        metrics.update(_memory(getattr(pl_module, "device", None)))
        self._opt = {}
        self._hb.step(step, **{k: v for k, v in metrics.items() if v is not None})
        if nonfinite(loss):
            self._hb.warn(f"non-finite loss {loss} at step {step}", loss=loss)

    # ---- evaluation --------------------------------------------------------------------------

    def on_validation_start(self, trainer, pl_module) -> None:
        self._enter("eval", stage="sanity_check" if getattr(trainer, "sanity_checking", False) else "validate")

    def on_validation_end(self, trainer, pl_module) -> None:
        self._leave("eval")
        self._announce_pending()

    def on_test_start(self, trainer, pl_module) -> None:
        self._enter("eval", stage="test")

    def on_test_end(self, trainer, pl_module) -> None:
        self._leave("eval")

    def on_predict_start(self, trainer, pl_module) -> None:
        self._enter("predict")

    def on_predict_end(self, trainer, pl_module) -> None:
        self._leave("predict")

    # ---- checkpoints -------------------------------------------------------------------------

    def _wrap_save(self, trainer) -> None:
        """Put `trainer.save_checkpoint` (ModelCheckpoint's and the user's one way to save) in the
        `checkpoint` phase.  `on_save_checkpoint` is no substitute: it runs while the checkpoint dict is
        being built, before anything is written."""
        if getattr(vars(trainer).get("save_checkpoint"), "__hangwatch__", None) is self:
            return
        original = trainer.save_checkpoint

        def save_checkpoint(filepath, *args, **kwargs):
            hb = self._hb
            if hb is None or hb.closed:
                return original(filepath, *args, **kwargs)
            with hb.phase("checkpoint", self.budgets["checkpoint"]):
                result = original(filepath, *args, **kwargs)
            if getattr(trainer, "is_global_zero", True):  # rank 0 writes the file; it alone announces it
                path = os.fspath(filepath)
                self._pending.append((path if "://" in path else os.path.abspath(path), int(trainer.global_step)))
                self._announce_pending()
            return result

        save_checkpoint.__hangwatch__ = self
        save_checkpoint.__wrapped__ = original
        trainer.save_checkpoint = save_checkpoint

    def _announce_pending(self) -> None:
        """`checkpoint` beats for the saves whose file exists (a remote URL is taken at its word)."""
        if not self._pending or self._hb is None or self._hb.closed:
            return
        waiting = []
        for path, step in self._pending:
            if "://" in path or os.path.exists(path):
                self._hb.checkpoint(path, step, good=False)
            else:
                waiting.append((path, step))
        self._pending = waiting

    # ---- helpers -----------------------------------------------------------------------------

    def _start(self, resumed_from: Optional[str]) -> None:
        if self._live:
            return
        self._live = True
        self._returns = []
        self._hb.current_phase = "init"  # a second start (trainer.test after fit) begins afresh too
        self._hb.start(resumed_from=resumed_from, integration="lightning")
        WRITERS.own_phases(self)

    def _finish(self, reason: str, **extra: Any) -> None:
        if not self._live:
            return
        self._announce_pending()
        self._live = False
        WRITERS.release_phases(self)
        if self.stop_beat:
            self._hb.stop(reason, **extra)

    def _release(self, trainer) -> None:
        if self._watch is not None:
            self._watch.uninstall()
        wrapper = vars(trainer).get("save_checkpoint")
        if getattr(wrapper, "__hangwatch__", None) is self:
            del trainer.save_checkpoint

    def _enter(self, name: str, **extra: Any) -> None:
        if self._hb is None:
            return
        if not self._live:  # e.g. trainer.test() after a fit that already said `stop`
            self._start(None)
        self._returns.append((name, self._hb.current_phase))
        self._hb.enter_phase(name, self.budgets.get(name), **extra)

    def _leave(self, name: str) -> None:
        if self._hb is None or not self._returns or self._returns[-1][0] != name:
            return
        _, previous = self._returns.pop()
        if self._live and self._hb.current_phase == name:
            self._hb.enter_phase(previous)


__all__ = ["HangwatchCallback", "resume_from", "choose_packages", "stop_reason"]
