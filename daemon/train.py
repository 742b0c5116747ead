"""The training loop: AdamW on the trainable parameters, warm-up + cosine in optimizer steps,
gradient accumulation with its own counter, clipping, a non-finite guard, evals, checkpoints.

Exactness is the point: a run killed at any instant and restarted from its last good checkpoint
continues bit for bit.  So everything that decides the next step's numbers is saved at a step
boundary and restored: adapter and extra-module weights, optimizer and scheduler state, the RNG
states (dropout), the data position and the accumulation counter; evaluation runs on a set-aside
RNG so whether it ran does not matter.

Lifecycle: `Trainer(...)` → `restore(path)` (or `seed_fresh()`) → `run()` → "finished" | "terminated"
| "idle".  Within a step boundary the order is: step beat → confirm pending checkpoints → eval (if
due) → checkpoint (if due) → stop request → max_steps.

The data position a checkpoint stores is the one taken at the last step boundary: a continuous-mode
source (`daemon.continuous`) may have handed out part of the next step's examples when a stop
request ends its wait for more, and those are simply taken again after the resume.  Once a
checkpoint is committed, the source's `commit` (if it has one) records what it covers.  A source
that runs dry for good (`end` "idle") gets its last, partial step trained, and the run finishes
with reason "idle".
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, TextIO

import numpy as np
import torch

from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import DataSource, Example, collate
from hangwatch.daemon.errors import NonFiniteStreak
from hangwatch.daemon.evaluate import run_eval
from hangwatch.daemon.model import EXTRA_FILE, ModelBundle, export_final, memory_metrics

ADAPTER_FILE = "adapter_model.safetensors"
# Settings that change nothing a checkpoint holds, so they may differ on resume.
FINGERPRINT_FREE = {("train", "sleep_per_step_s"), ("train", "max_nonfinite_streak")}


class WarmupCosine:
    """lr factor for optimizer step s (0-based): linear warm-up, then cosine decay to 0 at `total`."""

    def __init__(self, warmup: int, total: int):
        self.warmup = warmup
        self.total = total

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / (self.warmup + 1)
        progress = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def fingerprint_differences(saved: dict, current: dict, prefix: tuple = ()) -> list[str]:
    """'key: saved → current' for each setting that differs and matters for exact resume."""
    out = []
    for key in sorted(set(saved) | set(current)):
        path = prefix + (key,)
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_differences(a, b, path)
        elif a != b and path not in FINGERPRINT_FREE:
            out.append(f"{'.'.join(path)}: {a!r} → {b!r}")
    return out


@dataclass
class Pending:
    path: Path
    step: int


class NullHeartbeat:
    """Same interface as Heartbeat, writes nothing (benchmarks compare against it)."""

    current_step = 0
    current_phase = "train"

    def step(self, step, **m):
        self.current_step = step

    def progress(self, **k):
        pass

    def warn(self, *a, **k):
        pass

    def checkpoint(self, *a, **k):
        pass

    def enter_phase(self, name, budget_s=None, **k):
        self.current_phase = name

    def phase(self, name, budget_s=None, **k):
        import contextlib

        return contextlib.nullcontext()


class Trainer:
    def __init__(self, cfg, hb, run_dir, bundle: ModelBundle, source: DataSource, eval_examples: list[Example],
                 faults, stop, *, attempt: int = 1, out: TextIO = sys.stdout):
        self.cfg = cfg
        self.hb = hb
        self.run_dir = Path(run_dir)
        self.bundle = bundle
        self.source = source
        self.eval_examples = eval_examples
        self.faults = faults
        self.stop = stop
        self.attempt = attempt
        self.out = out
        t = cfg.train
        self.params = [p for _, p in bundle.trainable_parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, WarmupCosine(t.warmup_steps, t.max_steps))
        self.step = 0
        self.accum = 0  # micro-batches accumulated into the current optimizer step
        self.samples = 0
        self.tokens = 0
        self.nonfinite_total = 0
        self.nonfinite_streak = 0
        self.last_saved_step: Optional[int] = None
        self.pending: list[Pending] = []
        self.resumed_from: Optional[Path] = None
        self.last_metrics: dict = {}
        self.boundary_position: dict = {}  # the source's position at the last optimizer-step boundary

    # ---- state ----------------------------------------------------------------------------

    def seed_fresh(self) -> None:
        self.source.restore(None, 0)
        self.boundary_position = self.source.position()
        seed = self.cfg.train.seed
        random.seed(seed)
        np.random.seed(seed & 0xFFFFFFFF)
        torch.manual_seed(seed)

    def rng_state(self) -> dict:
        py = random.getstate()
        npst = np.random.get_state()
        state = {
            "python": [py[0], list(py[1]), py[2]],
            "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def set_rng_state(self, state: dict) -> None:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    def trainer_state(self) -> dict:
        from hangwatch.common.config import fingerprint

        return {
            "step": self.step,
            "data_position": self.boundary_position,
            "accumulation": {"micro_step": self.accum, "grad_accum": self.cfg.train.grad_accum},
            "samples": self.samples,
            "tokens": self.tokens,
            "nonfinite_total": self.nonfinite_total,
            "nonfinite_streak": self.nonfinite_streak,
            "weights_finite": self.bundle.weights_finite(),
            "fingerprint": fingerprint(self.cfg),
            "attempt": self.attempt,
            "t": time.time(),
        }

    def _fill(self, tmp: Path) -> None:
        from safetensors.torch import save_file

        save_file(self.bundle.adapter_state(), str(tmp / ADAPTER_FILE))
        self.bundle.model.peft_config["default"].save_pretrained(str(tmp))
        extra = self.bundle.extra_state()
        if extra:
            save_file(extra, str(tmp / EXTRA_FILE))
        torch.save(self.optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(self.rng_state(), tmp / "rng.pt")
        (tmp / ckpt.STATE).write_text(json.dumps(self.trainer_state(), indent=1, sort_keys=True) + "\n")

    def restore(self, path: Path) -> None:
        """Continue from checkpoint `path` exactly where it left off."""
        from safetensors.torch import load_file

        state = ckpt.read_state(path)
        accum = state["accumulation"]
        if accum["micro_step"] != 0:
            raise RuntimeError(f"{path}: saved mid-accumulation (micro_step {accum['micro_step']}); checkpoints are step boundaries")
        self.bundle.load_adapter_state(load_file(str(path / ADAPTER_FILE), device="cpu"))
        if (path / EXTRA_FILE).exists() or self.bundle.extra:
            if not (path / EXTRA_FILE).exists():
                raise RuntimeError(f"{path}: the model has extra trainable modules {sorted(self.bundle.extra)} but the checkpoint holds none")
            self.bundle.load_extra_state(load_file(str(path / EXTRA_FILE), device="cpu"))
        if not self.bundle.weights_finite():
            raise RuntimeError(f"{path}: restored weights are not finite")
        self.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"))
        self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        self.source.restore(state["data_position"], int(state["step"]))
        self.boundary_position = self.source.position()
        self.step = int(state["step"])
        self.hb.current_step = self.step
        self.samples = int(state["samples"])
        self.tokens = int(state["tokens"])
        self.nonfinite_total = int(state["nonfinite_total"])
        self.nonfinite_streak = int(state["nonfinite_streak"])
        self.last_saved_step = self.step
        self.resumed_from = path
        if not ckpt.is_good(path):
            self.pending.append(Pending(path, self.step))  # provisional: the steps after it confirm it
        # Last: nothing after this may draw random numbers before training does.
        self.set_rng_state(torch.load(path / "rng.pt", weights_only=True))

    # ---- one optimizer step ---------------------------------------------------------------

    def next_examples(self) -> tuple[list[Example], Optional[str]]:
        """The next optimizer step's examples, and why there are fewer than a full step (None: there are not)."""
        t = self.cfg.train
        n = t.micro_batch_size * t.grad_accum
        take_step = getattr(self.source, "take_step", None)
        if take_step is not None:
            return take_step(n)
        return self.source.take(n), None

    def train_step(self, examples: Optional[list[Example]] = None) -> dict:
        """Accumulate the step's micro-batches (`grad_accum` of them; fewer for a partial last step)
        and take (or skip, when non-finite) one optimizer step; `examples` default to the source's next."""
        t = self.cfg.train
        if examples is None:
            examples, _ = self.next_examples()
        number = self.step + 1
        self.faults.before_step(number, self.bundle)
        started = time.perf_counter()
        size = t.micro_batch_size
        micro = [examples[i:i + size] for i in range(0, len(examples), size)]
        n_labels = sum(e.n_label_tokens for mb in micro for e in mb)
        n_tokens = sum(len(e.input_ids) for mb in micro for e in mb)
        poison = self.faults.take_nan()
        ce_total = aux_total = 0.0
        self.accum = 0
        pause = t.sleep_per_step_s / t.grad_accum
        for examples in micro:
            loss, ce, aux = self.bundle.compute_loss(collate(examples, self.bundle.tokenizer.pad_token_id), n_labels)
            if poison:
                loss = loss * float("nan")
                ce = float("nan")
            loss.backward()
            self.accum += 1
            ce_total += ce
            aux_total += aux
            if pause:
                time.sleep(pause)
            if self.accum < len(micro):
                self.hb.progress(micro_step=self.accum, grad_accum=t.grad_accum)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm))
        loss_value = ce_total / n_labels
        lr = self.optimizer.param_groups[0]["lr"]
        finite = math.isfinite(loss_value) and math.isfinite(grad_norm) and math.isfinite(aux_total)
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
        self.samples += sum(len(mb) for mb in micro)
        self.tokens += n_tokens
        elapsed = time.perf_counter() - started
        self.boundary_position = self.source.position()
        return {
            "finite": finite, "loss": loss_value, "aux_loss": aux_total / n_labels, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": round(n_tokens / elapsed, 1) if elapsed > 0 else None, "step_s": round(elapsed, 4),
            "samples": self.samples, "tokens": self.tokens, **self.source.progress(),
        }

    def after_step(self, m: dict) -> None:
        """Beats, log line and the non-finite guard for the step just taken."""
        t = self.cfg.train
        if m["finite"]:
            fields = {k: v for k, v in m.items() if k != "finite"}
            fields.update(memory_metrics(self.bundle.device))
            self.hb.step(self.step, **fields)
            self.last_metrics = fields
            where = " ".join(f"{k} {v}" for k, v in self.source.progress().items())
            self.log(f"step {self.step}/{t.max_steps} loss {m['loss']:.4f} aux {m['aux_loss']:.4f} lr {m['lr']:.3e} "
                     f"grad_norm {m['grad_norm']:.3f} tok/s {m['tokens_per_s']} {where}")
            self.confirm_pending()
            return
        dropped = [str(p.path) for p in self.pending]
        self.pending.clear()
        self.hb.warn("non-finite loss or gradient norm: optimizer step skipped", loss=m["loss"], grad_norm=m["grad_norm"],
                     streak=self.nonfinite_streak, nonfinite_total=self.nonfinite_total, unconfirmed_checkpoints=dropped)
        self.log(f"step {self.step + 1}: non-finite (loss {m['loss']}, grad_norm {m['grad_norm']}) — skipped, "
                 f"{self.nonfinite_streak} in a row (limit {t.max_nonfinite_streak})")
        if self.nonfinite_streak >= t.max_nonfinite_streak:
            ckpt.clear_provisional(ckpt.checkpoints_root(self.run_dir))
            raise NonFiniteStreak(self.nonfinite_streak, self.step)

    # ---- checkpoints ------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        root = ckpt.checkpoints_root(self.run_dir)
        with self.hb.phase("checkpoint", budget_s=self.cfg.watchdog.phase_budgets_s.get("checkpoint")):
            started = time.perf_counter()
            position = self.boundary_position
            path = ckpt.commit(root, self.step, self._fill)
            self.last_saved_step = self.step
            self.hb.checkpoint(path, self.step, False, save_s=round(time.perf_counter() - started, 4))
            self.log(f"checkpoint {path.name} saved ({time.perf_counter() - started:.2f}s)")
            commit = getattr(self.source, "commit", None)
            if commit is not None:
                commit(position, self.step)  # after the manifest: a kill before this is repaired by the resume
            if self.cfg.checkpoint.confirm_steps == 0:
                self.mark_good(Pending(path, self.step))
            else:
                self.pending.append(Pending(path, self.step))
            self.retain()
        return path

    def mark_good(self, p: Pending, **why) -> None:
        if ckpt.validate(p.path, verify_hashes=False) is not None:
            self.hb.warn(f"checkpoint {p.path.name} is gone or damaged before it could be confirmed", path=str(p.path))
            return
        state = ckpt.read_state(p.path)
        if not state.get("weights_finite", False):
            self.hb.warn(f"checkpoint {p.path.name} has non-finite weights: never good", path=str(p.path))
            return
        ckpt.mark_good(p.path, confirmed_at_step=self.step, **why)
        self.hb.checkpoint(p.path, p.step, True)
        self.log(f"checkpoint {p.path.name} is good")

    def confirm_pending(self) -> None:
        need = self.cfg.checkpoint.confirm_steps
        still = []
        for p in self.pending:
            if self.step - p.step >= need:
                self.mark_good(p)
            else:
                still.append(p)
        changed = len(still) != len(self.pending)
        self.pending = still
        if changed:
            self.retain()

    def retain(self) -> None:
        """Retention; checkpoints still waiting for confirmation are kept too, or with a small keep_last
        none would ever live long enough to become good."""
        ckpt.apply_retention(ckpt.checkpoints_root(self.run_dir), self.cfg.checkpoint.keep_last,
                             protect=tuple(p.path for p in self.pending))

    # ---- the loop ---------------------------------------------------------------------------

    def evaluate(self) -> None:
        every = self.cfg.eval.every_steps
        number = self.step // every
        with self.hb.phase("eval", budget_s=self.cfg.watchdog.phase_budgets_s.get("eval")):
            processors = self.faults.before_eval(self.step, number, self.bundle)
            summary = run_eval(self.bundle, self.cfg, self.hb, self.run_dir, self.step, self.eval_examples,
                               attempt=self.attempt, processors=processors, should_stop=lambda: bool(self.stop))
        loss = summary["loss"]
        self.log(f"eval {number} at step {self.step}: loss {'-' if loss is None else f'{loss:.4f}'}, "
                 f"{summary['generations']} generations")

    def run(self) -> str:
        cfg = self.cfg
        self.hb.enter_phase("train")
        self.bundle.model.train()
        while True:
            if self.stop:
                if self.step > 0:
                    # The step's checkpoint may already exist (saved on schedule just before the
                    # request, common while continuous mode idles): it too must not wait for a
                    # confirmation that this attempt will never give.
                    path = (self.save_checkpoint() if self.last_saved_step != self.step
                            else ckpt.checkpoints_root(self.run_dir) / ckpt.step_name(self.step))
                    if (path.is_dir() and self.nonfinite_streak == 0 and self.bundle.weights_finite()
                            and not ckpt.is_good(path) and not ckpt.is_provisional(path)):
                        ckpt.mark_provisional(path, reason=f"graceful stop on {self.stop.requested}")
                        self.log(f"checkpoint {path.name} is provisional: the next attempt resumes from it")
                self.log(f"stopping on {self.stop.requested} at step {self.step}")
                return "terminated"
            if self.step >= cfg.train.max_steps:
                self.finish()
                return "finished"
            examples, end = self.next_examples()
            if end == "stop":
                continue  # a partial step is dropped: the checkpoint's position is the last step boundary
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

    def finish(self, why: str = "finished") -> None:
        """At the end (max_steps, or idle): the last checkpoint counts as confirmed (nothing follows it),
        the adapter is exported."""
        if self.last_saved_step != self.step:
            self.save_checkpoint()
        path = ckpt.checkpoints_root(self.run_dir) / ckpt.step_name(self.step)
        self.pending = [p for p in self.pending if p.path != path]
        if not ckpt.is_good(path):
            self.mark_good(Pending(path, self.step), reason=why)
        self.retain()
        final = export_final(self.bundle, self.cfg, self.run_dir / "final", self.step)
        self.log(f"finished at step {self.step}{'' if why == 'finished' else f' ({why})'}; adapter exported to {final}")

    def log(self, line: str) -> None:
        print(line, file=self.out, flush=True)
