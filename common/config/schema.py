"""The configuration schema: one declarative record per setting (type, default, bounds, doc).

Every key is a pydantic field, and every default that shapes behaviour lives in a record here, with
its doc: nothing in the worker or the supervisor carries a number of its own that a user would want
to know (kill wait, exit-after-stop, the `intake` and `load` phase budgets, ...).  `load.py` validates
YAML against these records; `reference.py` renders them for docs/configuration.md and `hangwatch run --help`.

Only pydantic here: the supervisor and the worker both import it.  Rules that relate one setting to
another live in `rules.py`; checks against the filesystem (files, model, command) in `deep.py`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from hangwatch.common.config.ops_schema import AlertsCfg, MetricsCfg, TrackersCfg

FAULT_KINDS = (
    "hang_generate",  # generate() never returns and produces no token (blocked in a call)
    "busy_loop",  # pure-Python spin inside the model's forward, one core at 100%
    "block_c",  # blocked in a C call, CPU idle
    "livelock",  # keeps sending progress, never finishes the step
    "crash",  # raises an exception
    "segfault",  # dies of SIGSEGV
    "oom",  # raises the framework's out-of-memory error
    "nan",  # loss non-finite for `steps` steps
    "exit",  # hard exit with `code`
    "runaway_generate",  # generate() keeps producing tokens: EOS suppressed, max_new_tokens huge
    "poison",  # the loss of the training examples `example_ids` is non-finite whenever they are trained
    "memory_limit",  # a fake device: weights + micro-batch × per-example memory over capacity_mb raises OOM
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class WorkerCfg(Section):
    command: Optional[list[str]] = Field(
        None,
        description="null: the built-in training daemon; else an argv list, e.g. [python, train.py] or "
        "[torchrun, --nproc-per-node=8, train.py]. A bare `python`/`python3` first is the supervisor's own interpreter "
        "(the environment hangwatch is installed in; under systemd PATH has no venv). Relative paths are used as "
        "given.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")
    cwd: Optional[str] = Field(
        None, description="Working directory of the worker (default: the config file's directory)."
    )
    nproc_per_node: int = Field(
        1,
        ge=1,
        le=1024,
        description="Ranks of the built-in worker on this box: > 1 runs it under torchrun "
        "(`python -m torch.distributed.run --standalone --nproc-per-node N -m hangwatch.daemon …`), DDP over the "
        "trainable parameters, gloo on CPU, NCCL on CUDA. `train.micro_batch_size` is per rank.",
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=4096,
        json_schema_extra={"also": ["auto"]},
        description="Nodes (machines) of the run, each with its own `hangwatch run`: > 1 launches the worker "
        "under torchrun with `--nnodes N --nproc-per-node P --rdzv-backend c10d --rdzv-endpoint E --rdzv-id "
        "ID-g<generation>` (docs/several-machines.md); every node needs the same `rdzv_endpoint`, `rdzv_id` and a "
        "shared `checkpoint.dir`. `auto`: from the Slurm job, for `srun --ntasks-per-node=1 hangwatch run CONFIG` with "
        "one config on every node (docs/several-machines.md#slurm): the step's node count and, where not written, "
        "`rdzv_endpoint` (its first node, `rdzv_port`), `rdzv_id` (`<SLURM_JOB_ID>.<SLURM_STEP_ID>`), `node_name` "
        "(SLURMD_NODENAME) and a run dir per node (`<run_dir>/node<SLURM_NODEID>`); an error outside a Slurm job. Not "
        "written: `auto` inside a Slurm job, else 1.",
    )
    rdzv_endpoint: Optional[str] = Field(
        None,
        description="`host:port` of the c10d rendezvous store (required when `nnodes` > 1 and not taken from Slurm; "
        "the same on every node). The hangwatch on the machine that owns that address hosts the store, so it outlives "
        "torchrun's restarts.",
    )
    rdzv_port: int = Field(
        29400,
        ge=1,
        le=65535,
        description="The rendezvous store's port when `rdzv_endpoint` comes from Slurm "
        "(`nnodes` auto): `<first node of the step>:<rdzv_port>`. Unused when `rdzv_endpoint` is written.",
    )
    rdzv_id: str = Field(
        "hangwatch",
        min_length=1,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="The job's rendezvous id, the same on every "
        "node; each coordinated restart rendezvouses as `<rdzv_id>-g<generation>`.",
    )
    node_name: Optional[str] = Field(
        None,
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="This node's name in incidents, status and the peers' notices "
        "(unique per node; null: `<host name>:<run dir>`).",
    )
    rdzv_timeout_s: float = Field(
        300,
        gt=0,
        description="Most time a node waits at the rendezvous for its peers (after a start or a restart) before "
        'the `lost_peer` incident and alert: "waiting for 1 of 2 nodes at the rendezvous since …". It keeps waiting '
        "after that; the peer's return resumes the run.",
    )
    max_restarts: int = Field(
        0,
        ge=0,
        description="torchrun's own `--max-restarts` within one attempt (multi-rank and multi-node): torchrun "
        "restarts its ranks in a new rendezvous round by itself; a new set of rank pids within an attempt is not a "
        "fault and shows in `status` as the round. 0: every failure is hangwatch's (an incident, a coordinated "
        "restart).",
    )

    instrument: Literal["auto", "off"] = Field(
        "auto",
        description="With `worker.command`: `auto` instruments every Python process of the worker without an edit "
        "of your files (a bootstrap `sitecustomize` on PYTHONPATH that chains to yours): heartbeats and stack dumps, a "
        "step beat per optimizer step (loss, lr), HangwatchCallback added to HF/TRL and Lightning Trainers, "
        "`generate`, `eval` and `checkpoint` phases, checkpoint announcements, the last good checkpoint handed to "
        "`Trainer.train()` / `fit()`. `off`: nothing enters the worker; it is watched by its output, py-spy and NVML "
        "only.",
    )
    resume_args: list[str] = Field(
        default_factory=list,
        description="With `worker.command`: arguments appended to the command when an attempt has a "
        "checkpoint to resume from, `{checkpoint}` replaced by its path and `{step}` by its step, e.g. "
        '[--resume, "{checkpoint}"]. Nothing is appended when there is none (the first attempt).',
    )

    @field_validator("resume_args")
    @classmethod
    def _placeholders(cls, v):
        for arg in v:
            try:
                arg.format(checkpoint="", step=0)
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(f"{arg!r}: only {{checkpoint}} and {{step}} can be filled in ({exc})") from None
        return v

    # What load.py took from a Slurm job (common/config/slurm.Derived), for what `run` and `validate-config` say;
    # not a key.
    _slurm: Optional[object] = None

    @field_validator("nnodes", mode="before")
    @classmethod
    def _auto_resolved(cls, v):
        # `auto` needs the process's environment, which only the loader has (load.py resolves it first)
        if v == "auto":
            raise ValueError(
                "auto is resolved from the Slurm job when a config file is loaded (load_config), not by "
                "the record alone"
            )
        return v

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v):
        if v is None:
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("not host:port (e.g. 10.0.0.1:29400)")
        return v

    @field_validator("command")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("must be null or a non-empty argv list")
        return v


Budget = Annotated[float, Field(gt=0)]  # a phase budget of 0 s would fire at once: name it null to drop it
DEFAULT_PHASE_BUDGETS_S = {"eval": 900, "predict": 900, "generate": 300, "checkpoint": 600, "intake": 600}
LANDMARK_KINDS = ("generate", "collective", "dataloader", "checkpoint", "backward", "optimizer", "tokenizer", "other")


class LandmarkCfg(Section):
    function: str = Field(
        ...,
        min_length=1,
        description="Function name as a stack dump shows it (e.g. `fetch_batch`; a `Class.method` form matches the "
        "method name).",
    )
    file: Optional[str] = Field(
        None, description="Only frames whose file path contains this text (e.g. `mylib/io.py`); null: any file."
    )
    name: Optional[str] = Field(None, description="What incidents call it (default: the function name).")
    kind: Literal[LANDMARK_KINDS] = Field("other", description="Its family: " + ", ".join(LANDMARK_KINDS) + ".")  # type: ignore[valid-type]


# Progress in a worker's output: a step number (`step 12`, `global_step=12`, `Step 12/100`), a trainer's loss
# line (`{'loss': 1.2, …}`, `loss=1.2`, `loss: 1.2`), an epoch, or a tqdm counter (`12/100 [00:03<00:20, …]`).
DEFAULT_PROGRESS_PATTERN = (
    r"(?i)(?:\b(?:global[_ ])?step\b\s*[:=#]?\s*(?P<step>\d+)"
    r"|['\"]?\bloss\b['\"]?\s*[:=]\s*[-+]?(?:\d|nan|inf)"
    r"|\bepoch\b\s*[:=]?\s*\d"
    r"|\d+/\d+\s*\[\d+:\d+)"
)


class ResumeAuditCfg(Section):
    enabled: bool = Field(
        True,
        description="After a restart, compare each replayed step's loss (and learning rate, gradient "
        "norm when the beats carry them) with the beat of the same step before the restart.",
    )
    rtol: Optional[float] = Field(
        None,
        ge=0,
        le=1,
        description="Relative tolerance of loss and gradient-norm comparisons; 0: bitwise equal. null: 0 for "
        "the built-in worker (deterministic), 0.01 for your own command (nondeterministic GPU kernels move a replayed "
        "loss by well under 1 %; a changed data order or a lost accumulation moves it by far more). The learning rate "
        "is computed, not measured: it is compared within min(rtol, 1e-6).",
    )
    on_divergence: Literal["warn", "stop"] = Field(
        "warn",
        description="A replayed step that differs: `warn` — a `resume_diverged` incident and an alert, training goes "
        "on; `stop` — the same, then the run ends failed before more GPU time goes into a broken resume.",
    )


class WatchdogCfg(Section):
    startup_timeout_s: float = Field(300, gt=0, description="Spawn → first `start` heartbeat.")
    silence_timeout_s: float = Field(120, gt=0, description="No heartbeat line at all (progress lines count).")
    output_silence_timeout_s: float = Field(
        600,
        gt=0,
        description="No new output (stdout/stderr, the attempt's worker.log) for this long is a stall — while "
        "no rank sends heartbeats (an uninstrumented worker: `worker.instrument: off`, a non-Python program, a Python "
        "too old to instrument). Once a rank beats, the heartbeat deadlines govern.",
    )
    progress_pattern: Optional[str] = Field(
        DEFAULT_PROGRESS_PATTERN,
        description="A regular expression that marks a line of the worker's output as progress "
        "(optional named group `step`: the step number). A worker whose output shows progress is not killed by the "
        "startup deadline, and progress lines keep a `load` phase alive. The default matches `step N`, "
        "`global_step=N`, `Step N/M`, HF Trainer's `{'loss': …}` lines, `Epoch N` and tqdm counters (`12/100 "
        "[00:03<…`). null: none.",
    )
    step_timeout_s: Optional[float] = Field(
        None,
        gt=0,
        description="Fixed step deadline while in `train`; null: learned from the run's step times (optimizer "
        "steps, or the progress lines of a script known by its output).",
    )
    first_steps_timeout_s: float = Field(
        600,
        gt=0,
        description="Step deadline until the step budget is learned, and for each rank's first two steps of an "
        "attempt (compile, warm-up; the interval between them is never a sample).",
    )
    calibrate_after: int = Field(
        2,
        ge=1,
        description="Step intervals seen (besides each rank's first of an attempt: warm-up) before the step budget is "
        "learned — by the end of step 4; it is refined with every one after.",
    )
    calibration_factor: float = Field(
        5.0, ge=1.0, description="Learned step budget = factor × p99 of the step times (under 100: the longest)."
    )
    step_timeout_min_s: float = Field(
        10, gt=0, description="Lower clamp of the learned step budget (at most `step_timeout_max_s`)."
    )
    step_timeout_max_s: float = Field(1800, gt=0, description="Upper clamp of the learned step budget.")
    token_deadline: bool = Field(
        True,
        description="Inside `generate()` (instrumented: automatic instrumentation, the callbacks, `GenerateWatch`), "
        "from its first call on: a progress beat overdue by `token_timeout_factor` × the tokens it stands for × the "
        "longest gap between two tokens seen (p99), at least `token_timeout_min_s`, is a stall — the tokens stopped. "
        "A generate slow but still producing tokens is never one (a runaway is `generate_overrun`'s). false: off.",
    )
    token_timeout_factor: float = Field(
        5.0, ge=1.0, description="Token budget = factor × tokens per beat × the p99 of the gaps between tokens."
    )
    token_timeout_min_s: float = Field(
        10,
        gt=0,
        description="Lower bound of the token budget, and the whole of it before any gap between tokens was seen.",
    )
    phase_budgets_s: dict[str, Budget] = Field(
        default_factory=lambda: dict(DEFAULT_PHASE_BUDGETS_S),
        description="Most time a phase may take (> 0 s), by name; a `budget_s` on the phase line wins. Your entries "
        "are merged over the defaults (null removes one). `load` (model loading) defaults to `startup_timeout_s`; "
        "`intake` is continuous mode's validation of one file.",
    )
    default_phase_budget_s: Optional[float] = Field(
        None,
        gt=0,
        description="Budget of phases not named above (null: none; `train` is governed by the step deadline).",
    )
    phase_learn: bool = Field(
        True,
        description="A phase whose budget is a default (the defaults of `phase_budgets_s`, or "
        "`default_phase_budget_s`) learns its budget from the run: once it completed `phase_learn_after` times, "
        "its budget is `phase_learn_factor` × the longest it took, at least `phase_learn_floor_s`. A budget you set "
        "(in `phase_budgets_s`, other than the default, or `budget_s` on the phase line) is kept as it is.",
    )
    phase_learn_after: int = Field(3, ge=1, description="Completed phases of a name before its budget is learned.")
    phase_learn_factor: float = Field(
        5.0, ge=1.0, description="Learned phase budget = factor × the longest time that phase took."
    )
    phase_learn_floor_s: float = Field(10.0, gt=0, description="Lower bound of a learned phase budget.")
    dump_grace_s: float = Field(5, ge=0, description="Most time to wait for stack dumps to stop growing.")
    abandon_grace_s: float = Field(
        5,
        gt=0,
        description="A stall of the built-in worker on one process (`restart.in_process`): how long, once the dumps "
        "are in, the worker gets to abandon the stuck step in its own process before the tree is killed (a thread "
        "blocked in C, a CUDA kernel or a collective cannot).",
    )
    term_grace_s: float = Field(
        10,
        ge=0,
        description="SIGTERM → SIGKILL grace of a graceful stop (operator's restart/stop, "
        "a worker exiting after `stop`): time to write its checkpoint and exit.",
    )
    stuck_term_grace_s: float = Field(
        0.4,
        ge=0,
        description="SIGTERM → SIGKILL grace of a worker known to be stuck (a deadline fired): its main thread "
        "cannot run a graceful stop, so it is not given `term_grace_s` it cannot use; children still get SIGTERM "
        "first.",
    )
    kill_wait_s: float = Field(
        30, gt=0, description="After SIGKILL, how long to wait for the tree to go before recording survivors."
    )
    exit_after_stop_s: float = Field(
        30,
        gt=0,
        description="A worker that announced `stop` gets this long (plus `term_grace_s`) to exit before it is killed "
        "(after every rank said its work was done — `finished`, `idle`, or the exit line with status 0 — the run then "
        "ends finished; after any other `stop`, it restarts).",
    )
    gpu_release_timeout_s: float = Field(
        30, ge=0, description="Most time to wait for a dead worker's GPU memory to be freed."
    )
    py_spy: bool = Field(True, description="Run `py-spy dump --native --locals` on a stall when py-spy is installed.")
    py_spy_timeout_s: float = Field(20, gt=0, description="Time box for one py-spy dump.")
    py_spy_path: Optional[str] = Field(
        None,
        description="The py-spy executable; null: the one next to the supervisor's Python (a venv's bin/), else PATH.",
    )
    poll_interval_s: float = Field(
        0.25,
        gt=0,
        le=5,
        description="Fallback period: heartbeat files are read, and the control socket polled, this often "
        "only where file events (inotify) or the control server's descriptor are unavailable; otherwise the loop wakes "
        "on events and at the earliest deadline.",
    )
    straggler_factor: float = Field(
        2.0,
        gt=1.0,
        description="A rank whose step time stays above this multiple of the other ranks' median is a straggler "
        "(a warning in the log, `status` and the next incident; nothing is killed). Step time: the `step_time_s` a "
        "step line carries, else the time between the rank's step lines.",
    )
    straggler_steps: int = Field(
        20, ge=1, description="Consecutive slow steps before a rank is recorded as a straggler."
    )
    generate_overrun: Literal["truncate", "restart"] = Field(
        "truncate",
        description="A `generate` phase past its budget while tokens still arrive: `truncate` — the generation "
        "is ended at the next token in the worker's own process (generate() returns what it has; every rank stops at "
        "the same token), recorded as a `generate_truncated` incident, nothing restarted; `restart` — a livelock, "
        "killed and restarted. A generate that produces no tokens (blocked in C, a kernel, a collective) is a stall "
        "either way.",
    )
    resume_audit: ResumeAuditCfg = Field(default_factory=ResumeAuditCfg, description="The resume audit.")
    landmarks: list[LandmarkCfg] = Field(
        default_factory=list,
        description="Your own landmark frames, added to the built-in registry (generate, collectives, "
        "DataLoader, checkpoint saving, backward, optimizer.step, tokenizer calls): an incident names the deepest "
        "landmark of the stuck stack first.",
    )

    @field_validator("progress_pattern")
    @classmethod
    def _regex(cls, v):
        if v is None:
            return v
        try:
            compiled = re.compile(v)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        if compiled.groups and "step" not in compiled.groupindex and compiled.groupindex:
            raise ValueError(f"named groups {sorted(compiled.groupindex)}: the only one read is `step`")
        return v

    @field_validator("phase_budgets_s", mode="before")
    @classmethod
    def _merge_phase_budgets(cls, value):
        # A user who sets one budget keeps the others: `{eval: 60}` must not silently drop `generate`.
        if not isinstance(value, dict):
            return value
        merged = {**DEFAULT_PHASE_BUDGETS_S, **value}
        return {k: v for k, v in merged.items() if v is not None}


class RestartCfg(Section):
    max_restarts: int = Field(
        10, ge=0, description="Restarts allowed within `window_s` without a new step before the run is `failed`."
    )
    window_s: float = Field(3600, gt=0, description="Crash-loop window.")
    backoff_initial_s: float = Field(
        1,
        ge=0,
        description="Delay before the restart after the second failure in a row (the first restart after a "
        "healthy stretch is immediate); doubles with each further one, at most `backoff_max_s`.",
    )
    backoff_max_s: float = Field(300, ge=0, description="Backoff cap.")
    healthy_after_s: float = Field(
        300, gt=0, description="An attempt that runs this long and steps resets the backoff."
    )
    no_progress_restarts: int = Field(
        3,
        ge=0,
        description="Restarts in a row that never step past the last good step before the run ends `failed` "
        "(incident `no_progress`, an alert) — before the restart budget is spent on hopeless attempts; 0: off.",
    )
    oom_remediation: bool = Field(
        True,
        description="Built-in worker: an out-of-memory failure restarts with a smaller micro-batch and more "
        "accumulation (the same examples per optimizer step; not bit-for-bit the same sums): the first one picked from "
        "the OOM's memory figures (the weights' share, what the step needed, the device's capacity; 90 % of it at "
        "most), else halved, down to 1, then gradient checkpointing, then `failed`. A script of your own "
        "(`worker.command`, `worker.instrument: auto`) whose HF Trainer, TRL trainer or Lightning Trainer runs out of "
        "memory in training restarts with the framework's per-device batch halved and its gradient accumulation "
        "doubled, down to 1, then `failed`. false: restart with the same settings.",
    )
    in_process: bool = Field(
        True,
        description="Built-in worker on one process: recover inside the worker's process where it can, without a "
        "restart. An out-of-memory error in a training step: the step's work dropped, the micro-batch halved and the "
        "accumulation doubled (then gradient checkpointing), the same step taken again on the same examples; in an "
        "eval, that batch halved. A non-finite streak: its examples quarantined and the last good checkpoint's state, "
        "held in host memory, put back. A stall in Python (after the stack dumps): the stuck step abandoned by an "
        "exception raised in it, and the last good state put back (`watchdog.abandon_grace_s`). What cannot be "
        "recovered there (a thread blocked in C or a CUDA kernel, several ranks, OOM at micro-batch 1 with "
        "checkpointing) is restarted as before. false: every recovery is a restart.",
    )
    on_unkillable: Literal["wait", "fail"] = Field(
        "wait",
        description="A process of the worker's tree still there `watchdog.kill_wait_s` after SIGKILL (uninterruptible "
        "sleep: NFS, a GPU driver) — no new attempt is started on top of it; an `unkillable` incident and an alert (a "
        "reboot or a GPU reset may be needed). `wait`: restart once every survivor is gone; `fail`: end the run "
        "`failed` at once.",
    )
    prewarm: Union[Literal["always"], bool] = Field(
        False,
        description="Built-in worker on one process: keep the next attempt's process loaded as a standby that has "
        "imported torch/transformers/peft, read the data and built the base model with its LoRA wrapping on the CPU "
        "(safetensors memory-mapped), holding no GPU memory; at a restart it is released with the resume point, moves "
        "to the device once the dead processes' memory is released and loads only the checkpoint. `true`: the standby "
        "is spawned at the stall (it loads while the stuck attempt is dumped and killed); `always`: it is spawned as "
        "soon as the current attempt has taken its first step, so it is ready before anything fails (its RAM is shown "
        "by `status`; a standby that dies is replaced). false: every restart is a cold start.",
    )

    @field_validator("prewarm", mode="before")
    @classmethod
    def _prewarm_mode(cls, value):
        # One message for a bad value, not one per member of the union.
        if value is True or value is False or value == "always":
            return value
        raise ValueError("expected true, false or always")


class ControlCfg(Section):
    socket: Optional[str] = Field(
        None,
        description="Control socket path; null: $RUNTIME_DIRECTORY/hangwatch.sock under systemd, else "
        "<run_dir>/hangwatch.sock.",
    )
    group: Optional[str] = Field(
        None, description="Group allowed to use the socket (mode 0660); null: owner only (0600)."
    )
    max_request_bytes: int = Field(65536, ge=256, description="Largest request line accepted.")


class TinyModelCfg(Section):
    vocab_size: int = Field(512, ge=32, description="Vocabulary size of the locally built tokenizer and model.")
    hidden_size: int = Field(64, ge=8, description="Hidden size.")
    intermediate_size: int = Field(128, ge=8, description="MLP size.")
    num_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Key/value heads (grouped-query attention).")
    max_position: int = Field(512, ge=16, description="Maximum sequence length.")
    extra_head: bool = Field(
        True,
        description="Attach an extra trainable module (an auxiliary projection head) that must survive PEFT wrapping "
        "and resume.",
    )

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be divisible by num_kv_heads")
        return self


class ModelCfg(Section):
    name_or_path: Optional[str] = Field(
        None, description="Local model directory or hub-cache id (never downloaded); null: build `tiny`."
    )
    tiny: TinyModelCfg = Field(default_factory=TinyModelCfg, description="The tiny Llama-style model built locally.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto: float32 on CPU; on a GPU that supports bf16 the base weights load in bf16 and run under "
        "bf16 autocast (trainable LoRA and extra parameters stay float32), float32 weights elsewhere.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available.")
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute the decoder layers' activations in the backward pass instead of keeping them: less "
        "memory, more time, the same numbers. OOM remediation turns it on by itself once the micro-batch is down to 1.",
    )
    load_in_4bit: bool = Field(
        False,
        description="QLoRA: load the base weights quantised to 4 bits (NF4) through bitsandbytes (the `qlora` extra: "
        "`pip install 'hangwatch[qlora]'`); CUDA only, and only for a `name_or_path` model.",
    )

    @model_validator(mode="after")
    def _four_bit(self):
        if self.load_in_4bit and self.device == "cpu":
            raise ValueError("load_in_4bit needs a CUDA GPU (bitsandbytes' 4-bit kernels); model.device is cpu")
        if self.load_in_4bit and not self.name_or_path:
            raise ValueError(
                "load_in_4bit quantises a pretrained model loaded from name_or_path; the tiny model is built "
                "in place, not loaded (set name_or_path or drop load_in_4bit)"
            )
        return self


class LoraCfg(Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA alpha.")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="Modules LoRA adapts."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full and saved with the adapter."
    )


class DataCfg(Section):
    train: Optional[str] = Field(
        None, description="Training JSONL: {prompt, completion} or {messages: [...]} per line."
    )
    eval: Optional[str] = Field(None, description="Held-out JSONL in the same format (eval loss).")
    max_length: int = Field(256, ge=8, description="Longest tokenized example.")
    truncation: Literal["keep_completion", "reject"] = Field(
        "keep_completion",
        description="Over-long examples: cut the prompt's start to keep the completion, or reject the example.",
    )
    inbox: bool = Field(False, description="Continuous mode: train on files dropped into <run_dir>/inbox/.")
    replay_ratio: float = Field(
        0.2, ge=0, lt=1, description="Continuous mode: fraction of already-trained examples mixed in."
    )
    on_bad_lines: Literal["reject_file", "skip_lines"] = Field(
        "reject_file", description="Continuous mode: a partly bad file is rejected whole, or its good lines train."
    )
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1, description="Continuous mode: larger inbox files are rejected.")
    flush_after_s: float = Field(
        30,
        gt=0,
        description="Continuous mode: with nothing new arriving for this long, the examples in hand train as a "
        "partial optimizer step (loss over the tokens present), the covering checkpoint is written and the file "
        "reaches done/.",
    )
    idle_exit_s: Optional[float] = Field(
        None,
        gt=0,
        description="Continuous mode: after this long idle (queue empty, nothing arriving) train what is "
        "left, checkpoint, export final/ and stop with reason `idle`; null: wait for files forever.",
    )


TRACKERS = ("wandb", "mlflow", "tensorboard")  # train.report_to's names, HF's


def tracker_names(value) -> list[str]:
    """`train.report_to` as HF takes it: a list of names, one name, `none` (or null) for none, `all` for all of
    them; an unknown name is refused with the nearest known one."""
    if value is None or value == "none" or value == ["none"]:
        return []
    if value == "all" or value == ["all"]:
        return list(TRACKERS)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of {', '.join(TRACKERS)} (or none, or all)")
    names: list[str] = []
    for name in value:
        if name in ("none", "all"):
            raise ValueError(f"{name} stands alone (report_to: {name}), not in a list with other names")
        if name not in TRACKERS:
            import difflib  # only for a config with a mistake

            close = difflib.get_close_matches(str(name).lower(), [*TRACKERS, "none", "all"], n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ValueError(f"unknown tracker {name!r} ({hint}known: {', '.join(TRACKERS)}; or none, or all)")
        if name not in names:
            names.append(name)
    return names


class TrainCfg(Section):
    max_steps: int = Field(100, ge=1, description="Optimizer steps in the run.")
    micro_batch_size: int = Field(4, ge=1, description="Examples per forward pass.")
    grad_accum: int = Field(2, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up, in optimizer steps; cosine decay after.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(0, description="Seed of the model init, data order and dropout.")
    max_nonfinite_streak: int = Field(5, ge=1, description="Non-finite losses in a row before the worker exits 75.")
    sleep_per_step_s: float = Field(
        0.0,
        ge=0,
        description="Demo knob: an artificial delay per optimizer step, so a tiny model's run lasts long enough to "
        "watch.",
    )
    report_to: list[Literal[TRACKERS]] = Field(  # type: ignore[valid-type]
        default_factory=list,
        json_schema_extra={"also": ["none", "all"]},
        description="Experiment trackers the built-in worker logs to (rank 0), as in HF's `report_to`: `wandb` "
        "(project WANDB_PROJECT or `hangwatch`, WANDB_MODE as set, its files under the run dir unless WANDB_DIR), "
        "`mlflow` (MLFLOW_TRACKING_URI, experiment MLFLOW_EXPERIMENT_NAME or `hangwatch`, key settings as params), "
        "`tensorboard` (TENSORBOARD_LOGGING_DIR or `<run_dir>/tensorboard`): train/loss, train/lr and train/grad_norm "
        "per optimizer step, eval/loss after each eval, at the step. Every attempt of the run joins the first "
        "attempt's tracker run, and a step already logged is not logged again. A tracker that fails (not installed, "
        "offline, refused) is said once in a `warn` line and is off for the attempt; training goes on. `none`: []; "
        "`all`: the three.",
    )
    run_name: Optional[str] = Field(
        None, min_length=1, description="The tracker run's name (`report_to`); null: the run dir's name."
    )

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers(cls, value):
        return tracker_names(value)


class EvalPrompt(Section):
    prompt: str = Field(..., description="Prompt text (the chat template is applied).")
    reference: Optional[str] = Field(None, description="Expected completion, recorded beside the output.")


class EvalCfg(Section):
    every_steps: int = Field(0, ge=0, description="Evaluate every N optimizer steps (0: never).")
    max_new_tokens: int = Field(32, ge=1, description="Generation length cap.")
    do_sample: bool = Field(False, description="Greedy by default.")
    progress_every_tokens: int = Field(8, ge=1, description="A `progress` beat every N generated tokens.")
    prompts: list[Union[str, EvalPrompt]] = Field(
        default_factory=list, description="Fixed prompts generated at each eval."
    )


class CheckpointCfg(Section):
    every_steps: int = Field(10, ge=1, description="Checkpoint every N optimizer steps.")
    keep_last: int = Field(3, ge=1, description="Valid checkpoints kept (the newest good one is never deleted).")
    confirm_steps: int = Field(
        2,
        ge=0,
        description="Steps after a checkpoint, each with a finite loss, before it counts as good — for the built-in "
        "worker's checkpoints and for those any script announces (`Heartbeat.checkpoint`); the last good one is handed "
        "to every attempt in HANGWATCH_RESUME_FROM.",
    )
    dir: Optional[str] = Field(
        None,
        description="Where the built-in worker writes its checkpoints (null: `<run_dir>/checkpoints`); relative to "
        "the config file's directory. Multi-node: a directory every node sees (a shared filesystem); global rank 0 "
        "writes, every rank resumes from the checkpoint rank 0 chose.",
    )


FAULT_SIZES = ("weights_mb", "per_example_mb", "capacity_mb")  # memory_limit's


class FaultCfg(Section):
    kind: Literal[FAULT_KINDS] = Field(..., description="What to inject.")  # type: ignore[valid-type]
    at_step: Optional[int] = Field(
        None, ge=0, description="Fire at this optimizer step (for hang_generate: the first eval at or after it)."
    )
    at_eval: Optional[int] = Field(None, ge=1, description="Fire at the Nth eval (1-based).")
    repeat: bool = Field(False, description="Fire on every attempt, not once per run.")
    steps: int = Field(3, ge=1, description="nan: how many steps the loss stays non-finite.")
    code: int = Field(1, ge=0, le=255, description="exit: the exit code.")
    spawn_child: bool = Field(False, description="Spawn a grandchild process first (it must die with the tree).")
    example_ids: list[str] = Field(
        default_factory=list,
        description="poison: the training examples (ids `FILE:LINE`, e.g. `train.jsonl:7`) whose loss "
        "is non-finite every time they are trained, from `at_step` on (default: from the start), on every attempt.",
    )
    weights_mb: Optional[float] = Field(
        None,
        gt=0,
        description="memory_limit: the memory (MiB) the model takes once on the fake device (its weights' share).",
    )
    per_example_mb: Optional[float] = Field(
        None,
        gt=0,
        description="memory_limit: the memory (MiB) each example of a training forward's batch takes on top.",
    )
    capacity_mb: Optional[float] = Field(
        None,
        gt=0,
        description="memory_limit: what the process may use (MiB); a training forward needing more raises "
        "torch's out-of-memory error in torch's words, from `at_step` on (default: from the start), on every attempt.",
    )
    rank: int = Field(
        0,
        ge=0,
        description="The rank it fires on (only that one) in a multi-rank run (`worker.nproc_per_node` > 1); "
        "`hang_generate` and `runaway_generate` need rank 0, the only rank of the built-in worker that generates.",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # memory_limit's sizes only where they are set: every other fault dumps (and is recorded as fired) as before.
        return {k: v for k, v in handler(self).items() if not (k in FAULT_SIZES and v is None)}

    @model_validator(mode="after")
    def _when(self):
        sizes = (self.weights_mb, self.per_example_mb, self.capacity_mb)
        if self.kind == "memory_limit":
            if any(v is None for v in sizes):
                raise ValueError("a memory_limit fault needs weights_mb, per_example_mb and capacity_mb")
            if self.at_eval is not None:
                raise ValueError("a memory_limit fault acts on training steps: use at_step, not at_eval")
            return self
        if any(v is not None for v in sizes):
            raise ValueError("weights_mb, per_example_mb and capacity_mb are for the memory_limit fault only")
        if self.kind == "poison":
            if not self.example_ids:
                raise ValueError("a poison fault needs example_ids (training example ids, e.g. train.jsonl:7)")
            if self.at_eval is not None:
                raise ValueError("a poison fault acts on training steps: use at_step, not at_eval")
            return self
        if self.example_ids:
            raise ValueError("example_ids is for the poison fault only")
        if self.at_step is None and self.at_eval is None:
            raise ValueError("a fault needs at_step or at_eval")
        return self


TERMINATION_LOG_AUTO = "auto"


class LoggingCfg(Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Supervisor log level.")
    termination_log: str = Field(
        TERMINATION_LOG_AUTO,
        description="Where `hangwatch run` leaves, as it ends, why the run ended — the container's termination message "
        "in Kubernetes (at most 4 KiB: the final state and why, the exit code's meaning, the last incident, the "
        "decision, the last good checkpoint, the run dir), shown by `kubectl describe pod`: `auto`: "
        "/dev/termination-log when that file exists and is writable (in a pod), else nothing is written; an absolute "
        "path: that file, always (a pod's own `terminationMessagePath`); empty: never (docs/kubernetes.md).",
    )

    @field_validator("termination_log", mode="before")
    @classmethod
    def _auto_path_or_never(cls, value):
        # One message for every bad value: null, a relative path, a directory.
        if value in (TERMINATION_LOG_AUTO, ""):
            return value
        if not isinstance(value, str) or not value.startswith("/") or value.endswith("/") or "\0" in value:
            raise ValueError("expected auto, an absolute path of a file (e.g. /dev/termination-log) or '' (never)")
        return value


class Config(Section):
    run_dir: str = Field("runs/default", description="Run directory (relative: to the config file's directory).")
    worker: WorkerCfg = Field(default_factory=WorkerCfg, description="What to run.")
    watchdog: WatchdogCfg = Field(default_factory=WatchdogCfg, description="Deadlines and escalation.")
    restart: RestartCfg = Field(default_factory=RestartCfg, description="Restart policy.")
    control: ControlCfg = Field(default_factory=ControlCfg, description="Control socket.")
    logging: LoggingCfg = Field(default_factory=LoggingCfg, description="Logging.")
    model: ModelCfg = Field(default_factory=ModelCfg, description="Base model.")
    lora: LoraCfg = Field(default_factory=LoraCfg, description="LoRA adapter.")
    data: DataCfg = Field(default_factory=DataCfg, description="Data.")
    train: TrainCfg = Field(default_factory=TrainCfg, description="Training loop.")
    eval: EvalCfg = Field(default_factory=EvalCfg, description="Evaluation.")
    checkpoint: CheckpointCfg = Field(default_factory=CheckpointCfg, description="Checkpoints.")
    faults: list[FaultCfg] = Field(default_factory=list, description="Faults to inject.")
    alerts: AlertsCfg = Field(default_factory=AlertsCfg, description="Alerts and the dead-man's switch.")
    metrics: MetricsCfg = Field(default_factory=MetricsCfg, description="Prometheus metrics.")
    trackers: TrackersCfg = Field(
        default_factory=TrackersCfg, description="Experiment trackers: hangwatch's reports on the worker's runs."
    )

    # Where the config came from; not a key.
    _source: Optional[Path] = None
    _instrument_note: Optional[str] = None  # what instrumentation the worker gets, once asked (the start line)

    @model_validator(mode="after")
    def _needs_data(self):
        if self.worker.command is None and not self.data.inbox and not self.data.train:
            raise ValueError("the built-in worker needs data.train (or data.inbox: true)")
        if self.worker.command is None and self.data.inbox and self.data.train:
            raise ValueError(
                "data.train and data.inbox: true exclude each other: in continuous mode every training "
                "file comes through the inbox (`hangwatch submit FILE`); drop data.train"
            )
        return self
