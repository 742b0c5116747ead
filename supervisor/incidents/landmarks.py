"""The call a stuck stack is in: its deepest landmark, the user's frame that called it, the innermost frame.

The innermost frame alone rarely says what hung: a sample inside a `generate()` that never returns lands in
attention, a logits processor, a stopping criterion or a streamer's `decode` — wherever the token loop happens
to be.  So the WHOLE main-thread stack (innermost first, as `dumps.parse_faulthandler` gives it, or py-spy's
Python frames) is read against a registry of landmarks — calls users know by name and that can run for a
long time or for ever:

    generate     transformers/peft `generate` and its decoding loops (`_sample`, `_beam_search`, …)
    collective   torch.distributed collectives, DDP's own; a C wait below the innermost Python frame (py-spy's
                 native frames: DDP's reducer, c10d `Work::wait`, NCCL, gloo; or a user line calling `.wait()`)
    dataloader   torch DataLoader `__next__` / `_next_data` / `_get_data` / `_try_get_data`
    checkpoint   torch.save, safetensors, `save_pretrained`, Trainer's `_save_checkpoint`, Lightning and
                 accelerate checkpoint saving (never `torch.utils.checkpoint`: that is activation recomputation)
    backward     torch autograd (and accelerate's, Lightning's `backward`)
    optimizer    `step` of a torch optimizer (not an LR scheduler's)
    tokenizer    encode / decode / `__call__` / `apply_chat_template` in transformers' tokenization files and
                 the `tokenizers` package
    + the user's own (`watchdog.landmarks`: function, optional file, name, kind), checked before the built-ins.

The rule that makes a reading not depend on where the sample lands:

* the deepest (innermost) landmark frame is the call's — named by its public call, the outermost frame of
  the same registry entry below the user's code (`DataLoader.__next__` around `_try_get_data`) — EXCEPT
  that a **helper** landmark, a short call made from inside a long-running one (kind `tokenizer`: a
  streamer's `decode`, a stopping criterion's), yields to any non-helper landmark outside it.  hangwatch's
  own frames (its heartbeat beating from a stopping criterion, its integrations) are never landmarks nor
  the user's code, so a progress beat inside `generate` reads as `generate`;
* a collective is never a helper: a collective inside `generate` (tensor parallelism, FSDP) is a real wait
  on the peers and is reported as the collective; a C wait seen only below the innermost Python frame
  (native frames, `work.wait()`) is the deepest landmark of all.

Besides the landmark: the **caller** — the innermost frame of the user's own code OUTER to the landmark
(not the standard library, not site-packages/dist-packages, not `<frozen …>` or other `<…>` code, not
hangwatch's heartbeat and integrations; hangwatch's built-in worker counts as the user's code), the
**outermost** frame of the user's own code and the **innermost** frame.  faulthandler prints at most 100
frames per thread and keeps the innermost ones: the deepest landmark survives, the outer frames (the caller,
the outermost one) may not — the reading says when the stack was truncated.

Pure: frames in, reading out.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from hangwatch.supervisor.incidents.collectives import COLLECTIVES, DDP_WAITS, native_wait, source_wait

HELPER_KINDS = frozenset({"tokenizer"})
MAX_FAULTHANDLER_FRAMES = 100  # CPython's faulthandler: deeper stacks end in "  ..."

# Packages whose frames are never the user's code, for py-spy's shortened paths ("torch/nn/modules/module.py").
KNOWN_LIBRARIES = frozenset(
    {
        "torch",
        "transformers",
        "peft",
        "accelerate",
        "lightning",
        "pytorch_lightning",
        "lightning_fabric",
        "safetensors",
        "tokenizers",
        "sentencepiece",
        "numpy",
        "datasets",
        "deepspeed",
        "trl",
        "triton",
        "huggingface_hub",
        "tqdm",
        "torchvision",
        "torchaudio",
        "evaluate",
        "bitsandbytes",
        "flash_attn",
        "xformers",
        "apex",
        "hangwatch",
    }
)
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ())) | {"runpy", "threading", "multiprocessing", "concurrent"}
_STDLIB_DIR = re.compile(r"/lib(?:64)?/python3\.\d+/")
# Package directories distinctive enough to be a library wherever they are installed (a project of yours is
# unlikely to have a folder named `transformers/` holding its training code).
_LIBRARY_DIR = re.compile(
    r"/(?:torch|transformers|peft|accelerate|lightning|pytorch_lightning|lightning_fabric|"
    r"safetensors|tokenizers|deepspeed|trl|triton|huggingface_hub)/(?:[^/]+/)*[^/]+\.py$"
)
# hangwatch's own frames inside a user's process: its heartbeat client and its trainer integrations.  The rest
# of hangwatch's worker (the built-in trainer) is, for an incident, the user's code.
HANGWATCH_DAEMON_DIR = str(Path(__file__).resolve().parents[2] / "daemon")  # this install's (a source checkout's too)
_HANGWATCH_DAEMONS = (HANGWATCH_DAEMON_DIR, "/hangwatch/daemon")
_HANGWATCH_INTERNAL = ("heartbeat.py", "integrations/", "autoinstrument/")  # hangwatch's own hooks in a user's process


@dataclass(frozen=True)
class Landmark:
    """One registry entry: frames whose function is one of `functions` in a file matching `file_re`."""

    name: str  # how incidents call it; "{function}" is replaced by the frame's function
    kind: str
    functions: frozenset
    file_re: Optional[re.Pattern] = None  # searched in "/" + the frame's path; None: any file
    qualified: Optional[str] = None  # a user's `Class.method`: a qualified frame name (py-spy) must end with it

    def matches(self, frame: dict) -> bool:
        function = frame.get("function") or ""
        if short_name(function) not in self.functions:
            return False
        if self.qualified and "." in function and not function.endswith(self.qualified):
            return False
        return self.file_re is None or bool(self.file_re.search("/" + _norm(frame.get("file") or "")))

    def name_for(self, frame: dict) -> str:
        return self.name.replace("{function}", short_name(frame.get("function") or "?"))


def _entry(name: str, kind: str, functions: Iterable[str], file_re: str) -> Landmark:
    return Landmark(name, kind, frozenset(functions), re.compile(file_re))


_LIGHTNING = r"/(?:lightning|pytorch_lightning|lightning_fabric)/"
BUILTIN: tuple[Landmark, ...] = (
    _entry(
        "generate",
        "generate",
        {
            "generate",
            "_sample",
            "_greedy_search",
            "_beam_search",
            "_group_beam_search",
            "_constrained_beam_search",
            "_assisted_decoding",
            "_contrastive_search",
            "_dola_decoding",
            "_prefill",
        },
        r"/transformers/generation/",
    ),
    _entry("generate", "generate", {"generate"}, r"/(?:transformers|peft)/"),
    _entry("{function}", "collective", COLLECTIVES, r"/torch/distributed/"),
    _entry("DDP {function}", "collective", DDP_WAITS, r"/torch/nn/parallel/distributed\.py$"),
    _entry(
        "DataLoader.{function}",
        "dataloader",
        {"__next__", "_next_data", "_get_data", "_try_get_data"},
        r"/torch/utils/data/dataloader\.py$",
    ),
    _entry("torch.save", "checkpoint", {"save", "_save"}, r"/torch/serialization\.py$"),
    _entry("safetensors {function}", "checkpoint", {"save_file", "save_model", "save"}, r"/safetensors/"),
    _entry("save_pretrained", "checkpoint", {"save_pretrained"}, r"/(?:transformers|peft)/"),
    _entry(
        "Trainer.{function}",
        "checkpoint",
        {"_save_checkpoint", "save_model", "_save"},
        r"/transformers/trainer[^/]*\.py$",
    ),
    _entry(
        "{function}",
        "checkpoint",
        {"save_checkpoint", "_save_checkpoint", "_save_topk_checkpoint", "_save_last_checkpoint"},
        _LIGHTNING,
    ),
    _entry(
        "accelerate {function}", "checkpoint", {"save_state", "save_model", "save"}, r"/accelerate/accelerator\.py$"
    ),
    _entry(
        "backward",
        "backward",
        {"backward", "_engine_run_backward", "grad", "run_backward"},
        r"/torch/(?:autograd/|_tensor\.py$)",
    ),
    _entry("backward", "backward", {"backward", "manual_backward"}, r"/accelerate/accelerator\.py$|" + _LIGHTNING),
    _entry("optimizer.step", "optimizer", {"step"}, r"/torch/optim/(?!lr_scheduler\.py$|swa_utils\.py$)[^/]*\.py$"),
    _entry("optimizer.step", "optimizer", {"step"}, r"/accelerate/optimizer\.py$"),
    _entry(
        "tokenizer.{function}",
        "tokenizer",
        {
            "encode",
            "decode",
            "batch_decode",
            "__call__",
            "apply_chat_template",
            "encode_plus",
            "batch_encode_plus",
            "_encode_plus",
            "_batch_encode_plus",
            "_decode",
            "encode_batch",
            "decode_batch",
            "_call_one",
        },
        r"/transformers/(?:models/[^/]+/)?tokenization_[^/]*\.py$|/tokenizers/|/sentencepiece/",
    ),
)


def user_landmarks(configured: Iterable[Any]) -> tuple[Landmark, ...]:
    """`watchdog.landmarks` (LandmarkCfg records, or dicts with the same keys) as registry entries."""
    out = []
    for c in configured or ():
        get = (lambda k, c=c: c.get(k)) if isinstance(c, dict) else (lambda k, c=c: getattr(c, k, None))
        function = str(get("function") or "").strip()
        if not function:
            continue
        file = get("file")
        out.append(
            Landmark(
                name=get("name") or function,
                kind=get("kind") or "other",
                functions=frozenset({short_name(function)}),
                file_re=re.compile(re.escape(_norm(file))) if file else None,
                qualified=function if "." in function else None,
            )
        )
    return tuple(out)


def short_name(function: str) -> str:
    """py-spy qualifies names ("GenerationMixin.generate", "f.<locals>.g"); faulthandler does not."""
    return function.rsplit(".", 1)[-1]


def _norm(path: str) -> str:
    return path.replace("\\", "/")


def is_own_code(path: Optional[str]) -> bool:
    """Whether a frame's file is the user's own code (see the module docstring)."""
    p = _norm(path or "")
    if not p or p.startswith("<"):
        return False
    rooted = p if p.startswith("/") else "/" + p  # py-spy shortens paths: "hangwatch/daemon/heartbeat.py"
    for root in _HANGWATCH_DAEMONS:
        i = rooted.find(root + "/")
        if i == 0 or (i > 0 and root == "/hangwatch/daemon"):
            return not rooted[i + len(root) + 1 :].startswith(_HANGWATCH_INTERNAL)  # the built-in worker is the user's
    if "/site-packages/" in p or "/dist-packages/" in p or _STDLIB_DIR.search(p):
        return False
    if _LIBRARY_DIR.search(p):
        return False  # an editable or --target install of a big library outside site-packages (src/transformers/…)
    if not p.startswith("/"):  # py-spy's shortened path: its first component is a package or a module
        top = p.split("/", 1)[0]
        top = top[:-3] if top.endswith(".py") else top
        if top in KNOWN_LIBRARIES or top in _STDLIB:
            return False
    return True


@dataclass(frozen=True)
class Reading:
    """What a stack says: the landmark (or none), the user's frames around it, the innermost frame."""

    landmark: Optional[dict]  # {"name", "kind", "frame", "depth", "via"}; depth: index from the innermost (-1: in C)
    caller_frame: Optional[dict]
    user_outermost_frame: Optional[dict]
    innermost_frame: Optional[dict]
    truncated: bool = False
    depth: int = 0  # frames read

    def fields(self) -> dict:
        """What goes into incident.json."""
        return {
            "landmark": self.landmark,
            "caller_frame": self.caller_frame,
            "user_outermost_frame": self.user_outermost_frame,
            "stack_truncated": self.truncated,
        }

    @property
    def kind(self) -> Optional[str]:
        return self.landmark["kind"] if self.landmark else None

    def words(self) -> str:
        """The landmark and its caller, for a sentence about one rank: "in generate(), called from f (x.py:3)"."""
        if not self.landmark:
            return ""
        text = f"in {call_text(self.landmark['name'])}"
        if self.caller_frame:
            return f"{text}, called from {short_frame(self.caller_frame)}"
        if self.truncated:
            return f"{text} (its caller is beyond the {MAX_FAULTHANDLER_FRAMES} frames faulthandler prints)"
        return f"{text} (no frame of your own code calls it)"

    def summary(self) -> str:
        """The landmark first: "in generate(), called from on_evaluate (train.py:46); innermost
        sdpa_attention_forward"."""
        if self.innermost_frame is None:
            return "no stack: the process wrote no dump"
        inner = self.innermost_frame
        if self.landmark:
            text = f"{self.words()}; innermost {inner.get('function')}"
        elif self.caller_frame is inner:
            text = f"no landmark call on the stack; innermost {short_frame(inner)}, your own code"
        elif self.caller_frame:
            text = (
                f"no landmark call on the stack; your code at {short_frame(self.caller_frame)}; "
                f"innermost {short_frame(inner)}"
            )
        else:
            text = f"no landmark call on the stack and none of your code; innermost {short_frame(inner)}"
        if self.truncated:
            text += f"; stack truncated to its innermost {MAX_FAULTHANDLER_FRAMES} frames"
        return text


def call_text(name: str) -> str:
    """ "generate" → "generate()"; a name that is not a call ("DDP reducer", "wait (c10d work)") stays as it is."""
    return f"{name}()" if re.fullmatch(r"[\w.]+", name) else name


def short_frame(f: Optional[dict]) -> str:
    """ "on_evaluate (train.py:46)": the function and the file's last component."""
    if not f:
        return "unknown"
    return f"{f.get('function')} ({_norm(f.get('file') or '?').rsplit('/', 1)[-1]}:{f.get('line')})"


def find_landmark(
    stack: list[dict], native: Iterable[str] = (), source_line: Optional[str] = None, extra: Iterable[Landmark] = ()
) -> Optional[dict]:
    """The landmark `stack` (innermost first) is in, by the rule in the module docstring, or None."""
    registry = tuple(extra) + BUILTIN
    found: list[tuple[int, Landmark, dict]] = []
    for depth, frame in enumerate(stack):
        entry = next((e for e in registry if e.matches(frame)), None)
        if entry is not None:
            found.append((depth, entry, frame))
    in_c = native_wait(list(native)) or source_wait(stack, source_line)
    if in_c and stack:
        via = "native frames" if native_wait(list(native)) else "source line"
        return {"name": in_c, "kind": "collective", "frame": stack[0], "depth": -1, "via": via}
    long_running = [f for f in found if f[1].kind not in HELPER_KINDS]
    chosen = (long_running or found or [None])[0]
    if chosen is None:
        return None
    depth, entry, frame = chosen
    # Named by the public call: the outermost frame of the same entry below the user's code around it
    # (`DataLoader.__next__` around `_try_get_data`, `tokenizer.__call__` around `_encode_plus`).
    own = next((i for i in range(depth + 1, len(stack)) if is_own_code(stack[i].get("file"))), len(stack))
    public = max((f for f in found if f[1] is entry and depth <= f[0] < own), key=lambda f: f[0])[2]
    return {"name": entry.name_for(public), "kind": entry.kind, "frame": frame, "depth": depth, "via": "stack"}


def read_stack(
    stack: list[dict],
    *,
    native: Iterable[str] = (),
    source_line: Optional[str] = None,
    extra: Iterable[Landmark] = (),
    truncated: bool = False,
) -> Reading:
    """The whole reading of one main-thread stack (innermost first); `extra`: the user's landmarks."""
    if not stack:
        return Reading(None, None, None, None, truncated, 0)
    landmark = find_landmark(stack, native, source_line, extra)
    start = landmark["depth"] + 1 if landmark and landmark["depth"] >= 0 else 0
    own = [i for i, f in enumerate(stack) if is_own_code(f.get("file"))]
    caller = next((stack[i] for i in own if i >= start), None)
    outermost = stack[own[-1]] if own else None
    return Reading(landmark, caller, outermost, stack[0], truncated, len(stack))
