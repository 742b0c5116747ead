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

from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ContinuousDataSource, DataSource, Example, collate
from hangwatch.daemon.distributed import World
from hangwatch.daemon.evaluate import heldout_loss, run_eval
from hangwatch.daemon.export import FINAL_DIR, export_final
from hangwatch.daemon.model import ModelBundle, memory_metrics
from hangwatch.daemon.resume_compat import fingerprint
from hangwatch.daemon.trainer import memory_evidence, quarantine, ranks, state
from hangwatch.daemon.trainer.confirmation import Confirmation, Pending, RankConfirmation
from hangwatch.daemon.trainer.quarantine import MAX_IDS_IN_BEAT, examples_digest
from hangwatch.daemon.trainer.schedule import WarmupCosine
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
    ):
        """`configured`: the config as written, when `cfg` is a remedied copy of it (its fingerprint is the run's)."""
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
            )
            if self.world.is_main
            else RankConfirmation(hb)
        )
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
        saved = state.load_weights(path, self.bundle, self.optimizer, self.scheduler)
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
        self.resumed_from = path
        if not ckpt.is_good(path):
            self.confirmation.wait_for(Pending(path, self.step))  # provisional: the steps after it confirm it
        state.load_rng(path, self.world.rank)  # last: nothing after this may draw random numbers before training does

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
        """Accumulate the step's micro-batches (`grad_accum` of them; fewer for a partial step) and take
        (or skip, when non-finite) one optimizer step; `examples` default to the source's next.

        Every micro-batch's loss is divided by the label tokens of the whole step *as it is*: a partial
        step's loss is the mean over the tokens actually present, never scaled down as if the missing
        examples had contributed zero."""
        t = self.cfg.train
        if examples is None:
            examples, _ = self.next_examples()
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
            self.confirmation.committed(Pending(path, self.step), self.step)
        return path

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
            )
        loss = summary["loss"]
        self.log(
            f"eval {number} at step {self.step}: loss {'-' if loss is None else f'{loss:.4f}'}, "
            f"{summary['generations']} generations"
        )

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> str:
        cfg = self.cfg
        self.hb.enter_phase("train")
        self.bundle.model.train()
        while True:
            if self.world.any(bool(self.stop)):  # a stop request may have reached some ranks only
                self.stop_gracefully()
                return "terminated"
            if self.step >= cfg.train.max_steps:
                self.finish()
                return "finished"
            examples, end = self.next_examples()
            if end == "stop":
                continue  # a partial step is dropped: the checkpoint's position is the last step boundary
            if end == "flush":
                self.flush(examples)
                continue
            if end == "idle":
                if examples:
                    self.after_step(self.train_step(examples))
                self.finish("no new data for data.idle_exit_s")
                return "idle"
            before = self.step
            self.after_step(self.train_step(examples))
            if self.step == before:
                continue
            if cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0:
                self.evaluate()
            if self.step % cfg.checkpoint.every_steps == 0 or self.step >= cfg.train.max_steps:
                self.save_checkpoint()

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
