"""The verified record of a named model's tokenizer, so that later `hangwatch submit`s check files without
transformers (and torch): see daemon/light_tokenizer.py for why and how it is trusted.

    remember(tok, name_or_path)   after transformers loaded `tok` from a local directory: store its backend
                                  (as transformers left it), chat template, special tokens and eos id, once
                                  a LightTokenizer rebuilt from them matches `tok` on every probe
    cached(name_or_path)          that LightTokenizer, or None (and a debug log saying why)

A record lives in $XDG_CACHE_HOME/hangwatch/tokenizers/ (~/.cache/… by default) under a key made of the
directory's path, the content of its files (weights aside) and the versions of transformers, tokenizers
and jinja2: any change to any of them is a new key, so a record is never used for anything but what it
was checked on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from hangwatch.daemon.light_tokenizer import LightTokenizer

log = logging.getLogger(__name__)

CACHE_FORMAT = 1  # bump when what `remember` stores, or how LightTokenizer uses it, changes
BIG_FILE = 64 * 2**20  # files larger than this are fingerprinted by size and mtime, not content
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".npz")

# What data.render calls on a tokenizer: a class that redefines any of these may not be the generic one's.
ENCODING_METHODS = (
    "__call__",
    "_call_one",
    "encode_plus",
    "_encode_plus",
    "_batch_encode_plus",
    "encode",
    "prepare_for_tokenization",
    "apply_chat_template",
    "get_chat_template",
)
MAX_PROBE_SPECIALS = 64
PROBES = [
    [{"role": "user", "content": "upper: fox"}, {"role": "assistant", "content": "FOX"}],
    [
        {"role": "system", "content": "transform the word"},
        {"role": "user", "content": "reverse: lamp"},
        {"role": "assistant", "content": "pmal"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "two"},
    ],
    [
        {"role": "user", "content": "  leading\n\n\ttabs  and  double  spaces\r\nCRLF  "},
        {"role": "assistant", "content": " trailing space \n"},
    ],
    [
        {"role": "user", "content": "Ünïcödé — 日本語, emoji 🙂, שלום, e\u0301, \u00a0nbsp, ½ ∑ ∞ ™"},
        {"role": "assistant", "content": "ÀÉÎÕÜ ß 한국어"},
    ],
    [
        {"role": "user", "content": '{"a": [1, 2.5, null]}\n```python\nprint(f"{x!r}")\n```'},
        {"role": "assistant", "content": "x = 12345678901234567890; y = -0.001e-10"},
    ],
    [
        {"role": "user", "content": " ".join(["the quick brown fox jumps over the lazy dog"] * 40)},
        {"role": "assistant", "content": "done"},
    ],
]


def cache_root(env: Mapping[str, str] = os.environ) -> Path:
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base).expanduser() / "hangwatch" / "tokenizers"


def local_dir(name_or_path: str) -> Optional[Path]:
    path = Path(name_or_path).expanduser()
    return path.resolve() if path.is_dir() else None


def transformers_version() -> Optional[str]:
    """The installed transformers' version, read from its __init__.py without importing it (importing it
    is what this module avoids; importlib.metadata scans every installed distribution: ~0.1 s)."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.origin:
        return None
    text = Path(spec.origin).read_text(errors="replace")
    found = re.search(r'^__version__\s*=\s*["\']([^"\']+)["\']', text, re.M)
    # No version line: the file itself stands for it (any other install is a new key).
    return found.group(1) if found else "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def versions() -> dict:
    import jinja2
    import tokenizers

    return {
        "format": CACHE_FORMAT,
        "transformers": transformers_version(),
        "tokenizers": tokenizers.__version__,
        "jinja2": jinja2.__version__,
    }


def fingerprint(model_dir: Path) -> list:
    """(name, content digest) of every file transformers may read for a tokenizer: those in the directory and
    its additional_chat_templates/, weights aside; a file over BIG_FILE by its size and mtime instead."""
    out = []
    for path in sorted([*model_dir.iterdir(), *(model_dir / "additional_chat_templates").glob("*")]):
        if not path.is_file() or path.name.endswith(WEIGHTS):
            continue
        st = path.stat()
        digest = (
            f"size {st.st_size} mtime {st.st_mtime_ns}"
            if st.st_size > BIG_FILE
            else hashlib.sha256(path.read_bytes()).hexdigest()
        )
        out.append([str(path.relative_to(model_dir)), digest])
    return out


def record_path(model_dir: Path, env: Mapping[str, str] = os.environ) -> Path:
    # The path too: transformers may decide by a model's name (a local directory's name is its path).
    key = json.dumps({"dir": str(model_dir), "files": fingerprint(model_dir), "versions": versions()}, sort_keys=True)
    return cache_root(env) / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def from_record(rec: dict, source: str) -> LightTokenizer:
    from tokenizers import Tokenizer

    return LightTokenizer(
        Tokenizer.from_str(rec["backend"]),
        chat_template=rec["chat_template"],
        special_tokens_map=rec["special_tokens_map"],
        eos_token_id=rec["eos_token_id"],
        split_special_tokens=rec["split_special_tokens"],
        source=source,
    )


def cached(name_or_path: str, env: Mapping[str, str] = os.environ) -> Optional[LightTokenizer]:
    """The light tokenizer verified for this model directory as it is now, or None."""
    model_dir = local_dir(name_or_path)
    if model_dir is None:
        log.debug("tokenizer: %s is not a local directory: loading it through transformers", name_or_path)
        return None
    try:
        path = record_path(model_dir, env)
    except ImportError as exc:
        log.debug("tokenizer: %s: no light tokenizer without %s: loading it through transformers", model_dir, exc.name)
        return None
    except OSError as exc:
        log.debug("tokenizer: cannot read %s (%s): loading it through transformers", model_dir, exc)
        return None
    try:
        rec = json.loads(path.read_text())
        tok = from_record(rec, f"{model_dir}, verified record {path}")
    except FileNotFoundError:
        log.debug(
            "tokenizer: no verified record for %s as it is now (first use, or its files or the versions "
            "of transformers/tokenizers/jinja2 changed): loading it through transformers",
            model_dir,
        )
        return None
    except Exception as exc:  # a torn or foreign record (tokenizers raises its own kinds): never trusted
        log.debug("tokenizer: unreadable record %s (%s): loading %s through transformers", path, exc, model_dir)
        return None
    log.debug("tokenizer: light (%s)", tok.source)
    return tok


# ---- remembering what transformers made of a directory ----------------------------------------------


def _plain_strings(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))


def record_of(tok) -> tuple[Optional[dict], str]:
    """(what a LightTokenizer needs of `tok`, "") or (None, why it cannot stand in for it)."""
    from transformers import PreTrainedTokenizerFast  # the generic class (TokenizersBackend in transformers 5)

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None, f"{type(tok).__name__} has no `tokenizers` backend"
    changed = [
        m for m in ENCODING_METHODS if getattr(type(tok), m, None) is not getattr(PreTrainedTokenizerFast, m, None)
    ]
    if changed:
        return None, f"{type(tok).__name__} redefines {', '.join(changed)}"
    template = None
    if tok.chat_template:
        try:
            template = tok.get_chat_template()
        except ValueError as exc:
            return None, f"its chat template cannot be chosen: {exc}"
    elif tok.chat_template is not None:
        template = tok.chat_template
    if template is not None and not isinstance(template, str):
        return None, f"its chat template is a {type(template).__name__}"
    specials = dict(tok.special_tokens_map)
    if not all(_plain_strings(v) for v in specials.values()):
        return None, "its special tokens are not plain strings"
    return {
        "chat_template": template,
        "special_tokens_map": specials,
        "eos_token_id": tok.eos_token_id,
        "split_special_tokens": bool(getattr(tok, "split_special_tokens", False)),
        "tokenizer_class": type(tok).__name__,
        "backend": backend.to_str(),
    }, ""


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # both must fail alike: the template's own errors count as an outcome
        return f"raised {type(exc).__name__}"


def differences(real, light) -> list[str]:
    """Where `light` renders or encodes a probe differently from `real` (empty: the same everywhere)."""
    found = []
    if real.eos_token_id != light.eos_token_id:
        found.append(f"eos id {real.eos_token_id} vs {light.eos_token_id}")
    if bool(real.chat_template) != bool(light.chat_template):
        found.append("one has a chat template, the other not")
    specials = sorted(set(real.all_special_tokens) | set(real.get_added_vocab()))[:MAX_PROBE_SPECIALS]
    probes = PROBES + [
        [
            {"role": "user", "content": " ".join(specials) + "x".join(specials)},
            {"role": "assistant", "content": "".join(specials) + " end"},
        ]
    ]
    for n, conv in enumerate(probes):
        texts = [m["content"] for m in conv]
        if real.chat_template:
            for head, gen in ((conv[:-1], True), (conv, False)):
                a = _outcome(lambda: real.apply_chat_template(head, tokenize=False, add_generation_prompt=gen))
                b = _outcome(lambda: light.apply_chat_template(head, tokenize=False, add_generation_prompt=gen))
                if a != b:
                    found.append(f"probe {n}: the chat template renders {a!r:.80} vs {b!r:.80}")
                elif isinstance(a, str):
                    texts.append(a)
        for text in texts:
            for special in (False, True):
                a = _outcome(lambda: list(real(text, add_special_tokens=special)["input_ids"]))
                b = _outcome(lambda: list(light(text, add_special_tokens=special)["input_ids"]))
                if a != b:
                    found.append(
                        f"probe {n}: {text[:40]!r} (add_special_tokens={special}) encodes as {a!s:.60} vs {b!s:.60}"
                    )
    return found


def remember(tok, name_or_path: str, env: Mapping[str, str] = os.environ) -> Optional[Path]:
    """Record `tok` (loaded by transformers from `name_or_path`) for later light loads, if a light tokenizer
    rebuilt from the record matches it on every probe.  The record's path, or None (a debug log says why)."""
    from hangwatch.common.durable import write_atomic

    model_dir = local_dir(name_or_path)
    if model_dir is None:
        return None
    rec, why = record_of(tok)
    if rec is None:
        log.debug("tokenizer: %s stays with transformers: %s", model_dir, why)
        return None
    try:
        path = record_path(model_dir, env)
        if path.is_file():  # already checked for these very files and versions (another process got here first)
            return path
        diffs = differences(tok, from_record(rec, "being checked"))
    except Exception as exc:  # the record is an optimisation: whatever goes wrong, transformers still answers
        log.debug("tokenizer: %s not recorded (%s: %s)", model_dir, type(exc).__name__, exc)
        return None
    if diffs:
        log.debug("tokenizer: %s stays with transformers: the light one differs: %s", model_dir, "; ".join(diffs[:3]))
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({**rec, "model_dir": str(model_dir), "versions": versions()}), durable=False)
    except OSError as exc:
        log.debug(
            "tokenizer: cannot write %s (%s); the next submit loads %s through transformers again", path, exc, model_dir
        )
        return None
    log.debug("tokenizer: recorded %s for %s: later submits load it without transformers", path, model_dir)
    return path
