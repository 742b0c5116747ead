"""A training loop under 🤗 Accelerate supervised by hangwatch: `hangwatch run configs/examples/accelerate.yaml`.

The plain loop of examples/plain_loop.py, written the Accelerate way: `accelerator.prepare`,
`accelerator.backward`, `accelerator.clip_grad_norm_`, and checkpoints with `accelerator.save_state` /
`load_state` (model, optimizer, scheduler, every rank's RNG, the sampler, and our step counter).  Runs
as one process (`python examples/accelerate_loop.py`) or several (`torchrun --nproc-per-node 2
examples/accelerate_loop.py`, or `accelerate launch` with a multi-process config; on a CPU-only box set
ACCELERATE_USE_CPU=true, or Accelerate runs each process on its own instead of on gloo).  Every rank
beats its own heartbeat file (the rank comes from RANK); rank 0 alone commits checkpoints and announces
them.  Every line hangwatch adds ends with `# hangwatch`.

A checkpoint is committed atomically although every rank writes into it (each its own RNG state):
all ranks save into one temporary directory, wait for each other, then rank 0 fsyncs the files,
renames the directory into place and fsyncs the parent.  A crash mid-save leaves a `.tmp-*` directory,
never a `step-*` directory that looks complete and is not.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time
from pathlib import Path

import tiny_model  # examples/tiny_model.py: stands in for your from_pretrained(...)
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from hangwatch.daemon.heartbeat import Heartbeat, NullHeartbeat  # hangwatch
from hangwatch.daemon.integrations.generation import GenerateWatch  # hangwatch

PROMPTS = ["question 3: what is 3 plus 3? answer:", "question 11: what is 11 plus 11? answer:"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--output-dir",
        default=None,
        help="checkpoints/ and final/ go here (default: the hangwatch run dir, else out/accelerate_loop)",
    )
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Progress:
    """The loop's own state, saved and restored by save_state/load_state (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under `path`, then the directories, innermost first."""
    for p in sorted(path.rglob("*"), key=lambda p: (p.is_dir(), -len(p.parts))):
        if p.is_dir():
            fsync_dir(p)
        else:
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def save_checkpoint(accelerator: Accelerator, ckpt_dir: Path, step: int) -> Path:
    """Every rank calls this; returns `checkpoints/step-NNNNNNNN/` once rank 0 has committed it."""
    final = ckpt_dir / f"step-{step:08d}"
    tmp = ckpt_dir / f".tmp-step-{step:08d}"  # one name every rank can compute: no broadcast needed
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)
    accelerator.wait_for_everyone()  # every rank's files are written before rank 0 commits
    if accelerator.is_main_process:
        fsync_tree(tmp)
        if final.exists():
            # A checkpoint of this step from an attempt that went on past the last good one (and so was
            # never resumed from): a different trajectory.  rename cannot replace a non-empty directory.
            stale = ckpt_dir / f".stale-step-{step:08d}"
            shutil.rmtree(stale, ignore_errors=True)
            os.rename(final, stale)
            os.rename(tmp, final)
            shutil.rmtree(stale)
        else:
            os.rename(tmp, final)
        fsync_dir(ckpt_dir)
    accelerator.wait_for_everyone()
    return final


@torch.no_grad()
def evaluate(accelerator, model, tok, eval_set, max_new_tokens: int) -> float:
    """Rank 0 evaluates (loss and generations); the other ranks wait for it, in the `eval` phase too."""
    loss = float("nan")
    if accelerator.is_main_process:
        net = accelerator.unwrap_model(model)
        net.eval()
        batch = next(iter(DataLoader(eval_set, batch_size=len(eval_set))))
        loss = net(**batch).loss.item()
        for prompt in PROMPTS:
            enc = tok(prompt, return_tensors="pt")
            # No hangwatch line here: the GenerateWatch installed in main() puts this call in the `generate` phase.
            out = net.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            text = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            print(f"  {prompt!r} -> {text!r}", flush=True)
        net.train()
    accelerator.wait_for_everyone()
    return loss


def main() -> None:
    args = parse_args()
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed))
    # Under hangwatch: this rank's heartbeat file (the rank comes from RANK); outside it: a heartbeat
    # that writes nothing.
    supervised = bool(os.environ.get("HANGWATCH_RUN_DIR"))  # hangwatch
    hb = Heartbeat.from_env() if supervised else NullHeartbeat()  # hangwatch
    # Outputs next to the run's heartbeats and incidents (your own --output-dir works just as well).
    out = Path(
        args.output_dir or (os.environ["HANGWATCH_RUN_DIR"] if supervised else "out/accelerate_loop")
    )  # hangwatch
    ckpt_dir = out / "checkpoints"

    torch.manual_seed(args.seed)
    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok, seed=args.seed)
    train_set = tiny_model.TextDataset(tok, tiny_model.TEXTS[:56])
    eval_set = tiny_model.TextDataset(tok, tiny_model.TEXTS[56:])
    # Every model.generate(...) from here on runs in the `generate` phase (its budget: the config's
    # watchdog.phase_budgets_s.generate) with a `progress` beat every 8 new tokens.  Rank 0 generates.
    GenerateWatch(hb, budget_s=None, progress_every=8).install(model)  # hangwatch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    # A prepared scheduler steps once per process per optimizer step: count its steps that way.
    warmup, total = args.warmup_steps * accelerator.num_processes, args.max_steps * accelerator.num_processes
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)

    # The last GOOD checkpoint (announced, then confirmed by finite steps after it), or None.
    resume = Heartbeat.resume_from()  # hangwatch
    if resume:
        accelerator.load_state(resume)
        accelerator.print(f"resumed from {resume} at step {progress.step}")
    step = progress.step
    # The start beat says where this attempt begins.
    hb.current_step = step  # hangwatch
    hb.start(resumed_from=resume)  # hangwatch

    model.train()
    hb.enter_phase("train")  # hangwatch
    epoch, skip = divmod(step, len(loader))
    while step < args.max_steps:
        loader.set_epoch(epoch)  # the epoch's shuffle comes from data_seed + epoch: the same after a resume
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            t0 = time.perf_counter()
            loss = model(**batch).loss
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step = progress.step = step + 1
            loss_value, lr = loss.item(), scheduler.get_last_lr()[0]
            tokens_per_s = int(batch["attention_mask"].sum()) / (time.perf_counter() - t0)
            hb.step(step, loss=loss_value, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s)  # hangwatch
            if not math.isfinite(loss_value):  # hangwatch
                hb.warn(f"non-finite loss {loss_value} at step {step}")  # hangwatch
            accelerator.print(f"step {step}: loss {loss_value:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f}")

            if step % args.eval_every == 0 or step == args.max_steps:
                with hb.phase("eval"):  # hangwatch
                    eval_loss = evaluate(accelerator, model, tok, eval_set, args.max_new_tokens)
                accelerator.print(f"eval at step {step}: loss {eval_loss:.4f}")
            if step % args.save_every == 0 or step == args.max_steps:
                with hb.phase("checkpoint"):  # hangwatch
                    path = save_checkpoint(accelerator, ckpt_dir, step)
                # Rank 0 announces it; good=False: the supervisor confirms it from the finite steps that follow.
                if accelerator.is_main_process:  # hangwatch
                    hb.checkpoint(path, step, good=False)  # hangwatch
                accelerator.print(f"checkpoint {path}")
            if step >= args.max_steps:
                break
        epoch, skip = epoch + 1, 0

    final = out / "final"
    accelerator.unwrap_model(model).save_pretrained(
        final, is_main_process=accelerator.is_main_process, save_function=accelerator.save
    )
    if accelerator.is_main_process:
        tok.save_pretrained(final)
    accelerator.wait_for_everyone()
    hb.stop("finished")  # hangwatch
    accelerator.end_training()


if __name__ == "__main__":
    main()
