"""Which checkpoints count: confirmation by the finite steps after a checkpoint, provisional
checkpoints, confirmation of an idle continuous run's checkpoint, and retention.

A committed checkpoint waits (`Pending`) until `checkpoint.confirm_steps` finite optimizer steps
followed it, then is marked good (if its weights are finite).  A non-finite step unconfirms every
waiting one: the steps after it did not stay finite.  A graceful stop leaves the last checkpoint
provisional instead (no steps follow it in this attempt); the next attempt resumes from it and
confirms it like any other.

Continuous mode (`provisional_on_commit`) cannot wait for later steps: data may not come for days,
and a kill meanwhile would go back to the last confirmed checkpoint, or to step 0.  So there:
  * every checkpoint whose weights are finite and whose step was finite is provisional from the
    moment it is committed: resume takes it, and a kill loses at most the work since the newest
    checkpoint;
  * it becomes good by the usual later finite steps, or, when the run goes quiet
    (`data.flush_after_s`, see `idle`), by a finite held-out loss of its weights on `data.eval`;
    without `data.eval` it stays provisional until training goes on and confirms it;
  * a non-finite held-out loss, like a non-finite streak, withdraws every provisional marker, so
    the rollback goes to the newest good checkpoint.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from hangwatch.daemon import checkpoint as ckpt
from hangwatch.daemon.worker_errors import NonFiniteStreak


class NonFiniteHeldOut(NonFiniteStreak):
    """An idle continuous run's weights give a non-finite held-out loss: like a non-finite streak,
    exit 75 and roll back to the last good checkpoint."""

    def __init__(self, step: int, loss: float):
        super().__init__(0, step)
        self.args = (f"non-finite held-out loss ({loss}) of the weights at step {step}",)


@dataclass
class Pending:
    path: Path
    step: int


class Confirmation:
    """The checkpoints of one attempt that wait for confirmation, and what becomes of them."""

    def __init__(
        self,
        run_dir: os.PathLike | str,
        hb,
        confirm_steps: int,
        keep_last: int,
        log: Callable[[str], None],
        *,
        provisional_on_commit: bool = False,
        root: Optional[os.PathLike] = None,
        on_good: Optional[Callable[[Path, int], None]] = None,
    ):
        self.root = Path(root) if root is not None else ckpt.checkpoints_root(run_dir)
        self.hb = hb
        self.confirm_steps = confirm_steps
        self.keep_last = keep_last
        self.log = log
        self.provisional_on_commit = provisional_on_commit
        self.pending: list[Pending] = []
        self.on_good = on_good  # told of each checkpoint marked good (the trainer holds it in memory)

    def wait_for(self, p: Pending) -> None:
        """`p` counts once the steps after it confirm it (a resumed provisional checkpoint, or a new one)."""
        self.pending.append(p)

    def commit_markers(self, tmp: Path) -> dict:
        """Continuous mode: the marks a checkpoint is committed with (`checkpoint.commit(markers=…)`):
        provisional when its weights and its step were finite — written inside the checkpoint before
        it is renamed into place, so no kill can find it committed but unmarked."""
        if not self.provisional_on_commit or self.confirm_steps == 0:
            return {}  # confirm_steps 0: `committed` makes it good at once
        state = ckpt.read_state(tmp)
        if not (state.get("weights_finite") is True and state.get("nonfinite_streak") == 0):
            return {}
        return {ckpt.PROVISIONAL: {"reason": "continuous mode: resumable until confirmed good or withdrawn"}}

    def committed(self, p: Pending, step: int) -> None:
        """Checkpoint `p` was just committed at `step`: good at once when no confirmation is asked for."""
        if self.confirm_steps == 0:
            self.mark_good(p, step)
        else:
            self.wait_for(p)
        self.retain()

    def mark_good(self, p: Pending, step: int, **why) -> None:
        if ckpt.validate(p.path, verify_hashes=False) is not None:
            self.hb.warn(
                f"checkpoint {p.path.name} is gone or damaged before it could be confirmed",
                path=str(p.path),
                unconfirmed_checkpoints=[str(p.path)],
            )  # the supervisor's ledger marks it bad
            return
        state = ckpt.read_state(p.path)
        if not state.get("weights_finite", False):
            self.hb.warn(
                f"checkpoint {p.path.name} has non-finite weights: never good",
                path=str(p.path),
                unconfirmed_checkpoints=[str(p.path)],
            )
            return
        ckpt.mark_good(p.path, confirmed_at_step=step, **why)
        if self.on_good is not None:
            self.on_good(p.path, p.step)
        self.hb.checkpoint(p.path, p.step, True)
        self.log(f"checkpoint {p.path.name} is good")

    def confirm(self, step: int) -> None:
        """A finite step `step` was taken: mark good every checkpoint it confirms."""
        still = []
        for p in self.pending:
            if step - p.step >= self.confirm_steps:
                self.mark_good(p, step)
            else:
                still.append(p)
        changed = len(still) != len(self.pending)
        self.pending = still
        if changed:
            self.retain()

    def unconfirm(self) -> list[str]:
        """A non-finite step: nothing waiting will be confirmed; returns their paths."""
        dropped = [str(p.path) for p in self.pending]
        self.pending.clear()
        return dropped

    def withdraw_provisional(self) -> None:
        """Training went non-finite for good: only confirmed checkpoints may be resumed."""
        ckpt.clear_provisional(self.root)

    def waiting_at(self, step: int) -> Optional[Pending]:
        """The checkpoint of `step` if it still waits for confirmation."""
        return next((p for p in self.pending if p.step == step), None)

    def settle_idle(self, step: int, heldout_loss: Optional[float]) -> None:
        """A continuous run went quiet at `step`, whose checkpoint is committed, whose training stayed
        finite, and which no step may follow for a long time: confirm it on the held-out loss of its
        weights (None: there is no data.eval; it stays provisional).  A non-finite loss withdraws
        every provisional marker and raises NonFiniteHeldOut (exit 75: roll back to the last good)."""
        p = self.waiting_at(step)
        if p is None:
            return
        if heldout_loss is None:
            self.log(f"checkpoint {p.path.name} stays provisional (no data.eval to confirm it on while idle)")
            return
        self.pending.remove(p)
        if not math.isfinite(heldout_loss):
            self.withdraw_provisional()
            self.hb.warn(
                f"checkpoint {p.path.name}: non-finite held-out loss while idle: never good; "
                "provisional checkpoints withdrawn",
                path=str(p.path),
                heldout_loss=heldout_loss,
                unconfirmed_checkpoints=[str(p.path)],
            )
            self.retain()
            raise NonFiniteHeldOut(step, heldout_loss)
        self.mark_good(p, step, reason="idle: finite held-out loss", heldout_loss=heldout_loss)
        self.retain()

    def provisional_on_stop(self, path: Path, finite: bool, why: str) -> None:
        """A graceful stop at checkpoint `path`: the next attempt may resume from it unconfirmed, if the
        training that led to it was finite."""
        if path.is_dir() and finite and not ckpt.is_good(path) and not ckpt.is_provisional(path):
            ckpt.mark_provisional(path, reason=why)
            self.log(f"checkpoint {path.name} is provisional: the next attempt resumes from it")

    def finish(self, step: int, why: str) -> None:
        """The run ends at `step`: its checkpoint counts as confirmed, as nothing follows it."""
        path = self.root / ckpt.step_name(step)
        self.pending = [p for p in self.pending if p.path != path]
        if not ckpt.is_good(path):
            self.mark_good(Pending(path, step), step, reason=why)
        self.retain()

    def retain(self) -> None:
        """Retention; checkpoints still waiting for confirmation are kept too, or with a small keep_last
        none would ever live long enough to become good."""
        ckpt.apply_retention(self.root, self.keep_last, protect=tuple(p.path for p in self.pending))


class RankConfirmation:
    """`Confirmation`'s stand-in on the ranks other than 0 of a multi-rank run: rank 0 alone writes,
    confirms, marks and retains checkpoints, so the other ranks keep none of that bookkeeping."""

    def __init__(self, hb=None):
        self.hb = hb

    def wait_for(self, p: Pending) -> None:
        pass

    def commit_markers(self, tmp: Path) -> dict:
        return {}

    def committed(self, p: Pending, step: int) -> None:
        pass

    def confirm(self, step: int) -> None:
        pass

    def unconfirm(self) -> list[str]:
        return []

    def withdraw_provisional(self) -> None:
        pass

    def waiting_at(self, step: int) -> Optional[Pending]:
        return None

    def settle_idle(self, step: int, heldout_loss: Optional[float]) -> None:
        pass

    def provisional_on_stop(self, path: Path, finite: bool, why: str) -> None:
        pass

    def finish(self, step: int, why: str) -> None:
        pass

    def retain(self) -> None:
        pass
