"""The light tokenizer (`hangwatch submit`'s, no torch) gives exactly the worker's token ids and verdicts.

The worker's tokenizer is transformers' (model.build_tiny_tokenizer, or AutoTokenizer on a directory as
model.load_base loads it); every comparison below is against it, on real data lines and on lines made
to be awkward (unicode, whitespace, special-token text, over-long, malformed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from hangwatch.daemon import light_tokenizer, tokenizer_cache
from hangwatch.daemon.data import load_tokenizer, prompt_ids_for, validate_file
from hangwatch.daemon.light_tokenizer import LightTokenizer, tiny

ROOT = Path(__file__).resolve().parents[3]
REAL = [ROOT / "configs/data/train.jsonl", ROOT / "configs/data/eval.jsonl"]
AWKWARD = [
    {"prompt": "upper: fox", "completion": "FOX"},
    {
        "messages": [
            {"role": "system", "content": "  be brief\n"},
            {"role": "user", "content": "hi\tthere\r\n"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "ok "},
        ]
    },
    {"prompt": "Ünïcödé — 日本語 🙂 ½", "completion": "ÀÉÎ ß"},
    {"prompt": "text with <|user|> and </s> and <s> inside", "completion": "<|assistant|> <pad> <unk>"},
    {"prompt": "word " * 40, "completion": "long prompt, cut at its start or rejected"},
    {"prompt": "short", "completion": "a completion far longer than the max_length allows " * 3},
    {"prompt": "x", "completion": "   "},
    {"prompt": "missing completion"},
    {"messages": [{"role": "user", "content": "no assistant turn"}]},
    "not an object",
]
CHATML = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def awkward_file(path: Path) -> Path:
    lines = [json.dumps(o, ensure_ascii=False).encode() for o in AWKWARD] + [b"{not json", b"", b"\xff\xfe not UTF-8"]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def data_cfg(max_length: int = 64, truncation: str = "keep_completion"):
    return SimpleNamespace(max_length=max_length, truncation=truncation)


def verdicts(path: Path, tok, cfg) -> tuple:
    """Everything validate_file says about a file: each example's ids, labels and flags, each problem."""
    examples, problems = validate_file(path, tok, cfg)
    return ([(e.id, e.input_ids, e.labels, e.truncated, e.digest) for e in examples], [str(p) for p in problems])


@pytest.fixture(scope="module")
def transformers_tiny():
    from hangwatch.daemon.model import build_tiny_tokenizer

    return {v: build_tiny_tokenizer(v) for v in (128, 40)}


# ---- the tiny model's tokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [128, 40, 7])
def test_the_tiny_backend_is_the_one_transformers_wraps(vocab_size):
    from hangwatch.daemon.model import build_tiny_tokenizer

    worker, light = build_tiny_tokenizer(vocab_size), tiny(vocab_size)
    theirs, ours = json.loads(worker.backend_tokenizer.to_str()), json.loads(light.backend.to_str())
    # transformers 5 gives the backend a post-processor that adds nothing; 4.x leaves none: ids are the same
    theirs.pop("post_processor"), ours.pop("post_processor")
    assert ours == theirs  # vocabulary, added special tokens (and their flags), pre-tokenizer, decoder
    assert light.eos_token_id == worker.eos_token_id
    assert light.special_tokens_map.items() <= worker.special_tokens_map.items()
    for text in ["<s>hi</s>", "plain text", "Ünï 🙂"]:
        for special in (True, False):
            assert (
                light(text, add_special_tokens=special)["input_ids"]
                == worker(text, add_special_tokens=special)["input_ids"]
            )


@pytest.mark.parametrize("vocab_size", [128, 40])
@pytest.mark.parametrize("max_length,truncation", [(64, "keep_completion"), (32, "reject"), (24, "keep_completion")])
def test_tiny_gives_the_workers_verdicts_on_real_and_awkward_lines(
    tmp_path, transformers_tiny, vocab_size, max_length, truncation
):
    worker, light = transformers_tiny[vocab_size], tiny(vocab_size)
    cfg = data_cfg(max_length, truncation)
    files = REAL + [awkward_file(tmp_path / "awkward.jsonl")]
    for f in files:
        assert verdicts(f, light, cfg) == verdicts(f, worker, cfg), f
    examples, problems = verdicts(files[-1], light, cfg)
    assert examples and len(problems) >= 5  # the awkward file really has both kinds


def test_generation_prompts_match(transformers_tiny):
    worker, light = transformers_tiny[128], tiny(128)
    for prompt in ["upper: fox", "  spaced  ", "日本語", "<|assistant|>"]:
        assert prompt_ids_for(light, prompt) == prompt_ids_for(worker, prompt)


def test_load_tokenizer_gives_the_light_one_for_the_tiny_model(caplog):
    cfg = SimpleNamespace(model=SimpleNamespace(name_or_path=None, tiny=SimpleNamespace(vocab_size=128)))
    with caplog.at_level(logging.DEBUG, logger="hangwatch"):
        tok = load_tokenizer(cfg)
    assert isinstance(tok, LightTokenizer)
    assert "tokenizer: light (tiny, vocab_size=128)" in caplog.text


# ---- a model directory: recorded after transformers loaded it, then light ----------------------------


def save_bpe(where: Path, chat_template, tokenizer_class=None) -> Path:
    """A byte-level BPE tokenizer trained on the demo data (bos added by its post-processor), saved as a
    model directory with save_pretrained, as a real one would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    specials = ["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [line for f in REAL for line in f.read_text().splitlines()],
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A",
        pair="<|begin|> $A <|begin|> $B",
        special_tokens=[("<|begin|>", bpe.token_to_id("<|begin|>"))],
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin|>", eos_token="<|end|>", additional_special_tokens=specials[2:]
    )
    tok.chat_template = chat_template
    tok.save_pretrained(where)
    LlamaConfig(vocab_size=400).save_pretrained(where)
    if tokenizer_class:
        cfg_path = where / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "tokenizer_class": tokenizer_class}))
    return where


def save_tiny(where: Path) -> Path:
    from hangwatch.daemon.model import build_tiny_tokenizer

    build_tiny_tokenizer(128).save_pretrained(where)
    return where


def model_cfg(path: Path):
    return SimpleNamespace(model=SimpleNamespace(name_or_path=str(path), tiny=None))


def workers_tokenizer(path: Path):
    """The tokenizer as model.load_base loads it for the worker."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "hangwatch" / "tokenizers"


@pytest.mark.parametrize("kind", ["tiny saved", "bpe, chatml template", "bpe, no template", "bpe, GPT2Tokenizer class"])
def test_a_model_directory_is_light_once_recorded_and_gives_the_workers_verdicts(tmp_path, cache, kind, caplog):
    d = tmp_path / "model"
    if kind == "tiny saved":
        save_tiny(d)
    else:
        save_bpe(d, None if kind == "bpe, no template" else CHATML, "GPT2Tokenizer" if "GPT2" in kind else None)
    with caplog.at_level(logging.DEBUG, logger="hangwatch"):
        first = load_tokenizer(model_cfg(d))  # transformers, then recorded
        second = load_tokenizer(model_cfg(d))
    assert not isinstance(first, LightTokenizer) and isinstance(second, LightTokenizer)
    assert "no verified record" in caplog.text and "recorded" in caplog.text and "tokenizer: light" in caplog.text
    assert len(list(cache.glob("*.json"))) == 1
    worker = workers_tokenizer(d)
    files = REAL + [awkward_file(tmp_path / "awkward.jsonl")]
    for cfg in (data_cfg(), data_cfg(48, "reject")):
        for f in files:
            assert verdicts(f, second, cfg) == verdicts(f, worker, cfg), (kind, f)
    if kind == "bpe, no template":  # the prompt/completion path: bos from the recorded post-processor
        assert second("hi", add_special_tokens=True)["input_ids"][0] == worker.bos_token_id


def test_a_changed_directory_is_checked_again(tmp_path, cache):
    d = save_bpe(tmp_path / "model", CHATML)
    load_tokenizer(model_cfg(d))
    assert isinstance(load_tokenizer(model_cfg(d)), LightTokenizer)
    (d / "chat_template.jinja").write_text(CHATML.replace("<|im_end|>\\n", "<|im_end|>"))
    assert tokenizer_cache.cached(str(d)) is None  # a new key: the old record says nothing about this
    load_tokenizer(model_cfg(d))
    light = load_tokenizer(model_cfg(d))
    assert isinstance(light, LightTokenizer) and "<|im_end|>\\n" not in light.chat_template
    assert verdicts(REAL[0], light, data_cfg()) == verdicts(REAL[0], workers_tokenizer(d), data_cfg())


def test_a_torn_record_is_never_trusted(tmp_path, cache, caplog):
    d = save_tiny(tmp_path / "model")
    load_tokenizer(model_cfg(d))
    (record,) = cache.glob("*.json")
    record.write_text(record.read_text()[:100])
    with caplog.at_level(logging.DEBUG, logger="hangwatch"):
        assert tokenizer_cache.cached(str(d)) is None
    assert "unreadable record" in caplog.text


def test_what_cannot_stand_in_stays_with_transformers(tmp_path, cache, caplog):
    from transformers import PreTrainedTokenizerFast

    class Lowercasing(PreTrainedTokenizerFast):
        def __call__(self, text, **kw):
            return super().__call__(text.lower(), **kw)

    d = save_tiny(tmp_path / "model")
    odd = Lowercasing(tokenizer_object=light_tokenizer.tiny_backend(128), eos_token="</s>")
    with caplog.at_level(logging.DEBUG, logger="hangwatch"):
        assert tokenizer_cache.remember(odd, str(d)) is None
        assert tokenizer_cache.cached("some-org/some-model") is None
    assert "redefines __call__" in caplog.text and "not a local directory" in caplog.text
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_a_light_tokenizer_that_differs_is_caught_by_the_probes(transformers_tiny):
    worker = transformers_tiny[128]
    other_template = tiny(128)
    other_template.chat_template = light_tokenizer.CHAT_TEMPLATE.replace("{{ bos_token }}", "")
    assert any("chat template renders" in d for d in tokenizer_cache.differences(worker, other_template))
    assert any("encodes as" in d for d in tokenizer_cache.differences(worker, tiny(40)))
    assert tokenizer_cache.differences(worker, tiny(128)) == []


def test_the_template_environment_is_transformers(transformers_tiny):
    """Loop controls, {% generation %}, tojson (non-ASCII kept), raise_exception, namespace: rendered alike."""
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | tojson }}"
        "{% endgeneration %}{% else %}  {{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}{{ ns.n }}"
        "{% if messages | length > 9 %}{{ raise_exception('too long') }}{% endif %}"
    )
    worker = transformers_tiny[128]
    light = LightTokenizer(
        light_tokenizer.tiny_backend(128),
        chat_template=template,
        special_tokens_map=worker.special_tokens_map,
        eos_token_id=worker.eos_token_id,
    )
    conv = [
        {"role": "user", "content": "héllo"},
        {"role": "assistant", "content": 'wörld "q"'},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
    ]
    ours = light.apply_chat_template(conv)
    assert ours == worker.apply_chat_template(conv, chat_template=template, tokenize=False)
    assert '"wörld \\"q\\""' in ours and ours.endswith("3")
    with pytest.raises(Exception, match="too long") as theirs:
        worker.apply_chat_template(conv * 5, chat_template=template, tokenize=False)
    with pytest.raises(theirs.type, match="too long"):
        light.apply_chat_template(conv * 5)
