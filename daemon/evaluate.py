"""Evaluation: held-out loss, then generation for the fixed prompts, appended to evolution.jsonl;
and the held-out loss alone (`heldout_loss`), on which continuous mode confirms an idle checkpoint.

Generation is its own heartbeat phase (`generate`, with the configured budget) and beats
`progress` every few tokens from a stopping criterion — that is, from the thread that generates:
a generate() that stops producing tokens also stops beating.  The training RNG is set aside for
the whole eval, so evaluating (or not) never changes the training trajectory.

The supervisor may end a runaway generate (`watchdog.generate_overrun: truncate`) with an order file in the
attempt's directory (`integrations.generation.StopOrder`, read from the phase's start): the prompt being
generated stops once its generate() has produced the order's LIMIT new tokens, a `progress` line carries
`generate_truncated` (the prompt, the output's tail), its evolution record says `"truncated": true` with
`tokens`, `limit` and `skipped_prompts` (the eval's prompts not generated after it), and the eval ends there.

In a multi-rank run every rank scores its share of the held-out examples and the sums are added
across ranks (`World.sum`); generation runs on rank 0 alone, and the other ranks wait for it in phase
`wait` (`World.on_main`), so a hung generate() names rank 0 and shows the others as waiting.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

from hangwatch.common.durable import append_durable
from hangwatch.common.protocol import TRUNCATED_FIELD
from hangwatch.daemon.data import Example, collate, prompt_ids_for
from hangwatch.daemon.distributed import World
from hangwatch.daemon.integrations.generation import StopOrder, TokenGaps, truncation_report
from hangwatch.daemon.trainer.ranks import eval_shard
from hangwatch.daemon.trainer.recovery import is_oom, release_memory

EVOLUTION = "evolution.jsonl"


def eval_loss(
    bundle,
    examples: list[Example],
    batch_size: int,
    on_batch: Optional[Callable[[], None]] = None,
    world: Optional[World] = None,
    on_oom: Optional[Callable[[int, int, str], None]] = None,
) -> Optional[float]:
    """Mean cross-entropy per completion token over `examples` (None without examples); in a
    multi-rank run each rank scores its share and the sums are added across ranks.

    `on_oom(size, smaller, message)` (`restart.in_process`): a batch that runs out of memory is scored again in halves
    (down to one example; then the error goes on), each told to it; the sums, hence the loss, are the same."""
    if not examples:
        return None
    world = world or World()
    mine = eval_shard(examples, world.rank, world.size)
    total, count = 0.0, 0
    pad = bundle.tokenizer.pad_token_id
    i = 0
    while i < len(mine):
        chunk = mine[i : i + batch_size]
        n = sum(e.n_label_tokens for e in chunk)
        message = None
        try:
            _, ce_sum, _ = bundle.compute_loss(collate(chunk, pad), n)
        except BaseException as exc:
            if on_oom is None or batch_size <= 1 or not is_oom(exc):
                raise
            message = str(exc)
        if message is not None:  # out of the handler: the failed batch's tensors are gone
            smaller = batch_size // 2
            release_memory(bundle.device)
            on_oom(batch_size, smaller, message)
            batch_size = smaller
            continue
        total += ce_sum
        count += n
        i += len(chunk)
        if on_batch is not None:
            on_batch()
    total, count = world.sum([total, count])
    return total / count


def _progress_criterion(
    hb, every: int, prompt_len: int, should_stop: Callable[[], bool], order: Optional[StopOrder] = None
):
    from transformers import StoppingCriteria

    class BeatEveryTokens(StoppingCriteria):
        """Beats `progress` every `every` new tokens, with the longest gap between two of them (`token_s`: what the
        supervisor's token budget learns from); stops early when the worker is asked to stop, or when the
        supervisor's order (`order`) ends this generate (what it did: `truncated`)."""

        truncated: Optional[dict] = None
        gaps = TokenGaps()

        def __call__(self, input_ids, scores, **kwargs):
            self.gaps.tick()
            produced = int(input_ids.shape[-1]) - prompt_len
            if produced > 0 and produced % every == 0:
                hb.progress(tokens=produced, **self.gaps.take())
            done = should_stop()
            if not done and order is not None:
                limit = order.poll()
                if limit is not None and produced >= limit:
                    done = True
                    if self.truncated is None:
                        self.truncated = {
                            "order": order.order,
                            "limit": limit,
                            "tokens": produced,
                            "prompt_tokens": prompt_len,
                        }
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    return BeatEveryTokens()


@dataclass
class Generated:
    text: str
    truncated: Optional[dict] = None  # {"order", "limit", "tokens", "prompt_tokens"}: the supervisor's order ended it


def max_new_tokens_for(eval_cfg, extra_processors=()) -> int:
    """The configured cap, unless a processor carries its own `max_new_tokens` (the runaway_generate fault's,
    which must outlast any budget): the largest wins."""
    caps = [
        n
        for n in (getattr(p, "max_new_tokens", None) for p in extra_processors)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0
    ]
    return max([eval_cfg.max_new_tokens, *caps])


def generate_one(
    bundle, prompt: str, eval_cfg, hb, *, extra_processors=(), should_stop: Callable[[], bool] = lambda: False
) -> str:
    """The output text of `prompt` (see `generate_prompt`)."""
    return generate_prompt(
        bundle, prompt, eval_cfg, hb, extra_processors=extra_processors, should_stop=should_stop
    ).text


def generate_prompt(
    bundle,
    prompt: str,
    eval_cfg,
    hb,
    *,
    extra_processors=(),
    should_stop: Callable[[], bool] = lambda: False,
    order: Optional[StopOrder] = None,
) -> Generated:
    """One prompt's generation, beating `progress`; `order`: the supervisor's stop order of the current phase."""
    from transformers import LogitsProcessorList, StoppingCriteriaList

    tok = bundle.tokenizer
    ids = torch.tensor([prompt_ids_for(tok, prompt)], device=bundle.device)
    criterion = _progress_criterion(hb, eval_cfg.progress_every_tokens, ids.shape[-1], should_stop, order)
    criteria = StoppingCriteriaList([criterion])
    kwargs = dict(
        max_new_tokens=max_new_tokens_for(eval_cfg, extra_processors),
        do_sample=eval_cfg.do_sample,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attention_mask=torch.ones_like(ids),
        stopping_criteria=criteria,
        logits_processor=LogitsProcessorList(list(extra_processors)),
    )
    if not eval_cfg.do_sample:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    with bundle.autocast():
        out = bundle.model.generate(input_ids=ids, **kwargs)
    return Generated(tok.decode(out[0, ids.shape[-1] :], skip_special_tokens=True), criterion.truncated)


def append_evolution(run_dir: os.PathLike | str, records: list[dict]) -> None:
    """One eval's generations, appended in one durable write (a kill leaves whole lines only)."""
    append_durable(
        Path(run_dir) / EVOLUTION, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    )


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
        return eval_loss(
            bundle, eval_examples, cfg.train.micro_batch_size, on_batch=lambda: hb.progress(note="eval loss")
        )


def run_eval(
    bundle,
    cfg,
    hb,
    run_dir,
    step: int,
    eval_examples: list[Example],
    *,
    attempt: int = 1,
    processors=(),
    should_stop: Callable[[], bool] = lambda: False,
    world: Optional[World] = None,
    on_oom: Optional[Callable[[int, int, str], None]] = None,
) -> dict:
    """One evaluation at `step`: loss, generations (rank 0), evolution.jsonl; returns a summary.  `on_oom`
    (`restart.in_process`): an eval batch out of memory is halved (`eval_loss`); a prompt whose generate() runs out of
    memory (one prompt is one batch: nothing to halve) is recorded with the error and the next one goes on."""
    budgets = cfg.watchdog.phase_budgets_s
    world = world or World()

    def generate_all() -> list[dict]:
        records = []
        prompts = list(cfg.eval.prompts)
        with hb.phase("generate", budget_s=budgets.get("generate")):
            order = StopOrder.of(hb)  # orders older than this phase are not its orders
            for i, item in enumerate(prompts):
                if should_stop():
                    break
                prompt = item if isinstance(item, str) else item.prompt
                reference = None if isinstance(item, str) else item.reference
                message = None
                try:
                    gen = generate_prompt(
                        bundle, prompt, cfg.eval, hb, extra_processors=processors, should_stop=should_stop, order=order
                    )
                except BaseException as exc:
                    if on_oom is None or not is_oom(exc):
                        raise
                    message = str(exc)
                if message is not None:  # out of the handler: what the failed generate() held is gone
                    release_memory(bundle.device)
                    on_oom(1, 0, message)
                    records.append(
                        {
                            "step": step,
                            "prompt": prompt,
                            "reference": reference,
                            "output": None,
                            "error": f"out of memory: {message[:500]}",
                            "loss": loss,
                            "attempt": attempt,
                            "t": time.time(),
                        }
                    )
                    continue
                record = {
                    "step": step,
                    "prompt": prompt,
                    "reference": reference,
                    "output": gen.text,
                    "loss": loss,
                    "attempt": attempt,
                    "t": time.time(),
                }
                records.append(record)
                if gen.truncated is not None:
                    # The supervisor ended this phase: the prompts after this one are not generated.
                    record.update(
                        truncated=True,
                        tokens=gen.truncated["tokens"],
                        limit=gen.truncated["limit"],
                        skipped_prompts=len(prompts) - i - 1,
                    )
                    hb.progress(**{TRUNCATED_FIELD: truncation_report(gen.truncated, prompt=prompt, output=gen.text)})
                    break
        return records

    with set_aside(bundle):
        loss = eval_loss(
            bundle,
            eval_examples,
            cfg.train.micro_batch_size,
            on_batch=lambda: hb.progress(note="eval loss"),
            world=world,
            on_oom=on_oom,
        )
        records = world.on_main(hb, "generate", generate_all) or []
    if records:
        append_evolution(run_dir, records)
    return {"loss": loss, "generations": len(records)}
