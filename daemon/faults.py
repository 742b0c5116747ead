"""Fault injection: the failures hangwatch exists to catch, on demand, at a chosen step or eval.

Faults come from the config's `faults:` list plus the `HANGWATCH_FAULTS` environment variable (a
JSON list of the same objects).  Each fires once per run: it is recorded in `<run_dir>/faults-fired.json`
(hangwatch.common.durable) *before* it fires, so the attempt that resumes after it does not fire it again;
`repeat: true` fires it once per attempt instead.

Trigger points (the first opportunity at or after the given moment):
  - `at_step: N` — at the start of optimizer step N (1-based); `hang_generate` and `runaway_generate` wait
    for the first eval at or after step N and act on its generate();
  - `at_eval: K` — at the K-th eval of the run (eval number = step // eval.every_steps).

`poison` is not an event but bad data: the training examples it names (`example_ids`) have a non-finite loss
every time they are trained (from `at_step` on, if given), on every attempt — what a corrupt example does
— so that the trainer's quarantine of the examples of non-finite steps (`trainer.quarantine`) can be
tested.  It is announced once per attempt, the first time it strikes.

`memory_limit` is not an event either but a device: a fake allocator (`FakeAllocator`) whose memory use is a known
function of the micro-batch — `weights_mb` once the model is on it, `per_example_mb` more for each example of a
training forward's batch — within `capacity_mb` (the per-process cap).  A training forward (from `at_step` on, if
given) whose need is over it raises `torch.OutOfMemoryError` in torch's own words (the capped variant, with the
figures), on every attempt, as a real device would; the trainer reads the weights' share through it as it would
through torch.cuda (`daemon.trainer.memory`, the probe `FaultPlan.memory_probe`), so that OOM remediation's
evidence-based pick can be tested on the CPU.  Announced once per attempt, when it strikes.

`rank: R` (default 0) fires a fault on that rank of a multi-rank run only; every rank keeps the
one `faults-fired.json` (updated under a lock, as several ranks may record at once).  Several nodes keep it
beside their shared checkpoints (`checkpoint.dir`): `rank` is the global rank, whichever node hosts it.

What each kind does is written so that the evidence looks like the real thing: a pure-Python loop
inside the model's forward (`busy_loop`), a native wait no signal ends (`block_c`), a loop that
keeps beating `progress` (`livelock`), a wait inside a generate() logits processor (`hang_generate`: generate
stuck, no tokens), a generate() that never ends while tokens keep coming (`runaway_generate`: a logits
processor that takes EOS away, and that eval's `max_new_tokens` raised to RUNAWAY_MAX_NEW_TOKENS, which
the processor carries as its `max_new_tokens` for `evaluate.generate_prompt`).  The eval-time kinds are
handed to the eval as the logits processors `before_eval` returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from hangwatch.common.durable import write_json_atomic
from hangwatch.common.rundir import read_json
from hangwatch.daemon.doctor.memory_estimate import CUDA_CONTEXT_BYTES

ENV_FAULTS = "HANGWATCH_FAULTS"
FIRED_FILE = "faults-fired.json"
FIRED_LOCK = ".faults-fired.lock"
TRAIN_KINDS = ("busy_loop", "block_c", "livelock", "crash", "segfault", "oom", "nan", "exit")
GENERATE_KINDS = ("hang_generate", "runaway_generate")  # act on an eval's generate(): at_step waits for an eval
# Far beyond any budget.  A model with rotary positions (the tiny Llama, most local pretrained ones) generates
# past `max_position_embeddings` (transformers only logs a reminder); one with learned positions cannot
# (`_runaway_cap`).
RUNAWAY_MAX_NEW_TOKENS = 1_000_000
CHILD_MARK = "hangwatch-fault-child"


def faults_from(cfg, environ: Optional[dict] = None) -> list:
    """The config's faults plus those of HANGWATCH_FAULTS; raises ConfigError on a bad variable."""
    from pydantic import ValidationError

    from hangwatch.common.config import ConfigError, FaultCfg

    env = os.environ if environ is None else environ
    faults = list(cfg.faults)
    raw = env.get(ENV_FAULTS)
    if not raw:
        return faults
    try:
        items = json.loads(raw)
    except ValueError as exc:
        raise ConfigError([f"{ENV_FAULTS}: not valid JSON: {exc}"]) from None
    if not isinstance(items, list):
        raise ConfigError([f"{ENV_FAULTS}: expected a JSON list of fault objects, got {type(items).__name__}"])
    problems = []
    for i, item in enumerate(items):
        try:
            faults.append(FaultCfg.model_validate(item))
        except ValidationError as err:
            for e in err.errors():
                where = ".".join(str(p) for p in e["loc"]) or "(object)"
                problems.append(f"{ENV_FAULTS}[{i}].{where}: {e['msg']}")
    if problems:
        raise ConfigError(problems)
    return faults


def _identity(fault) -> str:
    d = fault.model_dump(mode="json")
    if d.get("rank") == 0:
        del d["rank"]  # the default: a record made before faults had a rank still names the same fault
    return json.dumps(d, sort_keys=True)


def _key(fault, occurrence: int) -> str:
    return _identity(fault) + f"#{occurrence}"


def spawn_fault_children(spawn: Callable = subprocess.Popen) -> list[int]:
    """Two sleeping grandchildren: one in our process group, one that called setsid and left it."""
    argv = [sys.executable, "-c", "import time; time.sleep(86400)", CHILD_MARK]
    kids = [
        spawn(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        spawn(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        ),
    ]
    return [k.pid for k in kids]


# ---- the misbehaviours themselves (named for what a stack dump should show) --------------------


def _select_ranges(ranges) -> list:
    """Sparse-attention range selection with the bug of the incident report: an invalid range is
    retried forever instead of skipped.  Pure Python, so one core spins at 100%."""
    kept = []
    for s, e in ranges:
        if s < e:
            kept.append((s, e))
    return kept


def _busy_forward_hook(module, args):
    _select_ranges(itertools.cycle([(7, 3)]))


def _wait_for_batch() -> None:
    """Blocked in native code that no signal ends, as a collective waiting for a rank that never comes or a native
    loader waiting for its producer: pthread_mutex_lock(3) on a mutex this thread already holds (ctypes releases the
    GIL, so the process's other threads — its heartbeat's, faulthandler's — go on; a signal's Python handler never
    runs, for the thread never returns to Python)."""
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(
        64
    )  # all zeros: PTHREAD_MUTEX_INITIALIZER (glibc), a default, non-recursive one
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def _retry_forever(hb, step: int) -> None:
    """Alive but going nowhere: keeps reporting progress on a step that never finishes."""
    attempt = 0
    while True:
        attempt += 1
        hb.progress(note="retrying micro-batch", retry=attempt, stuck_step=step)
        time.sleep(0.5)


def _never_ending_logits():
    """A logits processor that never returns: generate() hangs right here, and nothing beats."""
    from transformers import LogitsProcessor

    class NeverEndingLogits(LogitsProcessor):
        def __call__(self, input_ids, scores):
            while True:
                time.sleep(3600)

    return NeverEndingLogits()


def _runaway_logits(eos_ids, max_new_tokens: int = RUNAWAY_MAX_NEW_TOKENS):
    """A logits processor that takes every EOS id away: with `max_new_tokens` (which it carries, for the eval
    to honour) far beyond any budget, generate() keeps producing tokens and never ends by itself."""
    from transformers import LogitsProcessor

    class RunawayLogits(LogitsProcessor):
        def __init__(self, ids, cap):
            self.eos_ids = sorted(ids)
            self.max_new_tokens = cap

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[..., self.eos_ids] = float("-inf")
            return scores

    return RunawayLogits(eos_ids, max_new_tokens)


def _runaway_cap(model) -> int:
    """RUNAWAY_MAX_NEW_TOKENS, or for a model with learned positions (no rotary parameters in its config: GPT-2's
    kind), half its positions, so that the eval's short prompts plus the generation stay inside the table
    (an index past it is an IndexError on the CPU, a device-side assert on a GPU)."""
    config = getattr(model, "config", None)
    rotary = ("rope_parameters", "rope_theta", "rope_scaling")
    if config is None or any(getattr(config, name, None) is not None for name in rotary):
        return RUNAWAY_MAX_NEW_TOKENS
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return max(1, int(positions) // 2) if isinstance(positions, int) else RUNAWAY_MAX_NEW_TOKENS


def _eos_ids(bundle) -> set:
    """Every id that would end a generation: the tokenizer's eos and the model's generation config's."""
    ids = set()
    sources = [
        getattr(bundle.tokenizer, "eos_token_id", None),
        getattr(getattr(bundle.model, "generation_config", None), "eos_token_id", None),
    ]
    for value in sources:
        for i in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(i, int) and i >= 0:
                ids.add(i)
    return ids


class FaultPlan:
    """Decides when each fault fires and records it durably first.

    Lifecycle: built once per attempt; the trainer calls `before_step(step, ...)` at the start of
    every optimizer step and `before_eval(step, eval_number, ...)` at every eval."""

    def __init__(
        self,
        faults: list,
        run_dir: os.PathLike | str,
        hb,
        *,
        attempt: int = 1,
        spawn: Callable = subprocess.Popen,
        rank: int = 0,
        shared: bool = False,
    ):
        """`rank`: this process's rank (only its faults fire here); `shared`: other ranks record
        into the same file, so records are made under a lock."""
        self.run_dir = Path(run_dir)
        self.hb = hb
        self.attempt = attempt
        self.rank = rank
        self.shared = shared
        self._spawn = spawn
        seen: dict[str, int] = {}
        self.entries = []
        self.poisons = [f for f in faults if f.kind == "poison" and f.rank == rank]
        self._poison_announced = False
        limits = [f for f in faults if f.kind == "memory_limit" and f.rank == rank]
        # The device's memory, as the trainer's memory evidence sees it (`daemon.trainer.memory`); None: the real one.
        self.memory_probe: Optional[FakeAllocator] = FakeAllocator(limits[0], hb) if limits else None
        for f in faults:
            if f.kind in ("poison", "memory_limit"):
                continue  # bad data, a small device: not events, never recorded as fired
            base = _identity(f)
            seen[base] = seen.get(base, 0) + 1
            if f.rank == rank:
                self.entries.append((f, _key(f, seen[base])))
        self._fired_this_attempt: set[str] = set()
        self.nan_remaining = 0
        self.children: list[int] = []

    # ---- bookkeeping

    def _fired_file(self) -> Path:
        return self.run_dir / FIRED_FILE

    def fired_record(self) -> list[dict]:
        return (read_json(self._fired_file()) or {}).get("fired", [])

    def _due(self, fault, key) -> bool:
        if key in self._fired_this_attempt:
            return False
        if fault.repeat:
            return True
        return all(r.get("key") != key for r in self.fired_record())

    def _record(self, fault, key, step: int) -> None:
        self._fired_this_attempt.add(key)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._locked():
            fired = self.fired_record()
            fired.append(
                {
                    "key": key,
                    "kind": fault.kind,
                    "step": step,
                    "attempt": self.attempt,
                    "t": time.time(),
                    **({"rank": self.rank} if self.shared else {}),
                }
            )
            write_json_atomic(self._fired_file(), {"fired": fired})

    @contextlib.contextmanager
    def _locked(self):
        """Read-modify-write of the record, exclusive among the ranks that share it."""
        if not self.shared:
            yield
            return
        with open(self.run_dir / FIRED_LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    def _announce(self, fault, step: int, where: str) -> None:
        if fault.spawn_child:
            pids = spawn_fault_children(self._spawn)
            self.children.extend(pids)
        else:
            pids = []
        self.hb.warn(f"injecting fault {fault.kind} at {where}", fault=fault.kind, children=pids)
        print(f"fault: injecting {fault.kind} at {where}" + (f" (children {pids})" if pids else ""), flush=True)

    # ---- trigger points

    def before_step(self, step: int, bundle) -> None:
        """Called at the start of optimizer step `step` (1-based), before any forward."""
        if self.memory_probe is not None:
            self.memory_probe.attach(step, bundle)
        for fault, key in self.entries:
            if fault.kind in GENERATE_KINDS or fault.at_eval is not None or fault.at_step is None:
                continue
            if step >= fault.at_step and self._due(fault, key):
                self._record(fault, key, step)
                self._announce(fault, step, f"step {step}")
                self._fire(fault, step, bundle)

    def before_eval(self, step: int, eval_number: int, bundle) -> list:
        """Called at each eval; fires eval-time faults and returns logits processors for generate() (one with a
        `max_new_tokens` attribute raises that eval's cap to it)."""
        processors = []
        for fault, key in self.entries:
            if fault.at_eval is not None:
                hit = eval_number >= fault.at_eval and (fault.at_step is None or step >= fault.at_step)
            else:
                hit = fault.kind in GENERATE_KINDS and step >= fault.at_step
            if not hit or not self._due(fault, key):
                continue
            self._record(fault, key, step)
            self._announce(fault, step, f"eval {eval_number} (step {step})")
            if fault.kind == "hang_generate":
                processors.append(_never_ending_logits())
            elif fault.kind == "runaway_generate":
                processors.append(_runaway_logits(_eos_ids(bundle), _runaway_cap(bundle.model)))
            else:
                self._fire(fault, step, bundle)
        return processors

    def poisoned(self, step: int, ids: list[str]) -> list[bool]:
        """For the examples `ids` of optimizer step `step`: whether each one's loss is to be made non-finite."""
        bad = {i for f in self.poisons if f.at_step is None or step >= f.at_step for i in f.example_ids}
        hits = [i in bad for i in ids]
        if any(hits) and not self._poison_announced:
            self._poison_announced = True
            named = sorted({i for i, h in zip(ids, hits) if h})
            self.hb.warn(f"injecting fault poison at step {step}: examples {named}", fault="poison", example_ids=named)
            print(f"fault: injecting poison at step {step} (examples {', '.join(named)})", flush=True)
        return hits

    def rolled_back(self) -> None:
        """The trainer put the last good state back in its process (`restart.in_process`): a `nan` fault's remaining
        steps go with the state they poisoned, as they go with the process on a restart (a new attempt's plan starts
        with none)."""
        self.nan_remaining = 0

    def take_nan(self) -> bool:
        """Whether this step's loss is to be made non-finite (consumes one of the nan fault's steps)."""
        if self.nan_remaining > 0:
            self.nan_remaining -= 1
            return True
        return False

    def _fire(self, fault, step: int, bundle) -> None:
        kind = fault.kind
        if kind == "busy_loop":
            # One forward spins (until the process is killed, or the step abandoned in it): the next forward of the
            # same process is as a new process's would be.
            attention = _first_attention(bundle.model)
            handle = None

            def spin_once(module, args):
                handle.remove()
                _busy_forward_hook(module, args)

            handle = attention.register_forward_pre_hook(spin_once)
        elif kind == "block_c":
            _wait_for_batch()
        elif kind == "livelock":
            _retry_forever(self.hb, step)
        elif kind == "crash":
            raise RuntimeError(f"injected fault: crash at step {step}")
        elif kind == "segfault":
            sys.stdout.flush()
            ctypes.string_at(0)
            os.kill(os.getpid(), signal.SIGSEGV)
        elif kind == "oom":
            import torch

            raise torch.OutOfMemoryError(
                f"injected fault: CUDA out of memory at step {step} (tried to allocate 20.00 GiB)"
            )
        elif kind == "nan":
            self.nan_remaining = fault.steps
        elif kind == "exit":
            sys.stdout.flush()
            os._exit(fault.code)


# ---- memory_limit: a fake allocator ---------------------------------------------------------------------------

MIB = 1 << 20
FAKE_DEVICE_TOTAL_MB = 81559.0  # an 80 GB H100 as torch reports it (79.65 GiB); the process is capped below it
FAKE_CONTEXT_MB = CUDA_CONTEXT_BYTES / MIB  # the CUDA context's share of the process's memory in use (non-PyTorch)


def format_size(size: int) -> str:
    """c10's format_size (CUDACachingAllocator.cpp): "512 bytes", "20.00 KiB", "3.61 MiB", "75.31 GiB"."""
    if size <= 1024:
        return f"{size} bytes"
    if size <= 1048576:
        return f"{size / 1024.0:.2f} KiB"
    if size <= 1073741824:
        return f"{size / 1048576.0:.2f} MiB"
    return f"{size / 1073741824.0:.2f} GiB"


def oom_message(
    *,
    tried_mb: float,
    total_mb: float,
    free_mb: float,
    in_use_mb: float,
    allocated_mb: float,
    reserved_mb: float,
    allowed_mb: Optional[float] = None,
    gpu: int = 0,
) -> str:
    """torch 2.x's CUDA out-of-memory message, word for word, with the "allowed" part when the process is capped."""

    def size(mb: float) -> str:
        return format_size(int(round(mb * MIB)))

    allowed = f"{size(allowed_mb)} allowed; " if allowed_mb is not None else ""
    return (
        f"CUDA out of memory. Tried to allocate {size(tried_mb)}. GPU {gpu} has a total capacity of {size(total_mb)} "
        f"of which {size(free_mb)} is free. Including non-PyTorch memory, this process has {size(in_use_mb)} memory "
        f"in use. {allowed}Of the allocated memory {size(allocated_mb)} is allocated by PyTorch, and "
        f"{size(reserved_mb - allocated_mb)} is reserved by PyTorch but unallocated. If reserved but unallocated "
        f"memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
        f"documentation for Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
    )


ALLOCATIONS_PER_STEP = 8  # a training step's activations, allocated layer after layer


class FakeAllocator:
    """The `memory_limit` fault: a device capped at `capacity_mb` on which the model takes `weights_mb` and a training
    step `per_example_mb` for each example of its micro-batch.  It imitates what torch.cuda measures of a real step:
    the step's memory is allocated in ALLOCATIONS_PER_STEP pieces, one after the other (activations, layer by layer),
    and the out-of-memory error is raised at the first piece that does not fit — so what the message says was
    allocated then, plus what was being asked for, is *less* than the step's need, as on a real device; a step that
    fits leaves its full need as the peak (`max_memory_allocated`).  It is the trainer's memory probe (`figures`, as
    `daemon.trainer.memory_evidence.CudaProbe`), and a forward pre-hook on the model (`attach`, from `at_step` on)
    that raises torch's OutOfMemoryError, in torch's words, for a micro-batch that does not fit."""

    def __init__(self, fault, hb):
        self.weights_mb = float(fault.weights_mb)
        self.per_example_mb = float(fault.per_example_mb)
        self.capacity_mb = float(fault.capacity_mb)
        self.total_mb = max(FAKE_DEVICE_TOTAL_MB, self.capacity_mb)
        self.at_step = fault.at_step or 0
        self.hb = hb
        self.peak_mb = self.weights_mb
        self.step_mb = 0.0  # what the step under way holds now (freed when it fails or ends)
        self._hooked = False
        self._announced = False

    def figures(self, device) -> dict[str, float]:
        """What torch.cuda would say: the weights allocated (a failed or finished forward's block is freed again)."""
        in_use = self.weights_mb + FAKE_CONTEXT_MB
        return {
            "total_mb": self.total_mb,
            "allowed_mb": self.capacity_mb,
            "allocated_mb": self.weights_mb,
            "peak_mb": self.peak_mb,
            "reserved_mb": self.weights_mb,
            "free_mb": self.total_mb - in_use,
        }

    def load(self) -> None:
        """The model's weights onto the device, layer by layer: torch's OutOfMemoryError at the first piece that does
        not fit when the weights alone are over the cap."""
        self.peak_mb = 0.0
        piece, held = self.weights_mb / ALLOCATIONS_PER_STEP, 0.0
        for _ in range(ALLOCATIONS_PER_STEP):
            if held + piece > self.capacity_mb:
                weights, self.weights_mb = self.weights_mb, 0.0  # what is allocated at the failure: the pieces so far
                try:
                    self._out_of_memory(piece, held, self.weights_mb)
                finally:
                    self.weights_mb = weights
            held += piece
        self.peak_mb = self.weights_mb

    def reset_peak(self) -> None:
        """torch.cuda.reset_peak_memory_stats: the peak from now on."""
        self.peak_mb = self.weights_mb

    def attach(self, step: int, bundle) -> None:
        if self._hooked or step < self.at_step:
            return
        self._hooked = True
        bundle.model.register_forward_pre_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs):
        if not module.training:
            return None  # evals and generate() are not what this device is sized for
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows = int(ids.shape[0]) if hasattr(ids, "shape") and len(ids.shape) else 1
        self.allocate(rows * self.per_example_mb)
        return None

    def allocate(self, mb: float) -> None:
        """A step needing `mb` on top of the weights, allocated in ALLOCATIONS_PER_STEP pieces: the peak it makes, or
        torch's OutOfMemoryError at the first piece that does not fit (what was allocated then is freed)."""
        piece = mb / ALLOCATIONS_PER_STEP
        held = 0.0
        for _ in range(ALLOCATIONS_PER_STEP):
            if self.weights_mb + held + piece > self.capacity_mb:
                self._out_of_memory(piece, held, mb)
            held += piece
            self.peak_mb = max(self.peak_mb, self.weights_mb + held)

    def _out_of_memory(self, piece: float, held: float, mb: float) -> None:
        import torch

        f = self.figures(None)
        allocated = f["allocated_mb"] + held
        message = oom_message(
            tried_mb=piece,
            total_mb=f["total_mb"],
            free_mb=f["total_mb"] - allocated - FAKE_CONTEXT_MB,
            in_use_mb=allocated + FAKE_CONTEXT_MB,
            allocated_mb=allocated,
            reserved_mb=allocated,
            allowed_mb=f["allowed_mb"],
        )
        if not self._announced:
            self._announced = True
            where = f"{self.weights_mb:g} MiB weights + {mb:g} MiB of {self.capacity_mb:g} MiB allowed"
            self.hb.warn(f"injecting fault memory_limit: {where}", fault="memory_limit")
            print(f"fault: injecting memory_limit ({where})", flush=True)
        raise torch.OutOfMemoryError(message)


def _first_attention(model):
    for name, mod in model.named_modules():
        if name.endswith("self_attn"):
            return mod
    raise RuntimeError("busy_loop fault: the model has no module named *.self_attn to hook")
