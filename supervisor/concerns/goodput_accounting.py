"""Where every second of the run went (`records.goodput.Goodput`, the ledger; `goodput.json`).

Heartbeat lines of the main rank — steps, phase changes, checkpoints, starts, stops — prove progress at the line's
own time; a worker that does not beat proves it by progress lines in its output; a failure's detection turns the
provisional time since the last proof into lost time; each settled pass says what the time from then on is
(`records.goodput.activity`).  The ledger goes on from `goodput.json` across supervisor restarts.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from hangwatch.supervisor.concerns.base import Concern, PassState
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat, OutputProgress, PassSettled, Prepared
from hangwatch.supervisor.records.goodput import GOODPUT_NAME, Goodput, activity, read_goodput
from hangwatch.supervisor.rules.states import State

WRITE_S = 5.0  # goodput.json at most this often (and at the end)
PROGRESS_EVENTS = ("start", "phase", "step", "checkpoint", "stop")


class GoodputAccounting(Concern):
    def __post_init__(self) -> None:
        self.name = "goodput"
        self.ledger: Optional[Goodput] = None  # made at `Prepared` (from goodput.json) or at first use
        self.stepped = False  # the current attempt has beaten a step (or shown progress in its output)
        self.after_failure = False  # the current attempt follows a failure (its start-up is recovery)
        self.written_at = float("-inf")

    def on_prepared(self, ev: Prepared) -> None:
        now = ev.now
        self.ledger = Goodput(now, previous=read_goodput(self.run.run_dir))

    def _ledger(self, now: float) -> Goodput:
        if self.ledger is None:
            self.ledger = Goodput(now)
        return self.ledger

    def tick(self, where: Optional[PassState], now: float) -> None:
        if where is None:
            return
        ep, main = where.episode, where.main
        self._ledger(now).tick(
            now,
            activity(
                where.state.value,
                phase=main.phase if main is not None else None,
                stepped=self.stepped,
                after_failure=self.after_failure,
                failing=ep is None or ep.incident is not None,
                tree_gone=ep is not None and ep.killer is not None and ep.killer.gone_at is not None,
            ),
        )

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.stepped = False

    def on_beat(self, ev: Beat) -> None:
        tr, rec, now = ev.track, ev.rec, ev.now
        ev = rec["event"]
        if ev == "step":
            self.stepped = True
        if tr.rank != self.run.deadlines.main_rank() or ev not in PROGRESS_EVENTS:
            return
        # Placed at the line's own time (the writer's clock, the same machine's): a checkpoint or an eval shorter
        # than a pass still shows, and the activity from then on follows the phase the line entered.
        ledger = self._ledger(now)
        t = rec.get("t")
        at_line = now
        if isinstance(t, (int, float)) and not isinstance(t, bool):
            at_line = min(max(float(t) - ledger.offset, ledger.last), now)
        ledger.progress(at_line, int(rec["step"]) if ev == "step" else None)
        self.tick(self.run.where(), at_line)

    def on_output_progress(self, ev: OutputProgress) -> None:
        now = ev.now
        if not self.run.deadlines.started:
            self.stepped = True
            self._ledger(now).progress(now)  # a worker that does not beat: its progress lines are the proof

    def episode_opened(self, attempt, episode, intent, now: float) -> dict[str, Any]:
        """A failure's detection (an incident) makes the time since the last proof lost; a clean end proves it."""
        where = self.run.where()
        if episode.incident is not None and not (where is not None and where.state is State.STOPPING):
            self._ledger(now).detected(now)
            self.after_failure = True
        else:
            self._ledger(now).progress(now)
            self.after_failure = False
        return {}

    def on_pass_settled(self, ev: PassSettled) -> None:
        where, now = ev.where, ev.now
        self.tick(where, now)
        if now - self.written_at >= WRITE_S or where.state.final:
            self._write(now, durable=where.state.final)

    def _write(self, now: float, durable: bool) -> None:
        self.written_at = now
        path = self.run.run_dir / GOODPUT_NAME
        try:  # a record for `report` and the end summary; status reads the ledger itself
            self.run.fs.write_json(path, self._ledger(now).record(), durable=durable)
        except OSError as exc:
            self.run.write_failed(exc, path)

    def readers(self, now: float) -> dict[str, Callable[[], Any]]:
        return {"goodput": self._ledger(now).snapshot}
