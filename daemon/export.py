"""The final adapter: `<run_dir>/final/` in peft format, with the extra modules, the tokenizer and,
for the tiny model, its base, so that it loads without this run's config.

The export is written to a temporary directory, every file and directory fsynced, then swapped in
for an earlier export by two renames; a crash leaves the old export or the new one under `final/`
(and at worst a hidden leftover beside it).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

from hangwatch.common.durable import fsync_dir
from hangwatch.daemon.checkpoint import fsync_tree
from hangwatch.daemon.model import EXTRA_FILE, CausalProjectionHead, ModelBundle, attach_extra, build_tiny_model

FINAL_DIR = "final"
FINAL_INFO = "hangwatch.json"


def export_final(bundle: ModelBundle, cfg, out_dir: os.PathLike | str, step: int) -> Path:
    """Write the adapter (peft format), extra modules, tokenizer and, for the tiny model, its base,
    to `out_dir`, replacing an earlier export atomically."""
    from safetensors.torch import save_file
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bundle.model.save_pretrained(tmp)
    extra = bundle.extra_state()
    if extra:
        save_file(extra, str(tmp / EXTRA_FILE))
    bundle.tokenizer.save_pretrained(tmp)
    if cfg.model.name_or_path:
        base_ref = cfg.model.name_or_path
    else:
        base_ref = "base_model"
        plain = build_tiny_model(cfg.model.tiny, bundle.tokenizer, cfg.train.seed, extra_head=False)
        plain.save_pretrained(tmp / base_ref)
    info = {
        "base_model": base_ref,
        "extra_modules": sorted(bundle.extra),
        "step": step,
        "hidden_size": int(bundle.base.config.hidden_size),
    }
    (tmp / FINAL_INFO).write_text(json.dumps(info, indent=2) + "\n")
    fsync_tree(tmp)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)
    return out


def load_final(final_dir: os.PathLike | str):
    """(PeftModel, tokenizer, extras) from an exported `final/` directory."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = Path(final_dir)
    info = json.loads((final / FINAL_INFO).read_text())
    base_ref = info["base_model"]
    base_path = final / base_ref if (final / base_ref).is_dir() else base_ref
    base = AutoModelForCausalLM.from_pretrained(base_path, local_files_only=True)
    extras = {}
    for name in info["extra_modules"]:
        head = CausalProjectionHead(info["hidden_size"])
        attach_extra(base, name, head)
        extras[name] = head
    if extras:
        sd = load_file(str(final / EXTRA_FILE))
        for name, mod in extras.items():
            mod.load_state_dict({k[len(name) + 1 :]: v for k, v in sd.items() if k.startswith(name + ".")})
    model = PeftModel.from_pretrained(base, str(final), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(final, local_files_only=True)
    return model, tok, extras
