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

Errors are one line on stderr, `hangwatch: ...`, and a non-zero exit: 64 usage, 69 no daemon
reachable, 1 the daemon refused the request, 78 bad config, 65 `submit` rejected a file; `run`
exits with the supervisor's code.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

import click

from hangwatch.supervisor.client import Client, ClientError, resolve_socket
from hangwatch.common.config import Config, ConfigError, load_config, reference_text
from hangwatch.common.exitcodes import EXIT_CONFIG as EX_CONFIG, EX_USAGE



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
            _fail(str(exc), exc.exit_code)
        except NoLogYet as exc:
            _fail(str(exc), 1)
        except KeyboardInterrupt:
            ctx.exit(130)


def _fail(message: str, code: int) -> None:
    click.echo(f"hangwatch: {message}", err=True)
    sys.exit(code)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def main() -> None:
    """hangwatch: a LoRA fine-tuning daemon and the watchdog that keeps it alive.

    `hangwatch run CONFIG` starts the supervisor; the other commands talk to a running one through its
    control socket, found with --run-dir DIR (or $HANGWATCH_RUN_DIR) or --socket PATH (or $HANGWATCH_SOCKET).
    """


# --------------------------------------------------------------------------------------------
# The supervisor itself


@main.command(short_help="Run the supervisor in the foreground.", epilog="\b\nConfiguration keys (YAML; key = default  (type)):\n" + reference_text())
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--run-dir", type=click.Path(file_okay=False), help="Use this run directory instead of the config's run_dir.")
def run(config: str, run_dir: Optional[str]) -> None:
    """Run the supervisor in the foreground: start the worker, watch it, restart it on a stall.

    Exits 0 when the run finished or was stopped, 78 on a bad config, non-zero when the run failed.
    Under systemd (Type=notify) it reports READY, STATUS and WATCHDOG pings.
    """
    from hangwatch.supervisor import app

    try:
        cfg = load_config(config, run_dir)
    except ConfigError as exc:
        report_config_error(exc)  # the same words as validate-config; nothing is started
        sys.exit(EX_CONFIG)
    code = app.run(cfg)
    if code != EX_CONFIG:
        for line in run_summary(cfg.run_dir, code):
            click.echo(line, err=True)
    sys.exit(code)


def run_summary(run_dir: str, code: int) -> list[str]:
    """What a person wants to know when `hangwatch run` returns: how it ended, what went wrong on the
    way (each incident and where its evidence is), and where the result is."""
    from pathlib import Path

    from hangwatch.supervisor import statefile
    from hangwatch.supervisor.incidents import IncidentStore

    rd = Path(run_dir)
    state, _ = statefile.read(rd / "state.json")
    state = state or {}
    lines = [f"hangwatch: run {state.get('state', 'ended')} (exit {code}) after {state.get('attempt', '?')} attempt(s); "
             f"run dir {rd}"]
    store = IncidentStore(rd)
    for inc, d in zip(store.list(), store.dirs()):
        lines.append(f"  incident {inc.get('id')} [{inc.get('kind')}] {d}: {inc.get('summary')}")
    final = rd / "final"
    if final.is_dir():
        lines.append(f"  final adapter: {final}  (PeftModel.from_pretrained(base, '{final}'))")
    return lines


@main.command("validate-config", short_help="Check a config file (exit 78 when bad).")
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--run-dir", type=click.Path(file_okay=False), help="As for `run`: override the config's run_dir.")
def validate_config(config: str, run_dir: Optional[str]) -> None:
    """Check a config file: print OK and what it will do, or every problem (exit 78)."""
    try:
        cfg = load_config(config, run_dir)
    except ConfigError as exc:
        report_config_error(exc)
        sys.exit(EX_CONFIG)
    click.echo(f"OK: {config}")
    for label, text in config_summary(cfg):
        click.echo(f"  {label:<10} {text}")


def report_config_error(exc: ConfigError) -> None:
    """The one place a bad config is explained: a headline, then one line per problem."""
    n = len(exc.problems)
    click.echo(f"hangwatch: invalid configuration ({n} problem{'s' if n != 1 else ''}):", err=True)
    for problem in exc.problems:
        click.echo(f"  {problem}", err=True)


def config_summary(cfg: Config) -> list[tuple[str, str]]:
    from hangwatch.supervisor.control import socket_path_for

    w = cfg.watchdog
    if cfg.worker.command is None:
        worker = "built-in training daemon (python -m hangwatch.daemon)"
    else:
        worker = " ".join(cfg.worker.command)
    if cfg.model.name_or_path:
        model = cfg.model.name_or_path
    else:
        t = cfg.model.tiny
        model = f"tiny (built locally: {t.num_layers} layers, hidden {t.hidden_size}, vocab {t.vocab_size})"
    step = f"step {w.step_timeout_s:g}s" if w.step_timeout_s else (
        f"step calibrated after {w.calibrate_after} steps ({w.calibration_factor:g}× p99, "
        f"{w.step_timeout_min_s:g}–{w.step_timeout_max_s:g}s; first steps {w.first_steps_timeout_s:g}s)"
    )
    phases = ", ".join(f"{k} {v:g}s" for k, v in w.phase_budgets_s.items()) or "none"
    data = f"train {cfg.data.train or '-'}, eval {cfg.data.eval or '-'}" + (", inbox on" if cfg.data.inbox else "")
    faults = ", ".join(
        f.kind + (f" at step {f.at_step}" if f.at_step is not None else f" at eval {f.at_eval}") for f in cfg.faults
    ) or "none"
    r = cfg.restart
    mode = "0660, group " + cfg.control.group if cfg.control.group else "0600"
    return [
        ("run dir", cfg.run_dir),
        ("worker", worker),
        ("model", model),
        ("data", data),
        ("training", f"{cfg.train.max_steps} steps, micro-batch {cfg.train.micro_batch_size} × accum {cfg.train.grad_accum}, lr {cfg.train.lr:g}"),
        ("deadlines", f"startup {w.startup_timeout_s:g}s, silence {w.silence_timeout_s:g}s, {step}"),
        ("phases", phases),
        ("restarts", f"up to {r.max_restarts} in {r.window_s:g}s without progress, backoff {r.backoff_initial_s:g}s → {r.backoff_max_s:g}s"),
        ("checkpoint", f"every {cfg.checkpoint.every_steps} steps, keep {cfg.checkpoint.keep_last}, good after {cfg.checkpoint.confirm_steps} finite steps"),
        ("socket", f"{socket_path_for(cfg, cfg.run_dir)} (mode {mode})"),
        ("faults", faults),
    ]


# --------------------------------------------------------------------------------------------
# Client commands


def daemon_options(f):
    f = click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for an answer.")(f)
    f = click.option("--socket", "socket_path", envvar="HANGWATCH_SOCKET", type=click.Path(dir_okay=False),
                     help="The control socket.")(f)
    f = click.option("--run-dir", envvar="HANGWATCH_RUN_DIR", type=click.Path(file_okay=False),
                     help="The run directory (its socket is found from there).")(f)
    return f


def _client(run_dir: Optional[str], socket_path: Optional[str], timeout: float) -> Client:
    return Client(resolve_socket(run_dir=run_dir, socket_path=socket_path), timeout=timeout)


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


@main.command(short_help="Show where the run is (--json, --watch).")
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option("--watch", "-w", is_flag=True, help="Keep the view up to date (like `top`).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Refresh period of --watch.")
@click.option("-n", "--count", type=int, default=None, help="With --watch: stop after this many refreshes.")
def status(run_dir, socket_path, timeout, as_json, watch, interval, count) -> None:
    """Where the run is: state, attempt, pids, phase, step, loss, checkpoint, incidents, GPUs."""
    client = _client(run_dir, socket_path, timeout)
    if watch:
        _live(client, interval, count, as_json)
        return
    st = client.call("status")
    if as_json:
        click.echo(json.dumps(st, default=str))
        return
    from hangwatch.supervisor.render import status_view

    _console().print(status_view(st))


@main.command(short_help="Live view of the run.")
@daemon_options
@click.option("--interval", type=float, default=1.0, show_default=True, help="Refresh period.")
@click.option("-n", "--count", type=int, default=None, help="Stop after this many refreshes.")
def top(run_dir, socket_path, timeout, interval, count) -> None:
    """Live view of the run (Ctrl-C to leave)."""
    _live(_client(run_dir, socket_path, timeout), interval, count, False)


def _live(client: Client, interval: float, count: Optional[int], as_json: bool) -> None:
    """Refresh until interrupted; a daemon that goes away is shown as such, and retried."""
    from rich.live import Live

    from hangwatch.supervisor.render import status_view

    last: dict = {}
    refreshes = 0

    def fetch():
        nonlocal last
        try:
            last = client.call("status")
            return status_view(last)
        except ClientError as exc:
            return status_view(last, error=str(exc))

    if as_json:
        while count is None or refreshes < count:
            try:
                click.echo(json.dumps(client.call("status"), default=str))
            except ClientError as exc:
                click.echo(json.dumps({"error": str(exc)}))
            refreshes += 1
            if count is None or refreshes < count:
                time.sleep(interval)
        return
    console = _console()
    with Live(fetch(), console=console, auto_refresh=False, transient=False) as live:
        refreshes = 1
        while count is None or refreshes < count:
            time.sleep(interval)
            live.update(fetch(), refresh=True)
            refreshes += 1


def _simple(cmd: str):
    def command(run_dir, socket_path, timeout):
        from hangwatch.supervisor.render import result_message

        click.echo(result_message(cmd, _client(run_dir, socket_path, timeout).call(cmd)))

    return command


@main.command(short_help="Restart the worker (--now: dump and kill).")
@daemon_options
@click.option("--now", is_flag=True, help="Do not wait for a checkpoint: dump stacks and kill the worker.")
def restart(run_dir, socket_path, timeout, now) -> None:
    """Restart the worker: by default it checkpoints first, so no step is lost."""
    from hangwatch.supervisor.render import result_message

    result = _client(run_dir, socket_path, timeout).call("restart", mode="now" if now else "graceful")
    click.echo(result_message("restart", result))


main.command(name="stop", short_help="Checkpoint and stop the worker, then exit.", help="Stop the run: the worker checkpoints and exits, then the supervisor exits.")(
    daemon_options(_simple("stop"))
)
main.command(name="pause", short_help="Stop the worker after a checkpoint; stay up.", help="Stop the worker (after a checkpoint) but keep the supervisor; `resume` continues.")(
    daemon_options(_simple("pause"))
)
main.command(name="resume", short_help="Start the worker again after pause.", help="Start the worker again after `pause`.")(daemon_options(_simple("resume")))


@main.command(short_help="Print fresh stacks of every rank.")
@daemon_options
def dump(run_dir, socket_path, timeout) -> None:
    """Print fresh stack dumps of every rank (SIGUSR1 → faulthandler), without stopping anything."""
    from hangwatch.supervisor.render import dump_text

    result = _client(run_dir, socket_path, timeout).call("dump") or {}
    click.echo(dump_text(result.get("dumps") or {}), nl=False)


@main.command(short_help="List incidents, or show one by ID.")
@daemon_options
@click.argument("incident_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def incidents(run_dir, socket_path, timeout, incident_id, as_json) -> None:
    """List incidents, or show one (by ID, e.g. 0003). With --run-dir they are read from disk when no
    supervisor is running there (after the run ended)."""
    from hangwatch.supervisor.client import DaemonUnavailable

    try:
        client = _client(run_dir, socket_path, timeout)
        result = client.call("incidents", id=incident_id) if incident_id else client.call("incidents")
    except DaemonUnavailable:
        if not run_dir:
            raise
        from hangwatch.supervisor.incidents import IncidentStore

        store = IncidentStore(run_dir)
        result = store.get(incident_id) if incident_id else store.list()
        if incident_id and result is None:
            _fail(f"no incident {incident_id} in {run_dir}/incidents", 1)
    if as_json:
        click.echo(json.dumps(result, default=str))
        return
    from hangwatch.supervisor.render import incident_view, incidents_table

    if incident_id:
        _console().print(incident_view(result if isinstance(result, dict) else {"result": result}))
    elif not result:
        click.echo("no incidents")
    else:
        _console().print(incidents_table(result))


@main.command(short_help="Print the worker log (-f: follow across restarts).")
@daemon_options
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, moving on to each new attempt.")
@click.option("--supervisor", is_flag=True, help="The supervisor's log instead of the worker's.")
@click.option("--attempt", type=int, default=None, help="The worker log of this attempt (default: the newest).")
@click.option("-n", "--lines", type=int, default=None, help="Start with the last N lines (default: all).")
def logs(run_dir, socket_path, timeout, follow, supervisor, attempt, lines) -> None:
    """Print the current attempt's worker log (or the supervisor log); -f follows it across restarts."""
    from pathlib import Path

    from hangwatch.supervisor.logfollow import follow_log

    if run_dir is None:
        # Only the socket is known: the daemon says where its run dir is.
        run_dir = _client(run_dir, socket_path, timeout).call("status").get("run_dir")
        if not run_dir:
            raise ClientError("the daemon did not say where its run directory is; pass --run-dir")
    out = sys.stdout.buffer
    base = Path(run_dir)
    for item in follow_log(run_dir, supervisor=supervisor, attempt=attempt, follow=follow, last_lines=lines):
        if isinstance(item, Path):
            if follow:
                try:
                    shown = item.relative_to(base)
                except ValueError:
                    shown = item
                click.echo(f"hangwatch: following {shown}", err=True)
            continue
        out.write(item)
        out.flush()


@main.command(short_help="Check data files and publish the good ones into the inbox.")
@daemon_options
@click.argument("files", nargs=-1, required=True, type=click.Path(dir_okay=False))
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The run's config (default: the run dir's config.yaml, the config as run).")
@click.option("--priority", type=click.IntRange(0, 99), default=None,
              help="0-99: files of higher priority are trained first (default 0).")
def submit(run_dir, socket_path, timeout, files, config_path, priority) -> None:
    """Check FILE… as the worker will (JSON, fields, lengths, label masks, with the run's tokenizer)
    and publish each good one into <run_dir>/inbox/ (copied, then renamed into place, so the worker
    never sees half a file).  Prints `accepted NAME (N examples)` or `rejected NAME: why` per file;
    a rejected file is not published, and the exit code is then 65.
    """
    import subprocess
    from pathlib import Path

    if config_path is None:
        if run_dir is None and socket_path is not None:
            run_dir = _client(run_dir, socket_path, timeout).call("status").get("run_dir")
        if run_dir is None:
            _fail("submit needs --run-dir DIR (or $HANGWATCH_RUN_DIR), --socket PATH or --config CONFIG", EX_USAGE)
        config_path = str(Path(run_dir) / "config.yaml")
        if not Path(config_path).is_file():
            _fail(f"{run_dir}: no config.yaml (has the run been started there?); pass --config CONFIG", EX_CONFIG)
    try:
        cfg = load_config(config_path, run_dir)
    except ConfigError as exc:
        report_config_error(exc)
        sys.exit(EX_CONFIG)
    if not cfg.data.inbox:
        _fail(f"{config_path}: data.inbox is false: the run at {cfg.run_dir} does not take files from an inbox", EX_CONFIG)
    # Validation needs the run's tokenizer, hence transformers and torch: it runs in a worker-side
    # process (daemon.submit) so that supervisor/ itself never imports them.
    argv = [sys.executable, "-m", "hangwatch.daemon.submit", "--config", config_path]
    if run_dir is not None:
        argv += ["--run-dir", str(run_dir)]
    if priority is not None:
        argv += ["--priority", str(priority)]
    done = subprocess.run([*argv, "--", *files], capture_output=True, text=True)
    click.echo(done.stdout, nl=False)
    click.echo(done.stderr, nl=False, err=True)
    sys.exit(done.returncode)


@main.command(short_help="Benchmark hangwatch on this machine (scripts/bench.py).",
              context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args) -> None:
    """Run the benchmark (`scripts/bench.py` of the checkout hangwatch runs from) with ARGS, e.g. --quick.

    It writes bench-results.json and bench-results.md and prints the table."""
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"
    if not script.is_file():
        _fail(f"no benchmark at {script}: `hangwatch bench` needs a source checkout (pip install -e .)", 1)
    sys.exit(subprocess.call([sys.executable, str(script), *args]))


if __name__ == "__main__":
    main(prog_name="hangwatch")
