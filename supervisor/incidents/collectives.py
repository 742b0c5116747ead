"""Is a rank waiting for its peers?  The collective it waits in, read from its own stack.

A rank blocked in `dist.all_reduce` shows, in its faulthandler dump (Python frames only, innermost
first), `all_reduce (torch/distributed/distributed_c10d.py)` ← `wrapper (torch/distributed/c10d_logger.py)`
← the user's frame: the innermost frame of torch.distributed whose name is a collective names it.
Some waits have no Python frame of their own, because the C call is made straight from user code:
`work.wait()` of an async collective, or DDP's reducer waiting for its buckets at the end of
`backward()` (faulthandler shows only `_engine_run_backward`).  For those, py-spy's native frames of the
main thread say it (`c10d::Reducer::…`, `c10d::Work::wait`, gloo, NCCL); without py-spy, the source line
of the innermost user frame (`work.wait()`) does.

Without any C stack (py-spy absent, failed, or not permitted to read the process), a stack that ends in
`backward()` with nothing but the frameworks' own frames inside it (`probable_wait`) is where DDP's reducer
all-reduces the gradients in C++ autograd hooks and waits for them (FSDP's and DeepSpeed's gradient
reductions run there too): an idle rank there is probably waiting for its peers, though nothing on its
stack proves it.  It is a presumption, kept apart from the waits above: such a rank is never made the
culprit for being outside a collective (`verdict`); only evidence that points at it (behind in step count)
can name it.
"""

from __future__ import annotations

import re
from typing import Optional

from hangwatch.supervisor.incidents.dumps import is_library

COLLECTIVES = frozenset(
    {
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "_all_gather_base",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "_reduce_scatter_base",
        "all_to_all",
        "all_to_all_single",
        "broadcast",
        "broadcast_object_list",
        "barrier",
        "monitored_barrier",
        "reduce",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "send_object_list",
        "recv_object_list",
        "batch_isend_irecv",
        "wait_tensor",
        "init_process_group",
        "new_group",
    }
)
DDP_WAITS = frozenset(
    {  # torch/nn/parallel/distributed.py: DDP's own collectives around forward and backward
        "_sync_buffers",
        "_sync_module_buffers",
        "_default_broadcast_coalesced",
        "_distributed_broadcast_coalesced",
        "_sync_params_and_buffers",
        "_check_global_requires_backward_grad_sync",
        "_match_all_reduce_for_bwd_pass",
        "_match_unused_params_allreduce",
        "_rebuild_buckets",
    }
)
NATIVE_WAITS = (  # py-spy --native frame (innermost first) → what the rank waits in
    (re.compile(r"c10d::Reducer::"), "DDP reducer"),
    (re.compile(r"c10d::\w*Work\w*::wait|c10d::Work::wait|c10::ivalue::Future::wait"), "wait (c10d work)"),
    (re.compile(r"ProcessGroupNCCL|\bnccl\w*", re.IGNORECASE), "NCCL"),
    (re.compile(r"ProcessGroupGloo|\bgloo::"), "gloo"),
)
# Calls under which a collective runs in C++ without a Python frame of its own (`probable_wait`): the file, the
# functions, and what the rank then probably waits in.
DDP_GRADIENTS = "DDP's gradient all-reduce"
DEEPSPEED_GRADIENTS = "DeepSpeed's gradient reduction"
C_COLLECTIVE_SITES = (
    (
        re.compile(r"/torch/autograd/|/torch/_tensor\.py$"),
        frozenset({"backward", "_engine_run_backward", "run_backward", "grad"}),
        DDP_GRADIENTS,
    ),
    (
        re.compile(r"/accelerate/accelerator\.py$|/(?:lightning|pytorch_lightning|lightning_fabric)/"),
        frozenset({"backward", "manual_backward"}),
        DDP_GRADIENTS,
    ),
    (
        re.compile(r"/deepspeed/runtime/"),
        frozenset(
            {
                "backward",
                "allreduce_gradients",
                "reduce_gradients",
                "reduce_ipg_grads",
                "buffered_allreduce_fallback",
                "allreduce_bucket",
                "average_tensor",
            }
        ),
        DEEPSPEED_GRADIENTS,
    ),
)
# Frameworks whose frames may sit inside such a call (autograd's engine, the frameworks' hooks and wrappers).
FRAMEWORKS = re.compile(r"/(?:torch|deepspeed|accelerate|lightning|pytorch_lightning|lightning_fabric)/")
SOURCE_WAIT = re.compile(r"\b(?!os\b)(\w+)\.wait\(\s*\)")  # `work.wait()`: a C wait called straight from user code
PY_SPY_THREAD = re.compile(r'^Thread (0x[0-9a-fA-F]+|\d+) \(([^)]*)\)(?:: "(.*)")?\s*$')
PY_SPY_FRAME = re.compile(r"^    (\S.*?) \((.+)\)\s*$")
PY_SPY_PROCESS = re.compile(r"^Process (\d+):")


def _in_torch_distributed(path: str) -> bool:
    return "torch/distributed/" in path.replace("\\", "/")


def _in_ddp(path: str) -> bool:
    return path.replace("\\", "/").endswith("torch/nn/parallel/distributed.py")


def _in_torch(path: str) -> bool:
    return "/torch/" in path.replace("\\", "/")


def _short(function: str) -> str:
    return function.rsplit(".", 1)[-1]  # py-spy qualifies: "_exception_logger.<locals>.wrapper"


def python_wait(stack: list[dict]) -> Optional[str]:
    """The collective a rank waits in, named by the torch.distributed frames at the INNER end of `stack`
    (innermost first), or None.  Only the frames from the innermost one outward up to the first frame
    of other code count: a rank spinning in its own code inside DDP's `forward` has `_run_ddp_forward`
    further out in its stack, and that is not a wait.  Other torch internals between the collective and
    the innermost frame (dispatch, autograd) are passed over; DDP's file counts only for its own
    collectives (`DDP_WAITS`)."""
    generic = None
    for f in stack:
        path, name = f.get("file") or "", _short(f.get("function") or "")
        if _in_ddp(path):
            if name in DDP_WAITS:
                return f"DDP {name}"
            break  # DDP's forward/backward wrapper around the rank's own code: not a wait by itself
        if _in_torch_distributed(path):
            if name in COLLECTIVES:
                return name
            generic = generic or f"torch.distributed {name}"
            continue
        if _in_torch(path) and generic is None:
            continue  # torch internals inside a collective's call (ops dispatch, autograd)
        break  # the rank's own code (or another library): whatever is further out is not what it waits in
    return generic


def native_wait(native: list[str]) -> Optional[str]:
    """What py-spy's native frames of the main thread (innermost first) show it waiting in, or None."""
    for frame in native:
        for pattern, name in NATIVE_WAITS:
            if pattern.search(frame):
                return name
    return None


def source_wait(stack: list[dict], source_line: Optional[str]) -> Optional[str]:
    """`wait()` when the innermost frame is user code whose line calls `.wait()` (a C call: no frame of its own)."""
    if not stack or not source_line or is_library(stack[0].get("file") or ""):
        return None
    return "wait" if SOURCE_WAIT.search(source_line) else None


def waits_in(stack: list[dict], native: list[str] = (), source_line: Optional[str] = None) -> Optional[str]:
    """The collective a rank waits in: Python frames first, then py-spy's native frames, then the source line."""
    return python_wait(stack) or native_wait(list(native)) or source_wait(stack, source_line)


def probable_wait(stack: list[dict], native: list[str] = ()) -> Optional[str]:
    """What a rank whose stack shows no wait probably waits in, judged without C stacks: DDP_GRADIENTS when its
    stack (innermost first) ends in `backward()` — torch's, accelerate's, Lightning's — with only the frameworks'
    frames inside it, DEEPSPEED_GRADIENTS when DeepSpeed's engine is among them; else None.  None as well when
    py-spy's native frames are there: they show what the rank does in C, and `native_wait` reads them.  Whether
    the rank is idle (a rank computing its gradients is busy) is the caller's to weigh."""
    if native:
        return None
    found = None
    for f in stack:
        path = "/" + (f.get("file") or "").replace("\\", "/").lstrip("/")
        name = _short(f.get("function") or "")
        site = next(
            (what for file_re, names, what in C_COLLECTIVE_SITES if name in names and file_re.search(path)), None
        )
        if site is not None:
            found = DEEPSPEED_GRADIENTS if DEEPSPEED_GRADIENTS in (site, found) else site
            continue
        if not FRAMEWORKS.search(path):
            break  # the user's code (or another library): whatever is further out is not what it waits in
    return found


def py_spy_main_thread(text: str) -> tuple[list[dict], list[str]]:
    """(Python frames, native frames) of the main thread in a `py-spy dump --native` text, innermost first.

    The main thread is the one py-spy names "MainThread", else the one whose id is the process id."""
    pid = next((m.group(1) for m in map(PY_SPY_PROCESS.match, text.splitlines()) if m), None)
    blocks: list[tuple[str, Optional[str], list[str]]] = []
    for line in text.splitlines():
        m = PY_SPY_THREAD.match(line)
        if m:
            blocks.append((m.group(1), m.group(3), []))
        elif blocks and PY_SPY_FRAME.match(line):
            blocks[-1][2].append(line)
    main = next((b for b in blocks if b[1] == "MainThread"), None) or next((b for b in blocks if b[0] == pid), None)
    if main is None:
        return [], []
    python: list[dict] = []
    native: list[str] = []
    for line in main[2]:
        name, where = PY_SPY_FRAME.match(line).groups()
        file, _, lineno = where.rpartition(":")
        if file and lineno.isdigit():
            python.append({"file": file, "line": int(lineno), "function": name})
        else:
            native.append(f"{name} ({where})")
    return python, native
