"""The model: a local base (or the tiny Llama built from config), its tokenizer, LoRA via peft, and
any extra trainable module, kept trainable and saved beside the adapter.

Nothing is ever downloaded: a named model is loaded with `local_files_only=True` (a local
directory or the hub cache), and the tiny model's tokenizer is built here, character by character,
with bos/eos/pad and a chat template.

Extra trainable modules (the tiny model's `causal_projection` head, or anything a caller attaches
and lists in `EXTRA_MODULES_ATTR`) are what PEFT silently freezes or drops: `wrap_lora` turns them
back on and `ModelBundle.trainable_state` saves them with the adapter, and it refuses to run when
some trainable parameter would be saved by neither.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
# Characters in the order they claim vocabulary slots when vocab_size is small.
CHARSET = (" " + "abcdefghijklmnopqrstuvwxyz" + "ABCDEFGHIJKLMNOPQRSTUVWXYZ" + "0123456789"
           + ".,:;!?'\"-_()[]{}<>/\\|@#$%^&*+=~`" + "\n\t")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
EXTRA_MODULES_ATTR = "hangwatch_extra_modules"
AUX_LOSS_WEIGHT = 0.1
EXTRA_FILE = "extra_modules.safetensors"


# ---- tokenizer and tiny model -----------------------------------------------------------------


def build_tiny_tokenizer(vocab_size: int):
    """A character-level tokenizer with special and role tokens; characters that do not fit map to <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + ROLE_TOKENS
    room = max(0, vocab_size - len(specials))
    tokens = specials + list(CHARSET[:room])
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        additional_special_tokens=ROLE_TOKENS, model_max_length=1 << 30,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


class CausalProjectionHead(nn.Module):
    """Auxiliary head: predicts the next position's final hidden state from the current one.

    Its loss is added to the language-model loss, so it trains alongside the adapter and must be
    checkpointed with it."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden)


def projection_loss_sum(head, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over learned positions of the squared error of `head` predicting hidden[t+1] from hidden[t].

    `head` is the CausalProjectionHead or peft's modules_to_save wrapper around it."""
    pred = head(hidden[:, :-1].float())
    target = hidden[:, 1:].detach().float()
    per_pos = (pred - target).pow(2).mean(-1)
    return (per_pos * mask[:, 1:].to(per_pos.dtype)).sum()


def build_tiny_model(tiny, tokenizer, seed: int, *, extra_head: Optional[bool] = None):
    """The tiny Llama-style model, initialised from `seed`, in float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=max(tiny.vocab_size, len(tokenizer)), hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size, num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        if tiny.extra_head if extra_head is None else extra_head:
            attach_extra(model, "causal_projection", CausalProjectionHead(tiny.hidden_size))
    return model


def attach_extra(model: nn.Module, name: str, module: nn.Module) -> None:
    """Attach a trainable module to the base model so that it is trained, saved and restored."""
    setattr(model, name, module)
    names = list(getattr(model, EXTRA_MODULES_ATTR, []))
    if name not in names:
        names.append(name)
    setattr(model, EXTRA_MODULES_ATTR, names)


def load_base(cfg, seed: int):
    """(base model, tokenizer) from `model.name_or_path` (local only) or the tiny config."""
    mcfg = cfg.model
    if mcfg.name_or_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(mcfg.name_or_path, local_files_only=True)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        dtype = torch.bfloat16 if mcfg.dtype == "bfloat16" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(mcfg.name_or_path, local_files_only=True, dtype=dtype)
        return model, tok
    tok = build_tiny_tokenizer(mcfg.tiny.vocab_size)
    return build_tiny_model(mcfg.tiny, tok, seed), tok


# ---- LoRA and the bundle ----------------------------------------------------------------------


def pick_device(cfg) -> tuple[torch.device, Optional[torch.dtype]]:
    """(device, autocast dtype or None)."""
    want = cfg.model.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            from hangwatch.common.config import ConfigError

            raise ConfigError(["model.device: cuda requested but torch sees no CUDA device"])
        autocast = torch.bfloat16 if cfg.model.dtype != "float32" and torch.cuda.is_bf16_supported() else None
        return torch.device("cuda"), autocast
    return torch.device("cpu"), None


@dataclass
class ModelBundle:
    """The wrapped model and what the trainer needs to know about it."""

    model: Any  # peft.PeftModel
    tokenizer: Any
    extra: dict[str, nn.Module] = field(default_factory=dict)
    device: torch.device = torch.device("cpu")
    autocast_dtype: Optional[torch.dtype] = None

    @property
    def base(self):
        return self.model.get_base_model()

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def adapter_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        sd = get_peft_model_state_dict(self.model)
        return {k: v.detach().to("cpu").contiguous().clone() for k, v in sd.items()}

    def extra_state(self) -> dict[str, torch.Tensor]:
        return {f"{name}.{k}": v.detach().to("cpu").contiguous().clone()
                for name, mod in self.extra.items() for k, v in mod.state_dict().items()}

    def load_adapter_state(self, sd: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, sd)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k or "modules_to_save" in k]
        if unexpected or missing:
            raise RuntimeError(f"adapter state does not fit the model: unexpected {unexpected[:5]}, missing {missing[:5]}")

    def load_extra_state(self, sd: dict[str, torch.Tensor]) -> None:
        for name, mod in self.extra.items():
            prefix = name + "."
            part = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
            mod.load_state_dict(part, strict=True)
        stray = [k for k in sd if k.split(".", 1)[0] not in self.extra]
        if stray:
            raise RuntimeError(f"saved extra-module weights for modules the model does not have: {stray[:5]}")

    def weights_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for _, p in self.trainable_parameters())

    def compute_loss(self, batch: dict, n_label_total: int, module=None) -> tuple[torch.Tensor, float, float]:
        """(loss to backpropagate, LM cross-entropy sum, auxiliary loss sum) for one micro-batch,
        normalised by the label tokens of the whole optimizer step.  `module`: what the forward goes
        through (the DDP wrapper of `model` while a multi-rank run trains; default `model`)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        labels = batch["labels"]
        head = self.extra.get("causal_projection")
        if head is None:
            head = _peft_module(self.base, "causal_projection")
        forward = self.model if module is None else module
        with self.autocast():
            out = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          output_hidden_states=head is not None, use_cache=False)
        logits = out.logits[:, :-1].float()
        target = labels[:, 1:]
        ce = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                         ignore_index=-100, reduction="sum")
        total = ce
        aux = torch.zeros((), device=ce.device)
        if head is not None:
            aux = projection_loss_sum(head, out.hidden_states[-1], labels != -100)
            total = ce + AUX_LOSS_WEIGHT * aux
        return total / n_label_total, float(ce.detach()), float(aux.detach())


def _peft_module(base, name):
    """An extra head peft took over through `modules_to_save` (a ModulesToSaveWrapper), if any."""
    if name in getattr(base, EXTRA_MODULES_ATTR, []):
        return getattr(base, name, None)
    return None


def wrap_lora(base, lora_cfg):
    """get_peft_model, then re-enable the extra modules PEFT froze; returns (peft model, extras)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules), modules_to_save=list(lora_cfg.modules_to_save) or None,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model = get_peft_model(base, config)
    extras: dict[str, nn.Module] = {}
    for name in getattr(base, EXTRA_MODULES_ATTR, []):
        if name in lora_cfg.modules_to_save:
            continue  # peft trains and saves it as a modules_to_save copy
        mod = getattr(base, name)
        for p in mod.parameters():
            p.requires_grad_(True)
        extras[name] = mod
    return model, extras


def check_everything_saved(bundle: ModelBundle) -> None:
    """Refuse a model with trainable parameters that neither the adapter nor the extras would save."""
    from peft import get_peft_model_state_dict

    saved = {t.data_ptr() for t in get_peft_model_state_dict(bundle.model).values()}
    saved |= {p.data_ptr() for m in bundle.extra.values() for p in m.parameters()}
    lost = [name for name, p in bundle.trainable_parameters() if p.data_ptr() not in saved]
    if lost:
        raise RuntimeError(f"trainable parameters that no checkpoint would save: {lost[:5]}")


def load_model(cfg) -> ModelBundle:
    """Base + tokenizer + LoRA wrapping on the configured device."""
    device, autocast = pick_device(cfg)
    base, tok = load_base(cfg, cfg.train.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed + 1)
        model, extras = wrap_lora(base, cfg.lora)
    model.to(device)
    bundle = ModelBundle(model=model, tokenizer=tok, extra=extras, device=device, autocast_dtype=autocast)
    check_everything_saved(bundle)
    return bundle


def memory_metrics(device: torch.device) -> dict:
    if device.type == "cuda":
        mb = 1 << 20
        return {
            "mem_allocated_mb": round(torch.cuda.memory_allocated(device) / mb, 1),
            "mem_reserved_mb": round(torch.cuda.memory_reserved(device) / mb, 1),
            "max_mem_allocated_mb": round(torch.cuda.max_memory_allocated(device) / mb, 1),
        }
    try:
        with open("/proc/self/statm") as f:
            rss_pages = int(f.read().split()[1])
        return {"rss_mb": round(rss_pages * os.sysconf("SC_PAGE_SIZE") / (1 << 20), 1)}
    except (OSError, ValueError, IndexError):
        return {}
