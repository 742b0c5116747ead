"""Reading the logs back: `hangwatch logs [-f] [--supervisor] [--attempt N]`.

The worker's output is kept per attempt (`attempts/NNNN/worker.log`), and the attempt that hung is seldom the
newest: so every attempt's log is shown, oldest first, each under a heading that says how the attempt ended
(`attempt_heading`: from what the run dir records of it — the incident that ended it, its last words, its last
beat, state.json for the attempt in progress).  `--attempt N` shows one.  Following (`-f`) goes on from the newest
attempt into each new one; the supervisor log is followed across rotation (rename + create) and truncation.
`sleep` is a seam so tests drive it without waiting.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from hangwatch.common.rundir import (
    ATTEMPTS,
    EXIT_NAME,
    STATE_NAME,
    SUPERVISOR_LOG_NAME,
    attempt_dir,
    attempt_numbers,
    heartbeat_path,
    read_json,
    tail_text,
    worker_log_path,
)
from hangwatch.supervisor.incidents.store import RECORD_NAME, IncidentStore
from hangwatch.supervisor.records.runlock import holder

ENDED_STATES = ("finished", "failed", "stopped")
RULE = "────"


def run_ended(run_dir: os.PathLike | str) -> bool:
    """True when the run is over: state.json says it ended and no supervisor holds the run dir.

    A supervisor that died (SIGKILL) leaves `running` behind: that run is not over (systemd may be
    about to restart it), so a follower keeps waiting.
    """
    state = read_json(Path(run_dir) / STATE_NAME) or {}
    return state.get("state") in ENDED_STATES and holder(run_dir) is None


class NoLogYet(Exception):
    pass


def attempt_logs(run_dir: os.PathLike | str) -> list[tuple[int, Path]]:
    """(attempt, its worker.log) of every attempt that has one, oldest first.  An attempt whose directory exists
    but whose worker was not spawned yet has no log, and is not listed until it has."""
    out = []
    for n in attempt_numbers(run_dir):
        p = worker_log_path(run_dir, n)
        if p.exists():
            out.append((n, p))
    return out


def latest_worker_log(run_dir: os.PathLike | str) -> Optional[Path]:
    """The worker log of the newest attempt that has one."""
    logs = attempt_logs(run_dir)
    return logs[-1][1] if logs else None


def attempt_of(path: Path) -> Optional[int]:
    """The attempt an `attempts/NNNN/worker.log` belongs to, or None for another file."""
    parent = path.parent
    return int(parent.name) if parent.parent.name == ATTEMPTS and parent.name.isdigit() else None


def no_such_attempt(run_dir: os.PathLike | str, attempt: int) -> str:
    """The one line that says attempt `attempt` has no log, naming those that have one."""
    have = [n for n, _ in attempt_logs(run_dir)]
    if not have:
        return f"no attempt {attempt} in {run_dir}: it has no worker log yet"
    if attempt_dir(run_dir, attempt).is_dir():
        return f"attempt {attempt} in {run_dir} has no worker log yet; attempts with one: {_ranges(have)}"
    return f"no attempt {attempt} in {run_dir}; its attempts: {_ranges(have)}"


def _ranges(numbers: list[int]) -> str:
    """1, 2, 3, 5, 6 → "1-3, 5, 6": a run with hundreds of restarts still fits on the line."""
    out: list[str] = []
    start = prev = None
    for n in numbers + [None]:
        if prev is not None and n == prev + 1:
            prev = n
            continue
        if start is not None:
            out.append(f"{start}-{prev}" if prev - start >= 2 else ", ".join(map(str, range(start, prev + 1))))
        start = prev = n
    return ", ".join(out)


# ---------------------------------------------------------------------------------------- how an attempt ended

# The kinds of incident in which the supervisor ended the worker itself: "killed after a stall".  Any other incident
# that carries the worker's exit is the worker's own end ("exit 1: crash", "killed by SIGSEGV: signal").
KILLED_AFTER = {
    "stall": "a stall",
    "livelock": "a livelock",
    "startup_timeout": "a startup timeout",
    "manual": "restart --now",
    "no_progress": "no progress",
    "resume_ignored": "an ignored resume",
    "unkillable": "an unkillable wait",
    "lost_peer": "a lost peer",
    "peer_restart": "a peer's restart",
}


class AttemptOutcomes:
    """How each attempt ended, from what the run dir records: read once (incidents), state.json read each time (the
    attempt in progress moves on).  An attempt newer than any incident seen makes the incidents be read again."""

    def __init__(self, run_dir: os.PathLike | str):
        self.run_dir = Path(run_dir)
        self._incidents: Optional[dict[int, list[dict]]] = None
        self._newest = 0

    def incidents(self, attempt: int) -> list[dict]:
        if self._incidents is None or attempt > self._newest:
            self._incidents = {}
            for d in IncidentStore(self.run_dir).dirs():
                rec = read_json(d / RECORD_NAME)
                if rec is not None and isinstance(rec.get("attempt"), int):
                    self._incidents.setdefault(rec["attempt"], []).append(rec)
            self._newest = max([attempt, *self._incidents], default=attempt)
        return self._incidents.get(attempt, [])

    def describe(self, attempt: int) -> str:
        """ "exit 1: crash, incident 0002", "killed after a stall, incident 0001", "running", "finished", …"""
        ending = [i for i in self.incidents(attempt) if isinstance(i.get("exit"), dict)]
        if ending:
            return incident_words(ending[-1])
        state = read_json(self.run_dir / STATE_NAME) or {}
        recorded, now = state.get("attempt"), state.get("state")
        if recorded == attempt and isinstance(now, str):
            if now in ENDED_STATES or holder(self.run_dir) is not None:
                return now
            return f"{now} when last recorded; no supervisor now"
        newest = max(attempt_numbers(self.run_dir), default=attempt)
        if attempt >= newest and (not isinstance(recorded, int) or attempt > recorded) and holder(self.run_dir):
            return "running"  # just spawned: state.json says so at the supervisor's next write
        words = read_json(attempt_dir(self.run_dir, attempt) / EXIT_NAME)
        if words is not None:
            code = words.get("exit_code")
            return f"exit {code}: {words.get('kind')}" if code is not None else f"{words.get('kind')}"
        stop = last_stop(self.run_dir, attempt)
        return f"stopped: {stop}" if stop else "ended"


def incident_words(inc: dict) -> str:
    kind = str(inc.get("kind") or "incident")
    ident = f"incident {inc.get('id')}"
    ex = inc.get("exit") or {}
    sig = ex.get("signal_name") or _signal_name(ex.get("signal"))
    if kind in KILLED_AFTER:
        return f"killed after {KILLED_AFTER[kind]}, {ident}"
    if sig:
        return f"killed by {sig}: {kind}, {ident}"
    if ex.get("code") is not None:
        return f"exit {ex['code']}: {kind}, {ident}"
    return f"{kind}, {ident}"


def _signal_name(sig) -> Optional[str]:
    if not isinstance(sig, int):
        return None
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def last_stop(run_dir: os.PathLike | str, attempt: int) -> Optional[str]:
    """The reason of the main rank's last `stop` beat in `attempt` (a graceful restart: `terminated`), if any."""
    for line in reversed(tail_text(heartbeat_path(attempt_dir(run_dir, attempt), 0), 20).splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == "stop":
            return str(rec.get("reason") or "stop")
    return None


def heading(attempt: int, outcome: str) -> str:
    """The separator line a log is shown under: `──── attempt 2 (killed after a stall, incident 0001) ────`."""
    return f"{RULE} attempt {attempt} ({outcome}) {RULE}"


# ------------------------------------------------------------------------------------------------- reading


def follow_log(
    run_dir: os.PathLike | str,
    *,
    supervisor: bool = False,
    attempt: Optional[int] = None,
    follow: bool = False,
    last_lines: Optional[int] = None,
    poll_s: float = 0.25,
    sleep=time.sleep,
    ended: Optional[Callable[[], bool]] = None,
) -> Iterator[Union[Path, bytes]]:
    """Yield a `Path` each time a file is opened, then its bytes as they arrive.

    The worker logs are those of every attempt, oldest first (`attempt`: that one only); once one is drained the
    next attempt's is opened, and with `follow` the newest is then followed until a newer attempt's worker.log
    appears (the old worker is dead by then: the supervisor starts an attempt only after the previous tree is
    reaped).  `last_lines`: start with the last N lines of them all, in whichever attempts those lie.  The
    supervisor log is followed like `tail -F`: a rotated (moved) file is drained, then the new one opened; a
    truncated one is read again from its start.  `ended()` (default `run_ended(run_dir)`) says the run is over:
    once it is and the file is drained, following stops instead of waiting forever.
    """
    if ended is None:
        ended = lambda: run_ended(run_dir)  # noqa: E731
    run_dir = Path(run_dir)
    every = not supervisor and attempt is None
    shown: Optional[int] = None  # the attempt whose log is open (every attempt's logs)

    def target() -> Optional[Path]:
        """The file to read now: the one open unless a newer one replaced it."""
        if supervisor:
            p = run_dir / SUPERVISOR_LOG_NAME
            return p if p.exists() else None
        if attempt is not None:
            p = worker_log_path(run_dir, attempt)
            return p if p.exists() else None
        later = [p for n, p in attempt_logs(run_dir) if shown is None or n > shown]
        if later:
            return later[0]
        return worker_log_path(run_dir, shown) if shown is not None else None

    f = None
    path: Optional[Path] = None
    first = True
    try:
        while True:
            if f is None:
                start = 0
                if first and every and last_lines is not None:
                    path, start = _tail_start(run_dir, last_lines)
                else:
                    path = target()
                if path is None:
                    if not follow or ended():
                        if supervisor:
                            raise NoLogYet(f"no supervisor log yet in {run_dir}")
                        if attempt is not None:
                            raise NoLogYet(no_such_attempt(run_dir, attempt))
                        raise NoLogYet(f"no worker log yet in {run_dir}")
                    sleep(poll_s)
                    continue
                f = open(path, "rb")
                if first and last_lines is not None:
                    f.seek(start if every else _tail_offset(f, last_lines))
                first = False
                if every:
                    shown = attempt_of(path)
                yield path
            chunk = f.read(65536)
            if chunk:
                yield chunk
                continue
            now_target = target()
            moved_on = now_target is not None and (
                now_target != path or _inode(now_target) != os.fstat(f.fileno()).st_ino
            )
            if not follow and not (every and moved_on):
                return
            if moved_on:
                rest = f.read(65536)  # written between the read that found it drained and the new file appearing
                if rest:
                    yield rest
                    continue
                f.close()
                f = None  # drained: move on to the next attempt / the file that replaced a rotated one
                continue
            if os.fstat(f.fileno()).st_size < f.tell():
                f.seek(0)  # truncated in place (copytruncate)
                continue
            if ended():
                rest = f.read()  # what was written between the last read and the end
                if rest:
                    yield rest
                return
            sleep(poll_s)
    finally:
        if f is not None:
            f.close()


def _tail_start(run_dir: Path, lines: int) -> tuple[Optional[Path], int]:
    """Where the last `lines` lines of all the attempts' logs together begin: (that attempt's log, the offset)."""
    logs = attempt_logs(run_dir)
    if not logs:
        return None, 0
    path, offset = logs[-1][1], 0
    for _, p in reversed(logs):
        with open(p, "rb") as f:
            offset, found = _tail_lines(f, lines)
        path = p
        lines -= found
        if lines <= 0:
            break
    return path, offset


def _inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _tail_offset(f, lines: int) -> int:
    """Offset of the start of the last `lines` lines of the open binary file `f`."""
    return _tail_lines(f, lines)[0]


def _tail_lines(f, lines: int) -> tuple[int, int]:
    """(offset, n) of the start of the last `lines` lines of the open binary file `f`: n is how many lines that
    start holds — fewer than `lines` when the whole file is shorter (the offset is then 0)."""
    end = f.seek(0, os.SEEK_END)
    if lines <= 0:
        return end, 0
    pos, seen, block = end, 0, 65536
    # A file that ends with a newline: that newline terminates the last line, it does not start one.
    f.seek(max(end - 1, 0))
    skip_last = f.read(1) == b"\n"
    while pos > 0:
        start = max(pos - block, 0)
        f.seek(start)
        data = f.read(pos - start)
        if skip_last and pos == end:
            data = data[:-1]
        for i in range(len(data) - 1, -1, -1):
            if data[i] == 0x0A:
                seen += 1
                if seen == lines:
                    return start + i + 1, seen
        pos = start
    return 0, seen + (1 if end > 0 else 0)
