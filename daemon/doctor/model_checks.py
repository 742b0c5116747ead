"""The doctor's checks that need the loaded model (the worker's `model.load_model`): one micro-batch
through the worker's own `collate` and `ModelBundle.compute_loss`, forward and backward — finite loss,
gradients on exactly the trainable parameters — and a time-boxed `generate` of each eval prompt through
`evaluate.generate_one`, watching whether eos can come at all and how long the configured generation
may take against the `generate` phase budget.  torch is imported where it is used, so that
`check_generate` (a verdict on plain probe records) is tested without it.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Optional

from hangwatch.daemon.data import IGNORE_INDEX, Example, collate
from hangwatch.daemon.doctor.findings import Finding, fail, ok, skip, warn
from hangwatch.daemon.doctor.memory_estimate import classify

if TYPE_CHECKING:  # annotations only: torch is imported where it is used
    import torch

PROBE_TOKENS = 64  # tokens generated per prompt to measure speed and eos
PROBE_SECONDS = 10.0  # per prompt
LONG_GENERATION = 512  # max_new_tokens beyond which a generation that never stops costs real time


def check_batch(batch: dict, chunk: list[Example], eos: Optional[int]) -> Finding:
    """The worker's collate: each row's labels are its example's, padding is -100, and a learned eos
    survives even when pad == eos (padding is masked by position)."""
    name = "batch padding"
    labels, ids = batch["labels"], batch["input_ids"]
    for i, e in enumerate(chunk):
        n = len(e.input_ids)
        if labels[i, :n].tolist() != e.labels or (labels[i, n:] != IGNORE_INDEX).any():
            return fail(
                name,
                f"row {i} ({e.id}): labels in the batch differ from the example's or padding is learned",
                "report this: the worker's collate is wrong",
            )
    kept = sum(
        1
        for i, e in enumerate(chunk)
        if e.labels and e.labels[-1] == eos and int(labels[i, len(e.input_ids) - 1]) == eos
    )
    return ok(name, f"{len(chunk)} rows padded to {ids.shape[1]}: padding labelled -100, {kept} learned eos kept")


def _pairs_zero_b(named: dict[str, torch.nn.Parameter], name: str) -> bool:
    """A lora_A gradient is exactly zero at initialisation because its lora_B starts at zero."""
    if "lora_A" not in name:
        return False
    b = named.get(name.replace("lora_A", "lora_B"))
    return b is not None and not bool(b.detach().abs().sum())


def check_forward_backward(bundle, chunk: list[Example], modules_to_save: list[str]) -> Finding:
    """One micro-batch forward and backward: a finite loss, a non-zero gradient on every trainable
    parameter (lora_A excepted while lora_B is still zero), none on frozen ones; trainable parameters
    counted and listed by kind (LoRA, modules_to_save, extra modules)."""
    import torch

    from hangwatch.daemon.model import EXTRA_MODULES_ATTR

    name = "forward/backward"
    model = bundle.model
    extras = list(getattr(bundle.base, EXTRA_MODULES_ATTR, []))
    batch = collate(chunk, bundle.tokenizer.pad_token_id)
    n_labels = sum(e.n_label_tokens for e in chunk)
    model.train()
    model.zero_grad(set_to_none=True)
    t0 = time.monotonic()
    loss, ce, aux = bundle.compute_loss(batch, n_labels)
    loss.backward()
    took = time.monotonic() - t0
    named = dict(model.named_parameters())
    kinds, numel = classify(named.items(), extras)
    counts = ", ".join(f"{k} {len(v)} tensors ({numel[k]:,} params)" for k, v in kinds.items())
    details = [f"{k}: " + ", ".join(v[:4]) + (f", … {len(v) - 4} more" if len(v) > 4 else "") for k, v in kinds.items()]
    try:
        value = float(loss.detach())
        if not math.isfinite(value):
            return fail(
                name,
                f"loss {value} on the first micro-batch ({len(chunk)} examples, {n_labels} label tokens)",
                "check the data (all-masked rows), train.lr and model.dtype",
                details,
            )
        leaked = [n for n, p in named.items() if not p.requires_grad and p.grad is not None]
        missing = [n for n, p in named.items() if p.requires_grad and p.grad is None]
        zero = [
            n
            for n, p in named.items()
            if p.requires_grad and p.grad is not None and not bool(p.grad.abs().sum()) and not _pairs_zero_b(named, n)
        ]
        nonfinite = [n for n, p in named.items() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        unmatched = [m for m in modules_to_save if not any(m in n for n in kinds.get("modules_to_save", []))]
        if kinds.get("other"):
            return fail(
                name,
                f"trainable parameters that are neither LoRA, modules_to_save nor extra modules: {kinds['other'][:3]}",
                "freeze them or list their module in lora.modules_to_save",
                details,
            )
        if nonfinite:
            return fail(name, f"non-finite gradients on {nonfinite[:3]}", "check the data and model.dtype", details)
        if leaked:
            return fail(
                name,
                f"gradients on frozen parameters {leaked[:3]}",
                "report this: frozen weights get gradients",
                details,
            )
        if missing or zero:
            what = missing or zero
            return fail(
                name,
                f"{len(what)} trainable parameter(s) get {'no' if missing else 'a zero'} gradient: {what[:3]}",
                "they are not on the loss's path: drop them from lora.modules_to_save / the extra modules",
                details,
            )
        if unmatched:
            return warn(
                name,
                f"lora.modules_to_save names {unmatched} but no module of the model matched",
                "use module names as model.named_modules() shows them",
                details,
            )
        return ok(
            name,
            f"loss {value:.4f} (ce {ce / n_labels:.4f}) on {len(chunk)} examples in {took:.2f}s; "
            f"gradients on all trainable parameters: {counts}",
            details,
        )
    finally:
        model.zero_grad(set_to_none=True)


class _Beats:
    """generate_one beats progress into this: the doctor has no supervisor listening."""

    def progress(self, **_kw) -> None:
        pass


def probe_generate(bundle, prompt: str, eval_cfg, tokens: int, seconds: float) -> dict:
    """One time-boxed generate through the worker's generate_one: tokens made, the eos probability at
    each step (after every processor generate applies: suppress_tokens, temperature, top-k/top-p), time."""
    import torch
    from transformers import LogitsProcessor

    eos = bundle.tokenizer.eos_token_id
    seen: dict = {"p": [], "vocab": None}

    class Watch(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen["vocab"] = scores.shape[-1]
            if eos is not None and eos < scores.shape[-1]:
                seen["p"].append(float(torch.softmax(scores[0].float(), -1)[eos]))
            return scores

    deadline = time.monotonic() + seconds
    probe_cfg = eval_cfg.model_copy(update={"max_new_tokens": tokens})
    t0 = time.monotonic()
    from hangwatch.daemon.evaluate import generate_one, set_aside

    with set_aside(bundle):
        text = generate_one(
            bundle,
            prompt,
            probe_cfg,
            _Beats(),
            extra_processors=[Watch()],
            should_stop=lambda: time.monotonic() > deadline,
        )
    took = time.monotonic() - t0
    made = len(seen["p"]) if seen["vocab"] is not None else 0
    return {
        "prompt": prompt,
        "tokens": made,
        "seconds": took,
        "timed_out": time.monotonic() > deadline,
        "stopped_early": made < tokens and time.monotonic() <= deadline,
        "eos_p": seen["p"],
        "vocab": seen["vocab"],
        "text": text,
    }


def check_generate(
    probes: list[dict],
    *,
    eos: Optional[int],
    eos_text: str,
    max_new_tokens: int,
    do_sample: bool,
    budget_s: Optional[float],
) -> Finding:
    """EOS reachability and the configured generation's worst case against the `generate` phase budget."""
    name = "generate / eos"
    if not probes:
        return skip(name, "no eval.prompts")
    details = [
        f"{p['prompt']!r}: {p['tokens']} tokens in {p['seconds']:.2f}s"
        f"{', stopped at eos' if p['stopped_early'] else ''}: {p['text'][:40]!r}"
        for p in probes
    ]
    vocab = probes[0]["vocab"]
    if eos is None:
        return fail(
            name,
            "the tokenizer has no eos: every generation runs to max_new_tokens",
            "give the tokenizer an eos token",
            details,
        )
    if vocab is not None and eos >= vocab:
        return fail(
            name,
            f"eos id {eos} is outside the model's {vocab} logits: the model can never emit it",
            "resize the model's embeddings to the tokenizer, or fix the tokenizer's eos",
            details,
        )
    tokens = sum(p["tokens"] for p in probes)
    per_token = sum(p["seconds"] for p in probes) / max(1, tokens)
    worst = per_token * max_new_tokens * len(probes)
    eos_p = [x for p in probes for x in p["eos_p"]]
    never = bool(eos_p) and max(eos_p) == 0.0
    reached = sum(1 for p in probes if p["stopped_early"])
    mode = "sampling" if do_sample else "greedy"
    budget_text = f"the generate phase budget {budget_s:g}s" if budget_s else "no generate budget"
    timing = (
        f"{mode}, max_new_tokens {max_new_tokens}: worst case {max_new_tokens} tokens × {len(probes)} prompt(s) × "
        f"{per_token * 1000:.1f} ms ≈ {worst:.1f}s against {budget_text}"
    )
    fix_long = "lower eval.max_new_tokens (or raise watchdog.phase_budgets_s.generate)"
    if never:
        msg = (
            f"eos {eos_text!r} (id {eos}) is never emitted: its probability is 0 at every generated step "
            "(generation_config suppress_tokens / bad_words_ids, or a logits processor, removes it); every eval "
            f"prompt runs all {max_new_tokens} tokens — {timing}"
        )
        fix = "remove the eos id from the model's generation_config suppress_tokens / bad_words_ids; " + fix_long
        return (fail if budget_s and worst > budget_s else warn)(name, msg, fix, details)
    if budget_s and worst > budget_s:
        return fail(name, f"{timing}: a prompt that never reaches eos is killed as a hang", fix_long, details)
    if do_sample and max_new_tokens > LONG_GENERATION and not reached:
        return warn(
            name, f"{timing}; eos reached in 0/{len(probes)} probes of {probes[0]['tokens']} tokens", fix_long, details
        )
    return ok(name, f"eos reached in {reached}/{len(probes)} probes; {timing}", details)
