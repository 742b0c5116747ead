"""The `hangwatch` commands that talk to a running supervisor through its control socket.

    status [--json] [--watch]   top   restart [--now]   stop   pause   resume   dump   incidents [ID]   logs [-f]

Each finds the daemon by --run-dir DIR ($HANGWATCH_RUN_DIR) or --socket PATH ($HANGWATCH_SOCKET); told
neither, by the runs under ./runs/ (`find_run`: the only one running, else the most recent, saying which).
`cli.py` registers them on the `hangwatch` group; a `ClientError` raised here becomes one line on
stderr and its exit code there.  Importing this module loads click and the socket client only: what
shows an answer (render.py, rich) is imported while the request is in flight, and `--json` never
needs it.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Optional

import click

from hangwatch.common.exitcodes import EXIT_FAILED
from hangwatch.supervisor.cli.client import Client, ClientError, DaemonUnavailable, resolve_socket


def fail(message: str, code: int) -> None:
    """The one way a command gives up: `hangwatch: message` on stderr and exit `code`."""
    click.echo(f"hangwatch: {message}", err=True)
    sys.exit(code)


def which_run() -> str:
    """The run a command means when it is not told: `find_run`'s choice (said on stderr unless it is the only one
    running), or a usage error that says what to pass."""
    from hangwatch.supervisor.cli.find_run import NoRunFound, find_run

    try:
        run_dir, words = find_run()
    except NoRunFound as exc:
        err = ClientError(str(exc))
        err.exit_code = exc.exit_code
        raise err from None
    if "that is running" not in words:
        click.echo(f"hangwatch: {words}", err=True)
    return str(run_dir)


def daemon_options(f):
    """--run-dir, --socket and --timeout; a command told neither of the first two (nor a --config that names the
    run, as `submit` takes) gets `which_run`'s."""

    command = f

    @functools.wraps(command)
    def resolved(*args, run_dir=None, socket_path=None, **kwargs):
        if not run_dir and not socket_path and not kwargs.get("config_path"):
            run_dir = which_run()
        return command(*args, run_dir=run_dir, socket_path=socket_path, **kwargs)

    f = resolved
    f = click.option("--timeout", type=float, default=30.0, show_default=True, help="Seconds to wait for an answer.")(f)
    f = click.option(
        "--socket",
        "socket_path",
        envvar="HANGWATCH_SOCKET",
        type=click.Path(dir_okay=False),
        help="The control socket.",
    )(f)
    f = click.option(
        "--run-dir",
        envvar="HANGWATCH_RUN_DIR",
        type=click.Path(file_okay=False),
        help="The run directory (its socket is found from there).",
    )(f)
    return f


def client_for(run_dir: Optional[str], socket_path: Optional[str], timeout: float) -> Client:
    return Client(resolve_socket(run_dir=run_dir, socket_path=socket_path), timeout=timeout)


def daemon_run_dir(socket_path: Optional[str], timeout: float) -> str:
    """Only the socket is known: the daemon says where its run dir is."""
    run_dir = client_for(None, socket_path, timeout).call("status").get("run_dir")
    if not run_dir:
        raise ClientError("the daemon did not say where its run directory is; pass --run-dir")
    return run_dir


def _console():
    from rich.console import Console

    return Console(highlight=False, soft_wrap=False)


def _load_renderer() -> None:
    """Import what shows the answer (render.py and rich: a few tens of ms) as a request's `meanwhile`, so
    that it costs nothing while the supervisor's loop gets round to answering."""
    import rich.console  # noqa: F401

    import hangwatch.supervisor.cli.render  # noqa: F401


@click.command(short_help="Show where the run is (--json, --watch).")
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as one JSON object.")
@click.option("--watch", "-w", is_flag=True, help="Keep the view up to date (like `top`).")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Refresh period of --watch.")
@click.option("-n", "--count", type=int, default=None, help="With --watch: stop after this many refreshes.")
def status(run_dir, socket_path, timeout, as_json, watch, interval, count) -> None:
    """Where the run is: state, attempt, pids, phase, step, loss, checkpoint, incidents, GPUs.

    With no supervisor answering, what state.json last recorded is printed (--json: with `"source":
    "state.json"` and `supervisor_gone`), saying when the supervisor that wrote it is gone: a run that ended
    (finished, failed, stopped) exits 0 with its final state; one whose supervisor is gone before its end exits
    69, no supervisor reachable."""
    client = client_for(run_dir, socket_path, timeout)
    if watch:
        _live(client, interval, count, as_json)
        return
    try:
        if as_json:
            click.echo(json.dumps(client.call("status"), default=str))
            return
        st = client.call("status", meanwhile=_load_renderer)  # rich loads while the supervisor answers
    except DaemonUnavailable:
        if run_dir and _recorded(Path(run_dir), as_json):
            return  # the run is over: its final state is the answer
        raise
    from hangwatch.supervisor.cli.render import status_view

    _console().print(status_view(st))


def _recorded(run_dir: Path, as_json: bool) -> bool:
    """state.json's record on stdout, when there is one; True when it is a run's final state (finished, failed,
    stopped: the answer), False when it is not (the caller fails: nobody answered for a run that is not over)."""
    from hangwatch.supervisor.cli.find_run import FINAL_STATES
    from hangwatch.supervisor.cli.recorded import recorded, recorded_text

    rec = recorded(run_dir)
    if rec is None:
        return False
    click.echo(json.dumps(rec, default=str) if as_json else recorded_text(rec))
    return rec.get("state") in FINAL_STATES


@click.command(short_help="Live view of the run.")
@daemon_options
@click.option("--interval", type=float, default=1.0, show_default=True, help="Refresh period.")
@click.option("-n", "--count", type=int, default=None, help="Stop after this many refreshes.")
def top(run_dir, socket_path, timeout, interval, count) -> None:
    """Live view of the run (Ctrl-C to leave)."""
    _live(client_for(run_dir, socket_path, timeout), interval, count, False)


def _live(client: Client, interval: float, count: Optional[int], as_json: bool) -> None:
    """Refresh until interrupted; a daemon that goes away is shown as such, and retried."""
    if as_json:
        refreshes = 0
        while count is None or refreshes < count:
            try:
                click.echo(json.dumps(client.call("status"), default=str))
            except ClientError as exc:
                click.echo(json.dumps({"error": str(exc)}))
            refreshes += 1
            if count is None or refreshes < count:
                time.sleep(interval)  # the refresh period itself, not a wait for something
        return
    from rich.live import Live

    from hangwatch.supervisor.cli.render import status_view

    last: dict = {}

    def fetch():
        nonlocal last
        try:
            last = client.call("status")
            return status_view(last)
        except ClientError as exc:
            return status_view(last, error=str(exc))

    with Live(fetch(), console=_console(), auto_refresh=False, transient=False) as live:
        refreshes = 1
        while count is None or refreshes < count:
            time.sleep(interval)
            live.update(fetch(), refresh=True)
            refreshes += 1


@click.command(short_help="Restart the worker (--now: dump and kill).")
@daemon_options
@click.option("--now", is_flag=True, help="Do not wait for a checkpoint: dump stacks and kill the worker.")
def restart(run_dir, socket_path, timeout, now) -> None:
    """Restart the worker: by default it checkpoints first, so no step is lost."""
    result = client_for(run_dir, socket_path, timeout).call(
        "restart", mode="now" if now else "graceful", meanwhile=_load_renderer
    )
    from hangwatch.supervisor.cli.render import result_message

    click.echo(result_message("restart", result))


def _simple(cmd: str, short_help: str, help_text: str) -> click.Command:
    """A command that sends `cmd` with no arguments and prints the answer as one line."""

    def command(run_dir, socket_path, timeout):
        result = client_for(run_dir, socket_path, timeout).call(cmd, meanwhile=_load_renderer)
        from hangwatch.supervisor.cli.render import result_message

        click.echo(result_message(cmd, result))

    return click.command(name=cmd, short_help=short_help, help=help_text)(daemon_options(command))


stop = _simple(
    "stop",
    "Checkpoint and stop the worker, then exit.",
    "Stop the run: the worker checkpoints and exits, then the supervisor exits.",
)
pause = _simple(
    "pause",
    "Stop the worker after a checkpoint; stay up.",
    "Stop the worker (after a checkpoint) but keep the supervisor; `resume` continues.",
)
resume = _simple("resume", "Start the worker again after pause.", "Start the worker again after `pause`.")


@click.command(short_help="Print fresh stacks of every rank.")
@daemon_options
def dump(run_dir, socket_path, timeout) -> None:
    """Print fresh stack dumps of every rank (SIGUSR1 → faulthandler), without stopping anything."""
    result = client_for(run_dir, socket_path, timeout).call("dump", meanwhile=_load_renderer) or {}
    from hangwatch.supervisor.cli.render import dump_text

    click.echo(dump_text(result.get("dumps") or {}), nl=False)


@click.command(short_help="List incidents, or show one by ID.")
@daemon_options
@click.argument("incident_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def incidents(run_dir, socket_path, timeout, incident_id, as_json) -> None:
    """List incidents, or show one (by ID, e.g. 0003). With --run-dir they are read from disk when no
    supervisor is running there (after the run ended)."""
    try:
        client = client_for(run_dir, socket_path, timeout)
        meanwhile = None if as_json else _load_renderer
        result = (
            client.call("incidents", id=incident_id, meanwhile=meanwhile)
            if incident_id
            else client.call("incidents", meanwhile=meanwhile)
        )
    except DaemonUnavailable:
        if not run_dir:
            raise
        from hangwatch.supervisor.incidents import IncidentStore

        store = IncidentStore(run_dir)
        result = store.get(incident_id) if incident_id else store.list()
        if incident_id and result is None:
            fail(f"no incident {incident_id} in {run_dir}/incidents", EXIT_FAILED)
    if as_json:
        click.echo(json.dumps(result, default=str))
        return
    from hangwatch.supervisor.cli.render import incident_view, incidents_table

    if incident_id:
        _console().print(incident_view(result if isinstance(result, dict) else {"result": result}))
    elif not result:
        click.echo("no incidents")
    else:
        _console().print(incidents_table(result))


@click.command(short_help="Print every attempt's worker log (-f: follow across restarts).")
@daemon_options
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows, moving on to each new attempt.")
@click.option("--supervisor", is_flag=True, help="The supervisor's log instead of the worker's.")
@click.option("--attempt", type=int, default=None, help="The worker log of this attempt only (default: every attempt).")
@click.option("-n", "--lines", type=int, default=None, help="Start with the last N lines (default: all).")
def logs(run_dir, socket_path, timeout, follow, supervisor, attempt, lines) -> None:
    """Print the worker log of every attempt, oldest first, each under a line that says how that attempt ended (or
    the supervisor log); -f then follows the newest, across restarts."""
    from hangwatch.supervisor.cli.logs import AttemptOutcomes, NoLogYet, attempt_of, follow_log, heading

    if run_dir is None:
        run_dir = daemon_run_dir(socket_path, timeout)
    out = sys.stdout.buffer
    base = Path(run_dir)
    outcomes = AttemptOutcomes(run_dir)
    at_line_start = True
    try:
        for item in follow_log(run_dir, supervisor=supervisor, attempt=attempt, follow=follow, last_lines=lines):
            if isinstance(item, Path):
                if follow:
                    try:
                        shown = item.relative_to(base)
                    except ValueError:
                        shown = item
                    click.echo(f"hangwatch: following {shown}", err=True)
                number = None if supervisor else attempt_of(item)
                if number is not None:
                    # on a line of its own, even after a log whose last line was cut off mid-way
                    text = ("" if at_line_start else "\n") + heading(number, outcomes.describe(number)) + "\n"
                    out.write(text.encode())
                    out.flush()
                    at_line_start = True
                continue
            out.write(item)
            out.flush()
            at_line_start = item.endswith(b"\n")
    except NoLogYet as exc:
        fail(str(exc), EXIT_FAILED)


COMMANDS = (status, top, restart, stop, pause, resume, dump, incidents, logs)
