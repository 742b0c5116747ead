"""The doctor's memory estimate: parameter counts from the worker's own model code built on the `meta`
device (no weight is allocated or read, so a model far too big for the machine is counted in a second),
an estimate of the training peak (weights, trainable parameters with their gradients and AdamW state,
activations for micro_batch_size × max_length, logits), and the device memory it must fit in.

`estimate` and `check_memory` are pure; `meta_counts` and `available_memory` touch torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hangwatch.daemon.doctor.findings import Finding, fail, ok, warn

GIB = 1 << 30
CUDA_CONTEXT_BYTES = 512 << 20  # the worker's own CUDA context and allocator slack
MARGIN = 1.10  # allocator fragmentation and temporaries the estimate does not name


@dataclass
class Counts:
    """Parameters of the wrapped model, by kind, and the shapes activations scale with."""

    total: int
    trainable: dict[str, list[str]] = field(default_factory=dict)  # kind → parameter names
    trainable_numel: dict[str, int] = field(default_factory=dict)  # kind → elements
    hidden: int = 0
    intermediate: int = 0
    layers: int = 0
    vocab: int = 0

    @property
    def n_trainable(self) -> int:
        return sum(self.trainable_numel.values())


def kind_of(name: str, extras: list[str]) -> str:
    """lora / modules_to_save / extra / other: how a trainable parameter came to be trainable."""
    if "lora_" in name:
        return "lora"
    if "modules_to_save" in name:
        return "modules_to_save"
    if any(f".{e}." in f".{name}" for e in extras):
        return "extra"
    return "other"


def classify(named_params, extras: list[str]) -> tuple[dict[str, list[str]], dict[str, int]]:
    names: dict[str, list[str]] = {}
    numel: dict[str, int] = {}
    for n, p in named_params:
        if p.requires_grad:
            k = kind_of(n, extras)
            names.setdefault(k, []).append(n)
            numel[k] = numel.get(k, 0) + p.numel()
    return names, numel


def meta_counts(cfg) -> Counts:
    """Build the base model and wrap it exactly as the worker does (model.build_tiny_model / the model's
    config, model.wrap_lora), on the meta device: shapes without storage."""
    import torch

    from hangwatch.daemon.model import EXTRA_MODULES_ATTR, build_tiny_model, build_tiny_tokenizer, wrap_lora

    with torch.device("meta"):
        if cfg.model.name_or_path:
            from transformers import AutoConfig, AutoModelForCausalLM

            mconf = AutoConfig.from_pretrained(cfg.model.name_or_path, local_files_only=True)
            base = AutoModelForCausalLM.from_config(mconf)
        else:
            base = build_tiny_model(cfg.model.tiny, build_tiny_tokenizer(cfg.model.tiny.vocab_size), cfg.train.seed)
        extras = list(getattr(base, EXTRA_MODULES_ATTR, []))
        conf = base.config
        model, _ = wrap_lora(base, cfg.lora)
    names, numel = classify(model.named_parameters(), extras)
    text = getattr(conf, "get_text_config", lambda: conf)()
    return Counts(
        total=sum(p.numel() for p in model.parameters()),
        trainable=names,
        trainable_numel=numel,
        hidden=int(getattr(text, "hidden_size", 0) or 0),
        intermediate=int(getattr(text, "intermediate_size", 0) or 0),
        layers=int(getattr(text, "num_hidden_layers", 0) or 0),
        vocab=int(getattr(text, "vocab_size", 0) or 0),
    )


def weight_bytes_per_param(dtype: str, load_in_4bit: bool, cuda: bool, bf16_ok: bool) -> float:
    """Bytes per base weight as the worker loads it: 4-bit (~0.5 plus quantisation constants), bf16 for
    `bfloat16` and for `auto` on a bf16-capable GPU, float32 otherwise."""
    if load_in_4bit:
        return 0.56
    if dtype == "bfloat16" or (dtype == "auto" and cuda and bf16_ok):
        return 2.0
    return 4.0


def estimate(
    counts: Counts,
    *,
    micro_batch: int,
    max_length: int,
    weight_bytes: float,
    act_bytes: int,
    gradient_checkpointing: bool,
    cuda: bool,
) -> dict[str, int]:
    """Bytes of the training peak, by part.  Trainable parameters are float32 with a gradient and AdamW's
    two moments (16 bytes each).  Activations per layer and token ≈ (12·hidden + 5·intermediate) elements
    kept for backward (attention through SDPA: no seq² term); with gradient checkpointing only each
    layer's input is kept, plus one layer recomputed at a time.  Logits: in the compute dtype, a float32
    copy and its gradient."""
    tokens = micro_batch * max_length
    per_layer = tokens * (12 * counts.hidden + 5 * counts.intermediate) * act_bytes
    if gradient_checkpointing:
        activations = counts.layers * tokens * counts.hidden * act_bytes + per_layer
    else:
        activations = counts.layers * per_layer
    parts = {
        "weights": int((counts.total - counts.n_trainable) * weight_bytes),
        "trainable": counts.n_trainable * 4,
        "gradients": counts.n_trainable * 4,
        "optimizer": counts.n_trainable * 8,
        "activations": activations,
        "logits": tokens * counts.vocab * (act_bytes + 8),
    }
    if cuda:
        parts["cuda context"] = CUDA_CONTEXT_BYTES
    parts["total"] = int(sum(parts.values()) * MARGIN)
    return parts


def loading_words(cfg, cuda: bool) -> str:
    """For an out-of-memory error while loading: what the doctor estimates the model needs, in a sentence ("" when it
    cannot be had: this never raises)."""
    try:
        import torch

        counts = meta_counts(cfg)
        bf16_ok = cuda and torch.cuda.is_bf16_supported()
        wbytes = weight_bytes_per_param(cfg.model.dtype, bool(getattr(cfg.model, "load_in_4bit", False)), cuda, bf16_ok)
        parts = estimate(
            counts,
            micro_batch=cfg.train.micro_batch_size,
            max_length=cfg.data.max_length,
            weight_bytes=wbytes,
            act_bytes=2 if cuda and bf16_ok and cfg.model.dtype != "float32" else 4,
            gradient_checkpointing=bool(getattr(cfg.model, "gradient_checkpointing", False)),
            cuda=cuda,
        )
        available, where = available_memory(cuda)
        return (
            f"the doctor's estimate: the base weights alone take ~{fmt(parts['weights'])} ({counts.total:,} "
            f"parameters at {wbytes:g} bytes each), training ~{fmt(parts['total'])}; {fmt(available)} free on {where}"
        )
    except Exception:
        return ""


def available_memory(cuda: bool) -> tuple[int, str]:
    """(bytes free now, where): the GPU's free memory (torch.cuda.mem_get_info), else available RAM."""
    if cuda:
        import torch

        free, total = torch.cuda.mem_get_info()
        return int(free), f"{torch.cuda.get_device_name()} ({total / GIB:.1f} GiB)"
    import psutil

    return int(psutil.virtual_memory().available), "RAM"


def fmt(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


def check_memory(parts: dict[str, int], available: int, where: str, *, dtype_text: str, shape_text: str) -> Finding:
    name = "memory estimate"
    need = parts["total"]
    breakdown = ", ".join(f"{k} {fmt(v)}" for k, v in parts.items() if k != "total")
    details = [breakdown, f"{dtype_text}; {shape_text}"]
    text = f"~{fmt(need)} needed for training, {fmt(available)} free on {where}"
    fix = (
        "lower train.micro_batch_size (raise grad_accum to keep the batch), data.max_length, or use "
        "model.gradient_checkpointing / bfloat16 / load_in_4bit, or a bigger device"
    )
    if need > available:
        return fail(name, text + ": the model does not fit", fix, details)
    if need > 0.8 * available:
        return warn(name, text + ": over 80% of it", fix, details)
    return ok(name, text, details)
