"""The model: a local base (or the tiny Llama built from config), its tokenizer, LoRA via peft, and
any extra trainable module, kept trainable and saved beside the adapter.

Nothing is ever downloaded: a named model is loaded with `local_files_only=True` (a local
directory or the hub cache), and the tiny model's tokenizer is built here, character by character,
with bos/eos/pad and a chat template.

Memory (`prepare_for_training`, the one place every attempt's bundle passes, cold or prewarmed): with
`model.dtype: auto` the base weights are bf16 on a GPU that supports it (`base_dtype`; float32 on the CPU)
and the forward runs under bf16 autocast, while every trainable parameter (LoRA, `modules_to_save`, extra
modules) is kept float32, so the optimizer's updates are not rounded to bf16; `model.gradient_checkpointing`
recomputes the decoder layers' activations in the backward pass (non-reentrant checkpointing, which
replays the RNG state, so dropout — and therefore every number — is the same as without it);
`model.load_in_4bit` loads a pretrained model quantised to NF4 through bitsandbytes (QLoRA, CUDA only,
refused elsewhere as a config error).

Extra trainable modules (the tiny model's `causal_projection` head, or anything a caller attaches
and lists in `EXTRA_MODULES_ATTR`) are what PEFT silently freezes or drops: `wrap_lora` turns them
back on and `ModelBundle.trainable_state` saves them with the adapter, and it refuses to run when
some trainable parameter would be saved by neither.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

# The tiny tokenizer's definition lives with its light twin, which has no torch (`hangwatch submit` uses it).
from hangwatch.daemon.light_tokenizer import CHAT_TEMPLATE, ROLE_TOKENS, tiny_backend

EXTRA_MODULES_ATTR = "hangwatch_extra_modules"
AUX_LOSS_WEIGHT = 0.1
EXTRA_FILE = "extra_modules.safetensors"


# ---- tokenizer and tiny model -----------------------------------------------------------------


def build_tiny_tokenizer(vocab_size: int):
    """A character-level tokenizer with special and role tokens; characters that do not fit map to <unk>.

    Its backend is light_tokenizer.tiny_backend, which `hangwatch submit` uses without transformers."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=tiny_backend(vocab_size),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=ROLE_TOKENS,
        model_max_length=1 << 30,
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
        vocab_size=max(tiny.vocab_size, len(tokenizer)),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_layers,
        num_attention_heads=tiny.num_heads,
        num_key_value_heads=tiny.num_kv_heads,
        max_position_embeddings=tiny.max_position,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
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


def _remember_tokenizer(tok, name_or_path: str) -> None:
    """Let `hangwatch submit` validate files for this run with a light tokenizer (no torch import) from its
    first use on: the record is kept only when a light rebuild matches `tok` exactly.  A cache that cannot be
    written costs the submit speed, never the run."""
    from hangwatch.daemon import tokenizer_cache

    try:
        tokenizer_cache.remember(tok, name_or_path)
    except Exception as exc:  # noqa: BLE001 - a cache: never the worker's failure
        warnings.warn(f"tokenizer cache not written: {exc}")


def base_dtype(dtype: str, device_type: str, bf16_supported: bool) -> torch.dtype:
    """The dtype of the base (frozen) weights: `model.dtype`, with `auto` meaning bf16 on a GPU that supports it
    and float32 anywhere else."""
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "auto" and device_type == "cuda" and bf16_supported:
        return torch.bfloat16
    return torch.float32


def bf16_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def check_4bit(cfg, device: torch.device) -> None:
    """`model.load_in_4bit` needs a CUDA device and bitsandbytes: refused as a config error (exit 78) otherwise."""
    if not getattr(cfg.model, "load_in_4bit", False):
        return
    from hangwatch.common.config import ConfigError

    if device.type != "cuda":
        raise ConfigError(
            [
                f"model.load_in_4bit: 4-bit (QLoRA) loading needs a CUDA GPU and this worker runs on "
                f"{device.type} (torch sees no CUDA device); drop load_in_4bit or run on a GPU"
            ]
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise ConfigError(
            ["model.load_in_4bit: bitsandbytes is not installed: pip install 'hangwatch[qlora]'"]
        ) from None


def quantization_config(compute_dtype: torch.dtype):
    """NF4 with double quantisation, computing in `compute_dtype`: the QLoRA recipe."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_base(cfg, seed: int, device: Optional[torch.device] = None):
    """(base model, tokenizer) from `model.name_or_path` (local only) or the tiny config, its weights in the
    dtype that `device` (default: the configured one) calls for."""
    mcfg = cfg.model
    device = device if device is not None else pick_device(cfg)[0]
    dtype = base_dtype(mcfg.dtype, device.type, bf16_supported(device))
    if mcfg.name_or_path:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(mcfg.name_or_path, local_files_only=True)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        _remember_tokenizer(tok, mcfg.name_or_path)
        if getattr(mcfg, "load_in_4bit", False):
            check_4bit(cfg, device)
            compute = torch.bfloat16 if bf16_supported(device) else torch.float16
            model = AutoModelForCausalLM.from_pretrained(
                mcfg.name_or_path,
                local_files_only=True,
                dtype=compute,
                quantization_config=quantization_config(compute),
                device_map={"": device.index if device.index is not None else torch.cuda.current_device()},
            )
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(
                model,
                use_gradient_checkpointing=mcfg.gradient_checkpointing,
                gradient_checkpointing_kwargs={"use_reentrant": False},
            )
            return model, tok
        model = AutoModelForCausalLM.from_pretrained(mcfg.name_or_path, local_files_only=True, dtype=dtype)
        return model, tok
    tok = build_tiny_tokenizer(mcfg.tiny.vocab_size)
    model = build_tiny_model(mcfg.tiny, tok, seed)
    return (model if dtype == torch.float32 else model.to(dtype)), tok


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
        return {
            f"{name}.{k}": v.detach().to("cpu").contiguous().clone()
            for name, mod in self.extra.items()
            for k, v in mod.state_dict().items()
        }

    def load_adapter_state(self, sd: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, sd)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        missing = [k for k in (getattr(result, "missing_keys", []) or []) if "lora_" in k or "modules_to_save" in k]
        if unexpected or missing:
            raise RuntimeError(
                f"adapter state does not fit the model: unexpected {unexpected[:5]}, missing {missing[:5]}"
            )

    def load_extra_state(self, sd: dict[str, torch.Tensor]) -> None:
        for name, mod in self.extra.items():
            prefix = name + "."
            part = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
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
        loss, ce, aux, _ = self.compute_loss_rows(batch, n_label_total, module)
        return loss, ce, aux

    def compute_loss_rows(
        self, batch: dict, n_label_total: int, module=None, poison: Optional[list[bool]] = None
    ) -> tuple[torch.Tensor, float, float, list[int]]:
        """`compute_loss`, plus the rows (examples) of the micro-batch whose own loss is non-finite — looked for
        only when the micro-batch's loss is (the culprits of a non-finite step, for the quarantine).
        `poison`: rows whose logits are made non-finite (the `poison` fault: what a corrupt example does)."""
        batch = {k: v.to(self.device) for k, v in batch.items()}
        labels = batch["labels"]
        head = self.extra.get("causal_projection")
        if head is None:
            head = _peft_module(self.base, "causal_projection")
        forward = self.model if module is None else module
        with self.autocast():
            out = forward(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                output_hidden_states=head is not None,
                use_cache=False,
            )
        logits = out.logits[:, :-1].float()
        if poison is not None and any(poison):
            scale = torch.tensor([float("nan") if p else 1.0 for p in poison], device=logits.device)
            logits = logits * scale[:, None, None]
        target = labels[:, 1:]
        ce = nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=-100, reduction="sum"
        )
        total = ce
        aux = torch.zeros((), device=ce.device)
        if head is not None:
            aux = projection_loss_sum(head, out.hidden_states[-1], labels != -100)
            total = ce + AUX_LOSS_WEIGHT * aux
        ce_value, aux_value = float(ce.detach()), float(aux.detach())
        bad_rows: list[int] = []
        if not (math.isfinite(ce_value) and math.isfinite(aux_value)):
            with torch.no_grad():
                per_token = nn.functional.cross_entropy(
                    logits.detach().reshape(-1, logits.size(-1)),
                    target.reshape(-1),
                    ignore_index=-100,
                    reduction="none",
                ).view(target.shape)
                per_row = per_token.sum(dim=1)
                bad_rows = [i for i, v in enumerate(per_row.tolist()) if not math.isfinite(v)]
        return total / n_label_total, ce_value, aux_value, bad_rows


def _peft_module(base, name):
    """An extra head peft took over through `modules_to_save` (a ModulesToSaveWrapper), if any."""
    if name in getattr(base, EXTRA_MODULES_ATTR, []):
        return getattr(base, name, None)
    return None


def wrap_lora(base, lora_cfg):
    """get_peft_model, then re-enable the extra modules PEFT froze; returns (peft model, extras)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        modules_to_save=list(lora_cfg.modules_to_save) or None,
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
    """Base + tokenizer + LoRA wrapping on the configured device, ready to train (`prepare_for_training`)."""
    device, autocast = pick_device(cfg)
    check_4bit(cfg, device)
    base, tok = load_base(cfg, cfg.train.seed, device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed + 1)
        model, extras = wrap_lora(base, cfg.lora)
    if not getattr(base, "is_loaded_in_4bit", False):  # a quantised model is placed by its device_map, and cannot move
        model.to(device)
    bundle = ModelBundle(model=model, tokenizer=tok, extra=extras, device=device, autocast_dtype=autocast)
    check_everything_saved(bundle)
    prepare_for_training(bundle, cfg)
    return bundle


def prepare_for_training(bundle: ModelBundle, cfg, gradient_checkpointing: Optional[bool] = None) -> ModelBundle:
    """Weights in their dtypes and gradient checkpointing as configured; idempotent, so a bundle a standby
    preloaded on the CPU passes here too once it is on its device.  `gradient_checkpointing`: the setting in
    force (OOM remediation may turn it on; default `model.gradient_checkpointing`)."""
    base = bundle.base
    if not getattr(base, "is_loaded_in_4bit", False):
        want = base_dtype(cfg.model.dtype, bundle.device.type, bf16_supported(bundle.device))
        frozen = [p for p in bundle.model.parameters() if not p.requires_grad and p.is_floating_point()]
        if any(p.dtype != want for p in frozen):
            with torch.no_grad():
                for p in frozen:
                    p.data = p.data.to(want)
    keep_trainable_float32(bundle)
    on = cfg.model.gradient_checkpointing if gradient_checkpointing is None else gradient_checkpointing
    if on and not checkpointing_on(base):
        enable_gradient_checkpointing(base)
    return bundle


def checkpointing_on(base) -> bool:
    """Whether activation checkpointing is on (transformers 5's name first, 4.x's after)."""
    on = getattr(type(base), "is_activation_checkpointing", None)
    return bool(
        base.is_activation_checkpointing if on is not None else getattr(base, "is_gradient_checkpointing", False)
    )


def keep_trainable_float32(bundle: ModelBundle) -> None:
    """Every trainable parameter in float32 (the optimizer's master weights), whatever the base's dtype."""
    with torch.no_grad():
        for _, p in bundle.trainable_parameters():
            if p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()


def enable_gradient_checkpointing(base) -> None:
    """Non-reentrant activation checkpointing on every decoder layer (transformers 5's name first, 4.x's after)."""
    kwargs = {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        if hasattr(base, "activation_checkpointing_enable"):
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


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
