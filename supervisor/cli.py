"""`hangwatch`: run the supervisor, and talk to a running one.

    hangwatch run CONFIG [--run-dir DIR]          the supervisor, in the foreground
    hangwatch validate-config CONFIG              OK and a summary, or the problems (exit 78)
    hangwatch status [--json] [--watch]           (every client command: --run-dir DIR or --socket PATH)
    hangwatch top                                 live view
    hangwatch restart [--now] | stop | pause | resume
    hangwatch dump                                fresh stacks of every rank
    hangwatch logs [-f] [--supervisor]            the current attempt's worker log, across restarts
    hangwatch incidents [ID]
    hangwatch submit FILE… [--priority N]         check data files, publish the good ones into the inbox
    hangwatch bench [ARGS]                        the benchmark of a source checkout

Errors are one line on stderr, `hangwatch: ...`, and a non-zero exit: 64 usage, 69 no daemon
reachable, 1 the daemon refused the request, 78 bad config, 65 `submit` rejected a file; `run`
exits with the supervisor's code.  The commands that only talk to a daemon live in cli_client.py.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import click

from hangwatch.common.config import ConfigError, load_checked, load_config, reference_text
from hangwatch.common.exitcodes import EX_CANTCREAT, EX_USAGE, EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from hangwatch.common.rundir import CONFIG_NAME
from hangwatch.supervisor import cli_client
from hangwatch.supervisor.cli_client import client_for, daemon_options, fail
from hangwatch.supervisor.client import ClientError
from hangwatch.supervisor.summary import config_summary, finished_hint, run_summary

REPO = Path(__file__).resolve().parents[1]  # the checkout hangwatch runs from (an editable install)
INTERRUPTED = 130  # the shell's code for death by SIGINT


class _Group(click.Group):
    """Turns the errors a user can act on into one line and an exit code, never a traceback.
    Usage errors exit 64 (EX_USAGE), like the ones the client raises, not click's 2."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            exc.exit_code = EX_USAGE
            raise

    def invoke(self, ctx: click.Context) -> Any:
        from hangwatch.supervisor.logfollow import NoLogYet

        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.exit_code = EX_USAGE
            raise
        except ClientError as exc:
            fail(str(exc), exc.exit_code)
        except NoLogYet as exc:
            fail(str(exc), EXIT_FAILED)
        except KeyboardInterrupt:
            ctx.exit(INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """hangwatch: a LoRA fine-tuning daemon and the watchdog that keeps it alive.

    `hangwatch run CONFIG` starts the supervisor; the other commands talk to a running one through its
    control socket, found with --run-dir DIR (or $HANGWATCH_RUN_DIR) or --socket PATH (or $HANGWATCH_SOCKET).
    """


for _command in cli_client.COMMANDS:
    main.add_command(_command)


def load_or_exit(config: str, run_dir: Optional[str]):
    """The config, or its problems on stderr (the same words for every command) and exit 78."""
    try:
        return load_config(config, run_dir)
    except ConfigError as exc:
        report_config_error(exc)
        sys.exit(EXIT_CONFIG)


def check_or_exit(config: str, run_dir: Optional[str]):
    """The config checked against this machine too (data files, model, command, directories): its
    problems exit 78 before anything starts; its warnings go to stderr and the command goes on."""
    try:
        cfg, warnings = load_checked(config, run_dir)
    except ConfigError as exc:
        report_config_error(exc)
        sys.exit(EXIT_CONFIG)
    for warning in warnings:
        click.echo(f"hangwatch: warning: {warning}", err=True)
    return cfg


def report_config_error(exc: ConfigError) -> None:
    """The one place a bad config is explained: a headline, then one line per problem."""
    n = len(exc.problems)
    click.echo(f"hangwatch: invalid configuration ({n} problem{'s' if n != 1 else ''}):", err=True)
    for problem in exc.problems:
        click.echo(f"  {problem}", err=True)


@main.command(short_help="Run the supervisor in the foreground.", epilog="\b\nConfiguration keys (YAML; key = default  (type)):\n" + reference_text())
@click.argument("config")
@click.option("--run-dir", type=click.Path(file_okay=False), help="Use this run directory instead of the config's run_dir.")
def run(config: str, run_dir: Optional[str]) -> None:
    """Run the supervisor in the foreground: start the worker, watch it, restart it on a stall.

    Exits 0 when the run finished or was stopped, 78 on a bad config, non-zero when the run failed.
    The config is checked as by `validate-config` first (files, model, command): nothing starts for a
    bad one.  A run dir whose run already finished is left alone: exit 0 with how to start afresh.
    Under systemd (Type=notify) it reports READY, STATUS and WATCHDOG pings.
    """
    from hangwatch.supervisor import app

    cfg = check_or_exit(config, run_dir)  # nothing is started for a bad config
    hint = finished_hint(cfg, config)
    if hint is not None:
        say_finished(hint)
        sys.exit(EXIT_OK)
    code = app.run(cfg)
    if code not in (EXIT_CONFIG, EX_CANTCREAT):  # nothing ran: no summary of someone else's run
        for line in run_summary(cfg.run_dir, code):
            click.echo(line, err=True)
    sys.exit(code)


def say_finished(hint: list[str]) -> None:
    """The finished-run hint on stderr, and to systemd (READY then STOPPING: a clean exit, not a failed start)."""
    from hangwatch.supervisor.notify import Notifier

    for line in hint:
        click.echo(line, err=True)
    notifier = Notifier.from_env()
    notifier.ready(status=hint[0])
    notifier.stopping()
    notifier.close()


@main.command("validate-config", short_help="Check a config file (exit 78 when bad).")
@click.argument("config")
@click.option("--run-dir", type=click.Path(file_okay=False), help="As for `run`: override the config's run_dir.")
def validate_config(config: str, run_dir: Optional[str]) -> None:
    """Check a config file: print OK and what it will do, or every problem (exit 78).

    Beyond each key's type and range: settings that contradict each other, duplicate keys, and what
    the config names on this machine (data files and their first lines, the model, worker.cwd and
    worker.command, the run and socket directories).  Likely mistakes are warnings on stderr."""
    cfg = check_or_exit(config, run_dir)
    click.echo(f"OK: {config}")
    for label, text in config_summary(cfg):
        click.echo(f"  {label:<10} {text}")


@main.command(short_help="Check data files and publish the good ones into the inbox.")
@daemon_options
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--config", "config_path",
              help="The run's config (default: the run dir's config.yaml, the config as run).")
@click.option("--priority", type=click.IntRange(0, 99), default=None,
              help="0-99: files of higher priority are trained first (default 0).")
def submit(run_dir, socket_path, timeout, files, config_path, priority) -> None:
    """Check FILE… as the worker will (JSON, fields, lengths, label masks, with the run's tokenizer)
    and publish each good one into <run_dir>/inbox/ (copied, then renamed into place, so the worker
    never sees half a file).  Prints `accepted NAME (N examples)` or `rejected NAME: why` per file;
    a rejected file is not published, and the exit code is then 65.
    """
    if config_path is None:
        if run_dir is None and socket_path is not None:
            run_dir = client_for(run_dir, socket_path, timeout).call("status").get("run_dir")
        if run_dir is None:
            fail("submit needs --run-dir DIR (or $HANGWATCH_RUN_DIR), --socket PATH or --config CONFIG", EX_USAGE)
        config_path = str(Path(run_dir) / CONFIG_NAME)
        if not Path(config_path).is_file():
            fail(f"{run_dir}: no config.yaml (has the run been started there?); pass --config CONFIG", EXIT_CONFIG)
    cfg = load_or_exit(config_path, run_dir)
    if not cfg.data.inbox:
        fail(f"{config_path}: data.inbox is false: the run at {cfg.run_dir} does not take files from an inbox", EXIT_CONFIG)
    # Validation needs the run's tokenizer, hence transformers and torch: it runs in a worker-side
    # process (hangwatch.daemon.submit) so that the supervisor itself never imports them.
    argv = [sys.executable, "-m", "hangwatch.daemon.submit", "--config", config_path]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if priority is not None:
        argv += ["--priority", str(priority)]
    done = subprocess.run([*argv, "--", *files], capture_output=True, text=True)
    click.echo(done.stdout, nl=False)
    click.echo(done.stderr, nl=False, err=True)
    sys.exit(done.returncode)


@main.command(short_help="Benchmark hangwatch on this machine (scripts/bench).",
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args) -> None:
    """Run the benchmark (`scripts/bench` of the checkout hangwatch runs from) with ARGS, e.g. --quick
    (`hangwatch bench --help` is the benchmark's own help).

    It writes bench-results.json and bench-results.md and prints the table."""
    package = REPO / "scripts" / "bench"
    if not (package / "__main__.py").is_file():
        fail(f"no benchmark at {package}: `hangwatch bench` needs a source checkout (pip install -e .)", EXIT_FAILED)
    sys.exit(subprocess.call([sys.executable, str(package), *args]))


if __name__ == "__main__":
    main(prog_name="hangwatch")
