"""`python -m hangwatch.daemon --config CONFIG [--run-dir DIR]`: the training worker the supervisor watches.

Order of business, so that the `start` heartbeat comes before the slow imports: read the config
(pydantic and yaml only), choose the checkpoint to resume from (standard library only), beat
`start`, enter `load` and only then import torch, transformers and peft.

With `data.inbox: true` the worker trains continuously on files dropped into `<run_dir>/inbox/`
(`hangwatch.daemon.inbox`); after `data.flush_after_s` with no file coming it trains what it has as a
partial step and checkpoints it, and with `data.idle_exit_s` set it ends, reason `idle`, once no file
came for that long.

Under torchrun (`worker.nproc_per_node` > 1: `python -m torch.distributed.run --standalone
--nproc-per-node N -m hangwatch.daemon …`, WORLD_SIZE > 1) each rank is one of these processes: it
beats into its own heartbeat file, joins the process group after `load` begins and trains its share
of every step under DDP (`hangwatch.daemon.distributed`, `trainer.ranks`).  Every rank resumes from
the checkpoint rank 0 chose; one written by another world size is refused (exit 78).  Continuous
mode runs on one rank only.

With `--standby` (`restart.prewarm`, spawned by the supervisor at a stall) the worker first loads its
model and data on the CPU and waits on stdin for the supervisor's release, which says where to resume
(`hangwatch.daemon.standby_worker`); from its `start` beat on it is the worker described here.

Self-healing: after an out-of-memory failure the supervisor writes `<run_dir>/remediation.json` and the
worker trains with its setting (a smaller micro-batch, more accumulation, then gradient checkpointing:
`trainer.remediation`), said in the start beat and the start line; the config file stays as written.
Examples quarantined after a non-finite streak (`<run_dir>/quarantine.jsonl`, `trainer.quarantine`) are
skipped by the data order.

Exit codes (docs/operations.md): 0 finished, idle or terminated on request · 78 bad config · 65 no usable data ·
75 non-finite streak · 1 any other failure.  Every failure but a hard kill leaves last words in
attempts/NNNN/exit.json (rank R > 0 of a multi-rank run: exit-rank<R>.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from hangwatch.common.config import ConfigError, dump_config, load_config
from hangwatch.common.config.rules import GENERATE_FAULTS
from hangwatch.common.durable import write_atomic
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_OK
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_RUN_DIR, rank_from_env
from hangwatch.common.rundir import CONFIG_NAME, next_attempt
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ContinuousDataSource
from hangwatch.daemon.distributed import world_size_from_env
from hangwatch.daemon.heartbeat import Heartbeat
from hangwatch.daemon.lastwords import last_words_for, write_last_words
from hangwatch.daemon.resume_compat import check_resume_compatible
from hangwatch.daemon.signals import StopRequest
from hangwatch.daemon.standby_worker import (
    STANDBY_FLAG,
    FileData,
    Preloaded,
    hold,
    prepare_torch,
    quiet_libraries,
    read_files,
)
from hangwatch.daemon.trainer import remediation
from hangwatch.daemon.trainer.ranks import effective_batch
from hangwatch.daemon.worker_errors import DataError

MAX_PROBLEMS_IN_BEAT = 10


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m hangwatch.daemon", description="hangwatch training worker (LoRA fine-tuning)."
    )
    p.add_argument("--config", required=True, help="YAML config (see `hangwatch --help` for every key)")
    p.add_argument("--run-dir", default=None, help="run directory (overrides run_dir in the config)")
    p.add_argument(
        STANDBY_FLAG,
        action="store_true",
        help="started by the supervisor as the next attempt's standby (restart.prewarm): load, then wait "
        "on stdin for the release that says where to resume",
    )
    return p.parse_args(argv)


def load_data(cfg, tokenizer, hb, stop, files: Optional[FileData] = None):
    """(train source, eval examples); problems are reported, no usable training data raises DataError.
    `files`: the data files as a standby read them before its release (read here otherwise).

    Continuous mode: the source is the inbox (`daemon.inbox.feed.InboxFeed`, to be closed after use)."""
    from hangwatch.daemon.data import ShuffledEpochs

    if not cfg.data.inbox and cfg.data.train is None:
        raise DataError("data.train is not set: this worker trains from a file (or set data.inbox: true)")
    files = files if files is not None else read_files(cfg, tokenizer)
    if cfg.data.inbox:
        from hangwatch.daemon.inbox.feed import open_feed

        source = open_feed(cfg, tokenizer, hb, stop)
    else:
        _report(hb, "training data", cfg.data.train, files.train, files.train_problems)
        if not files.train:
            raise DataError(
                f"{cfg.data.train}: no usable training example ({len(files.train_problems)} problem(s))",
                files.train_problems,
            )
        from hangwatch.daemon.trainer.quarantine import quarantined_ids

        skip = quarantined_ids(cfg.run_dir) & {e.id for e in files.train}
        if skip and hb.rank == 0:
            print(
                f"quarantine: {len(skip)} training example(s) skipped after non-finite losses: "
                f"{', '.join(sorted(skip))}",
                flush=True,
            )
        source = ShuffledEpochs(files.train, cfg.train.seed, skip=frozenset(skip))
    if cfg.data.eval:
        _report(hb, "eval data", cfg.data.eval, files.eval, files.eval_problems)
    return source, files.eval


def _report(hb, what, path, examples, problems) -> None:
    if hb.rank != 0:
        return  # every rank reads the same file: rank 0 speaks for all
    truncated = sum(1 for e in examples if e.truncated)
    print(
        f"{what}: {path}: {len(examples)} usable example(s), {truncated} truncated, {len(problems)} problem(s)",
        flush=True,
    )
    for p in problems:
        print(f"  {p}", flush=True)
    if problems:
        hb.warn(
            f"{what}: {len(problems)} unusable line(s) in {path}",
            file=str(path),
            count=len(problems),
            problems=[str(p) for p in problems[:MAX_PROBLEMS_IN_BEAT]],
        )


def check_world(cfg, world_size: int) -> None:
    """What a multi-rank run cannot do, refused before anything starts (exit 78)."""
    if world_size > 1 and cfg.data.inbox:
        raise ConfigError(
            [
                f"data.inbox: continuous mode trains on one rank only, and this worker is one of {world_size} "
                "(set worker.nproc_per_node: 1)"
            ]
        )


def agree_on_resume(cfg, world, choice):
    """Every rank resumes from the checkpoint rank 0 chose (a rank's own look may differ by a race)."""
    chosen = world.broadcast(None if choice.path is None else (str(choice.path), choice.step))
    mine = None if choice.path is None else (str(choice.path), choice.step)
    if chosen == mine:
        return choice
    if chosen is not None:
        check_resume_compatible(cfg, chosen[0], world.size)
    return ckpt.ResumeChoice(path=None if chosen is None else Path(chosen[0]), step=0 if chosen is None else chosen[1])


def _warn_faults(cfg, hb, faults, world) -> None:
    if not world.is_main:
        return  # said once, by rank 0
    for f in faults:
        if (f.at_eval is not None or f.kind in GENERATE_FAULTS) and not cfg.eval.every_steps:
            hb.warn(f"fault {f.kind} waits for an eval, but eval.every_steps is 0: it will never fire", fault=f.kind)
        if f.rank >= world.size:
            hb.warn(
                f"fault {f.kind} is for rank {f.rank}, but the run has {world.size} rank(s): it will never fire",
                fault=f.kind,
            )
        elif f.kind in GENERATE_FAULTS and f.rank != 0:
            hb.warn(f"fault {f.kind} is for rank {f.rank}, but only rank 0 generates: it will never fire", fault=f.kind)


def run(
    cfg, hb, choice, stop, faults, pre: Optional[Preloaded] = None, configured=None, remedy: Optional[dict] = None
) -> str:
    """Load everything (what a standby preloaded, `pre`, is only moved to the device), then train;
    returns the stop reason.  `cfg`: the setting to train with; `configured`: the config as written, when
    OOM remediation (`remedy`) changed it."""
    hb.enter_phase("load")
    if pre is not None:  # a released standby: what it has not loaded yet, it loads now, in this phase
        hb.progress(**pre.wait().load_fields())
    quiet_libraries()
    import torch

    from hangwatch.daemon.distributed import open_world
    from hangwatch.daemon.faults import FaultPlan
    from hangwatch.daemon.model import load_model, pick_device, prepare_for_training
    from hangwatch.daemon.trainer.loop import Trainer

    world = open_world(pick_device(cfg)[0])
    choice = agree_on_resume(cfg, world, choice)
    hb.current_step = choice.step
    # Several nodes: the record lives beside the shared checkpoints, so a fault fires once per run whichever node
    # hosts its global rank in a round (torchrun's rendezvous may hand rank R to another node after a restart).
    record_dir = cfg.checkpoint.dir if cfg.worker.nnodes > 1 and cfg.checkpoint.dir else cfg.run_dir
    plan = FaultPlan(faults, record_dir, hb, attempt=hb.attempt, rank=world.rank, shared=world.size > 1)
    _warn_faults(cfg, hb, faults, world)
    trackers = _open_trackers(cfg, configured or cfg, hb, world)  # they import and open while the model loads
    if cfg.model.device != "cpu" and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    prepare_torch(cfg)
    preloaded = pre is not None and pre.bundle is not None
    try:
        if plan.memory_probe is not None:
            plan.memory_probe.load()  # the memory_limit fault's device: the weights may not fit on it
        bundle = prepare_for_training(pre.on_device(cfg), cfg) if preloaded else load_model(cfg)
    except torch.OutOfMemoryError as exc:  # the same model onto the same device: no restart would do better
        from hangwatch.daemon.doctor.memory_estimate import loading_words
        from hangwatch.daemon.worker_errors import DoesNotFit

        raise DoesNotFit(exc, loading_words(cfg, cfg.model.device != "cpu" and torch.cuda.is_available())) from exc
    source, eval_examples = load_data(cfg, bundle.tokenizer, hb, stop, pre.files if preloaded else None)
    watch = None
    if cfg.restart.in_process and world.size == 1 and not cfg.data.inbox:
        from hangwatch.daemon.trainer.recovery import AbandonWatch

        watch = AbandonWatch(hb.path.parent, hb).start()
    reason = "failed"
    try:
        trainer = Trainer(
            cfg,
            hb,
            cfg.run_dir,
            bundle,
            source,
            eval_examples,
            plan,
            stop,
            attempt=hb.attempt,
            world=world,
            configured=configured,
            in_process=cfg.restart.in_process,
            watch=watch,
        )
        if remedy is not None:
            trainer.log(remediation.words(remedy))
        if world.size > 1:
            b = effective_batch(cfg.train.micro_batch_size, cfg.train.grad_accum, world.size)
            trainer.log(
                f"{world.size} ranks ({world.backend}): effective batch {b['effective_batch']} examples per "
                f"optimizer step = micro_batch_size {b['micro_batch_size']} × grad_accum {b['grad_accum']} "
                f"× {world.size} ranks"
            )
        if choice.path is not None:
            trainer.restore(choice.path)
            trainer.log(f"resumed from {choice.path} at step {trainer.step}")
        else:
            trainer.seed_fresh()
        for s in choice.skipped:
            trainer.log(f"skipped checkpoint {s['path']}: {s['reason']}")
        if remedy is not None and remedy.get("probe") and not cfg.data.inbox:
            _probe(trainer, hb)
        trainer.trackers = trackers
        reason = trainer.run()
        world.close()
        return reason
    finally:
        if trackers is not None:
            _close_trackers(trackers, hb, reason)
        if watch is not None:
            watch.close()
        if isinstance(source, ContinuousDataSource):
            source.close()  # the inbox's watcher thread


def _open_trackers(cfg, configured, hb, world):
    """`train.report_to` (rank 0): the trackers' runs, opened in threads of their own; a tracker's problem is said once,
    in a `warn` beat and the log, and never stops training (`trainer.trackers`).  Closed at the end of `run`, or at
    exit when loading failed."""
    if not world.is_main or not cfg.train.report_to:
        return None
    from hangwatch.daemon.trainer.trackers import TrackerLog

    def warn(message: str, **fields) -> None:
        hb.warn(message, **fields)
        print(message, flush=True)

    return TrackerLog.for_worker(cfg, configured, cfg.run_dir, hb.attempt, warn, rank=hb.rank)


TRACKERS_CLOSE_S = {"failed": 10.0}  # how long the end waits for the trackers (default 30 s): a failure is not held up


def _close_trackers(trackers, hb, reason: str) -> None:
    """The trackers' runs ended, in a phase of their own (the last step's deadline is no measure of a W&B finish or an
    MLflow store still being created)."""
    from hangwatch.daemon.trainer.trackers import CLOSE_TIMEOUT_S

    timeout_s = TRACKERS_CLOSE_S.get(reason, CLOSE_TIMEOUT_S)
    with hb.phase("trackers", budget_s=timeout_s + 15):
        trackers.close(reason, timeout_s=timeout_s)


def _probe(trainer, hb) -> None:
    """After an out-of-memory restart: the micro-batch measured before training (`Trainer.probe_micro_batch`), said in
    a `warn` line the supervisor records in remediation.json."""
    result = trainer.probe_micro_batch()
    if not trainer.world.is_main:
        return
    picked = result.get("picked")
    if picked is None:
        text = f"micro-batch not measured ({result.get('why')}): training at {result['micro_batch_size']}"
    elif picked == result["micro_batch_size"]:
        text = f"micro-batch {picked} measured to fit ({result.get('per_example_mb')} MiB per example)"
    else:
        text = (
            f"micro-batch {result['micro_batch_size']} → {picked} from a probe step: "
            f"{result.get('per_example_mb')} MiB per example above {result.get('weights_mb')} MiB, "
            f"{result.get('capacity_mb')} MiB capacity"
        )
    hb.warn(f"OOM remediation: {text}", remediation_probe=result)
    trainer.log(f"OOM remediation: {text}")


def main(argv: Optional[list[str]] = None, environ: Optional[dict] = None) -> int:
    args = parse_args(argv)
    env = os.environ if environ is None else environ
    run_dir_arg = args.run_dir or env.get(ENV_RUN_DIR)
    try:
        cfg = load_config(args.config, run_dir=run_dir_arg)
    except ConfigError as exc:
        if args.standby:  # not an attempt yet: no last words; the supervisor spawns cold, which reports it
            _print_problems(exc)
            return EXIT_CONFIG
        _config_failure(exc, run_dir_arg, env)
        return EXIT_CONFIG
    pre = None
    if args.standby:  # nothing below may happen before the release: it writes in the run dir
        pre = hold(cfg, env, sys.stdin.buffer)
        if pre is None:  # discarded: leave at once, whatever the preload thread is in the middle of
            sys.stdout.flush()
            os._exit(EXIT_OK)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / CONFIG_NAME).exists():
        write_atomic(run_dir / CONFIG_NAME, dump_config(cfg))
    hb = Heartbeat.from_env(run_dir, environ=env)
    stop = StopRequest(repeat_kills=not (_under_torchrun(env) or _in_slurm_job(env))).install()
    try:
        from hangwatch.daemon.faults import faults_from

        faults = faults_from(cfg, env)  # a bad HANGWATCH_FAULTS is a config error, reported before anything starts
        world_size = world_size_from_env(env)
        check_world(cfg, world_size)
        choice = ckpt.choose_resume(run_dir, clean=hb.rank == 0, configured=cfg.checkpoint.dir)
        if choice.path is not None:
            check_resume_compatible(cfg, choice.path, world_size)
        remedy, stale = remediation.read(run_dir, cfg)
        train_cfg = remediation.apply(cfg, remedy)
        hb.current_step = choice.step
        hb.start(
            resumed_from=str(choice.path) if choice.path else None,
            skipped_checkpoints=choice.skipped,
            resumed_step=choice.step,
            **effective_batch(train_cfg.train.micro_batch_size, train_cfg.train.grad_accum, world_size),
            **remediation.beat_fields(remedy),
            **(pre.beat_fields() if pre is not None else {}),
        )
        if stale and hb.rank == 0:
            hb.warn(stale)
        reason = run(train_cfg, hb, choice, stop, faults, pre, configured=cfg, remedy=remedy)
        hb.stop(reason)
        return EXIT_OK
    except Exception as exc:  # last words for everything; signals and os._exit never get here
        kind, code, path = last_words_for(
            exc, run_dir, hb.attempt, rank=hb.rank, step=hb.current_step, phase=hb.current_phase
        )
        if isinstance(exc, ConfigError):
            _print_problems(exc)
        else:
            traceback.print_exc()
        print(f"worker exiting with {code} ({kind}); last words in {path}", file=sys.stderr, flush=True)
        return code
    finally:
        stop.uninstall()
        hb.release_dump_handler()
        hb.close()


def _under_torchrun(env) -> bool:
    """Started by torchrun's agent (which sets TORCHELASTIC_RUN_ID for every rank it starts)."""
    return bool(env.get("TORCHELASTIC_RUN_ID"))


def _in_slurm_job(env) -> bool:
    """In a Slurm job (SLURM_JOB_ID): scancel and the time limit signal every process of the step, and srun passes
    its own SIGTERM on, besides the supervisor's: a repeated SIGTERM is routine there, not an operator's second."""
    return bool(env.get("SLURM_JOB_ID"))


def _print_problems(exc: ConfigError) -> None:
    print("configuration error:", file=sys.stderr)
    for line in exc.problems:
        print(f"  {line}", file=sys.stderr)


def _config_failure(exc: ConfigError, run_dir: Optional[str], env) -> None:
    """A config that does not load: said on stderr, and as last words when the run dir is known."""
    _print_problems(exc)
    if run_dir:
        attempt = int(env[ENV_ATTEMPT]) if env.get(ENV_ATTEMPT) else next_attempt(run_dir)
        write_last_words(
            run_dir,
            attempt,
            "config_error",
            str(exc),
            None,
            rank=rank_from_env(env),
            problems=exc.problems,
            exit_code=EXIT_CONFIG,
        )


if __name__ == "__main__":
    sys.exit(main())
