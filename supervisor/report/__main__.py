"""`python -m hangwatch.supervisor.report [--run-dir D] [--out FILE.html] [--open]`: the same as `hangwatch report`."""
from hangwatch.supervisor.report.command import report

report(prog_name="hangwatch report")
