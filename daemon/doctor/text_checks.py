"""The doctor's tokenizer and data checks: special tokens, the chat template, what the worker's own
`data.validate_file` makes of the files, one decoded example with its masked span, label alignment.

No torch: they take the run's tokenizer as `data.load_tokenizer` gives it (the light one where it is exact,
transformers' otherwise) and the worker's `Example`s, so `hangwatch run`'s pre-run check costs a fraction of
a second.  Each check is a function returning a `Finding`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Optional

from hangwatch.common.example_shape import EXPECTED, FIRST_LINE_WHY, ExampleRejected, example_of_line, messages_of
from hangwatch.daemon.data import IGNORE_INDEX, Example, Problem, prompt_ids_for, render
from hangwatch.daemon.doctor.findings import Finding, fail, ok, skip, warn

SPECIALS = ("bos", "eos", "pad", "unk")


# ---- the tokenizer, whichever kind ---------------------------------------------------------------


def special_ids(tok) -> dict[str, tuple[Optional[str], Optional[int]]]:
    """{name: (token text, id)} for bos/eos/pad/unk of a transformers tokenizer or a LightTokenizer."""
    out = {}
    transformers = hasattr(tok, "convert_tokens_to_ids")
    for name in SPECIALS:
        if transformers:
            out[name] = (getattr(tok, f"{name}_token", None), getattr(tok, f"{name}_token_id", None))
        else:  # daemon.light_tokenizer.LightTokenizer
            text = tok.special_tokens_map.get(f"{name}_token")
            out[name] = (text, tok.backend.token_to_id(text) if text else None)
    return out


def decode(tok, ids: list[int]) -> str:
    if hasattr(tok, "decode"):
        return tok.decode(ids, skip_special_tokens=False)
    return tok.backend.decode(ids, skip_special_tokens=False)


def learned_span(e: Example) -> tuple[int, list[int]]:
    """(index of the first learned position, the learned labels)."""
    first = next((i for i, x in enumerate(e.labels) if x != IGNORE_INDEX), len(e.labels))
    return first, [x for x in e.labels if x != IGNORE_INDEX]


def ends_with_eos(e: Example, eos: Optional[int]) -> bool:
    learned = learned_span(e)[1]
    return eos is not None and bool(learned) and learned[-1] == eos


# ---- checks ------------------------------------------------------------------------------------


def check_special_tokens(tok, examples: list[Example]) -> Finding:
    """bos/eos/pad present and distinct; pad == eos is acceptable only while the eos that ends each
    completion stays a learned label (this worker masks padding by position, not by id)."""
    name = "tokenizer special tokens"
    ids = special_ids(tok)
    shown = ", ".join(f"{k} {t!r}={i}" for k, (t, i) in ids.items() if t is not None or k != "unk")
    eos, pad, bos = ids["eos"][1], ids["pad"][1], ids["bos"][1]
    if eos is None:
        return fail(
            name,
            f"no eos token ({shown}): completions are never taught to end and generate() never stops early",
            "give the tokenizer an eos token (tokenizer_config.json eos_token)",
        )
    if pad is None:
        return fail(
            name,
            f"no pad token ({shown}): micro-batches cannot be padded",
            "add a pad token: tokenizer.add_special_tokens({'pad_token': '<pad>'}) and save the tokenizer",
        )
    if pad == eos:
        with_eos = sum(1 for e in examples if ends_with_eos(e, eos))
        if examples and with_eos == 0:
            return fail(
                name,
                f"pad == eos (id {eos}) and no training example learns eos: the model never learns to stop",
                "give the tokenizer its own pad token (add_special_tokens({'pad_token': '<pad>'})), so eos stays a "
                "label",
            )
        return warn(
            name,
            f"pad == eos (id {eos}): padding is masked by position here, so eos stays learned "
            f"({with_eos}/{len(examples)} examples end with a learned eos); collators that mask every pad id "
            "would drop it",
            "give the tokenizer a distinct pad token (add_special_tokens({'pad_token': '<pad>'}))",
            [shown],
        )
    clashes = [
        f"{a} == {b}"
        for a, b in (("bos", "eos"), ("pad", "bos"), ("pad", "unk"))
        if ids[a][1] is not None and ids[a][1] == ids[b][1]
    ]
    if clashes:
        return warn(name, f"{', '.join(clashes)} ({shown})", "give each role its own special token", [shown])
    note = "" if bos is not None else " (no bos: the template or the model does without one)"
    return ok(name, f"{shown}: present and distinct{note}")


def first_object(path: Optional[str]) -> Optional[Any]:
    """The first JSON object of a data file that is an example (None when there is none).  Lines are read
    as the worker reads them (`example_of_line`): one that is not UTF-8 is skipped like any other bad line,
    never a reason for this check to fail where the worker trains."""
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    return example_of_line(line)
                except ExampleRejected:
                    continue
    except OSError:
        return None
    return None


def check_chat_template(tok, obj: Optional[Any]) -> Finding:
    """The template renders a training conversation so that the prompt is a prefix, its text survives
    encode → decode, its eos text becomes the eos id, and an eval prompt is rendered as training renders it."""
    name = "chat template"
    if obj is None:
        return skip(name, "no training example to render")
    messages = messages_of(obj)
    if not getattr(tok, "chat_template", None):
        return ok(name, "none: examples are prompt + completion + eos (the worker's fallback)")
    try:
        prompt_ids, completion_ids = render(tok, messages)
    except ExampleRejected as exc:
        return fail(name, f"the first training example does not render: {exc}", "fix the tokenizer's chat_template")
    full_text = tok.apply_chat_template(messages, tokenize=False)
    ids = tok(full_text, add_special_tokens=False)["input_ids"]
    back = decode(tok, ids)
    details = [f"rendered: {full_text!r}"]
    eos_text, eos = special_ids(tok)["eos"]
    if eos_text and eos_text in full_text and eos not in ids:
        return fail(
            name,
            f"the template writes {eos_text!r} but it tokenizes as text, not as the eos id {eos}",
            "register the eos text as a special token of the tokenizer",
            details,
        )
    if back != full_text:
        at = next((i for i, (a, b) in enumerate(zip(back, full_text)) if a != b), min(len(back), len(full_text)))
        return warn(
            name,
            f"encode → decode changes the rendered text at character {at}: "
            f"{full_text[at : at + 20]!r} → {back[at : at + 20]!r}",
            "check the tokenizer's normaliser / special tokens against the template",
            details,
        )
    if len(messages) == 2 and messages[0]["role"] == "user":
        if prompt_ids_for(tok, messages[0]["content"]) != prompt_ids:
            return warn(
                name,
                "an eval prompt is tokenized differently from the same prompt in training",
                "make the chat template's generation prompt match its training rendering",
                details,
            )
    return ok(name, f"round-trips ({len(prompt_ids)} prompt + {len(completion_ids)} completion tokens)", details)


def reason_of(problem: Problem) -> str:
    m = problem.message
    if "nothing to learn" in m:
        return "all-masked"
    if "max_length" in m:
        return "too long"
    return "rejected"


def check_data(
    what: str,
    path: Optional[str],
    examples: list[Example],
    problems: list[Problem],
    *,
    required: bool,
    first_line: Optional[tuple[int, str]] = None,
) -> Finding:
    """Counts of usable / truncated / all-masked / over-long / otherwise rejected examples.  `first_line`: (line,
    why) when the file's first line is not an example — refused as validate-config refuses it (example_shape)."""
    name = f"{what} data"
    if not path:
        return skip(name, "not configured")
    if first_line is not None:
        lineno, why = first_line
        return fail(
            name,
            f"{path}:{lineno}: {why}: {FIRST_LINE_WHY}",
            f"fix or remove that line; {EXPECTED}",
            [str(p) for p in problems[:5]],
        )
    kinds = Counter(reason_of(p) for p in problems)
    total = len(examples) + len(problems)
    truncated = sum(1 for e in examples if e.truncated)
    counts = (
        f"{len(examples)}/{total} usable, {truncated} truncated, {kinds['all-masked']} all-masked, "
        f"{kinds['too long']} too long, {kinds['rejected']} otherwise rejected"
    )
    details = [str(p) for p in problems[:5]]
    if not examples:
        why = (
            "every example would be all-masked (nothing to learn): the loss would be 0/0"
            if kinds["all-masked"] == total
            else "no example is usable"
        )
        fix = (
            "give each example a non-empty completion (the assistant turn is what is learned)"
            if kinds["all-masked"]
            else "fix the lines listed (JSON, keys, lengths)"
        )
        return (fail if required else warn)(name, f"{path}: {why} ({counts})", fix, details)
    if kinds["all-masked"]:
        return warn(name, f"{path}: {counts}", "give those examples a non-empty completion, or drop them", details)
    if problems:
        return warn(
            name, f"{path}: {counts}", "fix or drop the lines listed; raise data.max_length for the long ones", details
        )
    if truncated * 10 > len(examples):
        return warn(
            name,
            f"{path}: {counts} — over 10% lose the start of their prompt",
            "raise data.max_length (or data.truncation: reject)",
        )
    return ok(name, f"{path}: {counts}")


def check_example(tok, examples: list[Example]) -> Finding:
    """One training example decoded, with its masked (-100) span and its learned span."""
    name = "decoded example"
    if not examples:
        return skip(name, "no usable training example")
    e = examples[0]
    first, learned = learned_span(e)
    masked_text, learned_text = decode(tok, e.input_ids[:first]), decode(tok, learned)
    details = [f"masked (-100), {first} tokens: {masked_text!r}", f"learned, {len(learned)} tokens: {learned_text!r}"]
    return ok(name, f"{e.id}: {first} masked + {len(learned)} learned tokens", details)


def check_label_alignment(examples: list[Example], eos: Optional[int]) -> Finding:
    """labels[i] is input_ids[i] or -100 (the loss shifts them itself), the masked span is one prefix, the
    first learned label is not at position 0 (a shifted loss never uses it), the learned span ends with eos."""
    name = "label alignment"
    if not examples:
        return skip(name, "no usable training example")
    bad, late_mask, at_zero, no_eos = [], 0, 0, 0
    for e in examples:
        if len(e.labels) != len(e.input_ids) or any(
            l != IGNORE_INDEX and l != t for l, t in zip(e.labels, e.input_ids)
        ):
            bad.append(e.id)
            continue
        first, learned = learned_span(e)
        late_mask += any(l == IGNORE_INDEX for l in e.labels[first:])
        at_zero += first == 0
        no_eos += not ends_with_eos(e, eos)
    if bad:
        return fail(
            name,
            f"{len(bad)} example(s) whose labels are not their input ids (pre-shifted?): {bad[:3]}",
            "labels must equal input_ids at learned positions; the loss shifts them by one itself",
        )
    if at_zero:
        return warn(
            name,
            f"{at_zero} example(s) learn from position 0: a causal loss never predicts the first token",
            "start each example with a prompt or a bos token",
        )
    if no_eos == len(examples):
        return fail(
            name,
            "no example's learned span ends with eos: the model never learns to stop",
            "let the chat template (or the data) end each completion with the eos token",
        )
    if late_mask or no_eos:
        return warn(
            name,
            f"{late_mask} example(s) with masked tokens inside the completion, {no_eos} not ending with eos",
            "check the chat template's assistant turn",
        )
    return ok(name, f"{len(examples)} examples: labels = input ids on the completion, -100 on the prompt, eos learned")
