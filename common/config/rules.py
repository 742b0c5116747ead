"""Rules across settings: pure functions of a validated Config, no filesystem.

A pydantic record checks one value; these check values against each other.  Two tiers:

    errors(cfg)   settings that contradict each other or cannot do what they say (the config is refused)
    advice(cfg)   legal settings that are very likely a mistake (said as a warning; the run goes ahead)

Each finding is `(key path, message)`; the loader turns the path into `FILE:LINE: dotted.key`.  Rules
about the training worker's own settings (eval, faults, checkpoints) apply only to the built-in worker:
a `worker.command` of one's own reads what it likes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

from hangwatch.common.config.schema import Config

Finding = tuple[tuple, str]  # (key path, e.g. ("restart", "backoff_initial_s"); what is wrong)
Rule = Callable[[Config], Iterator[Finding]]


def builtin_worker(cfg: Config) -> bool:
    return cfg.worker.command is None


# ---- errors ----------------------------------------------------------------------------------


def _not_above(loc: tuple, low: float, high_key: str, high: float, why: str) -> Iterator[Finding]:
    if low > high:
        yield loc, f"{low:g} exceeds {high_key} ({high:g}): {why}"


def backoff_order(cfg: Config) -> Iterator[Finding]:
    r = cfg.restart
    yield from _not_above(
        ("restart", "backoff_initial_s"),
        r.backoff_initial_s,
        "restart.backoff_max_s",
        r.backoff_max_s,
        "the first backoff delay cannot be larger than the cap it doubles towards",
    )


def step_clamp_order(cfg: Config) -> Iterator[Finding]:
    w = cfg.watchdog
    yield from _not_above(
        ("watchdog", "step_timeout_min_s"),
        w.step_timeout_min_s,
        "watchdog.step_timeout_max_s",
        w.step_timeout_max_s,
        "the calibrated step deadline is clamped between the two",
    )


def eval_has_something_to_do(cfg: Config) -> Iterator[Finding]:
    # An eval is the held-out loss (data.eval) and the generations (eval.prompts); with neither it
    # would stop training every N steps to record nothing.
    if builtin_worker(cfg) and cfg.eval.every_steps and not cfg.data.eval and not cfg.eval.prompts:
        yield (
            ("eval", "every_steps"),
            f"{cfg.eval.every_steps} evaluates every {cfg.eval.every_steps} steps, but there is nothing to "
            "evaluate: set data.eval (held-out loss) and/or eval.prompts (generations), or eval.every_steps: 0",
        )


GENERATE_FAULTS = ("hang_generate", "runaway_generate")  # they act on the built-in worker's eval generate()


def faults_can_fire(cfg: Config) -> Iterator[Finding]:
    # A fault that can never fire makes a test or a demo pass for the wrong reason.
    if not builtin_worker(cfg):
        return
    for i, f in enumerate(cfg.faults):
        waits_for_eval = f.kind in GENERATE_FAULTS or f.at_eval is not None
        if waits_for_eval and not cfg.eval.every_steps:
            yield (
                ("faults", i, "at_eval" if f.at_eval is not None else "kind"),
                f"{f.kind} waits for an eval, but eval.every_steps is 0: it would never fire",
            )
        elif f.kind in GENERATE_FAULTS and not cfg.eval.prompts:
            yield (
                ("faults", i, "kind"),
                f"{f.kind} acts on eval's generate(), which runs only for eval.prompts, "
                "and there are none: it would never fire",
            )
        if f.at_step is not None and f.at_step > cfg.train.max_steps:
            yield (
                ("faults", i, "at_step"),
                f"{f.at_step} is past train.max_steps ({cfg.train.max_steps}): it would never fire",
            )
        if f.at_eval is not None and cfg.eval.every_steps and f.at_eval * cfg.eval.every_steps > cfg.train.max_steps:
            yield (
                ("faults", i, "at_eval"),
                f"eval {f.at_eval} would come at step {f.at_eval * cfg.eval.every_steps}, past train.max_steps "
                f"({cfg.train.max_steps}): it would never fire",
            )


def ranks_fit(cfg: Config) -> Iterator[Finding]:
    # Several ranks of the built-in worker: a fault aimed at a rank that does not exist never fires;
    # generate() runs on rank 0 only; continuous mode trains on one process.
    if not builtin_worker(cfg):
        return
    n = cfg.worker.nproc_per_node * cfg.worker.nnodes
    for i, f in enumerate(cfg.faults):
        if f.rank >= n:
            size = (
                f"worker.nproc_per_node {cfg.worker.nproc_per_node} × worker.nnodes {cfg.worker.nnodes}"
                if cfg.worker.nnodes > 1
                else f"worker.nproc_per_node {n}"
            )
            yield (
                ("faults", i, "rank"),
                f"{f.rank} is not a rank of this run ({size}: ranks 0-{n - 1}): it would never fire",
            )
        elif f.kind in GENERATE_FAULTS and f.rank != 0:
            yield (
                ("faults", i, "rank"),
                f"{f.rank}: {f.kind} acts on generate(), which runs on rank 0 only: it would never fire",
            )
    if n > 1 and cfg.data.inbox:
        yield (
            ("worker", "nproc_per_node"),
            f"{n}: continuous mode (data.inbox: true) trains on one process; use worker.nproc_per_node: 1",
        )


def nodes_fit(cfg: Config) -> Iterator[Finding]:
    # Several nodes meet at a rendezvous every node must name alike; what no node can do alone is refused here.
    w = cfg.worker
    if w.nnodes <= 1:
        return
    if not w.rdzv_endpoint:
        yield (
            ("worker", "rdzv_endpoint"),
            f"required when worker.nnodes is {w.nnodes}: host:port of the rendezvous "
            "store, the same on every node (e.g. 10.0.0.1:29400)",
        )
    if cfg.data.inbox:
        yield (
            ("worker", "nnodes"),
            f"{w.nnodes}: continuous mode (data.inbox: true) trains on one process; use worker.nnodes: 1",
        )
    if w.command and not torchrun_command(w.command) and not python_command(w.command):
        yield (
            ("worker", "command"),
            f"{w.command[0]!r}: with worker.nnodes {w.nnodes} hangwatch launches torchrun itself; "
            "give the script as [python, train.py, …] (or a torchrun command line, whose rendezvous options hangwatch "
            "sets)",
        )


def resume_args_need_a_command(cfg: Config) -> Iterator[Finding]:
    # The built-in worker resumes from HANGWATCH_RESUME_FROM by itself; arguments would be appended to nothing.
    if builtin_worker(cfg) and cfg.worker.resume_args:
        yield (
            ("worker", "resume_args"),
            "appended to worker.command, which is null (the built-in worker, which resumes "
            "by itself): set worker.command or drop worker.resume_args",
        )


def torchrun_command(argv: list) -> bool:
    """`torchrun …` or `python -m torch.distributed.run …`."""
    return bool(argv) and (Path(argv[0]).name == "torchrun" or argv[1:3] == ["-m", "torch.distributed.run"])


def python_command(argv: list) -> bool:
    return bool(argv) and Path(argv[0]).name.startswith("python")


ERROR_RULES: tuple[Rule, ...] = (
    backoff_order,
    step_clamp_order,
    eval_has_something_to_do,
    faults_can_fire,
    ranks_fit,
    nodes_fit,
    resume_args_need_a_command,
)


# ---- advice ----------------------------------------------------------------------------------


def unused_eval_settings(cfg: Config) -> Iterator[Finding]:
    if not builtin_worker(cfg):
        return
    e = cfg.eval
    if not e.every_steps and e.prompts:
        yield (("eval", "prompts"), "never generated: eval.every_steps is 0 (no eval runs)")
    if not e.every_steps and cfg.data.eval:
        yield (("data", "eval"), "never read: eval.every_steps is 0 (no eval runs)")
    if e.every_steps > cfg.train.max_steps:
        yield (
            ("eval", "every_steps"),
            f"{e.every_steps} is more than train.max_steps ({cfg.train.max_steps}): no eval will run",
        )


def checkpoints_confirm_before_the_end(cfg: Config) -> Iterator[Finding]:
    # The first checkpoint counts as good only `confirm_steps` finite steps after it is written;
    # until then a crash restarts the run from step 0.
    if not builtin_worker(cfg):
        return
    c, t = cfg.checkpoint, cfg.train
    first_good = c.every_steps + c.confirm_steps
    if first_good >= t.max_steps:
        yield (
            ("checkpoint", "every_steps"),
            f"the first checkpoint (step {c.every_steps}, good {c.confirm_steps} steps later) is not good "
            f"before train.max_steps ({t.max_steps}): a crash before the end restarts the run from step 0",
        )


def warmup_within_run(cfg: Config) -> Iterator[Finding]:
    t = cfg.train
    if builtin_worker(cfg) and t.warmup_steps >= t.max_steps:
        yield (
            ("train", "warmup_steps"),
            f"{t.warmup_steps} is not less than train.max_steps ({t.max_steps}): the learning rate never "
            f"reaches train.lr ({t.lr:g})",
        )


def nodes_share_checkpoints(cfg: Config) -> Iterator[Finding]:
    # torchrun's rendezvous may place global rank 0 (the checkpoint writer) on another node after a restart
    if cfg.worker.nnodes > 1 and not cfg.checkpoint.dir:
        yield (
            ("checkpoint", "dir"),
            f"not set with worker.nnodes {cfg.worker.nnodes}: each node keeps checkpoints in "
            "its own run dir, and rank 0 may run on another node after a restart; point every node at one "
            "directory they all see",
        )


ADVICE_RULES: tuple[Rule, ...] = (
    unused_eval_settings,
    checkpoints_confirm_before_the_end,
    warmup_within_run,
    nodes_share_checkpoints,
)


def errors(cfg: Config) -> list[Finding]:
    """Every contradiction between settings (each makes the config unusable)."""
    return [finding for rule in ERROR_RULES for finding in rule(cfg)]


def advice(cfg: Config) -> list[Finding]:
    """Settings that are legal but very likely not what was meant."""
    return [finding for rule in ADVICE_RULES for finding in rule(cfg)]
