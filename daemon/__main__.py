"""`python -m hangwatch.daemon --config CONFIG [--run-dir DIR]`: the training worker the supervisor watches.

Order of business, so that the `start` heartbeat comes before the slow imports: read the config
(pydantic and yaml only), choose the checkpoint to resume from (standard library only), beat
`start`, enter `load` and only then import torch, transformers and peft.

With `data.inbox: true` the worker trains continuously on files dropped into `<run_dir>/inbox/`
(`hangwatch.daemon.inbox`); after `data.flush_after_s` with no file coming it trains what it has as a
partial step and checkpoints it, and with `data.idle_exit_s` set it ends, reason `idle`, once no file
came for that long.

Exit codes (DESIGN.md): 0 finished, idle or terminated on request · 78 bad config · 65 no usable data ·
75 non-finite streak · 1 any other failure.  Every failure but a hard kill leaves last words in
attempts/NNNN/exit.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Optional

from hangwatch.common.config import ConfigError, dump_config, load_config
from hangwatch.common.durable import write_atomic
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_OK
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_RUN_DIR
from hangwatch.common.rundir import CONFIG_NAME, next_attempt
from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.data import ContinuousDataSource
from hangwatch.daemon.errors import DataError
from hangwatch.daemon.heartbeat import Heartbeat
from hangwatch.daemon.lastwords import last_words_for, write_last_words
from hangwatch.daemon.resume_compat import check_resume_compatible
from hangwatch.daemon.signals import StopRequest

MAX_PROBLEMS_IN_BEAT = 10


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m hangwatch.daemon", description="hangwatch training worker (LoRA fine-tuning).")
    p.add_argument("--config", required=True, help="YAML config (see `hangwatch --help` for every key)")
    p.add_argument("--run-dir", default=None, help="run directory (overrides run_dir in the config)")
    return p.parse_args(argv)


def _quiet_libraries() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download: local files or the hub cache only
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="peft")


def load_data(cfg, tokenizer, hb, stop):
    """(train source, eval examples); problems are reported, no usable training data raises DataError.

    Continuous mode: the source is the inbox (`daemon.inbox.feed.InboxFeed`, to be closed after use)."""
    from hangwatch.daemon.data import ShuffledEpochs, validate_file

    if cfg.data.inbox:
        from hangwatch.daemon.inbox.feed import open_feed

        source = open_feed(cfg, tokenizer, hb, stop)
    elif cfg.data.train is None:
        raise DataError("data.train is not set: this worker trains from a file (or set data.inbox: true)")
    else:
        examples, problems = validate_file(cfg.data.train, tokenizer, cfg)
        _report(hb, "training data", cfg.data.train, examples, problems)
        if not examples:
            raise DataError(f"{cfg.data.train}: no usable training example ({len(problems)} problem(s))", problems)
        source = ShuffledEpochs(examples, cfg.train.seed)
    eval_examples = []
    if cfg.data.eval:
        eval_examples, eval_problems = validate_file(cfg.data.eval, tokenizer, cfg)
        _report(hb, "eval data", cfg.data.eval, eval_examples, eval_problems)
    return source, eval_examples


def _report(hb, what, path, examples, problems) -> None:
    truncated = sum(1 for e in examples if e.truncated)
    print(f"{what}: {path}: {len(examples)} usable example(s), {truncated} truncated, {len(problems)} problem(s)", flush=True)
    for p in problems:
        print(f"  {p}", flush=True)
    if problems:
        hb.warn(f"{what}: {len(problems)} unusable line(s) in {path}", file=str(path), count=len(problems),
                problems=[str(p) for p in problems[:MAX_PROBLEMS_IN_BEAT]])


def run(cfg, hb, choice, stop, faults) -> str:
    """Load everything, then train; returns the stop reason."""
    hb.enter_phase("load")
    _quiet_libraries()
    import torch

    from hangwatch.daemon.faults import FaultPlan
    from hangwatch.daemon.model import load_model
    from hangwatch.daemon.trainer.loop import Trainer

    plan = FaultPlan(faults, cfg.run_dir, hb, attempt=hb.attempt)
    for f in faults:
        if (f.at_eval is not None or f.kind == "hang_generate") and not cfg.eval.every_steps:
            hb.warn(f"fault {f.kind} waits for an eval, but eval.every_steps is 0: it will never fire", fault=f.kind)
    if cfg.model.device != "cpu" and torch.cuda.is_available():
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    if cfg.model.name_or_path is None and cfg.model.device != "cuda" and not torch.cuda.is_available():
        # The tiny model's ops are too small to gain from threads, and a fixed thread count keeps
        # CPU reductions bit-identical between attempts even if the machine's core count changes.
        torch.set_num_threads(1)
    bundle = load_model(cfg)
    source, eval_examples = load_data(cfg, bundle.tokenizer, hb, stop)
    try:
        trainer = Trainer(cfg, hb, cfg.run_dir, bundle, source, eval_examples, plan, stop, attempt=hb.attempt)
        if choice.path is not None:
            trainer.restore(choice.path)
            print(f"resumed from {choice.path} at step {trainer.step}", flush=True)
        else:
            trainer.seed_fresh()
        for s in choice.skipped:
            print(f"skipped checkpoint {s['path']}: {s['reason']}", flush=True)
        return trainer.run()
    finally:
        if isinstance(source, ContinuousDataSource):
            source.close()  # the inbox's watcher thread


def main(argv: Optional[list[str]] = None, environ: Optional[dict] = None) -> int:
    args = parse_args(argv)
    env = os.environ if environ is None else environ
    run_dir_arg = args.run_dir or env.get(ENV_RUN_DIR)
    try:
        cfg = load_config(args.config, run_dir=run_dir_arg)
    except ConfigError as exc:
        _config_failure(exc, run_dir_arg, env)
        return EXIT_CONFIG
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / CONFIG_NAME).exists():
        write_atomic(run_dir / CONFIG_NAME, dump_config(cfg))
    hb = Heartbeat.from_env(run_dir, environ=env)
    stop = StopRequest().install()
    try:
        from hangwatch.daemon.faults import faults_from

        faults = faults_from(cfg, env)  # a bad HANGWATCH_FAULTS is a config error, reported before anything starts
        choice = ckpt.choose_resume(run_dir)
        if choice.path is not None:
            check_resume_compatible(cfg, choice.path)
        hb.current_step = choice.step
        hb.start(resumed_from=str(choice.path) if choice.path else None, skipped_checkpoints=choice.skipped,
                 resumed_step=choice.step)
        reason = run(cfg, hb, choice, stop, faults)
        hb.stop(reason)
        return EXIT_OK
    except Exception as exc:  # last words for everything; signals and os._exit never get here
        kind, code, path = last_words_for(exc, run_dir, hb.attempt, step=hb.current_step, phase=hb.current_phase)
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


def _print_problems(exc: ConfigError) -> None:
    print("configuration error:", file=sys.stderr)
    for line in exc.problems:
        print(f"  {line}", file=sys.stderr)


def _config_failure(exc: ConfigError, run_dir: Optional[str], env) -> None:
    """A config that does not load: said on stderr, and as last words when the run dir is known."""
    _print_problems(exc)
    if run_dir:
        attempt = int(env[ENV_ATTEMPT]) if env.get(ENV_ATTEMPT) else next_attempt(run_dir)
        write_last_words(run_dir, attempt, "config_error", str(exc), None, problems=exc.problems, exit_code=EXIT_CONFIG)


if __name__ == "__main__":
    sys.exit(main())
