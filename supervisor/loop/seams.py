"""Everything the loop acts with that a test may replace: one value, built by `app.run` (or a test), handed to
`Supervisor`.  The defaults are the real things; nothing here does I/O until the loop uses it."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hangwatch.common.durable import FsOps
from hangwatch.supervisor.nodes.peers import SpawnHelper
from hangwatch.supervisor.ops.signal_source import SignalSource
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes import snapshot as snapshots
from hangwatch.supervisor.processes.interpreter import instrument_note
from hangwatch.supervisor.processes.standby import SpawnStandby, spawn_standby
from hangwatch.supervisor.rules.policy import RestartPolicy

from .wakeup import Wakeup


@dataclass
class Seams:
    """`clock`: the monotonic clock only `Supervisor.run` reads.  `spawn`/`kill`/`table`: how processes are started,
    signalled and listed.  `control`: the control server (None: no socket); `notifier`: systemd's notify (None: a
    null one); `listeners`: told once a pass with the read model (`pass_done(view, now)`, the ops side).
    `snapshot`/`gpu`/`gpu_pids`: what a stall's snapshot samples.  `wakeup`: the selector the loop sleeps in
    (None: one with signal handlers when `install_signals`).  `subreaper`: adopt the tree's orphans.  `end_leftovers`:
    end a previous supervisor's worker.  `fs`: every write in the run dir (the seam that makes one fail).  `policy`:
    the restart policy (None: from the config).  `file_times`: date heartbeat lines by their files' modification
    times (None: only on the real clock, to which those times relate).  `peer_spawn`: how a multi-node run's peer-link
    helper is started; `spawn_standby`: how a prewarmed standby is.  `probe`: what instrumentation a `worker.command`
    gets, in words.  `signal_source`: who sent a stopping signal (a Slurm job's scancel, time limit or warning).
    `transparent`: `hangwatch run` in the foreground standing in for the command (its signals and exit status as
    bare: `rules.stop_signals`, `rules.outcome.run_exit_status`); `hangup_stops`: there, SIGHUP is the terminal's
    hang-up, passed on, rather than a request to reopen the logs."""

    clock: Callable[[], float] = time.monotonic
    spawn: attempts.Spawn = process.spawn
    kill: process.Kill = os.kill
    table: Optional[process.ProcessTable] = None
    control: Any = None
    notifier: Any = None
    listeners: tuple = ()
    snapshot: Callable[..., Any] = snapshots.TreeSample
    gpu: Callable[[], dict] = snapshots.gpu
    gpu_pids: Callable[[], Optional[set]] = snapshots.gpu_pids
    wakeup: Optional[Wakeup] = None
    install_signals: bool = True
    subreaper: bool = False
    cpu_sample_s: float = 0.5
    end_leftovers: bool = True
    fs: Optional[FsOps] = None
    policy: Optional[RestartPolicy] = None
    file_times: Optional[bool] = None
    peer_spawn: Optional[SpawnHelper] = None
    spawn_standby: SpawnStandby = spawn_standby
    probe: Callable[..., str] = instrument_note
    signal_source: Optional[SignalSource] = None
    transparent: bool = False
    hangup_stops: bool = False
    helpers: Callable[[], Any] = tuple  # the ops side's helper processes' pids (not the worker's: processes.process)

    def __post_init__(self) -> None:
        self.fs = self.fs if self.fs is not None else FsOps()
        if self.table is None:
            self.table = process.PsutilProcessTable(self.kill, helpers=self.helpers)
        self.wakeup = self.wakeup if self.wakeup is not None else Wakeup(install_signals=self.install_signals)
        self.signal_source = self.signal_source if self.signal_source is not None else SignalSource()
        self.listeners = tuple(self.listeners)
        if self.file_times is None:
            self.file_times = self.clock is time.monotonic
