"""Training data: JSONL validation, chat-template rendering, label masking, truncation, order.

One example per line, either `{"prompt": ..., "completion": ...}` or `{"messages": [...]}` ending
with an assistant turn.  Both are rendered through the tokenizer's chat template (a tokenizer
without one gets prompt + completion + eos); only the completion (the last assistant turn and the
end-of-sequence token) is learned, every other position is labelled -100.  An over-long example
loses the start of its prompt (`data.truncation: keep_completion`) or is rejected (`reject`); an
example with nothing left to learn never reaches the loss.

`validate_file` is the one entry point for a file: it returns the usable examples and one problem
per bad line (file, line number, what was wrong).  The order of training is a `DataSource`: an
object yielding examples with stable ids whose position is a small JSON-serialisable dict; the
continuous (inbox) mode's source is a `ContinuousDataSource`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, runtime_checkable

# One definition of an example's shape, shared with `validate-config` (which may not import the worker).
from hangwatch.common.example_shape import ROLES, ExampleRejected, messages_of, parse_line  # noqa: F401

IGNORE_INDEX = -100


@dataclass
class Example:
    """One tokenized training example; `id` is stable across runs (file name and line number)."""

    id: str
    input_ids: list[int]
    labels: list[int]
    source: str = ""
    line: int = 0
    digest: str = ""
    truncated: bool = False

    @property
    def n_label_tokens(self) -> int:
        return sum(1 for x in self.labels if x != IGNORE_INDEX)


@dataclass
class Problem:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}" if self.line else f"{self.path}: {self.message}"


# ---- rendering -------------------------------------------------------------------------------


def render(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids) for a conversation whose last turn is the assistant's."""
    if not messages[-1]["content"].strip():
        raise ExampleRejected("the completion is empty: nothing to learn")
    if getattr(tokenizer, "chat_template", None):
        prompt_text = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        full_text = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full_text.startswith(prompt_text):
            raise ExampleRejected("the chat template renders the conversation so that the prompt is not a prefix of it")
        completion_text = full_text[len(prompt_text) :]
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        completion_ids = tokenizer(completion_text, add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in completion_ids:
            completion_ids = completion_ids + [tokenizer.eos_token_id]
    else:
        if len(messages) != 2:
            raise ExampleRejected("'messages' needs a tokenizer with a chat template")
        prompt_ids = tokenizer(messages[0]["content"], add_special_tokens=True)["input_ids"]
        completion_ids = tokenizer(messages[1]["content"], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion_ids = completion_ids + [tokenizer.eos_token_id]
    return list(prompt_ids), list(completion_ids)


def prompt_ids_for(tokenizer, prompt: str) -> list[int]:
    """Token ids of a bare prompt ready for generation (the same rendering training uses)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def build_example(
    prompt_ids: list[int], completion_ids: list[int], max_length: int, truncation: str
) -> tuple[list[int], list[int], bool]:
    """(input_ids, labels, truncated): prompt masked with -100, the completion kept whole."""
    n_prompt, n_completion = len(prompt_ids), len(completion_ids)
    truncated = False
    if n_prompt + n_completion > max_length:
        if truncation == "reject":
            raise ExampleRejected(
                f"{n_prompt + n_completion} tokens, longer than data.max_length={max_length} (data.truncation: reject)"
            )
        if n_completion >= max_length:
            raise ExampleRejected(
                f"the completion alone is {n_completion} tokens; data.max_length={max_length} leaves no room for any "
                "prompt"
            )
        prompt_ids = prompt_ids[n_prompt + n_completion - max_length :]
        truncated = True
    input_ids = list(prompt_ids) + list(completion_ids)
    labels = [IGNORE_INDEX] * len(prompt_ids) + list(completion_ids)
    if all(x == IGNORE_INDEX for x in labels):
        raise ExampleRejected("every label is masked: nothing to learn")
    return input_ids, labels, truncated


def encode(obj: Any, tokenizer, data_cfg) -> tuple[list[int], list[int], bool]:
    """Validate and tokenize one parsed JSONL object; raises ExampleRejected with the reason."""
    messages = messages_of(obj)
    prompt_ids, completion_ids = render(tokenizer, messages)
    return build_example(prompt_ids, completion_ids, data_cfg.max_length, data_cfg.truncation)


def validate_file(path: os.PathLike | str, tokenizer, cfg) -> tuple[list[Example], list[Problem]]:
    """Every usable example of a JSONL file and one Problem per unusable line.

    `cfg` is the run's Config (or its `data` section).  Blank lines are ignored.  Never raises
    for bad content; an unreadable file is a single problem at line 0."""
    data_cfg = getattr(cfg, "data", cfg)
    path = Path(path)
    examples: list[Example] = []
    problems: list[Problem] = []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return [], [Problem(str(path), 0, f"cannot read: {exc.strerror or exc}")]
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = parse_line(line)
            input_ids, labels, truncated = encode(obj, tokenizer, data_cfg)
        except ExampleRejected as exc:
            problems.append(Problem(str(path), lineno, str(exc)))
            continue
        examples.append(
            Example(
                id=f"{path.name}:{lineno}",
                input_ids=input_ids,
                labels=labels,
                source=str(path),
                line=lineno,
                digest=hashlib.sha256(line).hexdigest()[:16],
                truncated=truncated,
            )
        )
    return examples, problems


# ---- order -------------------------------------------------------------------------------------


class DataSource(Protocol):
    """Where training examples come from, in a resumable order.

    `take(n)` returns n examples; `position()` is asked for only on optimizer-step boundaries and
    stored in checkpoints; `restore(position, step)` continues from one (None: from the start);
    `progress()` is a few small fields for the step heartbeat and log line.
    """

    def take(self, n: int) -> list[Example]: ...

    def position(self) -> dict: ...

    def restore(self, position: Optional[dict], step: Optional[int] = None) -> None: ...

    def progress(self) -> dict: ...


@runtime_checkable
class ContinuousDataSource(DataSource, Protocol):
    """A source whose data arrives while training runs (continuous mode, `daemon.inbox.feed.InboxFeed`).

    `take_step(n) -> (examples, end)` may wait for data and come back short, with `end` "stop" (a
    stop request ended the wait: the examples are not trained), "flush" (no data came for
    `data.flush_after_s`: train what is in hand, possibly nothing, as a partial step and make it
    durable, then go on) or "idle" (no data came for `data.idle_exit_s`: train it and end); `end`
    is None for a full step.  `commit(position, step)` is called once the checkpoint holding `position` is
    committed; `close()` when training is over.
    """

    def take_step(self, n: int) -> tuple[list[Example], Optional[str]]: ...

    def commit(self, position: dict, step: int) -> None: ...

    def close(self) -> None: ...


@dataclass
class ShuffledEpochs:
    """Examples in a fresh seeded permutation per epoch; position = (epoch, index into that epoch).

    The permutation depends only on (seed, epoch), so a resumed run sees exactly the order an
    uninterrupted one would have.  `skip`: ids of quarantined examples (`trainer.quarantine`), passed
    over where they come in the permutation; the position still counts them, so every other example
    keeps its place and a checkpoint's position means the same with or without them."""

    examples: list[Example]
    seed: int
    epoch: int = 0
    index: int = 0
    _order: Optional[list[int]] = field(default=None, repr=False)
    skip: frozenset = field(default_factory=frozenset)

    def __post_init__(self):
        if not self.examples:
            raise ValueError("ShuffledEpochs needs at least one example")
        if self.skip and all(e.id in self.skip for e in self.examples):
            from hangwatch.daemon.worker_errors import DataError

            raise DataError(
                f"every training example ({len(self.examples)}) is quarantined after non-finite losses "
                "(quarantine.jsonl in the run dir): nothing is left to train on"
            )

    def quarantine(self, ids) -> None:
        """Examples quarantined since this source was built (a rollback in the process): passed over from now on,
        as a source built afresh with them would."""
        skip = frozenset(ids) & {e.id for e in self.examples}
        if skip and all(e.id in skip for e in self.examples):
            from hangwatch.daemon.worker_errors import DataError

            raise DataError(
                f"every training example ({len(self.examples)}) is quarantined after non-finite losses "
                "(quarantine.jsonl in the run dir): nothing is left to train on"
            )
        self.skip = skip

    def order(self, epoch: int) -> list[int]:
        import numpy as np

        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, epoch])
        return [int(i) for i in rng.permutation(len(self.examples))]

    def take(self, n: int) -> list[Example]:
        out = []
        while len(out) < n:
            if self._order is None:
                self._order = self.order(self.epoch)
            if self.index >= len(self._order):
                self.epoch += 1
                self.index = 0
                self._order = self.order(self.epoch)
            example = self.examples[self._order[self.index]]
            self.index += 1
            if example.id not in self.skip:
                out.append(example)
        return out

    def position(self) -> dict:
        return {"kind": "shuffled_epochs", "epoch": self.epoch, "index": self.index, "size": len(self.examples)}

    def progress(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def restore(self, position: Optional[dict], step: Optional[int] = None) -> None:
        if position is None:
            self.epoch, self.index, self._order = 0, 0, None
            return
        if position.get("size") not in (None, len(self.examples)):
            from hangwatch.common.config import ConfigError

            raise ConfigError(
                [
                    f"data: the checkpoint was trained on {position['size']} usable examples, the data now has "
                    f"{len(self.examples)}; resuming would not continue the same run (use a new run_dir)"
                ]
            )
        self.epoch = int(position["epoch"])
        self.index = int(position["index"])
        self._order = None


def load_tokenizer(cfg):
    """The run's tokenizer without its model, for checking files before they are submitted: one that gives
    exactly the worker's token ids.  A light one (the `tokenizers` library and jinja2, no torch:
    daemon/light_tokenizer.py) where it is known to be the same: always for the tiny model, and for a model
    directory once transformers' tokenizer for it was checked and recorded (daemon/tokenizer_cache.py);
    transformers' own otherwise, recorded then for the next time.  A debug log on `hangwatch` says which."""
    import logging

    log = logging.getLogger(__name__)
    name = cfg.model.name_or_path
    if not name:
        try:
            from hangwatch.daemon.light_tokenizer import tiny

            tok = tiny(cfg.model.tiny.vocab_size)
            log.debug("tokenizer: light (%s)", tok.source)
            return tok
        except ImportError as exc:
            log.debug("tokenizer: no light tokenizer without %s: building the tiny one through transformers", exc.name)
        from hangwatch.daemon.model import build_tiny_tokenizer  # imports torch

        return build_tiny_tokenizer(cfg.model.tiny.vocab_size)
    from hangwatch.daemon import tokenizer_cache

    light = tokenizer_cache.cached(name)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name, local_files_only=True)
    if tok.pad_token_id is None:  # as model.load_base does for the worker: its special tokens are the template's
        tok.pad_token = tok.eos_token
    tokenizer_cache.remember(tok, name)
    return tok


def collate(examples: list[Example], pad_id: int):
    """Right-padded tensors: input_ids, attention_mask, labels (pad positions labelled -100)."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
