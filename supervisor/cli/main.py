"""`hangwatch`: run the supervisor, and talk to a running one.

    hangwatch run [CONFIG] -- CMD ARGS…           a command you already run, in its place (no config needed)
    hangwatch run CONFIG [--run-dir DIR]          the built-in worker a config describes, in the foreground
    hangwatch validate-config CONFIG              OK and a summary, or the problems (exit 78)
    hangwatch config-keys                         every config key: default, type, what it does
    hangwatch doctor CONFIG [--json] [--cheap]    preflight checks of the built-in worker (exit 1 on a FAIL)
    hangwatch status [--json] [--watch]           (every client command: --run-dir DIR or --socket PATH)
    hangwatch top                                 live view
    hangwatch restart [--now] | stop | pause | resume
    hangwatch dump                                fresh stacks of every rank
    hangwatch logs [-f] [--supervisor]            the current attempt's worker log, across restarts
    hangwatch incidents [ID]
    hangwatch submit FILE… [--priority N] [-v]    check data files, publish the good ones into the inbox
    hangwatch bench [ARGS]                        the benchmark of a source checkout

Errors are one line on stderr, `hangwatch: ...`, and a non-zero exit: 64 usage, 69 no daemon
reachable, 1 the daemon refused the request, 78 bad config, 65 `submit` rejected a file; `run`
exits with the command's status, or one of hangwatch's own codes (EXIT_CODES, `common.exitcodes`).
The commands that only talk to a daemon live in cli_client.py.

Each command imports what it needs when it runs: a client command (status, top, …) never loads the
config package (pydantic, yaml), the logging stack or the supervisor's loop, and what shows its answer
(rich) loads while its request is in flight, so that `hangwatch status` costs little more than the
interpreter's start; `submit` leaves the config and the tokenizer to its worker-side child (no torch
there either: daemon/light_tokenizer.py); `run` and `validate-config` load everything, and `run --help`
builds its config reference only when it is shown.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import click

from hangwatch.common.exitcodes import EX_CANTCREAT, EX_USAGE, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, RUN_CODES
from hangwatch.common.rundir import CONFIG_NAME
from hangwatch.supervisor.cli import remote as cli_client
from hangwatch.supervisor.cli.client import ClientError
from hangwatch.supervisor.cli.remote import client_for, daemon_options, fail

if TYPE_CHECKING:
    import subprocess

    from hangwatch.common.config import ConfigError

REPO = (
    Path(__file__).resolve().parents[2]
)  # the checkout hangwatch runs from (an editable install): supervisor/cli/ → ../..
INTERRUPTED = 130  # the shell's code for death by SIGINT
HELP_WIDTH = 100  # the exit codes' lines in `run --help`, wrapped here: click's \b marker keeps it from re-wrapping


def exit_codes_text() -> str:
    """The end of `run --help`: hangwatch's own exit codes, worded once in `common.exitcodes.RUN_CODES`."""
    import textwrap

    lines = [
        "\b",
        "Exit status: the command's own where its exit ended the run (its last attempt's code; 128+N when",
        "signal N ended it; after Ctrl-C or another signal passed on, its answer: 130 when it died of SIGINT).",
        "hangwatch's own, only where hangwatch ended the run:",
    ]
    for code, words, _ in RUN_CODES:
        lines += textwrap.wrap(words, HELP_WIDTH, initial_indent=f"  {code:<4}", subsequent_indent=" " * 6)
    return "\n".join(lines)


EXIT_CODES = exit_codes_text()


class _Group(click.Group):
    """Turns the errors a user can act on into one line and an exit code, never a traceback.
    Usage errors exit 64 (EX_USAGE), like the ones the client raises, not click's 2."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.UsageError as exc:
            exc.exit_code = EX_USAGE
            raise

    def list_commands(self, ctx: click.Context) -> list[str]:
        """`run` first: it is what a person comes for; the rest alphabetically."""
        names = super().list_commands(ctx)
        return sorted(names, key=lambda name: (name != "run", name))

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            exc.exit_code = EX_USAGE
            raise
        except ClientError as exc:
            fail(str(exc), exc.exit_code)
        except KeyboardInterrupt:
            ctx.exit(INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """hangwatch: run your training command under a watchdog that catches hangs and failures.

    \b
        hangwatch run -- python train.py --epochs 3     in place of `python train.py --epochs 3`
        hangwatch run -- torchrun --nproc-per-node 4 train.py
        hangwatch run CONFIG                            the built-in LoRA worker a config describes

    The command behaves as it does bare (its output, terminal, exit status, Ctrl-C); a hang or a failure is
    caught, its stacks taken, its process tree ended and the command resumed from its last good checkpoint.
    The other commands talk to a running supervisor (the run under ./runs, or --run-dir DIR, or --socket PATH).
    """


for _command in cli_client.COMMANDS:
    main.add_command(_command)

from hangwatch.supervisor.cli.report.command import report as _report  # noqa: E402  click only; plotly loads when it runs

main.add_command(_report)


def check_or_exit(config: Optional[str], run_dir: Optional[str], command: Optional[list[str]] = None):
    """The config checked against this machine too (data files, model, command, directories): its
    problems exit 78 before anything starts; its warnings go to stderr and the command goes on.
    `command`: `-- CMD…` of `hangwatch run`, over `worker.command` (`config` None: no file, the defaults)."""
    from hangwatch.common.config import ConfigError, load_checked

    try:
        cfg, warnings = load_checked(config, run_dir, command=command)
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


class _RunCommand(click.Command):
    """`run`: everything after `--` is the worker's command line, taken aside before click parses (its options are
    the command's, never ours); the help ends with the exit codes (the config keys: `hangwatch config-keys`)."""

    def collect_usage_pieces(self, ctx: click.Context) -> list[str]:
        return [*super().collect_usage_pieces(ctx), "[-- CMD ARGS…]"]

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            ctx.meta["worker_command"] = args[cut + 1 :]
            args = args[:cut]
        return super().parse_args(ctx, args)


@main.command(cls=_RunCommand, short_help="Run a command (-- CMD) or a config under the watchdog.", epilog=EXIT_CODES)
@click.argument("config", required=False)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False),
    help="Use this run directory (default: the config's run_dir; with `-- CMD`: runs/<script name>); a run there "
    "that did not finish continues, even with another command or config.",
)
@click.option("--no-doctor", is_flag=True, help="Skip the built-in worker's preflight checks.")
@click.option("-q", "--quiet", is_flag=True, help="No lines of hangwatch's own (the command's output is untouched).")
@click.option(
    "-v", "--verbose", is_flag=True, help="hangwatch's structured log on stderr too (always in supervisor.log)."
)
@click.option(
    "--hide-output", is_flag=True, help="Keep the command's output off the screen (it is in `hangwatch logs`)."
)
@click.pass_context
def run(
    ctx: click.Context,
    config: Optional[str],
    run_dir: Optional[str],
    no_doctor: bool,
    quiet: bool,
    verbose: bool,
    hide_output: bool,
) -> None:
    """Run CMD (after `--`) or the worker CONFIG describes, and keep it alive.

    \b
        hangwatch run -- python train.py …            a command you already run: no config, no edit
        hangwatch run CONFIG -- torchrun … train.py   a config's settings (watchdog, restart, alerts), this command
        hangwatch run CONFIG                          the built-in LoRA worker

    The command runs as it would bare: its stdout and stderr on ours, a terminal where there is one, our stdin,
    Ctrl-C and other signals passed on, its exit status.  hangwatch says a few lines of its own on stderr (where
    the run goes, each stall or failure and what it did, a summary); its log is <run dir>/supervisor.log.
    A rerun of the same command continues a failed or stopped run; another command gets a run dir of its own.
    Config keys: `hangwatch config-keys` (and docs/configuration.md).
    """
    from hangwatch.supervisor.ops import lean_imports, logsetup

    # first: what is imported below finds it without what a supervisor never uses (rich: only for -v on a terminal)
    logsetup.import_structlog(terminal=verbose and sys.stderr.isatty())
    lean_imports.import_without("hangwatch.common.config", defer=("secrets",))  # pydantic without OpenSSL
    from hangwatch.supervisor.cli import rerun
    from hangwatch.supervisor.cli.summary import slurm_text

    command = ctx.meta.get("worker_command")
    if command is not None and not command:
        raise click.UsageError(
            "nothing after `--`: give the command to supervise, e.g. `hangwatch run -- python train.py`"
        )
    if config is None and command is None:
        raise click.UsageError(
            "give a config file, or the command to supervise after `--` (e.g. `hangwatch run -- python train.py`)"
        )
    service = under_systemd()
    say = (lambda line: None) if quiet else (lambda line: click.echo(line, err=True))
    cfg = check_or_exit(config, run_dir, command)  # nothing is started for a bad config
    taken = slurm_text(cfg)
    if taken:  # the job's output says what each node took from Slurm (config.yaml in its run dir holds the values)
        say(f"hangwatch: {taken}")
    again = [x for x in (config,) if x] + (["--", *command] if command else [])
    where = rerun.plan(
        cfg.model_dump(mode="json"), cfg.run_dir, again, continuous=bool(cfg.data.inbox), pinned=run_dir is not None
    )
    if where.finished:  # this very run finished already, started again by a service or a requeue: reported
        say_finished(where.lines)
        sys.exit(EXIT_OK)
    for line in where.lines:
        say(line)
    if where.run_dir != cfg.run_dir:  # another run than the one there: a run dir of its own
        cfg = check_or_exit(config, where.run_dir, command)
    if command is not None:
        from hangwatch.supervisor.cli.summary import command_preamble

        for line in command_preamble(cfg, config, verbose=verbose):
            say(line)
    doctor = start_preflight(config, cfg.run_dir) if not no_doctor and cfg.worker.command is None else None
    try:
        from hangwatch.supervisor import app  # while the doctor's child runs: the two overlap
    finally:
        if doctor is not None:
            end_preflight(doctor, config)
    # Under systemd the journal is the record: the structured log on stderr as always, the output in worker.log.
    fg = None if service else app.Foreground(show=not hide_output, say=not quiet, verbose=verbose)
    code = app.run(cfg, foreground=fg)
    if code != EX_CANTCREAT:
        rerun.record_start(cfg.run_dir)  # which Slurm job ran it: the same job again after its end is a requeue
    # 73: another supervisor holds the run dir, nothing ran: no summary of someone else's run.  A 78 here is a
    # worker's (a rank's) configuration error: the summary says which.
    if code != EX_CANTCREAT:
        from hangwatch.supervisor.cli.summary import run_summary as summarise

        for line in summarise(cfg.run_dir, code, brief=not verbose):
            say(line)
    if fg is not None and fg.died_of in DIE_OF:
        die_of(fg.died_of)
    sys.exit(code)


# After Ctrl-C (or a hangup, a SIGTERM) passed on, the command died of it: `run` dies of it too, so that the shell
# sees what it would have seen bare (bash ends a script or a `cmd; next` list at a child's death by SIGINT, and not
# at an exit 130).  SIGQUIT is left to exit 131: dying of it would dump a core of hangwatch.
DIE_OF = (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)


def die_of(signum: int) -> None:
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


@main.command("config-keys", short_help="Every config key: default, type, what it does.")
@click.option("--markdown", is_flag=True, help="As the table in docs/configuration.md.")
def config_keys(markdown: bool) -> None:
    """Every key of a config file (YAML), with its default, its type and what it does; generated from the schema
    that validates configs, as docs/configuration.md is."""
    from hangwatch.common.config import reference_markdown, reference_text

    click.echo(reference_markdown() if markdown else reference_text())


def under_systemd() -> bool:
    """Our stdout is systemd's journal (`JOURNAL_STREAM` names its device and inode): the journal keeps the
    supervisor's lines as always, and the worker's output stays in worker.log rather than doubling the journal."""
    import os

    from hangwatch.supervisor.cli.rerun import stdout_is_journal

    return stdout_is_journal(os.environ)


def doctor_argv(config: str, run_dir: Optional[str], *flags: str) -> list[str]:
    """The worker-side doctor as a child: it runs the worker's code (torch for the full set), which this
    process never imports."""
    argv = [sys.executable, "-m", "hangwatch.daemon.doctor", config, *flags]
    return argv + (["--run-dir", str(run_dir)] if run_dir else [])


def start_preflight(config: str, run_dir: str) -> subprocess.Popen:
    """The doctor's cheap set before the first attempt, started: a child process (`end_preflight` waits for it),
    so that the supervisor's own imports overlap with it."""
    import subprocess

    return subprocess.Popen(
        doctor_argv(config, run_dir, "--cheap", "--plain"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def end_preflight(doctor: subprocess.Popen, config: str) -> None:
    """The doctor's findings: what needs attention on stderr; a FAIL exits 78 (hours of GPU time are not spent
    on a run the checks say will fail).  A doctor that itself breaks (any other exit) is reported and the run
    goes on: the checks are advice, not a gate on hangwatch's own bugs."""
    try:
        stdout, stderr = doctor.communicate()
    except BaseException:  # interrupted: the doctor does not outlive the command
        doctor.kill()
        doctor.wait()
        raise
    for line in (stdout + stderr).splitlines():
        click.echo(f"hangwatch: {line}" if not line.startswith("hangwatch:") else line, err=True)
    if doctor.returncode == EXIT_CONFIG:
        sys.exit(EXIT_CONFIG)
    if doctor.returncode == EXIT_FAILED:
        click.echo(
            "hangwatch: the preflight checks failed (above): nothing started. Fix them (details: "
            f"`hangwatch doctor {config}`), or skip the checks with `hangwatch run --no-doctor`.",
            err=True,
        )
        sys.exit(EXIT_CONFIG)
    if doctor.returncode != EXIT_OK:
        click.echo(
            f"hangwatch: warning: the preflight checks exited {doctor.returncode}; the run goes on without them",
            err=True,
        )


def say_finished(hint: list[str]) -> None:
    """The finished-run hint on stderr, and to systemd (READY then STOPPING: a clean exit, not a failed start)."""
    from hangwatch.supervisor.ops.notify import Notifier

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
    from hangwatch.supervisor.cli.summary import config_summary

    cfg = check_or_exit(config, run_dir)
    click.echo(f"OK: {config}")
    for label, text in config_summary(cfg):
        click.echo(f"  {label:<10} {text}")


@main.command(short_help="Preflight checks of a config for the built-in worker (exit 1 on a FAIL).")
@click.argument("config")
@click.option("--run-dir", type=click.Path(file_okay=False), help="As for `run`: override the config's run_dir.")
@click.option("--json", "as_json", is_flag=True, help="The findings as JSON.")
@click.option(
    "--cheap", is_flag=True, help="Only what needs no model load (what `run` checks before its first attempt)."
)
def doctor(config: str, run_dir: Optional[str], as_json: bool, cheap: bool) -> None:
    """Check CONFIG as the built-in worker will run it, in seconds on a CPU (the GPU when there is one):
    tokenizer special tokens, chat template round-trip, a decoded training example with its masked span,
    all-masked / truncated / rejected examples, label alignment, LR and warm-up against the optimizer steps,
    device placement against worker.nproc_per_node, disk for the retained checkpoints, py-spy and ptrace;
    without --cheap also a memory estimate against the device, then (when it fits) one forward/backward
    (finite loss, gradients on exactly the trainable parameters) and a time-boxed generate per eval prompt
    (eos reachability).  Each check: OK / WARN / FAIL and the fix in one line.

    Exits 0 when nothing FAILs, 1 when something does, 78 for a config that does not load."""
    flags = (["--json"] if as_json else []) + (["--cheap"] if cheap else [])
    import subprocess

    sys.exit(subprocess.call(doctor_argv(config, run_dir, *flags)))


@main.command(short_help="Check data files and publish the good ones into the inbox.")
@daemon_options
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option(
    "--config", "config_path", help="The run's config (default: the run dir's config.yaml, the config as run)."
)
@click.option(
    "--priority",
    type=click.IntRange(0, 99),
    default=None,
    help="0-99: files of higher priority are trained first (default 0).",
)
@click.option("-v", "--verbose", is_flag=True, help="Say on stderr which tokenizer checked the files, and why.")
def submit(run_dir, socket_path, timeout, files, config_path, priority, verbose) -> None:
    """Check FILE… as the worker will (JSON, fields, lengths, label masks, with the run's tokenizer)
    and publish each good one into <run_dir>/inbox/ (copied, then renamed into place, so the worker
    never sees half a file).  Prints `accepted NAME (N examples)` or `rejected NAME: why` per file;
    a rejected file is not published, and the exit code is then 65 (78 for a bad config, or a run
    that takes no files from an inbox).
    """
    if config_path is None:
        if run_dir is None and socket_path is not None:
            run_dir = client_for(run_dir, socket_path, timeout).call("status").get("run_dir")
        if run_dir is None:
            fail("submit needs --run-dir DIR (or $HANGWATCH_RUN_DIR), --socket PATH or --config CONFIG", EX_USAGE)
        config_path = str(Path(run_dir) / CONFIG_NAME)
        if not Path(config_path).is_file():
            fail(f"{run_dir}: no config.yaml (has the run been started there?); pass --config CONFIG", EXIT_CONFIG)
    # The config and the check (which needs the run's tokenizer) are the worker side's business: one
    # child process (hangwatch.daemon.submit) loads and checks both, so the supervisor package never
    # imports the worker, and this process loads neither the config package nor a tokenizer.
    argv = [sys.executable, "-m", "hangwatch.daemon.submit", "--config", config_path]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if priority is not None:
        argv += ["--priority", str(priority)]
    if verbose:
        argv.append("--verbose")
    import subprocess

    done = subprocess.run([*argv, "--", *files], capture_output=True, text=True)
    click.echo(done.stdout, nl=False)
    click.echo(done.stderr, nl=False, err=True)
    sys.exit(done.returncode)


@main.command(
    short_help="Benchmark hangwatch on this machine (scripts/bench).",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args) -> None:
    """Run the benchmark (`scripts/bench` of the checkout hangwatch runs from) with ARGS, e.g. --quick
    (`hangwatch bench --help` is the benchmark's own help).

    It writes bench-results.json and bench-results.md and prints the table."""
    package = REPO / "scripts" / "bench"
    if not (package / "__main__.py").is_file():
        fail(f"no benchmark at {package}: `hangwatch bench` needs a source checkout (pip install -e .)", EXIT_FAILED)
    import subprocess

    sys.exit(subprocess.call([sys.executable, str(package), *args]))


if __name__ == "__main__":
    main(prog_name="hangwatch")
