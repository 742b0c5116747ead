"""The training loop: AdamW on the trainable parameters, warm-up + cosine in optimizer steps,
gradient accumulation with its own counter, clipping, a non-finite guard, evals, checkpoints.

Exactness is the point: a run killed at any instant and restarted from its last good checkpoint
continues bit for bit.  So everything that decides the next step's numbers is saved at a step
boundary and restored (`state.py`); evaluation runs on a set-aside RNG so whether it ran does not
matter.

Lifecycle: `Trainer(...)` → `restore(path)` (or `seed_fresh()`) → `run()` → "finished" | "terminated"
| "idle".  Within a step boundary the order is: step beat → confirm pending checkpoints → eval (if
due) → checkpoint (if due) → stop request → max_steps.

The data position a checkpoint stores is the one taken at the last step boundary: a continuous
source (`ContinuousDataSource`) may have handed out part of the next step's examples when a stop
request ends its wait for more, and those are simply taken again after the resume.  Once a
checkpoint is committed, the continuous source's `commit` records what it covers.

Under torchrun (a `TorchWorld`) every rank runs this loop over its share of each step
(`trainer.ranks`): the forward and backward go through DDP, gradients are exchanged on the last
micro-step only (`no_sync` before), the step's loss and finiteness are the world's (summed across
ranks, so every rank decides alike), a stop request that reached some ranks stops all of them at the
same step boundary, and rank 0 alone writes checkpoints (holding every rank's RNG states and data
position), generations and `final/` while the others wait for it.  A world of one is the
single-process worker, unchanged.

A continuous source that goes quiet (end "flush", after `data.flush_after_s`) gets the examples in
hand trained as a partial step (its loss normalised over the label tokens actually present, the step
beat marked `partial`), then the checkpoint covering them is written (their file reaches done/) and
settled: confirmed good on a finite held-out loss, or left provisional (`confirmation`).  One that
runs dry for good (end "idle") gets its last, partial step trained, and the run finishes with
reason "idle".

Self-healing.  `cfg` is the setting this attempt trains with, which OOM remediation may have regrouped
(`trainer.remediation`: a smaller micro-batch, more accumulation, the same examples per step); checkpoints
keep the fingerprint of the config as written (`configured`).  Every step beat names its examples
(`examples_digest`, and `example_ids` for steps of up to `MAX_IDS_IN_BEAT`), so that the examples of each
optimizer step can be compared across runs.  A non-finite step remembers its examples and those whose own
loss was non-finite; the streak that ends the attempt quarantines them (`trainer.quarantine`) before exit 75.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path
from typing import Optional, TextIO

import torch

from hangwatch.common.protocol import RECOVERED_FIELD
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ContinuousDataSource, DataSource, Example, collate
from hangwatch.daemon.distributed import World
from hangwatch.daemon.evaluate import heldout_loss, run_eval
from hangwatch.daemon.export import FINAL_DIR, export_final
from hangwatch.daemon.model import ModelBundle, memory_metrics
from hangwatch.daemon.resume_compat import fingerprint
from hangwatch.daemon.trainer import memory_evidence, quarantine, ranks, remediation, state
from hangwatch.daemon.trainer.confirmation import Confirmation, Pending, RankConfirmation
from hangwatch.daemon.trainer.quarantine import MAX_IDS_IN_BEAT, examples_digest
from hangwatch.daemon.trainer.recovery import AbandonWatch, LastGood, Rung, StepAbandoned, is_oom, landed_at, smaller
from hangwatch.daemon.trainer.schedule import WarmupCosine
from hangwatch.daemon.trainer.trackers import eval_metrics, step_metrics
from hangwatch.daemon.worker_errors import NonFiniteStreak


class Trainer:
    def __init__(
        self,
        cfg,
        hb,
        run_dir,
        bundle: ModelBundle,
        source: DataSource,
        eval_examples: list[Example],
        faults,
        stop,
        *,
        attempt: int = 1,
        out: Optional[TextIO] = None,
        world: Optional[World] = None,
        configured=None,
        in_process: bool = False,
        watch: Optional[AbandonWatch] = None,
    ):
        """`configured`: the config as written, when `cfg` is a remedied copy of it (its fingerprint is the run's).
        `in_process` (`restart.in_process`, honoured on a world of one outside continuous mode): recover from an
        out-of-memory step, a non-finite streak and, with `watch`, a stall in Python inside this process."""
        self.cfg = cfg
        self.configured = configured if configured is not None else cfg
        self.bad_steps: list[quarantine.BadStep] = []  # the current non-finite streak's steps
        self.world = world or World()
        self.continuous: Optional[ContinuousDataSource] = source if isinstance(source, ContinuousDataSource) else None
        if self.continuous is not None and self.world.size > 1:
            raise ValueError("continuous mode (data.inbox) trains on one rank only")
        self.confirmation = (
            Confirmation(
                run_dir,
                hb,
                cfg.checkpoint.confirm_steps,
                cfg.checkpoint.keep_last,
                self.log,
                provisional_on_commit=self.continuous is not None,
                root=ckpt.checkpoints_root(run_dir, cfg.checkpoint.dir),
                on_good=self._held_good,
            )
            if self.world.is_main
            else RankConfirmation(hb)
        )
        self.in_process = bool(in_process) and self.world.size == 1 and self.continuous is None
        self.last_good: Optional[LastGood] = LastGood() if self.in_process else None
        self.watch = watch if self.in_process else None
        self.rollbacks: set[tuple] = set()  # (kind, last good step, failed step) recovered here once already
        self.recoveries: list[dict] = []  # what this process recovered from (for the benchmarks and tests)
        self.hb = hb
        self.run_dir = Path(run_dir)
        self.bundle = bundle
        self.source = source
        self.eval_examples = eval_examples
        self.faults = faults
        self.stop = stop
        self.attempt = attempt
        self.out = out if out is not None else sys.stdout  # looked up now: a test may have replaced it
        t = cfg.train
        self.params = [p for _, p in bundle.trainable_parameters()]
        # The weights' share, before DDP and the optimizer add theirs: an OOM's evidence (`trainer.memory`).
        memory_evidence.note_model(bundle.device, t.micro_batch_size, probe=getattr(faults, "memory_probe", None))
        self.train_module = self.world.wrap(bundle.model)  # what forward and backward go through (DDP)
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(t.warmup_steps, t.max_steps))
        self.step = 0
        self.accum = 0  # micro-batches accumulated into the current optimizer step
        self.samples = 0
        self.tokens = 0
        self.nonfinite_total = 0
        self.nonfinite_streak = 0
        self.partial_steps = 0  # optimizer steps taken on fewer examples than a full step
        self.last_step_examples = 0
        self.last_saved_step: Optional[int] = None
        self.resumed_from: Optional[Path] = None
        self.last_metrics: dict = {}
        self.boundary_position: dict = {}  # the source's position at the last optimizer-step boundary
        self.trackers = None  # `train.report_to` on rank 0: a `trackers.TrackerLog` the worker opened

    @property
    def hb(self):
        return self._hb

    @hb.setter
    def hb(self, hb) -> None:
        """Swapping the heartbeat (benchmarks time one trainer with and without) swaps it everywhere."""
        self._hb = hb
        self.confirmation.hb = hb

    # ---- state ----------------------------------------------------------------------------

    def seed_fresh(self) -> None:
        self.source.restore(None, 0)
        self.boundary_position = self.source.position()
        state.seed_everything(ranks.rank_seed(self.cfg.train.seed, self.world.rank))
        if self.last_good is not None:
            self.last_good.hold_start(self.fill_checkpoint)

    def trainer_state(self, rank_states: Optional[list] = None) -> dict:
        """What trainer_state.json holds; `rank_states`: every rank's (`ranks.rank_state`), in rank order."""
        return {
            "step": self.step,
            "data_position": self.boundary_position,
            "world_size": self.world.size,
            "ranks": ranks.ranks_record(rank_states or [self.rank_state()]),
            "accumulation": {
                "micro_step": self.accum,
                "grad_accum": self.cfg.train.grad_accum,
                "micro_batch_size": self.cfg.train.micro_batch_size,
            },
            "samples": self.samples,
            "tokens": self.tokens,
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_streak": self.nonfinite_streak,
            "partial_steps": self.partial_steps,
            "last_step": {"examples": self.last_step_examples, "partial": self.last_step_examples < self.step_size},
            "weights_finite": self.bundle.weights_finite(),
            "fingerprint": fingerprint(self.configured, self.world.size),
            "attempt": self.attempt,
            "t": time.time(),
        }

    def rank_state(self) -> dict:
        """What a checkpoint keeps of this rank: its RNG states and data position at the step boundary."""
        rng = state.rng_state(cuda=self.bundle.device.type == "cuda", own_device_only=self.world.size > 1)
        return ranks.rank_state(self.world.rank, rng, self.boundary_position)

    def fill_checkpoint(self, tmp: Path, rank_states: Optional[list] = None) -> None:
        """Write this step's checkpoint files into `tmp` (for `checkpoint.commit`)."""
        rank_states = rank_states or [self.rank_state()]
        state.fill(
            tmp,
            self.bundle,
            self.optimizer,
            self.scheduler,
            self.trainer_state(rank_states),
            [s["rng"] for s in rank_states],
        )

    def restore(self, path: Path) -> None:
        """Continue from checkpoint `path` exactly where it left off."""
        files = state.Files(path)
        self._put_back(files)
        self.resumed_from = path
        if not ckpt.is_good(path):
            self.confirmation.wait_for(Pending(path, self.step))  # provisional: the steps after it confirm it
        if self.last_good is not None:  # what a restart now would resume from
            self.last_good.hold(path, self.step, provisional=not ckpt.is_good(path))
        state.load_rng(files, self.world.rank)  # last: nothing after this may draw random numbers before training does

    def _put_back(self, files: "state.Files") -> dict:
        """A checkpoint's weights, optimizer, scheduler, data position and counters (not its RNG states), from its
        directory or from memory — one code path, so that both continue alike."""
        saved = state.load_weights(files, self.bundle, self.optimizer, self.scheduler)
        self.source.restore(ranks.position_for(saved, self.world.rank), int(saved["step"]))
        self.boundary_position = self.source.position()
        self.step = int(saved["step"])
        self.hb.current_step = self.step
        self.samples = int(saved["samples"])
        self.tokens = int(saved["tokens"])
        self.nonfinite_total = int(saved["nonfinite_total"])
        self.nonfinite_streak = int(saved["nonfinite_streak"])
        self.partial_steps = int(saved.get("partial_steps", 0))  # absent from checkpoints older than the field
        self.last_step_examples = int(saved.get("last_step", {}).get("examples", 0))
        self.last_saved_step = self.step
        return saved

    def _held_good(self, path: Path, step: int) -> None:
        """A checkpoint was confirmed good: from now on it is the state a recovery in this process puts back."""
        if self.last_good is not None:
            self.last_good.hold(path, step)

    # ---- one optimizer step ---------------------------------------------------------------

    @property
    def step_size(self) -> int:
        """Examples in a full optimizer step (of the whole world: every rank takes its share of them)."""
        return self.cfg.train.micro_batch_size * self.cfg.train.grad_accum * self.world.size

    def next_examples(self) -> tuple[list[Example], Optional[str]]:
        """The next optimizer step's examples, and why there are fewer than a full step (None: there are not)."""
        if self.continuous is not None:
            return self.continuous.take_step(self.step_size)
        return self.source.take(self.step_size), None

    def train_step(self, examples: Optional[list[Example]] = None) -> dict:
        """One optimizer step on `examples` (default: the source's next).  In the process (`in_process`): a step that
        runs out of memory is taken again on the same examples, the RNG as it was before it, one rung down — half the
        micro-batch and twice the accumulation, then gradient checkpointing (`recovery.smaller`); with no rung left,
        the error goes on to the restart path."""
        if examples is None:
            examples, _ = self.next_examples()
        while True:
            rng = state.rng_state(cuda=self.bundle.device.type == "cuda") if self.in_process else None
            try:
                return self._train_step(examples)
            except BaseException as exc:
                if rng is None or not is_oom(exc):
                    raise
                message = str(exc)
            # Out of the handler: the exception's traceback, and with it the failed step's tensors, is gone.
            self._adapt_to_oom(message, rng)

    def _adapt_to_oom(self, message: str, rng: dict) -> None:
        """Drop what the failed step allocated, put its RNG back, go one rung down (or re-raise: none left)."""
        t = self.cfg.train
        now = Rung(t.micro_batch_size, t.grad_accum, bool(self.cfg.model.gradient_checkpointing))
        self.optimizer.zero_grad(set_to_none=True)
        self.accum = 0
        from hangwatch.daemon.trainer.recovery import release_memory

        release_memory(self.bundle.device)
        figures = memory_evidence.evidence()
        to = smaller(now)
        if to is None:
            import torch

            raise torch.OutOfMemoryError(message)  # micro-batch 1 with gradient checkpointing: the restart path
        state.set_rng_state(rng)
        if to.gradient_checkpointing and not now.gradient_checkpointing:
            from hangwatch.daemon.model import checkpointing_on, enable_gradient_checkpointing

            if not checkpointing_on(self.bundle.base):
                enable_gradient_checkpointing(self.bundle.base)
        self.cfg = remediation.apply(self.cfg, to.as_dict())
        memory_evidence.note_micro(to.micro_batch_size)
        number = self.step + 1
        what = (
            "gradient checkpointing turned on"
            if to.gradient_checkpointing and not now.gradient_checkpointing
            else f"micro_batch_size {now.micro_batch_size} → {to.micro_batch_size}, grad_accum {now.grad_accum} → "
            f"{to.grad_accum}"
        )
        record = {
            "kind": "oom",
            "step": number,
            "from": now.as_dict(),
            "to": to.as_dict(),
            "message": message[:1200],
            **({"memory": figures} if figures else {}),
        }
        self.recoveries.append(record)
        self.hb.warn(
            f"out of memory in step {number}: adapted in the process ({what}; the same examples per optimizer step)",
            oom_adapted=record,
        )
        self.log(f"step {number}: out of memory — {what}, step taken again in the process (no restart)")

    def _train_step(self, examples: list[Example]) -> dict:
        """Accumulate the step's micro-batches (`grad_accum` of them; fewer for a partial step) and take
        (or skip, when non-finite) one optimizer step; `examples` default to the source's next.

        Every micro-batch's loss is divided by the label tokens of the whole step *as it is*: a partial
        step's loss is the mean over the tokens actually present, never scaled down as if the missing
        examples had contributed zero."""
        t = self.cfg.train
        number = self.step + 1
        self.faults.before_step(number, self.bundle)
        started = time.perf_counter()
        micro = ranks.rank_micro_batches(examples, self.world.rank, self.world.size, t.micro_batch_size)
        n_labels = sum(e.n_label_tokens for e in examples)  # the world's step: every rank holds all of it
        n_tokens = sum(len(e.input_ids) for e in examples)
        poison = self.faults.take_nan()
        own_bad: list[str] = []  # this rank's examples whose own loss was non-finite
        ce_total = aux_total = 0.0
        self.accum = 0
        pause = t.sleep_per_step_s / t.grad_accum
        for batch in micro:
            # Gradients are exchanged once per optimizer step, on its last micro-step.
            last = self.accum == len(micro) - 1
            with contextlib.nullcontext() if last else self.world.no_sync(self.train_module):
                loss, ce, aux, bad_rows = self.bundle.compute_loss_rows(
                    collate(batch, self.bundle.tokenizer.pad_token_id),
                    n_labels,
                    self.train_module,
                    poison=self.faults.poisoned(number, [e.id for e in batch]),
                )
                own_bad += [batch[i].id for i in bad_rows]
                if poison:
                    loss = loss * float("nan")
                    ce = float("nan")
                if last:  # the last backward waits for the other ranks: what came before is this rank's own time
                    own_s = time.perf_counter() - started
                loss.backward()
            self.accum += 1
            ce_total += ce
            aux_total += aux
            if pause:
                time.sleep(pause)
            if self.accum < len(micro):
                self.hb.progress(micro_step=self.accum, grad_accum=t.grad_accum)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm))
        # The world's sums, so that every rank reports the same loss and takes (or skips) the step alike.
        ce_total, aux_total, bad_norms = self.world.sum([ce_total, aux_total, 0.0 if math.isfinite(grad_norm) else 1.0])
        loss_value = ce_total / n_labels
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(loss_value) and bad_norms == 0 and math.isfinite(aux_total)
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.step += 1
            self.nonfinite_streak = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_streak += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.accum = 0
        self.samples += len(examples)
        self.tokens += n_tokens
        partial = len(examples) < self.step_size
        ids = [e.id for e in examples]
        if finite:
            self.partial_steps += partial
            self.last_step_examples = len(examples)
            self.bad_steps = []
        else:
            self.note_bad_step(number, ids, own_bad)
        elapsed = time.perf_counter() - started
        self.boundary_position = self.source.position()
        own = {"step_time_s": round(own_s, 4)} if self.world.size > 1 else {}  # for the supervisor's straggler check
        return {
            "finite": finite,
            "loss": loss_value,
            "aux_loss": aux_total / n_labels,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": round(n_tokens / elapsed, 1) if elapsed > 0 else None,
            "step_s": round(elapsed, 4),
            "samples": self.samples,
            "tokens": self.tokens,
            "examples": len(examples),
            "partial": partial,
            "examples_digest": examples_digest(ids),
            **({"example_ids": ids} if len(ids) <= MAX_IDS_IN_BEAT else {}),
            **own,
            **self.source.progress(),
        }

    def after_step(self, m: dict) -> None:
        """Beats, log line and the non-finite guard for the step just taken."""
        t = self.cfg.train
        if m["finite"]:
            fields = {k: v for k, v in m.items() if k != "finite"}
            fields.update(memory_metrics(self.bundle.device))
            self.hb.step(self.step, **fields)
            if self.trackers is not None:
                self.trackers.log(self.step, step_metrics(m))
            fields.pop("example_ids", None)
            self.last_metrics = fields
            where = " ".join(f"{k} {v}" for k, v in self.source.progress().items())
            if m["partial"]:
                where += f" (partial: {m['examples']} of {self.step_size} examples)"
            self.log(
                f"step {self.step}/{t.max_steps} loss {m['loss']:.4f} aux {m['aux_loss']:.4f} lr {m['lr']:.3e} "
                f"grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']} {where}"
            )
            self.confirmation.confirm(self.step)
            return
        dropped = self.confirmation.unconfirm()
        if self.last_good is not None:
            self.last_good.drop_pending()
        self.hb.warn(
            "non-finite loss or gradient norm: optimizer step skipped",
            loss=m["loss"],
            grad_norm=m["grad_norm"],
            streak=self.nonfinite_streak,
            nonfinite_total=self.nonfinite_total,
            unconfirmed_checkpoints=dropped,
        )
        self.log(
            f"step {self.step + 1}: non-finite (loss {m['loss']}, grad_norm {m['grad_norm']}) — skipped, "
            f"{self.nonfinite_streak} in a row (limit {t.max_nonfinite_streak})"
        )
        if self.nonfinite_streak >= t.max_nonfinite_streak:
            self.confirmation.withdraw_provisional()
            if self.last_good is not None:
                self.last_good.withdrawn()
            self.quarantine_streak()
            raise NonFiniteStreak(self.nonfinite_streak, self.step)

    def note_bad_step(self, number: int, ids: list[str], own_bad: list[str]) -> None:
        """A skipped (non-finite) step: its examples, and those whose own loss was non-finite on any rank."""
        if self.world.size > 1:
            gathered = self.world.gather(own_bad)
            own_bad = [i for part in gathered or [] for i in part]
        own = set(own_bad)
        self.bad_steps.append(quarantine.BadStep(number, ids, [i for i in ids if i in own]))

    def quarantine_streak(self) -> None:
        """Before exit 75: the streak's culprits into quarantine.jsonl (rank 0), said in a warning and the log."""
        if self.world.is_main and self.bad_steps and self.continuous is None:
            quarantine.report(quarantine.record(self.run_dir, self.bad_steps, self.attempt), self.hb, self.log)

    # ---- checkpoints and evals ----------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        """This step's checkpoint, written once (by rank 0, with every rank's state gathered)."""
        rank_states = self.world.gather(self.rank_state())
        self.world.on_main(self.hb, "checkpoint", lambda: self._commit(rank_states))
        self.last_saved_step = self.step
        return ckpt.checkpoints_root(self.run_dir, self.cfg.checkpoint.dir) / ckpt.step_name(self.step)

    def _commit(self, rank_states: list) -> Path:
        root = ckpt.checkpoints_root(self.run_dir, self.cfg.checkpoint.dir)
        with self.hb.phase("checkpoint", budget_s=self.cfg.watchdog.phase_budgets_s.get("checkpoint")):
            started = time.perf_counter()
            position = self.boundary_position
            # Continuous mode: resumable (provisional) from the instant it exists, before it is announced
            # and before its data is recorded as done.
            path = ckpt.commit(
                root,
                self.step,
                lambda tmp: self.fill_checkpoint(tmp, rank_states),
                markers=self.confirmation.commit_markers,
            )
            self.last_saved_step = self.step
            provisional = (path / ckpt.PROVISIONAL).exists()
            self.hb.checkpoint(
                path, self.step, False, save_s=round(time.perf_counter() - started, 4), provisional=provisional
            )
            self.log(
                f"checkpoint {path.name} saved ({time.perf_counter() - started:.2f}s)"
                + (", provisional" if provisional else "")
            )
            if self.continuous is not None:
                self.continuous.commit(
                    position, self.step
                )  # after the manifest: a kill before this is repaired by the resume
            if self.last_good is not None:
                self.last_good.committed(path, self.step)
            self.confirmation.committed(Pending(path, self.step), self.step)
        return path

    def _eval_oom(self, size: int, smaller: int, message: str) -> None:
        """An eval batch (or a prompt's generate(): `smaller` 0) ran out of memory and was halved (or skipped)."""
        what = (
            f"eval batch {size} → {smaller}"
            if smaller
            else "one prompt's generate() skipped (a prompt is one batch: nothing to halve)"
        )
        self.recoveries.append({"kind": "eval_oom", "step": self.step, "from": size, "to": smaller})
        self.hb.warn(
            f"out of memory in the eval at step {self.step}: {what}, in the process (no restart)",
            eval_oom={"step": self.step, "from": size, "to": smaller, "message": message[:1200]},
        )
        self.log(f"eval at step {self.step}: out of memory — {what} (no restart)")

    def evaluate(self) -> None:
        every = self.cfg.eval.every_steps
        number = self.step // every
        with self.hb.phase("eval", budget_s=self.cfg.watchdog.phase_budgets_s.get("eval")):
            processors = self.faults.before_eval(self.step, number, self.bundle)
            summary = run_eval(
                self.bundle,
                self.cfg,
                self.hb,
                self.run_dir,
                self.step,
                self.eval_examples,
                attempt=self.attempt,
                processors=processors,
                should_stop=lambda: bool(self.stop),
                world=self.world,
                on_oom=self._eval_oom if self.in_process else None,
            )
        loss = summary["loss"]
        if self.trackers is not None:
            self.trackers.log(self.step, eval_metrics(summary))
        self.log(
            f"eval {number} at step {self.step}: loss {'-' if loss is None else f'{loss:.4f}'}, "
            f"{summary['generations']} generations"
        )

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        self.hb.enter_phase("train")
        self.bundle.model.train()
        while True:
            abandoned: Optional[tuple] = None
            try:
                if self.watch is not None and self.last_good.held is not None:
                    self.watch.arm()  # only with a state to go back to
                reason = self.iteration()
                if self.watch is not None:
                    self.watch.disarm()
                if reason is not None:
                    return reason
            except StepAbandoned as exc:
                self.watch.disarm()  # in the handler: marks the order delivered
                abandoned = (landed_at(exc),)
            except NonFiniteStreak as exc:
                if self.watch is not None:
                    self.watch.disarm()
                if not self.recover_nonfinite(exc):
                    raise
            if abandoned is not None:
                self.recover_stall(*abandoned)

    def iteration(self) -> Optional[str]:
        """One turn of the loop: a stop, the end, or one optimizer step with its eval and checkpoint when due;
        the run's end reason, or None to go on."""
        cfg = self.cfg
        if self.world.any(bool(self.stop)):  # a stop request may have reached some ranks only
            self.stop_gracefully()
            return "terminated"
        if self.step >= cfg.train.max_steps:
            self.finish()
            return "finished"
        examples, end = self.next_examples()
        if end == "stop":
            return None  # a partial step is dropped: the checkpoint's position is the last step boundary
        if end == "flush":
            self.flush(examples)
            return None
        if end == "idle":
            if examples:
                self.after_step(self.train_step(examples))
            self.finish("no new data for data.idle_exit_s")
            return "idle"
        before = self.step
        self.after_step(self.train_step(examples))
        if self.step == before:
            return None
        if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0:
            self.evaluate()
        if self.step % cfg.checkpoint.every_steps == 0 or self.step >= cfg.train.max_steps:
            self.save_checkpoint()
        return None

    # ---- the micro-batch measured, after an out-of-memory restart ------------------------------------------

    def probe_micro_batch(self) -> dict:
        """After an out-of-memory restart (remediation.json asks for a `probe`): one forward and backward at micro-batch
        1 on the longest example of the next step, before training, with the device's peak measured — an upper bound
        of what one example costs (everything the step allocates above the weights, gradients included) — and the
        largest micro-batch that divides the effective batch, is at most the one in force, and fits in PROBE_MARGIN of
        the capacity by that measure.  Nothing of it stays: gradients dropped, RNG and data position as they were.
        Every rank measures; the largest cost decides for all.  Returns what was measured and picked (`picked` None:
        nothing measured — no figures on this device — or micro-batch 1 itself ran out of memory)."""
        import torch

        from hangwatch.daemon.data import collate
        from hangwatch.daemon.trainer.memory_evidence import CudaProbe
        from hangwatch.daemon.trainer.recovery import PROBE_MARGIN, fitting_micro, release_memory

        t = self.cfg.train
        device = self.bundle.device
        probe = getattr(self.faults, "memory_probe", None)
        if probe is None and device.type == "cuda":
            probe = CudaProbe()
        result: dict = {"micro_batch_size": t.micro_batch_size, "grad_accum": t.grad_accum, "picked": None}
        mine: Optional[float] = None
        if probe is None:
            result["why"] = "no memory figures on this device (torch.cuda gives them; the CPU does not)"
        else:
            position = self.source.position()
            examples = self.source.take(self.step_size)
            self.source.restore(position, self.step)
            longest = max(examples, key=lambda e: len(e.input_ids))
            rng = state.rng_state(cuda=device.type == "cuda")
            if hasattr(probe, "attach"):  # the fake device sizes training forwards: this one too, whatever the step
                probe.attach(max(self.step + 1, getattr(probe, "at_step", 0)), self.bundle)
            if hasattr(probe, "reset_peak"):
                probe.reset_peak()
            elif device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            before = probe.figures(device)
            try:
                with self.world.no_sync(self.train_module):
                    loss, _, _, _ = self.bundle.compute_loss_rows(
                        collate([longest], self.bundle.tokenizer.pad_token_id),
                        longest.n_label_tokens,
                        self.train_module,
                        poison=[False],
                    )
                    loss.backward()
                del loss
                after = probe.figures(device)
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                after = None
                result["why"] = f"micro-batch 1 itself ran out of memory: {str(exc)[:300]}"
            self.optimizer.zero_grad(set_to_none=True)
            release_memory(device)
            state.set_rng_state(rng)
            if after is not None and "allocated_mb" in before and "peak_mb" in after:
                mine = max(0.0, float(after["peak_mb"]) - float(before["allocated_mb"]))
                caps = [after[k] for k in ("allowed_mb", "total_mb") if k in after]
                if "free_mb" in after and "reserved_mb" in after:
                    caps.append(after["free_mb"] + after["reserved_mb"])
                result.update(
                    weights_mb=round(float(before["allocated_mb"]), 1),
                    capacity_mb=round(min(caps), 1) if caps else None,
                    example_tokens=len(longest.input_ids),
                )
        costs = self.world.gather(mine)
        per_example = max((c for c in costs or [] if c is not None), default=None) if self.world.is_main else None
        pick = None
        if self.world.is_main and per_example is not None and result.get("capacity_mb"):
            effective = t.micro_batch_size * t.grad_accum
            pick = fitting_micro(
                result["weights_mb"], per_example, result["capacity_mb"], effective, t.micro_batch_size, PROBE_MARGIN
            )
            result.update(per_example_mb=round(per_example, 1), margin=PROBE_MARGIN)
        pick = self.world.broadcast(pick)
        result["picked"] = pick
        if pick is not None and pick != t.micro_batch_size:
            to = Rung(pick, t.micro_batch_size * t.grad_accum // pick, bool(self.cfg.model.gradient_checkpointing))
            self.cfg = remediation.apply(self.cfg, to.as_dict())
            memory_evidence.note_micro(pick)
            result["to"] = to.as_dict()
        return result

    # ---- recovery in the process --------------------------------------------------------------

    def roll_back(self) -> Optional[Path]:
        """Put the last good checkpoint's state (held in memory) back, as a restart from it would: weights, optimizer,
        scheduler, data position (passing over what is quarantined since), counters, RNG states last.  Returns the
        checkpoint's path (None: the state before the first step)."""
        held = self.last_good.held
        self.optimizer.zero_grad(set_to_none=True)
        self.accum = 0
        self.bad_steps = []
        self.confirmation.unconfirm()
        self.last_good.drop_pending()
        skip = quarantine.quarantined_ids(self.run_dir)
        if hasattr(self.source, "quarantine"):
            self.source.quarantine(skip)
        self.faults.rolled_back()
        self._put_back(held)
        state.load_rng(held, self.world.rank)
        self.hb.current_step = self.step
        self.bundle.model.train()
        return held.path

    def _can_roll_back(self, kind: str, failed_step: int) -> Optional[tuple]:
        """The key of this recovery, or None when it cannot be made here (nothing held, or the same failure after
        the same rollback already: the restart path takes it from there)."""
        if self.last_good is None or self.last_good.held is None:
            return None
        key = (kind, self.last_good.step, failed_step)
        return None if key in self.rollbacks else key

    def recover_nonfinite(self, exc: NonFiniteStreak) -> bool:
        """A non-finite streak (its examples already quarantined): the last good state put back, training goes on.
        False: not here (the exception goes on to exit 75 and a restart)."""
        failed = exc.step + 1
        key = self._can_roll_back("nonfinite", failed)
        if key is None:
            return False
        started = time.perf_counter()
        self.rollbacks.add(key)
        before = frozenset(getattr(self.source, "skip", frozenset()))
        path = self.roll_back()
        record = {
            "kind": "nonfinite",
            "streak": exc.streak,
            "failed_step": failed,
            "restored_step": self.step,
            "restored_from": str(path) if path else None,
            # the ids this streak quarantined (at most 40 here: a heartbeat line stays under PIPE_BUF; all of them
            # are in quarantine.jsonl)
            "quarantined": sorted(frozenset(getattr(self.source, "skip", frozenset())) - before)[:40],
            "s": round(time.perf_counter() - started, 4),
        }
        self.recoveries.append(record)
        self.hb.enter_phase("train")
        self.hb.warn(
            f"{exc.streak} non-finite steps in a row after step {exc.step}: rolled back in the process to "
            f"{'step ' + str(self.step) if path else 'the start'} (no restart)",
            **{RECOVERED_FIELD: record},
        )
        self.log(
            f"non-finite streak after step {exc.step}: rolled back in the process to "
            f"{path.name if path else 'the start'} (step {self.step})"
        )
        return True

    def recover_stall(self, where: Optional[str]) -> None:
        """The supervisor abandoned a stuck step (`where`: where the exception reached it): the last good state put
        back, training goes on.  Called out of the exception's handler, so that the abandoned step's frames (and
        tensors) are gone; the watch is armed only while a state is held."""
        phase = self.watch.raised_phase if self.watch is not None else None
        failed = self.step + 1
        started = time.perf_counter()
        path = self.roll_back()
        record = {
            "kind": "stall",
            "order": self.watch.delivered if self.watch is not None else None,
            "failed_step": failed,
            "phase": phase,
            "landed_at": where,
            "restored_step": self.step,
            "restored_from": str(path) if path else None,
            "s": round(time.perf_counter() - started, 4),
        }
        self.recoveries.append(record)
        self.hb.enter_phase("train")
        what = f"the {phase} at step {failed - 1}" if phase in ("eval", "generate") else f"step {failed}"
        self.hb.warn(
            f"{what} stuck: abandoned in the process ({where}); back to "
            f"{'step ' + str(self.step) if path else 'the start'} (no restart)",
            **{RECOVERED_FIELD: record},
        )
        self.log(
            f"{what} abandoned on the supervisor's order (stuck at {where}); rolled back in the process to "
            f"{path.name if path else 'the start'} (step {self.step})"
        )

    def flush(self, examples: list[Example]) -> None:
        """Continuous mode went quiet: train what is in hand as a partial step, write the checkpoint that
        covers everything trained so far (their files reach done/) and settle it."""
        if examples:
            before = self.step
            self.after_step(self.train_step(examples))
            if self.step != before and self.cfg.eval.every_steps and self.step % self.cfg.eval.every_steps == 0:
                self.evaluate()
        if self.step == 0:
            return  # nothing trained yet: nothing to make durable
        if self.last_saved_step != self.step:
            self.save_checkpoint()
        if self.nonfinite_streak or self.confirmation.waiting_at(self.step) is None:
            return  # good already, or the training since it did not stay finite: nothing to settle
        # The weights are the checkpoint's (just saved, or resumed and not stepped since).
        self.confirmation.settle_idle(self.step, heldout_loss(self.bundle, self.cfg, self.hb, self.eval_examples))

    def stop_gracefully(self) -> None:
        """A stop request: checkpoint this step (unless done already) and leave it provisional."""
        if self.step > 0:
            # The step's checkpoint may already exist (saved on schedule just before the request,
            # common while continuous mode idles): it too must not wait for a confirmation that
            # this attempt will never give.
            path = (
                self.save_checkpoint()
                if self.last_saved_step != self.step
                else ckpt.checkpoints_root(self.run_dir, self.cfg.checkpoint.dir) / ckpt.step_name(self.step)
            )
            finite = self.nonfinite_streak == 0 and self.bundle.weights_finite()
            self.confirmation.provisional_on_stop(path, finite, f"graceful stop on {self.stop_reason}")
        self.log(f"stopping on {self.stop_reason} at step {self.step}")

    @property
    def stop_reason(self) -> str:
        return self.stop.requested or "another rank's stop request"

    def finish(self, why: str = "finished") -> None:
        """At the end (max_steps, or idle): the last checkpoint counts as confirmed (nothing follows it),
        the adapter is exported."""
        if self.last_saved_step != self.step:
            self.save_checkpoint()
        self.confirmation.finish(self.step, why)
        # Beside the checkpoints when they have a directory of their own (multi-node: the one every node sees,
        # so the adapter is found in one place whichever node ran rank 0 at the end), else in the run dir.
        final = (Path(self.cfg.checkpoint.dir) if self.cfg.checkpoint.dir else self.run_dir) / FINAL_DIR
        self.world.on_main(self.hb, "export", lambda: export_final(self.bundle, self.cfg, final, self.step))
        self.log(f"finished at step {self.step}{'' if why == 'finished' else f' ({why})'}; adapter exported to {final}")

    def log(self, line: str) -> None:
        """The worker log: rank 0's lines only (every rank's beats carry its own numbers)."""
        if self.world.is_main:
            print(line, file=self.out, flush=True)
