"""Every exit code hangwatch uses, once (sysexits.h values where one fits).

Worker → supervisor: 0 finished · 65 unusable data (no restart) · 74 the disk refused a write (no restart) ·
75 non-finite streak (restart with rollback) · 78 configuration error (no restart) · anything else or a signal:
restart.  Under torchrun, which exits 1 for any failed rank, a rank's own 65/74/78 (its last words, or torchrun's
root-cause report) counts as the worker's (`supervisor.rules.no_retry`).
`hangwatch run` exits with the command's own status where the command's own exit ended the run (its last
attempt's code; 128+N when signal N ended it; after a stop it passed on — Ctrl-C, SIGTERM, SIGHUP, SIGQUIT — the
command's code, or 128+N for the signal hangwatch received).  hangwatch's own codes, only where it ended the run
itself (docs/operations.md has the table): 0 finished (or a finished run reported) / stopped on request ·
1 hangwatch or the machine could not go on (processes outlived SIGKILL) · 64 usage · 73 the run dir is another
supervisor's · 75 stopped to be run again (requeue me: SIGUSR1, a batch job's time limit is near; its checkpoint is
saved) · 78 configuration error, nothing started · 79 do not retry: another run would fail the same way (the same
failure twice, no progress past a point, a crash loop of stalls, a diverged resume), and the worker's 65 and 74 passed
on (`RUN_CODES` words each, with what a scheduler should do).  Client commands: 64 usage · 69 daemon unreachable ·
70 internal error.
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
EXIT_NO_RETRY = 79  # `run`: hangwatch ended the run, and running it again would fail the same way
EXIT_ALREADY_FINISHED = EXIT_NO_RETRY  # the old name

NO_RESTART_CODES = frozenset({EXIT_DATAERR, EXIT_CONFIG, EXIT_IOERR})
# `run`: the run dir is held by another supervisor (nothing started or changed); `report`: the page cannot be written
EX_CANTCREAT = 73
EX_NOINPUT = 66  # `report`: no run in the directory


# What each of `hangwatch run`'s own codes means, and what a scheduler should do with it: the one table that
# `run --help` (cli.main) and the termination message (supervisor.ops.termination_message) word it from, in the
# order `run --help` lists them; docs/operations.md's table says the same.
RUN_CODES: tuple[tuple[int, str, str], ...] = (
    (
        EXIT_OK,
        "finished (a finished run started again by systemd or a requeue: reported, not trained again), or stopped by "
        "`hangwatch stop`",
        "done",
    ),
    (
        EXIT_TEMPFAIL,
        "requeue me: stopped to be run again (SIGUSR1: a batch time limit is near; checkpoint saved)",
        "requeue",
    ),
    (EXIT_CONFIG, "bad configuration, or a preflight check failed: nothing started", "do not retry"),
    (
        EXIT_NO_RETRY,
        "do not retry: running it again would fail the same way (the same failure twice, no progress past a point, "
        "stalls that restarts do not get past)",
        "do not retry",
    ),
    (EXIT_DATAERR, "unusable data: the worker (or a rank) said so, and no attempt can get past it", "do not retry"),
    (EXIT_IOERR, "the disk refused a write (full, read-only, I/O error): a person must make room", "do not retry"),
    (EX_CANTCREAT, "the run dir is another supervisor's (named on stderr): nothing started", "retry later"),
    (
        EXIT_FAILED,
        "hangwatch or the machine could not go on (the control socket or metrics port cannot be opened, processes "
        "outlived SIGKILL)",
        "look at the machine",
    ),
    (EX_USAGE, "usage", "fix the command line"),
)
DO_NOT_RETRY = frozenset(code for code, _, then in RUN_CODES if then == "do not retry")


def run_code_meaning(code: int) -> tuple[str, str] | None:
    """(what `hangwatch run`'s exit `code` means, what a scheduler should do), or None for a code not its own."""
    return next(((words, then) for c, words, then in RUN_CODES if c == code), None)
