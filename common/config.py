"""The configuration schema: one declarative record per setting.

Every key is a pydantic field carrying its type, default, validation and doc.  The same schema
validates YAML files (unknown keys fail with a "did you mean"), renders the README's configuration
reference (`reference_markdown`) and the CLI's `--help` epilogue.  Relative paths in a config file
are resolved against the directory of that file, so a config behaves the same whatever the
working directory (systemd runs from its StateDirectory).

This module imports neither torch nor anything heavy: the supervisor and the worker both use it.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

FAULT_KINDS = (
    "hang_generate",  # generate() never returns
    "busy_loop",  # pure-Python spin inside the model's forward, one core at 100%
    "block_c",  # blocked in a C call, CPU idle
    "livelock",  # keeps sending progress, never finishes the step
    "crash",  # raises an exception
    "segfault",  # dies of SIGSEGV
    "oom",  # raises the framework's out-of-memory error
    "nan",  # loss non-finite for `steps` steps
    "exit",  # hard exit with `code`
)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class WorkerCfg(Section):
    command: Optional[list[str]] = Field(
        None,
        description="null: the built-in training daemon; else an argv list, e.g. "
        "[torchrun, --nproc-per-node=8, train.py]. Relative paths are used as given.",
    )
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the worker.")
    cwd: Optional[str] = Field(None, description="Working directory of the worker (default: the config file's directory).")

    @field_validator("command")
    @classmethod
    def _nonempty(cls, v):
        if v is not None and not v:
            raise ValueError("must be null or a non-empty argv list")
        return v


class WatchdogCfg(Section):
    startup_timeout_s: float = Field(300, gt=0, description="Spawn → first `start` heartbeat.")
    silence_timeout_s: float = Field(120, gt=0, description="No heartbeat line at all (progress lines count).")
    step_timeout_s: Optional[float] = Field(
        None, gt=0, description="Fixed step deadline while in `train`; null: calibrated from observed step times."
    )
    first_steps_timeout_s: float = Field(600, gt=0, description="Step deadline before calibration (compile, warm-up).")
    calibrate_after: int = Field(20, ge=1, description="Steps observed before the step deadline is calibrated.")
    calibration_factor: float = Field(5.0, ge=1.0, description="Calibrated step deadline = factor × p99 of step times.")
    step_timeout_min_s: float = Field(10, gt=0, description="Lower clamp of the calibrated step deadline.")
    step_timeout_max_s: float = Field(1800, gt=0, description="Upper clamp of the calibrated step deadline.")
    phase_budgets_s: dict[str, float] = Field(
        default_factory=lambda: {"eval": 900, "generate": 300, "checkpoint": 600, "intake": 600},
        description="Most time a phase may take, by name; a `budget_s` on the phase line wins. "
        "`load` (model loading) defaults to `startup_timeout_s`; `intake` is continuous mode's validation of one file.",
    )
    default_phase_budget_s: Optional[float] = Field(
        None, gt=0, description="Budget of phases not named above (null: none; `train` is governed by the step deadline)."
    )
    dump_grace_s: float = Field(5, ge=0, description="Most time to wait for stack dumps to stop growing.")
    term_grace_s: float = Field(10, ge=0, description="SIGTERM → SIGKILL grace.")
    kill_wait_s: float = Field(30, gt=0, description="After SIGKILL, how long to wait for the tree to go before recording survivors.")
    exit_after_stop_s: float = Field(
        30, gt=0, description="A worker that announced `stop` gets this long (plus `term_grace_s`) to exit before it is killed."
    )
    gpu_release_timeout_s: float = Field(30, ge=0, description="Most time to wait for a dead worker's GPU memory to be freed.")
    py_spy: bool = Field(True, description="Run `py-spy dump --native --locals` on a stall when py-spy is installed.")
    py_spy_timeout_s: float = Field(20, gt=0, description="Time box for one py-spy dump.")
    poll_interval_s: float = Field(0.25, gt=0, le=5, description="Supervisor loop period (deadline checks between file events).")

    @model_validator(mode="after")
    def _clamp_order(self):
        if self.step_timeout_min_s > self.step_timeout_max_s:
            raise ValueError("step_timeout_min_s must not exceed step_timeout_max_s")
        return self


class RestartCfg(Section):
    max_restarts: int = Field(10, ge=0, description="Restarts allowed within `window_s` without a new step before the run is `failed`.")
    window_s: float = Field(3600, gt=0, description="Crash-loop window.")
    backoff_initial_s: float = Field(1, ge=0, description="First restart delay; doubles each consecutive failure.")
    backoff_max_s: float = Field(300, ge=0, description="Backoff cap.")
    healthy_after_s: float = Field(300, gt=0, description="An attempt that runs this long and steps resets the backoff.")


class ControlCfg(Section):
    socket: Optional[str] = Field(
        None, description="Control socket path; null: $RUNTIME_DIRECTORY/hangwatch.sock under systemd, else <run_dir>/hangwatch.sock."
    )
    group: Optional[str] = Field(None, description="Group allowed to use the socket (mode 0660); null: owner only (0600).")
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
        True, description="Attach an extra trainable module (an auxiliary projection head) that must survive PEFT wrapping and resume."
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
        "auto", description="auto: float32 on CPU, bf16 autocast on a GPU that supports it."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available.")


class LoraCfg(Section):
    r: int = Field(8, ge=1, description="LoRA rank.")
    alpha: float = Field(16, gt=0, description="LoRA alpha.")
    dropout: float = Field(0.05, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], description="Modules LoRA adapts."
    )
    modules_to_save: list[str] = Field(default_factory=list, description="Modules trained in full and saved with the adapter.")


class DataCfg(Section):
    train: Optional[str] = Field(None, description="Training JSONL: {prompt, completion} or {messages: [...]} per line.")
    eval: Optional[str] = Field(None, description="Held-out JSONL in the same format (eval loss).")
    max_length: int = Field(256, ge=8, description="Longest tokenized example.")
    truncation: Literal["keep_completion", "reject"] = Field(
        "keep_completion", description="Over-long examples: cut the prompt's start to keep the completion, or reject the example."
    )
    inbox: bool = Field(False, description="Continuous mode: train on files dropped into <run_dir>/inbox/.")
    replay_ratio: float = Field(0.2, ge=0, lt=1, description="Continuous mode: fraction of already-trained examples mixed in.")
    on_bad_lines: Literal["reject_file", "skip_lines"] = Field(
        "reject_file", description="Continuous mode: a partly bad file is rejected whole, or its good lines train."
    )
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1, description="Continuous mode: larger inbox files are rejected.")
    idle_exit_s: Optional[float] = Field(
        None, gt=0, description="Continuous mode: after this long idle (queue empty, nothing arriving) train what is "
        "left, checkpoint, export final/ and stop with reason `idle`; null: wait for files forever."
    )


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
    sleep_per_step_s: float = Field(0.0, ge=0, description="Demo knob: an artificial delay per optimizer step, so a tiny model's run lasts long enough to watch.")


class EvalPrompt(Section):
    prompt: str = Field(..., description="Prompt text (the chat template is applied).")
    reference: Optional[str] = Field(None, description="Expected completion, recorded beside the output.")


class EvalCfg(Section):
    every_steps: int = Field(0, ge=0, description="Evaluate every N optimizer steps (0: never).")
    max_new_tokens: int = Field(32, ge=1, description="Generation length cap.")
    do_sample: bool = Field(False, description="Greedy by default.")
    progress_every_tokens: int = Field(8, ge=1, description="A `progress` beat every N generated tokens.")
    prompts: list[Union[str, EvalPrompt]] = Field(default_factory=list, description="Fixed prompts generated at each eval.")


class CheckpointCfg(Section):
    every_steps: int = Field(10, ge=1, description="Checkpoint every N optimizer steps.")
    keep_last: int = Field(3, ge=1, description="Valid checkpoints kept (the newest good one is never deleted).")
    confirm_steps: int = Field(2, ge=0, description="Finite steps after a checkpoint before it counts as good.")


class FaultCfg(Section):
    kind: Literal[FAULT_KINDS] = Field(..., description="What to inject.")  # type: ignore[valid-type]
    at_step: Optional[int] = Field(None, ge=0, description="Fire at this optimizer step (for hang_generate: the first eval at or after it).")
    at_eval: Optional[int] = Field(None, ge=1, description="Fire at the Nth eval (1-based).")
    repeat: bool = Field(False, description="Fire on every attempt, not once per run.")
    steps: int = Field(3, ge=1, description="nan: how many steps the loss stays non-finite.")
    code: int = Field(1, ge=0, le=255, description="exit: the exit code.")
    spawn_child: bool = Field(False, description="Spawn a grandchild process first (it must die with the tree).")

    @model_validator(mode="after")
    def _when(self):
        if self.at_step is None and self.at_eval is None:
            raise ValueError("a fault needs at_step or at_eval")
        return self


class LoggingCfg(Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Supervisor log level.")


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

    # Where the config came from; not a key.
    _source: Optional[Path] = None

    @model_validator(mode="after")
    def _needs_data(self):
        if self.worker.command is None and not self.data.inbox and not self.data.train:
            raise ValueError("the built-in worker needs data.train (or data.inbox: true)")
        if self.worker.command is None and self.data.inbox and self.data.train:
            raise ValueError("data.train and data.inbox: true exclude each other: in continuous mode every training "
                             "file comes through the inbox (`hangwatch submit FILE`); drop data.train")
        return self


class ConfigError(Exception):
    """A config that cannot be used. `problems` lists one human-readable line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


# --------------------------------------------------------------------------------------------
# Loading


def _line_index(text: str) -> dict[tuple, int]:
    """Map each key path of a YAML document to its 1-based line, for error messages."""
    index: dict[tuple, int] = {}
    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return index

    def walk(node, path):
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = (*path, k.value)
                index[key] = k.start_mark.line + 1
                walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                index[(*path, i)] = item.start_mark.line + 1
                walk(item, (*path, i))

    if root is not None:
        walk(root, ())
    return index


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The schema section a key path points into (for "did you mean")."""
    model: Any = Config
    for part in loc:
        if isinstance(part, int):
            continue
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        ann = fields[part].annotation
        model = _first_model(ann)
        if model is None:
            return None
    return model


def _first_model(ann) -> Optional[type[BaseModel]]:
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in getattr(ann, "__args__", ()) or ():
        found = _first_model(arg)
        if found is not None:
            return found
    return None


def _format_errors(err: ValidationError, source: str, lines: dict[tuple, int]) -> list[str]:
    problems = []
    errors = err.errors()

    def strip(raw):
        # Union members appear in the location as tags ("str", "EvalPrompt"); users never wrote those.
        return tuple(p for p in raw if not (isinstance(p, str) and (p[:1].isupper() or p in ("str", "list[str]"))))

    locs = [strip(e["loc"]) for e in errors]
    for e, loc in zip(errors, locs):
        if e["type"] == "string_type" and any(o != loc and o[: len(loc)] == loc for o in locs):
            continue  # the other union member's error says more
        dotted = ".".join(str(p) for p in loc) or "(top level)"
        line = None
        probe = loc
        while probe and line is None:
            line = lines.get(probe)
            probe = probe[:-1]
        where = f"{source}:{line}" if line else source
        if e["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.6)
                if close:
                    hint = f" (did you mean '{close[0]}'?)"
                else:
                    hint = f" (known keys: {', '.join(parent.model_fields)})"
            problems.append(f"{where}: {dotted}: unknown key{hint}")
        else:
            got = e.get("input")
            got_s = "" if isinstance(got, (dict, list)) else f", got {got!r}"
            msg = e["msg"]
            if msg.startswith("Value error, "):
                msg = msg[len("Value error, "):]
            problems.append(f"{where}: {dotted}: {msg}{got_s}")
    return problems


def parse_config(text: str, source: str = "<config>", base_dir: Optional[Path] = None) -> Config:
    """Validate YAML text. Raises ConfigError with one line per problem."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}" if mark else source
        raise ConfigError([f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{source}: expected a mapping of settings at the top level, got {type(data).__name__}"])
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source, _line_index(text))) from None
    if base_dir is not None:
        cfg = resolve_paths(cfg, base_dir)
    return cfg


def load_config(path: Union[str, os.PathLike], run_dir: Optional[str] = None) -> Config:
    """Read, validate and resolve a config file. `run_dir` (from --run-dir) overrides the file's."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError([f"{p}: no such config file"]) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read config: {exc}"]) from None
    cfg = parse_config(text, str(p), p.resolve().parent)
    if run_dir is not None:
        cfg.run_dir = str(Path(run_dir).expanduser().resolve())
    cfg._source = p.resolve()
    return cfg


def _resolve(base: Path, value: Optional[str]) -> Optional[str]:
    if value is None:
        return None
    p = Path(value).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def resolve_paths(cfg: Config, base: Path) -> Config:
    cfg.run_dir = _resolve(base, cfg.run_dir)
    cfg.data.train = _resolve(base, cfg.data.train)
    cfg.data.eval = _resolve(base, cfg.data.eval)
    cfg.control.socket = _resolve(base, cfg.control.socket)
    cfg.worker.cwd = _resolve(base, cfg.worker.cwd) or str(base)
    if cfg.model.name_or_path and (base / cfg.model.name_or_path).exists():
        cfg.model.name_or_path = _resolve(base, cfg.model.name_or_path)
    return cfg


def dump_config(cfg: Config) -> str:
    """The effective config as YAML (what `config.yaml` in the run dir holds)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def fingerprint(cfg: Config) -> dict[str, Any]:
    """Settings that must match for a checkpoint to be resumed bit for bit."""
    d = cfg.model_dump(mode="json")
    return {k: d[k] for k in ("model", "lora", "train")} | {"data": {k: d["data"][k] for k in ("max_length", "truncation")}}


# --------------------------------------------------------------------------------------------
# Reference documentation, generated from the schema


def _type_name(ann) -> str:
    import typing

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is Union:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann.__name__.removesuffix("Cfg").lower() if ann is not EvalPrompt else "{prompt, reference}"
    return getattr(ann, "__name__", str(ann))


def reference_rows(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every leaf setting, in schema order."""
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) else None
        if sub is not None:
            rows.extend(reference_rows(sub, key + "."))
            continue
        if f.is_required():
            default_s = "required"
        else:
            default = f.default_factory() if f.default_factory is not None else f.default
            default_s = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((key, _type_name(f.annotation), default_s, f.description or ""))
    return rows


def reference_markdown() -> str:
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, typ, default, doc in reference_rows():
        out.append(f"| `{key}` | {typ} | `{default}` | {doc} |")
    out += [f"| `{k}` | {t} | `{d}` | {doc} |" for k, t, d, doc in reference_rows(FaultCfg, "faults[].")]
    return "\n".join(out) + "\n"


def reference_text(width: int = 100) -> str:
    """A compact plain-text reference for `--help`."""
    lines = []
    for key, typ, default, doc in reference_rows():
        lines.append(f"  {key} = {default}  ({typ})")
        lines.append(f"      {doc}")
    return "\n".join(lines)
