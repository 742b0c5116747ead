"""The one wiring of a supervisor: logging into the run dir, the control socket, systemd notify, the loop.

`hangwatch run` and the tests (`python -m hangwatch.supervisor run …`) go through here, so what is
tested is what users run.  Seams (clock, spawn, kill, process table, …) pass through to `Supervisor`.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from hangwatch.common.config import Config
from hangwatch.common.exitcodes import EX_CANTCREAT, EXIT_FAILED
from hangwatch.supervisor import logsetup
from hangwatch.supervisor.control import make_control
from hangwatch.supervisor.notify import Notifier
from hangwatch.supervisor.runlock import RunDirBusy, RunLock
from hangwatch.supervisor.runner import Supervisor


def run(cfg: Config, *, control_factory: Optional[Callable[[Config], Any]] = make_control,
        notifier: Any = None, configure_logging: bool = True, **seams) -> int:
    """Supervise `cfg` until done; return the exit code.

    Exit codes: 0 finished or stopped; the worker's 65/78 when it reported a do-not-restart error;
    1 for a crash loop or another failure (also when the control socket cannot be opened); 73 when
    another supervisor holds the run dir (then nothing in it was touched).
    """
    # The run-dir lock comes first: a second supervisor must not write one byte (log, socket-path
    # record, state.json) into a run dir another one is supervising.
    try:
        lock = RunLock.acquire(cfg.run_dir)
    except RunDirBusy as busy:
        print(f"hangwatch: {busy}", file=sys.stderr)
        return EX_CANTCREAT
    with lock:
        if configure_logging:
            logsetup.configure(cfg.run_dir, cfg.logging.level)
        control = None
        if control_factory is not None:
            try:
                control = control_factory(cfg)
            except OSError as exc:
                print(f"hangwatch: cannot open the control socket: {exc}", file=sys.stderr)
                return EXIT_FAILED
        seams.setdefault("subreaper", True)
        sup = Supervisor(cfg, control=control, notifier=notifier if notifier is not None else Notifier.from_env(), **seams)
        return sup.run()
