"""Evaluation: held-out loss, then generation for the fixed prompts, appended to evolution.jsonl;
and the held-out loss alone (`heldout_loss`), on which continuous mode confirms an idle checkpoint.

Generation is its own heartbeat phase (`generate`, with the configured budget) and beats
`progress` every few tokens from a stopping criterion — that is, from the thread that generates:
a generate() that stops producing tokens also stops beating.  The training RNG is set aside for
the whole eval, so evaluating (or not) never changes the training trajectory.

In a multi-rank run every rank scores its share of the held-out examples and the sums are added
across ranks (`World.sum`); generation runs on rank 0 alone, and the other ranks wait for it in phase
`wait` (`World.on_main`), so a hung generate() names rank 0 and shows the others as waiting.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from hangwatch.common.durable import append_durable
from hangwatch.daemon.data import Example, collate, prompt_ids_for
from hangwatch.daemon.distributed import World
from hangwatch.daemon.trainer.ranks import eval_shard

EVOLUTION = "evolution.jsonl"


def eval_loss(bundle, examples: list[Example], batch_size: int, on_batch: Optional[Callable[[], None]] = None,
              world: Optional[World] = None) -> Optional[float]:
    """Mean cross-entropy per completion token over `examples` (None without examples); in a
    multi-rank run each rank scores its share and the sums are added across ranks."""
    if not examples:
        return None
    world = world or World()
    mine = eval_shard(examples, world.rank, world.size)
    total, count = 0.0, 0
    pad = bundle.tokenizer.pad_token_id
    for i in range(0, len(mine), batch_size):
        chunk = mine[i:i + batch_size]
        batch = collate(chunk, pad)
        n = sum(e.n_label_tokens for e in chunk)
        _, ce_sum, _ = bundle.compute_loss(batch, n)
        total += ce_sum
        count += n
        if on_batch is not None:
            on_batch()
    total, count = world.sum([total, count])
    return total / count


def _progress_criterion(hb, every: int, prompt_len: int, should_stop: Callable[[], bool]):
    from transformers import StoppingCriteria

    class BeatEveryTokens(StoppingCriteria):
        """Beats `progress` every `every` new tokens; stops early when the worker is asked to stop."""

        def __call__(self, input_ids, scores, **kwargs):
            produced = input_ids.shape[-1] - prompt_len
            if produced > 0 and produced % every == 0:
                hb.progress(tokens=int(produced))
            done = should_stop()
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return BeatEveryTokens()


def generate_one(bundle, prompt: str, eval_cfg, hb, *, extra_processors=(), should_stop: Callable[[], bool] = lambda: False) -> str:
    from transformers import LogitsProcessorList, StoppingCriteriaList

    tok = bundle.tokenizer
    ids = torch.tensor([prompt_ids_for(tok, prompt)], device=bundle.device)
    criteria = StoppingCriteriaList([_progress_criterion(hb, eval_cfg.progress_every_tokens, ids.shape[-1], should_stop)])
    kwargs = dict(
        max_new_tokens=eval_cfg.max_new_tokens, do_sample=eval_cfg.do_sample,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        attention_mask=torch.ones_like(ids), stopping_criteria=criteria,
        logits_processor=LogitsProcessorList(list(extra_processors)),
    )
    if not eval_cfg.do_sample:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    with bundle.autocast():
        out = bundle.model.generate(input_ids=ids, **kwargs)
    return tok.decode(out[0, ids.shape[-1]:], skip_special_tokens=True)


def append_evolution(run_dir: os.PathLike | str, records: list[dict]) -> None:
    """One eval's generations, appended in one durable write (a kill leaves whole lines only)."""
    append_durable(Path(run_dir) / EVOLUTION, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode())


@contextlib.contextmanager
def set_aside(bundle) -> Iterator[None]:
    """Eval mode, no gradients and the training RNG forked: whatever runs inside leaves the training
    trajectory exactly as it was."""
    model = bundle.model
    was_training = model.training
    model.eval()
    try:
        cuda_devices = [torch.cuda.current_device()] if bundle.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def heldout_loss(bundle, cfg, hb, eval_examples: list[Example]) -> Optional[float]:
    """The held-out loss of the current weights alone (no generation), in phase `eval`; None without
    eval examples.  Continuous mode confirms an idle checkpoint on it."""
    if not eval_examples:
        return None
    with hb.phase("eval", budget_s=cfg.watchdog.phase_budgets_s.get("eval")), set_aside(bundle):
        return eval_loss(bundle, eval_examples, cfg.train.micro_batch_size, on_batch=lambda: hb.progress(note="eval loss"))


def run_eval(bundle, cfg, hb, run_dir, step: int, eval_examples: list[Example], *, attempt: int = 1,
             processors=(), should_stop: Callable[[], bool] = lambda: False, world: Optional[World] = None) -> dict:
    """One evaluation at `step`: loss, generations (rank 0), evolution.jsonl; returns a summary."""
    budgets = cfg.watchdog.phase_budgets_s
    world = world or World()

    def generate_all() -> list[dict]:
        records = []
        with hb.phase("generate", budget_s=budgets.get("generate")):
            for item in cfg.eval.prompts:
                if should_stop():
                    break
                prompt = item if isinstance(item, str) else item.prompt
                reference = None if isinstance(item, str) else item.reference
                output = generate_one(bundle, prompt, cfg.eval, hb, extra_processors=processors, should_stop=should_stop)
                records.append({"step": step, "prompt": prompt, "reference": reference, "output": output,
                                "loss": loss, "attempt": attempt, "t": time.time()})
        return records

    with set_aside(bundle):
        loss = eval_loss(bundle, eval_examples, cfg.train.micro_batch_size, on_batch=lambda: hb.progress(note="eval loss"),
                         world=world)
        records = world.on_main(hb, "generate", generate_all) or []
    if records:
        append_evolution(run_dir, records)
    return {"loss": loss, "generations": len(records)}
