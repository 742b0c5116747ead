"""The next attempt's worker, loaded before it is needed (`restart.prewarm`; `processes.standby.Prewarm`).

`on_failure`: a standby is spawned where a restart becomes likely — a stall detected, an exit the policy restarts,
a graceful restart asked for — and loads the model while the old tree is dumped and killed.  `always`: it is kept
ready from the current attempt's first step on, and replaced when it dies.  The next attempt takes it instead of
spawning a cold worker; any outcome that is not a restart discards it.  Registered when `restart.prewarm` is set
(a run that cannot be prewarmed says why once, and keeps none).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import (
    AttemptStarted,
    Beat,
    Closing,
    OutcomeReached,
    OutputProgress,
    PassBegins,
    PassSettled,
    StopRequested,
)
from hangwatch.supervisor.processes.standby import Prewarm, SpawnStandby, spawn_standby
from hangwatch.supervisor.rules.states import State


@dataclass(eq=False)
class PrewarmedStandby(Concern):
    table: Any = None  # the process table
    config_path: Optional[Path] = None
    spawn: SpawnStandby = spawn_standby

    def __post_init__(self) -> None:
        self.name = "prewarmed_standby"
        self.keeper = Prewarm(self.run.cfg, self.config_path, self.table, fs=self.run.fs, spawn=self.spawn)
        self.stepped = False

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.stepped = False

    def take_worker(self, number: int, adir: Path, resume_from: str, now: float):
        return self.keeper.take(number, adir, resume_from, now)

    def own_pids(self) -> set[int]:
        return self.keeper.pids()  # discarded standbys not reaped yet are not the worker's orphans

    def on_beat(self, ev: Beat) -> None:
        rec = ev.rec
        if rec["event"] == "step":
            self.stepped = True

    def on_output_progress(self, ev: OutputProgress) -> None:
        if not self.run.deadlines.started:
            self.stepped = True

    def on_pass_begins(self, ev: PassBegins) -> None:
        now = ev.now
        self.keeper.poll(now)

    def on_stop_requested(self, ev: StopRequested) -> None:
        attempt, intent, now = ev.attempt, ev.intent, ev.now
        self.keeper.begin(attempt, intent, None, now, why=f"{intent.value} requested")

    def episode_opened(self, attempt, episode, intent, now: float) -> dict[str, Any]:
        where = self.run.where()
        if where is not None and where.state is State.STOPPING:
            return {}  # the stop request already began one, if a restart follows
        stall = episode.expired is not None or episode.kind == "manual"
        why = episode.kind or ("stall" if stall else "worker exited")
        self.keeper.begin(attempt, intent, None if stall else episode.proposed, now, why=why)
        return {}

    def on_outcome(self, ev: OutcomeReached) -> None:
        out, now = ev.outcome, ev.now
        if out.state not in (State.STARTING, State.BACKOFF):
            self.keeper.discard(now, f"no restart: {out.state.value} ({out.why})")

    def on_pass_settled(self, ev: PassSettled) -> None:
        where, now = ev.where, ev.now
        # restart.prewarm: always — the next attempt's standby, ready before a failure
        if (
            where.state is State.RUNNING
            and where.episode is None
            and where.expired is None
            and where.attempt is not None
            and self.stepped
        ):
            self.keeper.keep(where.attempt, now)

    def readers(self, now: float) -> dict[str, Callable[[], Any]]:
        return {"standby": lambda: self.keeper.describe(now)}

    def on_closing(self, ev: Closing) -> None:
        now = ev.now
        self.keeper.close(now)  # a standby nobody will release: killed and reaped
