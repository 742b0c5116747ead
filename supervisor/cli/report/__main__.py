"""`python -m hangwatch.supervisor.cli.report [--run-dir D] [--out FILE.html] [--open]`: the same as
`hangwatch report`."""

from hangwatch.supervisor.cli.report.command import report

report(prog_name="hangwatch report")
