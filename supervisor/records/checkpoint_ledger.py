"""Which checkpoints a worker announced, which of them are good, and which one an attempt resumes from.

Any training script can announce its checkpoints (`Heartbeat.checkpoint(path, step, good)`); the
supervisor keeps the record here, judges them from the beats that follow, persists the record in
`<run_dir>/checkpoints.json`, and hands every attempt the last good one in `HANGWATCH_RESUME_FROM`.

The rules (`CheckpointLedger`, pure: beats in, changes out):
  * a `checkpoint` beat records (path, step, attempt, rank) as *pending*; `good=True` makes it good
    at once (the built-in worker confirms its own; a script may vouch for one itself) — the worker's
    explicit word wins even over a non-finite loss the supervisor saw (that is logged);
  * a pending checkpoint becomes *good* once `checkpoint.confirm_steps` different steps numbered
    above its own, of the same attempt, reported a finite `loss` (from any rank; several ranks
    reporting the same step count once).  `confirm_steps: 0`: good when announced;
  * a non-finite loss (NaN, ±inf; JSON's NaN arrives as a float nan) from any rank of the same
    attempt, in a `step` beat or a `warn` beat, after the announcement and before the confirmation,
    makes it *bad* ("loss nan at step 5") — whatever the step number: a rank that lags behind still
    reports on weights that went into the checkpoint.  A `warn` beat naming it in
    `unconfirmed_checkpoints` (the built-in worker's non-finite guard) makes it bad too;
  * an attempt that ends first leaves it *unconfirmed* (never good: nothing vouched for it);
  * a new announcement of a path already recorded replaces the record (a later attempt, or a
    "latest" directory overwritten, saved other weights there) — except a duplicate of the same
    attempt and step (several ranks announcing one checkpoint), which changes nothing;
  * step beats without a `loss`: once any beat of the run reported a loss, they count for nothing
    (a script that logs its loss every N steps is judged on the losses it does report, so a
    checkpoint may wait longer).  A worker that has never reported a loss in the whole run is
    judged on the only evidence it gives: `confirm_steps` later steps confirm its checkpoints (it
    cannot have a non-finite loss we would see, and the alternative — never resuming — would throw
    the whole run away at every restart).  That is logged once, with how to do better: send
    `loss=` in step beats, or announce `good=True` yourself.  A string loss ("nan", "tensor(0.5)",
    what `json.dumps(default=str)` makes of a tensor) is read as the number it spells.

The last good checkpoint (`last_good`) is the good one with the highest step, then the latest
announced; `state.json` and `status` show it as recorded.  The resume point (`resume_point`) is the
same, but skips ones that no longer exist on disk (a script's own retention deleted them).  Paths
are recorded as announced; a relative one is the worker's (relative to `worker.cwd`), so existence is
checked, and the path handed over made absolute, against that directory (`resolved_path`).  The newest
MAX_KEPT settled records are kept (with every pending one and the last good one, however old).

`PersistedLedger` wraps the record with its file: loaded when the supervisor starts (so a
supervisor restarted on the same run dir keeps it), written atomically (`FsOps.write_json`) at every
change of status.  A write that fails is logged and retried at the next change, never fatal: the
record stays in memory.  A file that cannot be read is set aside (`checkpoints.json.corrupt-…`,
evidence is never deleted) and the run starts with an empty record.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterable, Optional

import structlog

from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import CHECKPOINT_LEDGER_NAME, read_json

log = structlog.get_logger("hangwatch")

FORMAT_VERSION = 1
PENDING, GOOD, BAD, UNCONFIRMED = "pending", "good", "bad", "unconfirmed"
STATUSES = (PENDING, GOOD, BAD, UNCONFIRMED)
MAX_KEPT = 200  # settled records kept (the newest good one and every pending one always are)
_TENSOR = re.compile(r"^\s*tensor\(\s*([^,)\s]+)")


def loss_of(rec: dict) -> Optional[float]:
    """The `loss` a beat carries as a float, or None when it carries none (absent, null, not a number)."""
    v = rec.get("loss")
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        m = _TENSOR.match(v)
        try:
            return float(m.group(1) if m else v)
        except ValueError:
            return None
    return None


@dataclass
class Entry:
    """One announced checkpoint and what became of it."""

    path: str  # as the worker announced it (relative paths are the worker's, see `resolved_path`)
    step: Optional[int]
    status: str
    attempt: int
    rank: int
    seq: int  # announcement order over the whole run: "latest" among equal steps
    why: str = ""  # how it got its status: "confirmed by finite loss at steps 6, 7", "loss nan at step 5"
    confirmed_by: list[int] = field(default_factory=list)  # the later steps counted so far
    announced_t: Optional[float] = None  # the worker's clock (`t` of the beat)
    set_aside: Optional[str] = None  # where a bad one was renamed to, out of the script's own "latest" search

    @property
    def good(self) -> bool:
        return self.status == GOOD

    def order(self) -> tuple[int, int]:
        return (self.step if self.step is not None else -1, self.seq)


@dataclass
class Change:
    """What a beat changed: `kind` is announced, replaced, good, bad, unconfirmed or lossless (the
    run's first checkpoint confirmed without any loss ever reported)."""

    kind: str
    entry: Entry
    note: str = ""


class CheckpointLedger:
    """The run's checkpoints and the rules that judge them (module docstring); no I/O."""

    def __init__(self, confirm_steps: int = 2, entries: Iterable[Entry] = (), loss_reported: bool = False):
        self.confirm_steps = confirm_steps
        self.entries: dict[str, Entry] = {e.path: e for e in entries}
        self.loss_reported = loss_reported
        self.next_seq = max((e.seq for e in self.entries.values()), default=0) + 1
        self._told_lossless = False

    # ---- beats -----------------------------------------------------------------------------------

    def observe(self, rec: dict, attempt: int) -> list[Change]:
        """One heartbeat line of attempt `attempt`; returns what it changed (empty for most beats)."""
        ev = rec.get("event")
        if ev == "checkpoint":
            return self._announced(rec, attempt)
        if ev == "step":
            return self._step(rec, attempt)
        if ev == "warn":
            return self._warn(rec, attempt)
        return []

    def _announced(self, rec: dict, attempt: int) -> list[Change]:
        path = rec.get("path")
        if not isinstance(path, str) or not path:
            return []
        step = rec.get("step") if isinstance(rec.get("step"), int) else None
        rank = int(rec.get("rank") or 0)
        vouched = rec.get("good") is True
        old = self.entries.get(path)
        if old is not None and old.attempt == attempt and old.step == step:
            if not vouched or old.good:
                return []  # the same checkpoint announced again (another rank): nothing new
            note = f" (the supervisor had seen: {old.why})" if old.status == BAD else ""
            return [self._settle(old, GOOD, "announced good by the worker" + note)]
        e = Entry(path, step, PENDING, attempt, rank, self._seq(), announced_t=rec.get("t"))
        self.entries[path] = e
        changes = [
            Change(
                "replaced" if old is not None else "announced",
                e,
                f"was {old.status} (attempt {old.attempt}, step {old.step})" if old is not None else "",
            )
        ]
        if vouched:
            changes.append(self._settle(e, GOOD, "announced good by the worker"))
        elif self.confirm_steps == 0:
            changes.append(self._settle(e, GOOD, "good when announced (checkpoint.confirm_steps is 0)"))
        self._prune()
        return changes

    def _step(self, rec: dict, attempt: int) -> list[Change]:
        loss = loss_of(rec)
        step = rec.get("step")
        if loss is not None:
            self.loss_reported = True
        pending = self._pending(attempt)
        if loss is not None and not math.isfinite(loss):
            return [self._settle(e, BAD, f"loss {_num(loss)} at step {step}") for e in pending]
        if loss is None and self.loss_reported:
            return []  # a step without a loss, from a worker that reports losses: no evidence either way
        changes = []
        for e in pending:
            if isinstance(step, int) and (e.step is None or step > e.step) and step not in e.confirmed_by:
                e.confirmed_by.append(step)
                if len(e.confirmed_by) >= self.confirm_steps:
                    steps = ", ".join(map(str, e.confirmed_by))
                    if loss is None:
                        changes.append(
                            self._settle(e, GOOD, f"confirmed by steps {steps} (this worker reports no loss)")
                        )
                        if not self._told_lossless:
                            self._told_lossless = True
                            changes.append(Change("lossless", e))
                    else:
                        changes.append(self._settle(e, GOOD, f"confirmed by finite loss at steps {steps}"))
        return changes

    def _warn(self, rec: dict, attempt: int) -> list[Change]:
        changes = []
        loss = loss_of(rec)
        if loss is not None and not math.isfinite(loss):
            why = f"loss {_num(loss)} at step {rec.get('step')}"
            changes += [self._settle(e, BAD, why) for e in self._pending(attempt)]
        named = rec.get("unconfirmed_checkpoints")
        if isinstance(named, list):
            why = f"the worker withdrew it: {rec.get('message') or 'no reason given'}"
            changes += [self._settle(e, BAD, why) for e in self._pending(attempt) if e.path in named]
        return changes

    def attempt_ended(self, attempt: int) -> list[Change]:
        """Attempt `attempt` is over: what it left unconfirmed stays so."""
        return [
            self._settle(
                e, UNCONFIRMED, f"attempt {e.attempt} ended before {self.confirm_steps} later steps confirmed it"
            )
            for e in self.entries.values()
            if e.status == PENDING and e.attempt <= attempt
        ]

    def adopt(self, path: str, step: Optional[int], why: str) -> Entry:
        """A good checkpoint known from elsewhere (state.json of a supervisor that kept no ledger)."""
        e = Entry(path, step, GOOD, 0, 0, self._seq(), why=why)
        self.entries[path] = e
        return e

    # ---- answers ---------------------------------------------------------------------------------

    def good(self) -> list[Entry]:
        """Good checkpoints, newest first."""
        return sorted((e for e in self.entries.values() if e.good), key=Entry.order, reverse=True)

    def last_good(self) -> Optional[Entry]:
        found = self.good()
        return found[0] if found else None

    def resume_point(self, exists: Callable[[Entry], bool]) -> tuple[Optional[Entry], list[Entry]]:
        """(the newest good checkpoint that `exists`, the newer good ones skipped because they do not)."""
        skipped = []
        for e in self.good():
            if exists(e):
                return e, skipped
            skipped.append(e)
        return None, skipped

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATUSES}
        for e in self.entries.values():
            out[e.status] += 1
        return out

    # ---- the record ------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        last = self.last_good()
        return {
            "version": FORMAT_VERSION,
            "confirm_steps": self.confirm_steps,
            "loss_reported": self.loss_reported,
            "last_good": last.path if last else None,
            "checkpoints": [asdict(e) for e in sorted(self.entries.values(), key=lambda e: e.seq)],
        }

    @classmethod
    def from_dict(cls, data: object, confirm_steps: int) -> "CheckpointLedger":
        """The record `to_dict` wrote; ValueError naming what is wrong.  Pending entries were left by a
        supervisor that ended with its attempt: they are unconfirmed now."""
        if not isinstance(data, dict):
            raise ValueError(f"expected an object, got {type(data).__name__}")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(f"format version {data.get('version')!r}, this hangwatch reads {FORMAT_VERSION}")
        raw = data.get("checkpoints")
        if not isinstance(raw, list):
            raise ValueError("`checkpoints` is not a list")
        entries, known = [], {f.name for f in fields(Entry)}
        for i, item in enumerate(raw):
            if not isinstance(item, dict):
                raise ValueError(f"checkpoint #{i} is not an object")
            try:
                e = Entry(**{k: v for k, v in item.items() if k in known})  # fields a newer writer added are dropped
            except TypeError as exc:
                raise ValueError(f"checkpoint #{i}: {exc}") from None
            if not (
                isinstance(e.path, str)
                and e.status in STATUSES
                and isinstance(e.seq, int)
                and isinstance(e.attempt, int)
                and (e.step is None or isinstance(e.step, int))
            ):
                raise ValueError(f"checkpoint #{i}: bad path, step, status, attempt or seq")
            entries.append(e)
        book = cls(confirm_steps, entries, loss_reported=bool(data.get("loss_reported")))
        for e in book.entries.values():
            if e.status == PENDING:
                e.status, e.why = (
                    UNCONFIRMED,
                    f"attempt {e.attempt} ended (with its supervisor) before it was confirmed",
                )
        return book

    # ---- inside ----------------------------------------------------------------------------------

    def _seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1

    def _pending(self, attempt: int) -> list[Entry]:
        return [e for e in self.entries.values() if e.status == PENDING and e.attempt == attempt]

    def _settle(self, e: Entry, status: str, why: str) -> Change:
        e.status, e.why = status, why
        return Change(status, e)

    def _prune(self) -> None:
        settled = sorted((e for e in self.entries.values() if e.status != PENDING), key=lambda e: e.seq)
        keep = self.last_good()
        for e in settled[: max(0, len(settled) - MAX_KEPT)]:
            if e is not keep:
                del self.entries[e.path]


def _num(x: float) -> str:
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf") if math.isinf(x) else f"{x:g}"


def resolved_path(path: str, cwd: Optional[str]) -> str:
    """An announced path as an absolute one: relative paths are the worker's, relative to its cwd."""
    return os.path.normpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(path)))


class PersistedLedger:
    """The ledger and its file in the run dir; the supervisor's one handle on both."""

    def __init__(self, run_dir: os.PathLike | str, confirm_steps: int, fs: Optional[FsOps] = None):
        self.path = Path(run_dir) / CHECKPOINT_LEDGER_NAME
        self.fs = fs if fs is not None else FsOps()
        self.ledger = CheckpointLedger(confirm_steps)
        self.dirty = False
        self.writable = True  # False once a bad file could not be set aside: it must not be overwritten

    def load(self) -> Optional[str]:
        """Read the file; returns the problem when it could not be used (the ledger then starts empty)."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
            self.ledger = CheckpointLedger.from_dict(data, self.ledger.confirm_steps)
            return None
        except (OSError, ValueError) as exc:
            problem = f"{self.path}: unusable ({exc})"
        aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            self.fs.rename(self.path, aside)
            problem += f"; set aside as {aside.name}, starting with an empty checkpoint record"
        except OSError as exc:
            self.writable = False
            problem += f"; could not be set aside ({exc}): left in place, the record is kept in memory only"
        return problem

    def observe(self, rec: dict, attempt: int) -> list[Change]:
        changes = self.ledger.observe(rec, attempt)
        self._changed(changes)
        return changes

    def attempt_ended(self, attempt: int) -> list[Change]:
        changes = self.ledger.attempt_ended(attempt)
        self._changed(changes)
        return changes

    def _changed(self, changes: list[Change]) -> None:
        for c in changes:
            _log_change(c)
        if changes:
            self.dirty = True
            self.save()

    def save(self) -> bool:
        """Write the record; a failure is logged and leaves it dirty (retried at the next change)."""
        if not self.writable:
            return False
        try:
            self.fs.write_json(self.path, self.ledger.to_dict())
        except OSError as exc:
            log.warning(
                "checkpoint_ledger_not_saved",
                path=str(self.path),
                error=str(exc),
                note="kept in memory; written again at the next change",
            )
            return False
        self.dirty = False
        return True


def read_record(run_dir: os.PathLike | str) -> Optional[dict]:
    """The persisted record of a run dir as plain JSON (for reports), None when missing or unreadable."""
    return read_json(Path(run_dir) / CHECKPOINT_LEDGER_NAME)


def _log_change(c: Change) -> None:
    e = c.entry
    where = dict(path=e.path, step=e.step, attempt=e.attempt, rank=e.rank)
    if c.kind == "announced":
        log.info("checkpoint_announced", **where)
    elif c.kind == "replaced":
        log.info("checkpoint_reannounced", **where, previous=c.note)
    elif c.kind == GOOD:
        log.info("good_checkpoint", **where, why=e.why)
    elif c.kind == BAD:
        log.warning("checkpoint_not_good", **where, why=e.why)
    elif c.kind == UNCONFIRMED:
        log.info("checkpoint_unconfirmed", **where, why=e.why)
    elif c.kind == "lossless":
        log.warning(
            "checkpoints_confirmed_without_loss",
            **where,
            note="the worker reports no loss, so later steps alone confirm its checkpoints; send loss= in "
            "step beats (or announce checkpoint(..., good=True) yourself) to have non-finite losses caught",
        )


def resume_choice(book: CheckpointLedger, cwd: Optional[str], attempt: int) -> tuple[str, Optional[int]]:
    """What the attempt about to start resumes from (HANGWATCH_RESUME_FROM): (the newest good checkpoint still on
    disk as an absolute path — relative ones are the worker's, its cwd —, its step); ("", None) for none.  Good ones
    that were deleted since are skipped, and said so."""
    chosen, skipped = book.resume_point(lambda e: os.path.exists(resolved_path(e.path, cwd)))
    for e in skipped:
        log.warning(
            "good_checkpoint_missing",
            path=e.path,
            step=e.step,
            resolved=resolved_path(e.path, cwd),
            note="no longer on disk: skipped",
        )
    if chosen is None:
        log.info(
            "resume_from",
            attempt=attempt,
            path=None,
            checkpoints=book.counts(),
            note="no good checkpoint on disk: HANGWATCH_RESUME_FROM is empty",
        )
        return "", None
    path = resolved_path(chosen.path, cwd)
    log.info("resume_from", attempt=attempt, path=path, step=chosen.step, why=chosen.why)
    return path, chosen.step


ASIDE_SUFFIX = ".hangwatch-bad"  # a bad checkpoint's new name: `checkpoint-8` → `checkpoint-8.hangwatch-bad`


def set_aside_bad(
    book: CheckpointLedger, cwd: Optional[str], rename: Callable[[str, str], None] = os.rename
) -> list[tuple[Entry, str]]:
    """Rename every checkpoint the ledger holds bad that is still on disk to `<path>.hangwatch-bad` (a free name:
    `.2`, `.3`, … after it), so that an unedited script's own "resume from the latest" logic (HF's
    `checkpoint-N` search, a glob of `*.pt`) finds the last good one instead.  Never deleted: the entry records
    where it went (`set_aside`).  Returns what was moved; a rename that fails is logged and left (the run goes
    on: the script may still find the bad one, as it would without hangwatch)."""
    moved = []
    for e in book.entries.values():
        if e.status != BAD or e.set_aside:
            continue
        src = resolved_path(e.path, cwd)
        if not os.path.lexists(src):
            continue
        dst, n = src.rstrip(os.sep) + ASIDE_SUFFIX, 1
        while os.path.lexists(dst):
            n += 1
            dst = f"{src.rstrip(os.sep)}{ASIDE_SUFFIX}.{n}"
        try:
            rename(src, dst)
        except OSError as exc:
            log.warning(
                "bad_checkpoint_not_set_aside",
                path=src,
                error=str(exc),
                note="the script's own search for its latest checkpoint may still find it",
            )
            continue
        e.set_aside = dst
        moved.append((e, dst))
        log.warning(
            "bad_checkpoint_set_aside",
            path=src,
            to=dst,
            step=e.step,
            why=e.why,
            note="renamed, not deleted, so the script's own resume logic finds the last good one",
        )
    return moved
