"""A plain PyTorch training loop supervised by hangwatch: `hangwatch run configs/examples/plain_loop.yaml`.

The loop is the kind people already have: AdamW with warm-up, a DataLoader, gradient clipping, a
periodic checkpoint (model + optimizer + scheduler + step) and an eval that calls `model.generate`.
Every line hangwatch adds ends with `# hangwatch`.  Outside hangwatch they do nothing: the script runs
the same with plain `python examples/plain_loop.py` and writes no heartbeat.

What the lines do:
  * a heartbeat (`Heartbeat.from_env()`) when hangwatch runs the script, a `NullHeartbeat` otherwise;
  * phases (`train`, `eval`, `checkpoint`, and `generate` from a `GenerateWatch`, with a `progress` beat
    every 8 new tokens): each has a budget in the config, so an eval `generate()` that never returns is
    caught within the generate budget, not hours later;
  * one `step` beat per optimizer step with loss, lr, grad norm and tokens/s: progress, and the
    evidence the supervisor uses to confirm a checkpoint good (finite loss for `confirm_steps`);
  * one `checkpoint` beat per committed checkpoint (good=False: the supervisor decides when it is good);
  * `Heartbeat.resume_from()`: the last *good* checkpoint (None on a first attempt), which is not
    always the newest one on disk: a checkpoint followed by a non-finite loss is never resumed from.

Checkpoints are written the way a crash cannot half-write them: into a temporary directory, every
file fsynced, renamed into place, the parent directory fsynced.  A process killed mid-save leaves a
`.tmp-*` directory behind, never a `step-*` directory that looks complete and is not.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import tiny_model  # examples/tiny_model.py: stands in for your from_pretrained(...)
import torch
from torch.utils.data import DataLoader

from hangwatch.daemon.heartbeat import Heartbeat, NullHeartbeat  # hangwatch
from hangwatch.daemon.integrations.generation import GenerateWatch  # hangwatch

PROMPTS = ["question 3: what is 3 plus 3? answer:", "question 11: what is 11 plus 11? answer:"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--output-dir",
        default=None,
        help="checkpoints/ and final/ go here (default: the hangwatch run dir, else out/plain_loop)",
    )
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


# ---- checkpoints ---------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_dir: Path, step: int, model, optimizer, scheduler) -> Path:
    """Commit `checkpoints/step-NNNNNNNN/` atomically: temp dir, fsync, rename, fsync the parent."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    for leftover in ckpt_dir.glob(".*-step-*"):  # from a save that was killed: never renamed, never announced
        shutil.rmtree(leftover, ignore_errors=True)
    final = ckpt_dir / f"step-{step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-", dir=ckpt_dir))
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }
    with open(tmp / "state.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    if final.exists():
        # A checkpoint of this step from an attempt that went on past the last good one (and so was
        # never resumed from): a different trajectory.  Move it aside first; rename cannot replace a
        # non-empty directory.
        stale = Path(tempfile.mkdtemp(prefix=f".stale-step-{step:08d}-", dir=ckpt_dir))
        os.rename(final, stale / "old")
        os.rename(tmp, final)
        shutil.rmtree(stale)
    else:
        os.rename(tmp, final)
    fsync_dir(ckpt_dir)
    return final


def load_checkpoint(path: str, model, optimizer, scheduler) -> int:
    state = torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    return int(state["step"])


# ---- data ------------------------------------------------------------------------------------------


def batches(dataset, batch_size: int, num_workers: int, seed: int, start_step: int):
    """Endless shuffled batches, one epoch's order fixed by its seed, so a resumed run sees exactly the
    batches the first one would have: the epoch of `start_step` is re-shuffled the same way and the
    batches it had already trained on are skipped."""
    steps_per_epoch = len(dataset) // batch_size
    epoch, skip = divmod(start_step, steps_per_epoch)
    for epoch in itertools.count(epoch):
        order = torch.Generator().manual_seed(seed + epoch)
        loader = DataLoader(
            dataset, batch_size=batch_size, shuffle=True, drop_last=True, generator=order, num_workers=num_workers
        )
        yield from itertools.islice(loader, skip, None)
        skip = 0


# ---- eval ------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(model, tok, eval_set, max_new_tokens: int) -> float:
    model.eval()
    batch = next(iter(DataLoader(eval_set, batch_size=len(eval_set))))
    loss = model(**batch).loss.item()
    for prompt in PROMPTS:
        enc = tok(prompt, return_tensors="pt")
        # No hangwatch line here: the GenerateWatch installed in main() puts this call in the `generate` phase.
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        print(
            f"  {prompt!r} -> {tok.decode(out[0, enc['input_ids'].shape[1] :], skip_special_tokens=True)!r}", flush=True
        )
    model.train()
    return loss


# ---- the loop --------------------------------------------------------------------------------------


def main() -> None:
    args = parse_args()
    # Under hangwatch: this attempt's heartbeat file; outside it: a heartbeat that writes nothing.
    supervised = bool(os.environ.get("HANGWATCH_RUN_DIR"))  # hangwatch
    hb = Heartbeat.from_env() if supervised else NullHeartbeat()  # hangwatch
    # Outputs next to the run's heartbeats and incidents (your own --output-dir works just as well).
    out = Path(args.output_dir or (os.environ["HANGWATCH_RUN_DIR"] if supervised else "out/plain_loop"))  # hangwatch
    ckpt_dir = out / "checkpoints"

    # SIGTERM (`hangwatch restart`, `hangwatch stop`, systemd, a preempted node): finish the step,
    # checkpoint, exit 0, so the next attempt loses nothing.
    terminate = []
    signal.signal(signal.SIGTERM, lambda signum, frame: terminate.append(signum))

    torch.manual_seed(args.seed)
    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok, seed=args.seed)
    train_set = tiny_model.TextDataset(tok, tiny_model.TEXTS[:56])
    eval_set = tiny_model.TextDataset(tok, tiny_model.TEXTS[56:])
    # Every model.generate(...) from here on runs in the `generate` phase (its budget: the config's
    # watchdog.phase_budgets_s.generate) with a `progress` beat every 8 new tokens.
    GenerateWatch(hb, budget_s=None, progress_every=8).install(model)  # hangwatch
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup, total = args.warmup_steps, args.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (total - s) / max(1, total - warmup))
    )

    step = 0
    # The last GOOD checkpoint (announced, then confirmed by finite steps after it), or None.
    resume = Heartbeat.resume_from()  # hangwatch
    if resume:
        step = load_checkpoint(resume, model, optimizer, scheduler)
        print(f"resumed from {resume} at step {step}", flush=True)
    # The start beat says where this attempt begins.
    hb.current_step = step  # hangwatch
    hb.start(resumed_from=resume)  # hangwatch

    model.train()
    data = batches(train_set, args.batch_size, args.num_workers, args.seed, start_step=step)
    hb.enter_phase("train")  # hangwatch
    while step < args.max_steps:
        t0 = time.perf_counter()
        batch = next(data)
        loss = model(**batch).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value, lr = loss.item(), scheduler.get_last_lr()[0]
        tokens_per_s = int(batch["attention_mask"].sum()) / (time.perf_counter() - t0)
        hb.step(step, loss=loss_value, lr=lr, grad_norm=grad_norm, tokens_per_s=tokens_per_s)  # hangwatch
        if not math.isfinite(loss_value):  # hangwatch
            hb.warn(f"non-finite loss {loss_value} at step {step}")  # hangwatch
        print(f"step {step}: loss {loss_value:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f}", flush=True)

        if step % args.eval_every == 0 or step == args.max_steps:
            with hb.phase("eval"):  # hangwatch
                eval_loss = evaluate(model, tok, eval_set, args.max_new_tokens)
            print(f"eval at step {step}: loss {eval_loss:.4f}", flush=True)
        if step % args.save_every == 0 or step == args.max_steps or terminate:
            with hb.phase("checkpoint"):  # hangwatch
                path = save_checkpoint(ckpt_dir, step, model, optimizer, scheduler)
            # good=False: the supervisor confirms it from the finite steps that follow.
            hb.checkpoint(path, step, good=False)  # hangwatch
            print(f"checkpoint {path}", flush=True)
        if terminate:
            hb.stop("terminated")  # hangwatch
            return

    final = out / "final"
    model.save_pretrained(final)  # the trained model in the usual format (checkpoints/ are for resuming)
    tok.save_pretrained(final)
    hb.stop("finished")  # hangwatch


if __name__ == "__main__":
    main()
