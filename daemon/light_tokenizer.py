"""The run's tokenizer without torch: the `tokenizers` library and jinja2, encoding exactly as the worker's
transformers tokenizer does, for `hangwatch submit`.

Why: submit checks every line with the run's tokenizer (lengths, label masks), and loading that through
transformers imports torch, seconds before the first line is read.  What `data.render` uses of a tokenizer
is small: its chat template rendered with jinja2, its backend's `encode`, its eos id.  `LightTokenizer` is
exactly that, and nothing else.

How we know it gives the worker's ids:
- the tiny model's tokenizer: its backend is built here (`tiny_backend`) and `model.build_tiny_tokenizer`
  wraps that very backend; transformers then adds the special tokens to it, and `tiny` adds the same ones
  (tests/unit/daemon/test_light_tokenizer.py compares the serialized backends and the ids of real lines);
- a named model's: what transformers makes of a model directory depends on its tokenizer class, its
  config and the transformers version, so it is never re-derived here.  The first time a directory is
  used (and again whenever its files or those versions change) transformers loads it; `remember` then
  stores its backend as transformers left it (`to_str`), its chat template, special tokens and eos id, once
  a light tokenizer rebuilt from them has rendered and encoded a set of probe conversations to the very
  same text and ids.  Later loads read that record (`cached`), keyed by the content of the directory's
  files and the versions of transformers, tokenizers and jinja2;
- anything else (a hub id, a tokenizer without a `tokenizers` backend, a probe that came out different)
  stays with transformers, and a debug log on the `hangwatch` logger says why.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from typing import Optional

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Characters in the order they claim vocabulary slots when vocab_size is small.
CHARSET = (
    " "
    + "abcdefghijklmnopqrstuvwxyz"
    + "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    + "0123456789"
    + ".,:;!?'\"-_()[]{}<>/\\|@#$%^&*+=~`"
    + "\n\t"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The template variables transformers passes for the tiny tokenizer (its special_tokens_map).
TINY_SPECIAL_TOKENS_MAP = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


class LightTokenizer:
    """The part of a transformers tokenizer that `data.render` and `data.prompt_ids_for` use."""

    def __init__(
        self,
        backend,
        *,
        chat_template: Optional[str],
        special_tokens_map: dict,
        eos_token_id: Optional[int],
        split_special_tokens: bool = False,
        source: str = "",
    ):
        # As transformers calls it: no truncation or padding, special tokens split only when configured so.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        self.backend = backend
        self.chat_template = chat_template
        if chat_template:
            compiled(chat_template)  # now: a missing jinja2 or a template that does not parse fails the load
        self.special_tokens_map = dict(special_tokens_map)
        self.eos_token_id = eos_token_id
        self.source = source

    def apply_chat_template(
        self, conversation: list[dict], tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        """The conversation rendered by the chat template, as transformers renders it (text only)."""
        if tokenize:
            raise TypeError("LightTokenizer.apply_chat_template renders text only (tokenize=False)")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        # transformers drops keys whose value is None and hands the template plain copies.
        messages = [{k: v for k, v in m.items() if v is not None} for m in conversation]
        return compiled(self.chat_template).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self.special_tokens_map,
        )

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.backend.encode(text, add_special_tokens=add_special_tokens).ids}

    def __repr__(self) -> str:
        return f"LightTokenizer({self.source})"


# ---- the chat template, rendered as transformers renders it ----------------------------------------


@functools.lru_cache(maxsize=8)
def compiled(template: str):
    """`template` compiled in the environment transformers' render_jinja_template uses: sandboxed, trim_blocks
    and lstrip_blocks, loop controls, `{% generation %}` blocks, its tojson, raise_exception, strftime_now,
    dict and namespace."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in re.findall(r"\d+", jinja2.__version__)[:3]) < (3, 1, 6):
        # transformers refuses older ones (known sandbox escapes): so does this, and the caller falls back to it
        raise ImportError(f"chat templates need jinja2>=3.1.6, not {jinja2.__version__}", name="jinja2")

    class Generation(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` marks what the assistant wrote; rendering keeps its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(template)


# ---- the tiny model's tokenizer ---------------------------------------------------------------------


def tiny_backend(vocab_size: int):
    """The tiny model's character-level backend: special and role tokens first, then as many characters
    of CHARSET as fit; characters that do not fit map to <unk>.  (Its special tokens are added by whoever
    wraps it: transformers in model.build_tiny_tokenizer, `tiny` here.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = SPECIAL_TOKENS + ROLE_TOKENS
    room = max(0, vocab_size - len(specials))
    tokens = specials + list(CHARSET[:room])
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    backend.decoder = decoders.Fuse()
    return backend


def tiny(vocab_size: int) -> LightTokenizer:
    """The tiny model's tokenizer, as model.build_tiny_tokenizer makes it, without transformers."""
    from tokenizers import AddedToken

    backend = tiny_backend(vocab_size)
    # What transformers does with bos/eos/pad/unk and the role tokens: added as special, not normalized.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + ROLE_TOKENS])
    return LightTokenizer(
        backend,
        chat_template=CHAT_TEMPLATE,
        special_tokens_map=TINY_SPECIAL_TOKENS_MAP,
        eos_token_id=backend.token_to_id("</s>"),
        source=f"tiny, vocab_size={vocab_size}",
    )
