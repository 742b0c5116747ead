"""Automatic instrumentation of an unedited Python training script (`worker.instrument: auto`).

The supervisor starts the worker's command with hangwatch's bootstrap directory first on PYTHONPATH
(`common.instrumentation.instrument_env`); the bootstrap's `sitecustomize` (boot/sitecustomize.py) calls
`install()` in every Python process of the tree before the script's first line.  `install()`:

  * decides whether this process is a rank (process_roles.py): the worker's top Python process and each launcher's
    rank are; launchers, multiprocessing helpers and Python descendants of a process that already claimed the
    same rank are not, and only get a stack-dump handler of their own (`stack-rank<R>-pid<PID>.txt`);
  * in a rank: opens the rank's heartbeat (`Heartbeat.shared()`: the one the callbacks use too), beats `start`
    at once (phase `load`, step HANGWATCH_RESUME_STEP, `instrumented: "auto"`) with the SIGUSR1 stack dump
    installed — DataLoader workers forked later included — and arranges, through post-import hooks
    (imports.py), that the moment torch, safetensors, transformers, peft or Lightning is imported their
    functions are wrapped:
        steps.py       a `step` beat per optimizer step (lr, loss when it can be had without a device sync)
        phases.py      `eval` while the trained model is in eval mode, `generate` around `generate()`
        saves.py       `checkpoint` around the outermost save (torch, safetensors, save_pretrained, accelerate,
                       Fabric), then a `checkpoint` beat with its path
        frameworks.py  a HangwatchCallback in every HF / Lightning Trainer, the last good checkpoint resumed
        oom_batch.py   after an OOM, the framework's per-device batch halved and its accumulation doubled
        trackers/      (daemon/trackers/hooks.py) W&B, MLflow, TensorBoard: every attempt joins the first attempt's
                       tracker run, and a step an earlier attempt logged is not logged again
  * beats `stop` (reason `exit`, the interpreter's exit code) as the interpreter exits normally (exits.py): the
    supervisor judges the exit by the process's own status, and a signal after that line — a crash in native
    teardown after the work was done — is not taken for a failed run.

Nothing is imported from the ML stack here: the hooks touch torch only once the script has imported it.  Every
hook contains its own errors (context.py): the first one is a `warn` beat, then that hook is off; the
script's own exceptions pass through untouched.  Outside hangwatch (no HANGWATCH_RUN_DIR, or
HANGWATCH_INSTRUMENT other than "auto") `install()` does nothing at all.

Standard library only.
"""

from __future__ import annotations

import os
from typing import Mapping, MutableMapping, Optional, Sequence

from hangwatch.common.instrumentation import ENV_INSTRUMENT, ENV_RESUME_STEP
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_RUN_DIR
from hangwatch.common.rundir import dump_path_for, forked_dump_path
from hangwatch.daemon.autoinstrument import process_roles
from hangwatch.daemon.autoinstrument.context import Context
from hangwatch.daemon.autoinstrument.exits import ExitLine
from hangwatch.daemon.autoinstrument.frameworks import Frameworks
from hangwatch.daemon.autoinstrument.imports import PostImportHooks
from hangwatch.daemon.autoinstrument.loads import Loads
from hangwatch.daemon.autoinstrument.phases import EvalPhase, GeneratePhase
from hangwatch.daemon.autoinstrument.saves import Saves
from hangwatch.daemon.autoinstrument.steps import StepCounter
from hangwatch.daemon.heartbeat import Heartbeat, install_dump_handler, target_from_env
from hangwatch.daemon.trackers.hooks import TrackerHooks

COMMAND_CHARS = 300  # of the command line, in the start beat


class _Installed:
    """What `install()` did in this process (one per process)."""

    def __init__(self):
        self.done = False
        self.role: Optional[process_roles.Role] = None
        self.context: Optional[Context] = None
        self.hooks: Optional[PostImportHooks] = None
        self.dump_file = None  # a non-rank's dump file: faulthandler writes to its descriptor, keep it open


_installed = _Installed()


def enabled(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether the environment asks for automatic instrumentation (hangwatch runs the command, `auto`)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_INSTRUMENT) == "auto" and bool(env.get(ENV_RUN_DIR))


def install(
    environ: Optional[MutableMapping[str, str]] = None, argv: Optional[Sequence[str]] = None
) -> Optional[Context]:
    """Instrument this process (see the module docstring); the rank's Context, or None when this process is no
    rank or hangwatch does not run it.  Once per process: a second call returns the first one's answer.
    `environ` (default os.environ) receives the rank claim its children inherit; `argv`: the interpreter's
    command line (default: this process's own)."""
    if _installed.done:
        return _installed.context
    env = os.environ if environ is None else environ
    if not enabled(env):
        return None
    _installed.done = True
    command = list(process_roles.command_line() if argv is None else argv)
    directory, _, _ = target_from_env(env)
    role = process_roles.decide(env, command, str(directory), os.getpid())
    _installed.role = role
    if role.kind == process_roles.OWN:
        return None
    if role.kind == process_roles.LAUNCHER:
        process_roles.release_claim(env)  # the ranks it starts are judged afresh
    if role.kind != process_roles.RANK:
        _installed.dump_file = _dumps_only(str(directory), role.rank, helper=role.kind == process_roles.HELPER)
        return None
    _installed.context = ctx = _instrument_rank(env, command, str(directory), role.rank)
    return ctx


def installed() -> Optional[Context]:
    """This process's Context when it is an instrumented rank, else None."""
    return _installed.context


def role() -> Optional[process_roles.Role]:
    """The role `install()` found for this process (None before it ran or outside hangwatch)."""
    return _installed.role


def resume_step(environ: Mapping[str, str]) -> int:
    """HANGWATCH_RESUME_STEP as an int: the step the attempt's checkpoint was taken at ("" or unreadable: 0)."""
    try:
        return max(0, int(environ.get(ENV_RESUME_STEP) or 0))
    except ValueError:
        return 0


def attempt_number(environ: Mapping[str, str]) -> int:
    """HANGWATCH_ATTEMPT as an int (1-based; absent or unreadable: 1)."""
    try:
        return max(1, int(environ.get(ENV_ATTEMPT) or 1))
    except ValueError:
        return 1


def _dumps_only(directory: str, rank: int, helper: bool = False):
    """A dump file of this process's own, named after its rank's like a DataLoader worker's.  A helper works for the
    rank: the processes it starts in turn (a forkserver's forks are the rank's DataLoader workers) get files named
    after the rank's too, where the supervisor looks for its workers' dumps."""
    os.makedirs(directory, exist_ok=True)
    rank_dump = dump_path_for(directory, rank)
    return install_dump_handler(forked_dump_path(rank_dump, os.getpid()), children_of=rank_dump if helper else None)


def _instrument_rank(env: MutableMapping[str, str], command: Sequence[str], directory: str, rank: int) -> Context:
    hb_env = dict(env)
    hb_env["RANK"] = str(rank)  # LOCAL_RANK alone (Lightning's launcher): the heartbeat is named after it too
    hb = Heartbeat.shared(hb_env)
    step = resume_step(env)
    hb.current_step = step
    hb.current_phase = "load"  # importing, loading the model: one long call that cannot beat, until the first step
    ctx = Context(hb, rank, step, env)
    hb._start(instrumented="auto", command=" ".join(command)[:COMMAND_CHARS])
    process_roles.claim(env, rank, os.getpid(), directory)
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=ctx.forked)
    try:
        ExitLine(ctx).install()
    except Exception as exc:
        ctx.failed(ctx.hook("exit"), exc)

    def patch_failed(name: str, callback, exc: BaseException) -> None:
        ctx.failed(ctx.hook("patching " + name), exc)

    steps = StepCounter(ctx)
    steps.loads = loads = Loads(ctx)
    try:
        loads.install_open()
    except Exception as exc:
        ctx.failed(loads.hook, exc)

    def hold_claim() -> None:  # this process trains: the Python processes it starts from now on work for it
        process_roles.claim(env, rank, os.getpid(), directory, held=True)
        steps.on_step.remove(hold_claim)

    steps.on_step.append(hold_claim)
    evals = EvalPhase(ctx, steps)
    generate = GeneratePhase(ctx)
    saves = Saves(ctx)
    frameworks = Frameworks(ctx, saves)
    hooks = _installed.hooks = PostImportHooks(on_error=patch_failed)
    for name, callback in (
        ("torch.optim.optimizer", steps.patch_optimizer_module),
        ("torch.autograd", steps.patch_autograd),
        ("torch.amp.grad_scaler", steps.patch_grad_scaler),
        ("torch.cuda.amp.grad_scaler", steps.patch_grad_scaler),  # torch < 2.3: its own GradScaler
        ("torch.nn.modules.module", evals.patch),
        ("torch.serialization", saves.patch_torch_save),
        ("torch.serialization", loads.patch_torch_load),
        ("safetensors.torch", saves.patch_safetensors),
        ("safetensors.torch", loads.patch_safetensors),
        ("safetensors", loads.patch_safe_open),
        ("transformers.modeling_utils", saves.patch_modeling_utils),
        ("transformers.generation.utils", generate.patch),
        ("transformers.trainer", frameworks.patch_hf_trainer),
        ("peft.peft_model", saves.patch_peft),
        ("accelerate.accelerator", saves.patch_accelerate),
        ("lightning.fabric.fabric", saves.patch_fabric),
        ("lightning.pytorch.trainer.trainer", frameworks.patch_lightning_trainer),
        ("pytorch_lightning.trainer.trainer", frameworks.patch_lightning_trainer),
    ):
        hooks.register(name, callback)
    try:  # W&B, MLflow, TensorBoard: every attempt joins the first attempt's run, no step logged twice
        trackers = TrackerHooks(
            str(ctx.run_dir), rank, attempt_number(env), lambda name, exc: ctx.failed(ctx.hook("tracker " + name), exc)
        )
        trackers.install(hooks)
    except Exception as exc:
        ctx.failed(ctx.hook("tracker hooks"), exc)
    return ctx


__all__ = ["install", "installed", "role", "enabled", "resume_step", "Context"]

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("heartbeat", "integrations", "trackers")
