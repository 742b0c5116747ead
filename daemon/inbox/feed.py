"""The worker's continuous mode (`data.inbox: true`): the inbox and its ContinuousSource behind the
trainer's data-source interface (`ContinuousDataSource`), and the `idle` phase while there is
nothing to train.

    feed = InboxFeed.open(cfg, hb, stop, validator)   # watches inbox/; what arrived while down is listed
    trainer = Trainer(cfg, hb, run_dir, bundle, feed, ...)
        feed.restore(position, step)                  # from the checkpoint (None: a fresh run)
        examples, end = feed.take_step(n)             # one optimizer step's examples
        feed.position()                               # on step boundaries, stored in checkpoints
        feed.commit(position, step)                   # once that checkpoint is committed
    feed.close()

Everything runs in the training thread: intake (validation with the run's tokenizer, then the
move to queue/ or rejected/), file moves and ledger writes.  The watchdog observer thread only
records file names; it never beats, so a hung training thread is still caught.

Waiting for data.  When no new example is available the worker is in phase `idle`: it beats
`progress` at least once a second (the supervisor applies no step deadline there, the silence
deadline still holds; the beat that ends the wait on a quiet spell carries its `decision`, flush or
idle), takes arrivals as they come, each intake in phase `intake` (budget
`watchdog.phase_budgets_s.intake`), and is back in `train` as soon as a file is
queued.

A step that cannot be filled (the queue ran dry part-way) waits in `idle` for the next file, so
step boundaries do not depend on when files arrive as long as they keep coming (a run whose files
were all there at the start trains the same steps however often it is interrupted).  Once nothing
new arrived for `data.flush_after_s` (`idle.IdlePolicy`), the examples in hand are handed out with
end "flush": the trainer trains them as a partial step, writes the checkpoint that covers them (so
their file reaches done/) and settles it; the wait then goes on, beating, without flushing again
until new examples are handed out.  After `data.idle_exit_s` with nothing queued and nothing
arriving, what is in hand is handed out with end "idle": the trainer trains it, checkpoints,
exports final/ and stops with reason `idle`.  With `idle_exit_s` null the worker waits for more
files for ever.  A stop request ends the wait with end "stop"; the examples already handed out for
the unfinished step are handed out again after the resume, since a checkpoint's position is always
the last step boundary.  `train.max_steps` still ends a run (reason `finished`); files not yet
trained then stay where they are for the next run in the same run dir.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, TextIO

from hangwatch.common.config import ConfigError
from hangwatch.daemon.inbox.assess import Validator
from hangwatch.daemon.inbox.idle import FLUSH, IDLE, IdlePolicy
from hangwatch.daemon.inbox.intake import Inbox, IntakeResult
from hangwatch.daemon.inbox.position import PositionError
from hangwatch.daemon.inbox.source import ContinuousSource

BEAT_EVERY_S = 1.0
MAX_PROBLEMS_IN_BEAT = 5


def printer(out: TextIO) -> Callable[[str], None]:
    """A log function: one line to `out`, flushed (the worker's stdout is its log file)."""
    return functools.partial(print, file=out, flush=True)


class WorkerInbox(Inbox):
    """The inbox as the worker runs it: each intake in phase `intake`, its outcome beaten and logged."""

    def __init__(self, *args: Any, hb, budget_s: Optional[float], log: Callable[[str], None], **kw: Any):
        super().__init__(*args, **kw)
        self.hb = hb
        self.budget_s = budget_s
        self.log = log
        self.intakes = 0  # files taken in (queued or rejected): any of them is activity, not idleness

    def intake(self, name: str) -> Optional[IntakeResult]:
        with self.hb.phase("intake", budget_s=self.budget_s, file=name):
            result = super().intake(name)
        if result is None:
            return None
        self.intakes += 1
        a = result.assessment
        if result.outcome == "queued":
            skipped = (
                f", {a.problems_total} bad line(s) left out (report {result.report.name})" if a.skipped_lines else ""
            )
            self.log(f"inbox: queued {name} as {result.path.name}: {a.examples} example(s){skipped}")
            if a.skipped_lines:
                self.hb.warn(
                    f"inbox: {name}: {a.problems_total} bad line(s) left out",
                    file=name,
                    report=str(result.report),
                    problems=a.problems[:MAX_PROBLEMS_IN_BEAT],
                )
        else:
            self.log(f"inbox: {a.summary()} (report rejected/{result.report.name})")
            self.hb.warn(
                f"inbox: rejected {name}",
                file=name,
                report=str(result.report),
                reasons=[r["message"] for r in a.reasons][:MAX_PROBLEMS_IN_BEAT],
                problems=a.problems[:MAX_PROBLEMS_IN_BEAT],
            )
        return result


class InboxFeed:
    """`daemon.data.ContinuousDataSource` over the inbox: `take_step` may wait for data, `commit`
    records what a committed checkpoint covers, `close` stops the watcher thread."""

    def __init__(
        self,
        source: ContinuousSource,
        inbox: WorkerInbox,
        hb,
        stop,
        *,
        flush_after_s: float,
        idle_exit_s: Optional[float],
        clock: Callable[[], float] = time.monotonic,
        beat_every_s: float = BEAT_EVERY_S,
        out: TextIO = sys.stdout,
    ):
        self.source = source
        self.inbox = inbox
        self.hb = hb
        self.stop = stop
        self.policy = IdlePolicy(flush_after_s, idle_exit_s)
        self._clock = clock
        self._beat_every_s = beat_every_s
        # True from a flush until new examples are handed out: a quiet spell is flushed once.
        # False in a new attempt, so that it settles the checkpoint it resumed from.
        self._flushed = False
        self.log = printer(out)

    @classmethod
    def open(cls, cfg, hb, stop, validator: Validator, **kw: Any) -> "InboxFeed":
        """Start watching `<run_dir>/inbox/`; files already there are taken in by the first `take_step`."""
        budget = cfg.watchdog.phase_budgets_s.get("intake")
        inbox = WorkerInbox.from_config(
            cfg.run_dir, validator, cfg.data, hb=hb, budget_s=budget, log=printer(kw.get("out", sys.stdout))
        )
        source = ContinuousSource.from_config(cfg.run_dir, validator, cfg)
        feed = cls(
            source, inbox, hb, stop, flush_after_s=cfg.data.flush_after_s, idle_exit_s=cfg.data.idle_exit_s, **kw
        )
        inbox.start()
        return feed

    def close(self) -> None:
        self.inbox.stop()

    # ---- ContinuousDataSource ------------------------------------------------------------

    def position(self) -> dict:
        return self.source.position()

    def progress(self) -> dict:
        return self.source.progress()

    def restore(self, position: Optional[dict], step: Optional[int] = None) -> None:
        try:
            summary = self.source.restore(position, step)
        except PositionError as exc:
            raise ConfigError(
                [
                    f"data.inbox: the checkpoint being resumed does not hold a continuous-mode data position ({exc}); "
                    "it was made by a run with data.inbox: false — use a new run_dir"
                ]
            ) from None
        self._pass_on_warnings()
        changes = {
            k: summary[k] for k in ("ledger_trimmed", "ledger_added", "replay_trimmed", "replay_added") if summary[k]
        }
        if changes or summary["completed"] or summary["reopened"]:
            self.log(
                f"inbox: ledger brought to the resumed position: {changes}; completed {summary['completed']}, "
                f"reopened {summary['reopened']}"
            )

    def commit(self, position: dict, step: int) -> None:
        result = self.source.commit(position, step)
        for name in result["completed"]:
            self.log(f"inbox: {name} done (checkpoint step {step} covers its last example)")

    def take(self, n: int) -> list:
        return self.take_step(n)[0]

    def take_step(self, n: int) -> tuple[list, Optional[str]]:
        """`n` examples (fresh and replayed), or fewer with end "stop", "flush" or "idle" (see the module doc)."""
        self.inbox.poll()  # arrivals while training: a few cheap checks unless a file is ready
        items: list = []
        end = None
        while len(items) < n:
            item = self.source.next_example()
            if item is None:
                end = self._wait_for_data(len(items))
                if end is not None:
                    break
                continue
            items.append(item)
            self._flushed = False
        self._pass_on_warnings()
        return [i.example for i in items], end

    # ---- idle ------------------------------------------------------------------------------

    def _wait_for_data(self, have: int) -> Optional[str]:
        """Phase idle until a file is queued (None), a stop is requested ("stop"), or the quiet spell
        calls for a flush ("flush") or the end ("idle"): `idle.IdlePolicy`."""
        since = last_activity = self._clock()
        intakes = self.inbox.intakes
        self.log(
            f"idle: no new data ({have} example(s) of the next step in hand); waiting for files in {self.inbox.dir}"
        )
        with self.hb.phase("idle", waiting_examples=have):
            while True:
                if self.stop:
                    return "stop"
                wait = self.policy.wait_s(self._clock() - last_activity, self._flushed, self._beat_every_s)
                if self.inbox.wait_for_work(wait):
                    self._pass_on_warnings()
                    if self.source.has_fresh():
                        return None
                self._pass_on_warnings()
                now = self._clock()
                if self.inbox.intakes != intakes or self.inbox.arriving():
                    intakes, last_activity = self.inbox.intakes, now
                quiet = now - last_activity
                decision = self.policy.decide(quiet, self._flushed)
                self.hb.progress(
                    idle_s=round(now - since, 1),
                    waiting_examples=have,
                    arriving=self.inbox.arriving(),
                    **({"decision": decision} if decision else {}),
                )
                if decision == IDLE:
                    self.log(
                        f"idle for {quiet:.1f}s (data.idle_exit_s = {self.policy.idle_exit_s:g}): "
                        f"finishing with {have} example(s) in the last step"
                    )
                    return IDLE
                if decision == FLUSH:
                    self._flushed = True
                    self.log(
                        f"no new data for {quiet:.1f}s (data.flush_after_s = {self.policy.flush_after_s:g}): "
                        + (
                            f"training the {have} example(s) in hand as a partial step"
                            if have
                            else "making the last step durable"
                        )
                    )
                    return FLUSH

    def _pass_on_warnings(self) -> None:
        while self.source.warnings:
            w = self.source.warnings.pop(0)
            self.hb.warn(f"inbox: {w}")
            self.log(f"inbox: {w}")


def open_feed(cfg, tokenizer, hb, stop) -> InboxFeed:
    """The continuous-mode data source of the built-in worker, validating with the run's tokenizer."""
    from hangwatch.daemon.data import validate_file

    def validator(path: Path):
        return validate_file(path, tokenizer, cfg)

    return InboxFeed.open(cfg, hb, stop, validator)
