"""`hangwatch report [--run-dir D] [--out FILE.html] [--open]`: the click command (`cli.py` registers it).

Reads only the run dir (no daemon needed): a finished run, a running one, or a copy.  Exit codes: 0 the page
was written; 66 (EX_NOINPUT) the run dir does not exist or holds no run; 73 (EX_CANTCREAT) the page cannot
be written.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import click

from hangwatch.common.exitcodes import EX_CANTCREAT, EX_NOINPUT
from hangwatch.common.rundir import ATTEMPTS, STATE_NAME


@click.command("report")
@click.option(
    "--run-dir",
    envvar="HANGWATCH_RUN_DIR",
    default=None,
    show_default="$HANGWATCH_RUN_DIR; else the current directory when it is a run, else the only run under ./runs/ "
    "that is running, else the most recent one",
    type=click.Path(file_okay=False),
    help="The run directory to report on.",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Where to write the page (default: <run dir>/report.html).",
)
@click.option("--open", "open_", is_flag=True, help="Open the page in the default browser once written.")
def report(run_dir: Optional[str], out: Optional[str], open_: bool) -> None:
    """The run on one self-contained HTML page (opens without a network, readable on a phone): loss, lr, step
    time and tokens/s over steps with attempt boundaries and incidents marked; the incidents (kind, culprit,
    frame, detection, steps lost, time to recover); eval generations over steps."""
    if run_dir is None:
        if Path(STATE_NAME).exists() or Path(ATTEMPTS).is_dir():
            run_dir = "."
        else:
            from hangwatch.supervisor.cli.remote import which_run

            run_dir = which_run()
    base = Path(run_dir)
    if not (base / STATE_NAME).exists() and not (base / ATTEMPTS).is_dir():
        click.echo(f"hangwatch: no run in {base} (no {STATE_NAME}, no {ATTEMPTS}/): pass --run-dir", err=True)
        sys.exit(EX_NOINPUT)
    from hangwatch.supervisor.cli.report.page import write_report  # noqa: PLC0415 (plotly loads only here)

    try:
        path = write_report(base, Path(out) if out else None)
    except OSError as exc:
        click.echo(f"hangwatch: cannot write the report: {exc}", err=True)
        sys.exit(EX_CANTCREAT)
    click.echo(str(path))
    if open_:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())
