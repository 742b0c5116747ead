"""Fine-tune a causal language model with Lightning: an ordinary Lightning script, supervised by hangwatch
through three added lines (marked `# hangwatch`).

    python examples/lightning_train.py --out runs/lightning-example       # on its own
    hangwatch run configs/examples/lightning.yaml                          # supervised

Validation computes the loss and, like most fine-tuning scripts, generates an answer to a fixed prompt to
show how the model is doing: the `generate()` call that, on a real model, can run for hours.  Checkpoints
are written every `--ckpt-every` optimizer steps and all kept, so hangwatch can resume an attempt from the
last *good* one.  Runs in seconds on a CPU with the tiny model of `tiny_model.py`.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings

import lightning.pytorch as L
import tiny_model  # your own script: AutoTokenizer / AutoModelForCausalLM .from_pretrained(...)
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Subset

from hangwatch.daemon.integrations.lightning import HangwatchCallback, resume_from  # hangwatch

PROMPT = "question 7: what is 7 plus 7? answer:"


class CausalLM(L.LightningModule):
    def __init__(self, model, tok, *, lr: float = 3e-3, warmup_steps: int = 4, max_new_tokens: int = 16):
        super().__init__()
        self.model, self.tok = model, tok
        self.lr, self.warmup_steps = lr, warmup_steps
        self.generate_kwargs = {"max_new_tokens": max_new_tokens, "do_sample": False}
        self.sample = ""

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("val_loss", loss)
        if batch_idx == 0:
            self.sample = self.generate_sample(PROMPT)
        return loss

    def generate_sample(self, prompt: str) -> str:
        enc = self.tok(prompt, return_tensors="pt").to(self.device)
        out = self.model.generate(**enc, pad_token_id=self.tok.pad_token_id, **self.generate_kwargs)
        return self.tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            val_loss = float(self.trainer.callback_metrics.get("val_loss", float("nan")))
            print(f"step {self.global_step}: val_loss {val_loss:.3f}, sample {self.sample!r}", flush=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (self.warmup_steps + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/lightning-example", help="checkpoints go to OUT/checkpoints")
    p.add_argument("--max-steps", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=4, help="optimizer steps between checkpoints")
    p.add_argument("--val-every", type=int, default=8, help="training batches between validations")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def quiet() -> None:
    """A log line per validation is all this script prints: no progress bar, no Lightning chatter."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")  # Lightning 2.6 on a newer torch


def main(argv=None) -> None:
    args = parse_args(argv)
    quiet()
    L.seed_everything(args.seed, verbose=False)
    tok = tiny_model.tokenizer()
    module = CausalLM(tiny_model.model(tok, seed=args.seed), tok, max_new_tokens=args.max_new_tokens)
    data = tiny_model.TextDataset(tok)
    train = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    val = DataLoader(Subset(data, range(8)), batch_size=8)
    checkpoints = ModelCheckpoint(
        dirpath=os.path.join(args.out, "checkpoints"),
        filename="step-{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=args.ckpt_every,
        save_top_k=-1,
    )
    trainer = L.Trainer(
        max_steps=args.max_steps,
        accelerator="auto",
        devices=1,
        accumulate_grad_batches=args.grad_accum,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        callbacks=[checkpoints, HangwatchCallback()],
    )  # hangwatch
    trainer.fit(module, train, val, ckpt_path=resume_from())  # hangwatch
    print(f"finished at step {trainer.global_step}; checkpoints in {checkpoints.dirpath}", flush=True)


if __name__ == "__main__":
    main()
