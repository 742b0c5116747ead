"""The `generate` phase wherever `model.generate` runs: a phase with a budget, and `progress` beats every N new tokens.

    watch = GenerateWatch(hb, budget_s=None, progress_every=8)
    watch.install(model)      # model and every submodule whose `generate` is callable
    ...                       # model.generate(...) anywhere: eval callbacks, GRPO rollouts, the user's own code
    watch.uninstall()

A `generate()` that never returns (EOS suppressed, a huge `max_new_tokens`) looks like progress to nothing
else: no optimizer step, no eval batch.  Inside `generate` the phase has its own budget (`budget_s`, or the
supervisor's `watchdog.phase_budgets_s["generate"]` when None), and a stopping criterion added to the call
beats `progress` every `progress_every` new tokens: proof of liveness (the silence deadline), never of
progress, so the phase budget still fires on a generation that runs forever.  The criterion never stops
anything: it returns "not done" for every row, and it is merged with the caller's `stopping_criteria`, never
replacing them.  It runs in the generating thread, once per decoding step, so the beats stop exactly when
generation stops advancing (no timer thread: a timer would hide the hang).

Each beat also carries `token_s`: the longest time between two decoding steps since the previous beat (`TokenGaps`:
one monotonic clock read per step; the first decoding step after the prompt — a compiled decode graph, a cache
allocated — left out).  The supervisor cannot see the tokens between two beats; from these it learns how long a
beat of `progress_every` tokens may take, and a beat that does not come in that time is a stall — the tokens
stopped — from the first generate of the run on (`watchdog.token_deadline`).  No beat is added for it: the line
that was written anyway grows by some 20 bytes.

The one exception is the supervisor's order to end a runaway generate (`watchdog.generate_overrun: truncate`):
`<attempt dir>/generate-stop.json` (`StopOrder`, looked at no more than every 50 ms), written while the call
runs, with `tokens: LIMIT`.  Once this call has produced LIMIT new tokens (at once, if it already has) the
criterion says "done" for every row, so `generate()` returns what it has; every rank reads the same file and
counts its own tokens, so ranks that generate in lockstep stop at the same token.  Before leaving the phase
the watch says so in one `progress` line:

    {"event": "progress", "phase": "generate", ..., "generate_truncated": {"order": N, "limit": LIMIT,
     "tokens": 812, "prompt_tokens": 40, "prompt": "...", "output_tail": "..."}}

(`prompt` and `output_tail` decoded from row 0 with `GenerateWatch.tokenizer`; without one, `prompt_ids`: the
first ids of row 0).  `GenerateWatch.last_truncated` and `last_truncation()` give the same to the caller.
An order that was there before the call began is not this call's.

Re-entrant calls — `PeftModel.generate` → the base model's `generate`, a LightningModule's own `generate`
calling its transformer's — make one phase, not two: the outermost watched call owns the phase, and the
first inner call that takes a `stopping_criteria` argument carries the criterion.

How `generate` is wrapped: the method is replaced on the instance's class by a dispatcher that looks the
instance up in a weak registry, so only installed instances are watched (another instance of the same class
runs the original), and copies of a model (`copy.deepcopy`, pickling) carry nothing of hangwatch.  A
`generate` set on the instance itself (monkeypatched by someone else) is wrapped on the instance.
`uninstall` puts every attribute back the way it was.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import threading
import time
import weakref
from typing import Any, Callable, Optional

from hangwatch.common.protocol import GENERATE_STOP_NAME, MAX_LINE, TRUNCATED_FIELD

POLL_INTERVAL_S = 0.05  # how stale a stop order may be read: a stat per 50 ms, not one per token
TOKEN_GAP_FIELD = "token_s"  # of a `progress` beat in `generate`: the longest gap between tokens since the last beat
PROMPT_CHARS = 500  # of the prompt in a `generate_truncated` report
TAIL_CHARS = 200  # of the output's end in a `generate_truncated` report
PROMPT_IDS = 32  # ids of the prompt reported when no tokenizer can decode them
TAIL_TOKENS = 400  # decoded for the output's tail: a runaway output can be far too long to decode whole
REPORT_BYTES = MAX_LINE - 1000  # the report's JSON; the rest of the `progress` line stays well inside MAX_LINE

_lock = threading.RLock()
_owners: "weakref.WeakKeyDictionary[Any, GenerateWatch]" = weakref.WeakKeyDictionary()  # watched instance → its watch
_patched: dict[type, "_ClassPatch"] = {}
_local = threading.local()  # .active: the criterion of this thread's outermost watched generate (None: none running);
#                             .last: the truncation report of its last outermost watched generate (None: not truncated)


class GenerateWatch:
    """Puts every `generate` call of the installed modules in the `generate` phase, with progress beats."""

    def __init__(
        self,
        hb,
        *,
        budget_s: Optional[float] = None,
        progress_every: int = 8,
        on_error: Optional[Callable[[BaseException], None]] = None,
        tokenizer: Any = None,
    ):
        """`on_error`: None — an error of the watch's own (a heartbeat that cannot be written) propagates, as a
        callback the script added should fail loudly; a callable — the error is handed to it and the call runs
        on unwatched (the automatic instrumentation, which must never break a run).  `tokenizer` (also settable
        later as an attribute): decodes the prompt and the output's tail of a truncated generate for its report."""
        if progress_every < 1:
            raise ValueError(f"progress_every must be at least 1 (got {progress_every})")
        if budget_s is not None and budget_s <= 0:
            raise ValueError(f"budget_s must be > 0 or None for the supervisor's default (got {budget_s})")
        self.hb = hb
        self.budget_s = budget_s
        self.progress_every = int(progress_every)
        self.on_error = on_error
        self.tokenizer = tokenizer
        self.last_truncated: Optional[dict] = None  # the report of this watch's last truncated outermost call
        self._classed: "weakref.WeakSet[Any]" = weakref.WeakSet()  # instances watched through their class
        self._own: list[tuple[weakref.ref, Callable]] = []  # instances whose own attribute was wrapped

    # ---- installing ------------------------------------------------------------------------

    def install(self, module) -> int:
        """Watch `generate` on `module` and on each of its submodules; returns how many were newly wrapped."""
        wrapped = 0
        with _lock:
            for obj in _targets(module):
                if _generate_of(obj) is None or _owned(obj) or _is_own_wrapper(obj):
                    continue
                if "generate" in _instance_dict(obj):
                    original = _instance_dict(obj)["generate"]
                    setattr(obj, "generate", _instance_wrapper(self, original))
                    self._own.append((weakref.ref(obj), original))
                else:
                    try:
                        _owners[obj] = self
                    except TypeError:  # not weakly referenceable: nothing safe to attach to
                        continue
                    _ClassPatch.ensure(type(obj)).instances.add(obj)
                    self._classed.add(obj)
                wrapped += 1
        return wrapped

    def uninstall(self) -> None:
        """Restore every `generate` this watch wrapped."""
        with _lock:
            for obj in list(self._classed):
                if _owners.get(obj) is self:
                    del _owners[obj]
                patch = _patched.get(type(obj))
                if patch is not None:
                    patch.instances.discard(obj)
                    if not patch.instances:
                        patch.restore()
            self._classed = weakref.WeakSet()
            for ref, original in self._own:
                obj = ref()
                if obj is not None and _is_own_wrapper(obj):
                    setattr(obj, "generate", original)
            self._own = []
        # Classes whose watched instances were garbage-collected keep no dispatcher once nothing is watched.
        with _lock:
            for patch in [p for p in _patched.values() if not p.instances]:
                patch.restore()

    # ---- one call ----------------------------------------------------------------------------

    def call(self, fn: Callable, args: tuple, kwargs: dict, takes_criteria: bool) -> Any:
        """Run `fn(*args, **kwargs)` (a watched `generate`) in the `generate` phase."""
        if self.on_error is not None:
            return self._call_guarded(fn, args, kwargs, takes_criteria)
        active = getattr(_local, "active", None)
        if active is not None:  # an inner generate of a call already watched: same phase, same criterion
            if takes_criteria:
                args, kwargs = with_criterion(args, kwargs, active)
            return fn(*args, **kwargs)
        if getattr(self.hb, "closed", False):
            return fn(*args, **kwargs)
        criterion = make_progress_criterion(self.hb, self.progress_every, order=StopOrder.of(self.hb))
        if takes_criteria:
            args, kwargs = with_criterion(args, kwargs, criterion)
        _local.last = self.last_truncated = None
        _local.active = criterion
        try:
            with self.hb.phase("generate", self.budget_s):
                result = fn(*args, **kwargs)
                _local.active = None
                if criterion.truncated is not None:
                    self._report(criterion, result)  # inside the phase: before the line that leaves it
                return result
        finally:
            _local.active = None

    def _call_guarded(self, fn: Callable, args: tuple, kwargs: dict, takes_criteria: bool) -> Any:
        """`call` for a watch with `on_error`: the watch's own work (the criterion, the phase lines) is fenced
        off from `fn`, whose exceptions propagate untouched; an error of the watch's own goes to `on_error`
        and `fn` runs (or goes on) unwatched."""
        active = getattr(_local, "active", None)
        if active is not None:
            if takes_criteria:
                try:
                    args, kwargs = with_criterion(args, kwargs, active)
                except Exception as exc:
                    self.on_error(exc)
            return fn(*args, **kwargs)
        if getattr(self.hb, "closed", False):
            return fn(*args, **kwargs)
        _local.last = self.last_truncated = None
        try:
            criterion = make_progress_criterion(
                self.hb, self.progress_every, self.on_error, order=StopOrder.of(self.hb)
            )
            watched_args, watched_kwargs = with_criterion(args, kwargs, criterion) if takes_criteria else (args, kwargs)
            phase = self.hb.phase("generate", self.budget_s)
            phase.__enter__()
        except Exception as exc:
            self.on_error(exc)
            return fn(*args, **kwargs)
        _local.active = criterion
        try:
            result = fn(*watched_args, **watched_kwargs)
        except BaseException as user_error:
            _local.active = None
            try:
                phase.__exit__(type(user_error), user_error, user_error.__traceback__)
            except BaseException as exc:  # the phase line failed (the user's own error is re-raised below)
                if exc is not user_error and isinstance(exc, Exception):
                    self.on_error(exc)
            raise
        _local.active = None
        if criterion.truncated is not None:
            try:
                self._report(criterion, result)
            except Exception as exc:
                self.on_error(exc)
        try:
            phase.__exit__(None, None, None)
        except Exception as exc:
            self.on_error(exc)
        return result

    def _report(self, criterion, result) -> None:
        """The `progress` line of a generate the supervisor's order ended: what it was, what it made.  Decoding
        is a courtesy: when it fails the line goes out without the text (the error goes to `on_error`, if set)."""
        texts: dict = {}
        try:
            texts = _row_zero(result, criterion.prompt_len, self.tokenizer)
        except Exception as exc:
            if self.on_error is not None:
                self.on_error(exc)
        report = truncation_report(criterion.truncated, **texts)
        self.last_truncated = _local.last = report
        self.hb.progress(**{TRUNCATED_FIELD: report})


def generating() -> bool:
    """Whether this thread is inside a watched `generate` (any watch's): an inner one adds no phase."""
    return getattr(_local, "active", None) is not None


def last_truncation() -> Optional[dict]:
    """The `generate_truncated` report of this thread's last watched outermost `generate` (any watch's), None
    when the supervisor's order did not end it (or none ran)."""
    return getattr(_local, "last", None)


def tokenizer_of(*candidates: Any) -> Any:
    """The first of `candidates` that can decode ids — a tokenizer, or a processor's `.tokenizer` (a Trainer's
    `processing_class` may be either) — else None.  Never raises: it only looks."""
    for candidate in candidates:
        for obj in (candidate, _attr(candidate, "tokenizer")):
            if obj is not None and callable(_attr(obj, "decode")):
                return obj
    return None


def _attr(obj: Any, name: str) -> Any:
    if obj is None:
        return None
    try:
        return getattr(obj, name, None)
    except Exception:  # a property that raises is no attribute to use
        return None


# ---- the supervisor's stop order ------------------------------------------------------------------


class StopOrder:
    """Reads the supervisor's order to end a runaway generate: `GENERATE_STOP_NAME` in the attempt's directory,
    `{"order": N, "tokens": LIMIT, ...}`, replaced atomically by the supervisor.

    Made when a generate (or the built-in eval's `generate` phase) begins; the order file as it is then is the
    baseline, and only a file that differs from it (inode, mtime, size) is an order for this generate.  `poll`
    runs once per decoded token, so it stats the file at most every `POLL_INTERVAL_S` and reads it only when it
    changed; a file that cannot be read or is not a valid order (a writer that did not replace it atomically)
    is read again at the next poll.  The first valid order is kept: every rank then stops at the same LIMIT."""

    __slots__ = ("path", "order", "limit", "_baseline", "_next_poll", "_clock")

    def __init__(self, directory: "os.PathLike[str] | str | None", *, clock: Callable[[], float] = time.monotonic):
        """`directory`: the attempt's directory (None: no orders ever).  `clock`: monotonic seconds."""
        self.path = os.path.join(os.fspath(directory), GENERATE_STOP_NAME) if directory is not None else None
        self.order: Optional[int] = None
        self.limit: Optional[int] = None  # LIMIT, once a valid order was read
        self._clock = clock
        self._next_poll = float("-inf") if self.path is not None else float("inf")  # no file: never time to look
        self._baseline = self._identity() if self.path is not None else None

    @classmethod
    def of(cls, hb, **kw: Any) -> "StopOrder":
        """The reader for `hb`'s attempt: the directory of its file; none for a heartbeat that writes no file
        (`NullHeartbeat`) or is closed."""
        try:
            path = None if getattr(hb, "closed", False) else getattr(hb, "path", None)
        except Exception:  # a heartbeat-like object with odd attributes: it gets no orders
            path = None
        return cls(os.path.dirname(os.fspath(path)) if path is not None else None, **kw)

    def poll(self, now: Optional[float] = None) -> Optional[int]:
        """LIMIT once an order for this generate has been read, else None; `now`: monotonic seconds."""
        if self.limit is not None or self.path is None:
            return self.limit
        if now is None:
            now = self._clock()
        if now < self._next_poll:
            return None
        self._next_poll = now + POLL_INTERVAL_S
        identity = self._identity()
        if identity is None or identity == self._baseline:
            return None
        parsed = _read_order(self.path)
        if parsed is not None:
            self.order, self.limit = parsed
        return self.limit

    def _identity(self) -> Optional[tuple]:
        try:
            st = os.stat(self.path)
        except (OSError, ValueError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)


def _read_order(path: str) -> Optional[tuple[int, int]]:
    """(order, LIMIT) of a valid order file, None for anything else."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(65536))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    order, tokens = data.get("order"), data.get("tokens")
    if type(order) is not int or type(tokens) is not int or tokens < 1:  # bool is no count
        return None
    return order, tokens


def truncation_report(
    truncated: dict, *, prompt: Optional[str] = None, output: Optional[str] = None, prompt_ids: Optional[list] = None
) -> dict:
    """`truncated` ({"order", "limit", "tokens", "prompt_tokens"}) with the prompt (at most PROMPT_CHARS, its
    middle elided), the output's last TAIL_CHARS (`output_tail`), and, when there is no text, the first
    PROMPT_IDS `prompt_ids`: shortened further until the whole report fits REPORT_BYTES, so the `progress`
    line that carries it stays one atomic write (an over-long line would lose the report whole)."""
    prompt_chars, tail_chars = PROMPT_CHARS, TAIL_CHARS
    while True:
        report = dict(truncated)
        if prompt is not None:
            report["prompt"] = _clip_middle(prompt, prompt_chars)
        if output is not None:
            report["output_tail"] = output[len(output) - tail_chars :] if tail_chars < len(output) else output
        if prompt_ids is not None:
            report["prompt_ids"] = [int(i) for i in list(prompt_ids)[:PROMPT_IDS]]
        if (
            len(json.dumps(report, separators=(",", ":"), default=str)) <= REPORT_BYTES
            or prompt_chars + tail_chars == 0
        ):
            return report
        if prompt_chars >= tail_chars:
            prompt_chars //= 2
        else:
            tail_chars //= 2


def _clip_middle(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    if limit < 8:
        return text[:limit]
    head = limit * 2 // 5
    return text[:head] + "…" + text[len(text) - (limit - head - 1) :]


def _row_zero(result, prompt_len: Optional[int], tokenizer) -> dict:
    """`truncation_report`'s text arguments for row 0 of `generate`'s result (a tensor of ids, or an output
    object with `.sequences`); {} when there is nothing to read."""
    seq = getattr(result, "sequences", result)
    shape = getattr(seq, "shape", None)
    if shape is None or len(shape) != 2 or shape[0] == 0 or prompt_len is None:
        return {}
    row = seq[0]
    prompt_len = min(int(prompt_len), int(shape[1]))
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        return {"prompt_ids": row[: min(prompt_len, PROMPT_IDS)].tolist()}
    new = row[prompt_len:]
    return {
        "prompt": decode(row[:prompt_len].tolist(), skip_special_tokens=True),
        "output": decode(new[max(0, int(new.shape[0]) - TAIL_TOKENS) :].tolist(), skip_special_tokens=True),
    }


# ---- the stopping criterion ---------------------------------------------------------------------


class TokenGaps:
    """The longest time between two decoding steps since it was last taken: what a generate's `progress` beat
    carries as `token_s`.  `tick()` once per decoding step (one clock read); the gap from the first step (the
    prompt's, which made token 1) to the second is left out — a compiled decode graph, a cache allocated there
    say nothing of the steps after.  `take()`: `{"token_s": longest}` and start over, `{}` when no gap was timed
    since (that beat then arms no token deadline).  Plain arithmetic: it cannot raise into the generation."""

    __slots__ = ("_clock", "_last", "_steps", "_longest")

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._last = 0.0
        self._steps = 0
        self._longest: Optional[float] = None

    def tick(self) -> None:
        now = self._clock()
        self._steps += 1
        if self._steps > 2:
            gap = now - self._last
            if self._longest is None or gap > self._longest:
                self._longest = gap
        self._last = now

    def take(self) -> dict:
        longest, self._longest = self._longest, None
        return {} if longest is None else {TOKEN_GAP_FIELD: round(max(0.0, longest), 6)}


def with_criterion(args: tuple, kwargs: dict, criterion) -> tuple[tuple, dict]:
    """`generate`'s arguments with `criterion` added to its `stopping_criteria` (the caller's list is not mutated).

    `generate(inputs, generation_config, logits_processor, stopping_criteria, ...)`: a list passed fourth
    positionally is merged where it is.  Continuous batching (`cache_implementation="paged"`) refuses any
    stopping criterion, so such a call gets none (the phase still applies)."""
    if kwargs.get("cache_implementation") == "paged":
        return args, kwargs
    if "stopping_criteria" not in kwargs and len(args) >= 4 and (args[3] is None or isinstance(args[3], list)):
        merged = _merged(args[3], criterion)
        return args[:3] + (merged,) + args[4:], kwargs
    merged = _merged(kwargs.get("stopping_criteria"), criterion)
    return args, {**kwargs, "stopping_criteria": merged}


def _merged(user, criterion):
    from transformers.generation import StoppingCriteriaList

    out = StoppingCriteriaList(list(user) if user is not None else [])
    if not any(c is criterion for c in out):
        out.append(criterion)
    return out


def make_progress_criterion(
    hb,
    every: int,
    on_error: Optional[Callable[[BaseException], None]] = None,
    order: Optional[StopOrder] = None,
    clock: Callable[[], float] = time.monotonic,
):
    """The criterion that beats `progress` every `every` new tokens, each beat with the longest gap between them
    since the last (`TokenGaps`, on `clock`); with `on_error`, a beat that fails is handed to it and the criterion
    beats no more (generation goes on), else the error propagates.  With `order` (a `StopOrder`) it also ends the
    generation the supervisor's order names, and keeps what it did in `truncated`."""
    return _criterion_class()(hb, every, on_error, order, clock)


@functools.lru_cache(maxsize=1)
def _criterion_class():
    # Defined on first use: transformers (and torch) are imported only once a model that generates exists.
    import torch
    from transformers.generation import StoppingCriteria

    class ProgressCriterion(StoppingCriteria):
        """Beats `progress` (tokens=N, token_s=…) every `every` new tokens; says stop only on the supervisor's
        order."""

        def __init__(self, hb, every: int, on_error=None, order: Optional[StopOrder] = None, clock=time.monotonic):
            self.hb = hb
            self.every = every
            self.on_error = on_error
            self.order = order
            self.gaps = TokenGaps(clock)
            self.truncated: Optional[dict] = None  # {"order", "limit", "tokens", "prompt_tokens"} once ordered to stop
            self.prompt_len: Optional[int] = None
            self.next_at = every
            self._no = None

        def __call__(self, input_ids, scores=None, **kwargs):
            length = int(input_ids.shape[-1])
            if self.prompt_len is None:  # first call: one token has been generated
                self.prompt_len = length - 1
            new = length - self.prompt_len
            self.gaps.tick()
            if new >= self.next_at and self.hb is not None and not getattr(self.hb, "closed", False):
                self.next_at = (new // self.every + 1) * self.every
                if self.on_error is None:
                    self.hb.progress(tokens=new, **self.gaps.take())
                else:
                    try:
                        self.hb.progress(tokens=new, **self.gaps.take())
                    except Exception as exc:
                        self.hb = None  # reported once; generation goes on without beats
                        self.on_error(exc)
            order = self.order
            # `poll`'s own test, inline: the common case (no order, not yet time to look) is one clock read.
            if (
                order is not None
                and (order.limit is not None or order._clock() >= order._next_poll)
                and self._ordered(new)
            ):
                return torch.ones(int(input_ids.shape[0]), dtype=torch.bool, device=input_ids.device)
            rows = int(input_ids.shape[0])
            no = self._no
            if no is None or no.shape[0] != rows or no.device != input_ids.device:
                # Reused: StoppingCriteriaList ORs it into a fresh tensor, so sharing it is safe.
                no = self._no = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
            return no

        def _ordered(self, new: int) -> bool:
            """Whether the supervisor's order ends the generation at `new` tokens (recorded the first time)."""
            try:
                limit = self.order.poll()
            except Exception as exc:  # the order cannot be read: generation goes on, never stopped by mistake
                self.order = None
                if self.on_error is None:
                    raise
                self.on_error(exc)
                return False
            if limit is None or new < limit:
                return False
            if self.truncated is None:
                self.truncated = {
                    "order": self.order.order,
                    "limit": limit,
                    "tokens": new,
                    "prompt_tokens": self.prompt_len,
                }
            return True

    return ProgressCriterion


# ---- wrapping ----------------------------------------------------------------------------------


class _ClassPatch:
    """One class whose `generate` dispatches to the watch of the instance (or to the original)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.had_own = "generate" in cls.__dict__
        self.raw = cls.__dict__.get("generate")
        original = getattr(cls, "generate")
        takes = _takes_criteria(original)

        @functools.wraps(original)
        def generate(obj, *args, **kwargs):
            watch = _owners.get(obj)
            if watch is None:
                return original(obj, *args, **kwargs)
            return watch.call(functools.partial(original, obj), args, kwargs, takes)

        generate.__hangwatch_dispatch__ = True
        self.instances: "weakref.WeakSet[Any]" = weakref.WeakSet()
        setattr(cls, "generate", generate)

    @classmethod
    def ensure(cls, klass: type) -> "_ClassPatch":
        patch = _patched.get(klass)
        if patch is None:
            patch = _patched[klass] = cls(klass)
        return patch

    def restore(self) -> None:
        if _patched.get(self.cls) is not self:
            return
        if self.had_own:
            setattr(self.cls, "generate", self.raw)
        else:
            delattr(self.cls, "generate")
        del _patched[self.cls]


def _instance_wrapper(watch: GenerateWatch, original: Callable) -> Callable:
    takes = _takes_criteria(original)

    @functools.wraps(original)
    def generate(*args, **kwargs):
        return watch.call(original, args, kwargs, takes)

    generate.__hangwatch_own__ = True
    return generate


def _takes_criteria(fn: Callable) -> bool:
    """Whether `fn` names a `stopping_criteria` parameter (GenerationMixin.generate does; a `*args, **kwargs`
    pass-through such as PeftModel.generate does not: the watched call inside it gets the criterion)."""
    try:
        return "stopping_criteria" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _targets(module) -> list:
    seen, out = set(), []
    modules = getattr(module, "modules", None)
    candidates = [module] + (list(modules()) if callable(modules) else [])
    for obj in candidates:
        if id(obj) not in seen:
            seen.add(id(obj))
            out.append(obj)
    return out


def _generate_of(obj) -> Optional[Callable]:
    if "generate" not in _instance_dict(obj) and not hasattr(type(obj), "generate"):
        return None  # only reached through `__getattr__` (peft's LoraModel → its model): that one is wrapped itself
    try:
        gen = getattr(obj, "generate", None)
    except Exception:  # a property that raises: not a generate method
        return None
    if not callable(gen) or hasattr(gen, "forward"):  # a submodule called `generate` is not a method
        return None
    return gen


def _owned(obj) -> bool:
    try:
        return obj in _owners
    except TypeError:  # not weakly referenceable or not hashable
        return False


def _instance_dict(obj) -> dict:
    try:
        return vars(obj)
    except TypeError:
        return {}


def _is_own_wrapper(obj) -> bool:
    return getattr(_instance_dict(obj).get("generate"), "__hangwatch_own__", False)


__all__ = [
    "GenerateWatch",
    "StopOrder",
    "TOKEN_GAP_FIELD",
    "TokenGaps",
    "generating",
    "last_truncation",
    "make_progress_criterion",
    "tokenizer_of",
    "truncation_report",
    "with_criterion",
]
