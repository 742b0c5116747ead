"""Every exit code hangwatch uses, once (sysexits.h values where one fits).

Worker → supervisor: 0 finished · 65 unusable data (no restart) · 74 the disk refused a write (no restart) ·
75 non-finite streak (restart with rollback) · 78 configuration error (no restart) · anything else or a signal:
restart.  Under torchrun, which exits 1 for any failed rank, a rank's own 65/74/78 (its last words, or torchrun's
root-cause report) counts as the worker's (`supervisor.rules.no_retry`).
Supervisor and CLI: 0 finished/stopped · 1 failed (crash loop, …) · 64 usage · 69 daemon unreachable ·
70 internal error · 75 `run`: stopped to be run again (SIGUSR1: a batch job's time limit is near; its checkpoint is
saved, so the job script requeues the job) · 78 configuration error · 79 `run`: the same run already finished,
nothing started.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the run ended failed (crash loop, …)
EX_USAGE = 64  # the command line was wrong
EXIT_DATAERR = 65  # unusable data for the whole run: do not restart
EX_UNAVAILABLE = 69  # no daemon answers on the socket
EX_SOFTWARE = 70  # the daemon answered with an error
EXIT_IOERR = 74  # the disk refused a write (full, read-only, I/O error): a person must make room; not restarted
EXIT_TEMPFAIL = 75  # worker: non-finite loss streak, restart with rollback; `run`: stopped to be run again (requeue)
EXIT_CONFIG = 78  # configuration error: do not restart
EXIT_ALREADY_FINISHED = 79  # `run`: this run dir holds this very run, finished: nothing was started

NO_RESTART_CODES = frozenset({EXIT_DATAERR, EXIT_CONFIG, EXIT_IOERR})
# `run`: the run dir is held by another supervisor (nothing started or changed); `report`: the page cannot be written
EX_CANTCREAT = 73
EX_NOINPUT = 66  # `report`: no run in the directory
