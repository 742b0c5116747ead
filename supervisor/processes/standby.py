"""`restart.prewarm`: the built-in worker's next attempt, loaded while the failed one is torn down.

A restart costs the worker's cold start — importing torch, transformers and peft, building the model
— after detection, dumps and the kill.  With `restart.prewarm: true` the supervisor spawns the next
attempt's worker at detection instead, as a *standby*: `python -m hangwatch.daemon … --standby`
(daemon/standby_worker.py), which loads everything that does not depend on the checkpoint onto the CPU and
then waits on its stdin.  Once the supervisor starts the next attempt — after the old tree is gone and
its GPU memory released, the order every restart keeps — it *releases* the standby: one JSON line
with the attempt number and HANGWATCH_RESUME_FROM (decided only now, as for a cold spawn).  The
standby then chooses its checkpoint, beats `start` (with `prewarmed: true`), takes the device and
trains: the restart costs what is left of the cold start.  What it saves is what overlaps: the
standby loads during detection → tree gone and any backoff; released when ready, it reaches its first
step in about a tenth of a second (`hangwatch bench --only prewarm`).

The standby is a real attempt-to-be: spawned like every worker (a session of its own, dying with the
supervisor: `process._child_setup`) with the next attempt's environment; it is not part of the failed
attempt's tree (`Attempt.foreign`: with the supervisor as subreaper it is one of our children, which
the tree scan would otherwise count as an orphan of the failed worker and kill); it beats, writes and
touches no checkpoint before its release; its output goes to `<run_dir>/standby.log`, moved into the
attempt's directory as its `worker.log` at release.

With `restart.prewarm: always` the standby does not wait for a failure: it is spawned as soon as the
current attempt has taken its first step (its own loading is over, so the two never compete for the
CPU and the disk at start-up), and is ready long before anything fails — a restart then costs the
kill, the GPU release, the checkpoint's load and the move to the device.  It holds the base model in
host RAM the whole time (shown by `status`: `describe`), and no GPU memory.  A standby that dies is
replaced after a back-off (1 s, doubling up to a minute while they keep dying).

`Prewarm`, owned by the reconciler, is the whole lifecycle:
    keep     `always`, every pass while the current attempt trains: spawn one when there is none;
    begin    at a stall, an exit the policy restarts, or a graceful `restart`: spawn it (once);
    poll     every pass: reap it if it died (a dead standby only means a cold spawn; `always` replaces it);
    take     when the next attempt starts: release it and hand over its `Worker`; None → spawn cold
             (no standby, it died, the release failed);
    discard  when no restart follows (stop, pause, failed, finished) or the run ends: SIGKILL to its
             group, reaped on a later pass (`dying`) — nothing in the loop waits;
    close    the supervisor is leaving: discard, and reap within a second (its teardown).
Only the built-in worker on one process is prewarmed (`ineligible`): a foreign command cannot be
told to wait, and a torchrun world is more than one process to hold.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable, Optional, Protocol

import structlog

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import WORKER_LOG_NAME, read_json, standby_ready_path
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes.process import ProcessTable, Worker, spawn
from hangwatch.supervisor.rules.outcome import Intent
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")

STANDBY_FLAG = "--standby"  # the worker's switch (daemon/standby_worker.py reads the release it then waits for)
STANDBY_LOG_NAME = "standby.log"  # in the run dir until the release moves it into the attempt's directory
REPLACE_AFTER_S = 1.0  # `always`: a standby that died is replaced after this, doubled for each death in a row …
REPLACE_AFTER_MAX_S = 60.0  # … up to this


def rss_of(pid: int) -> Optional[int]:
    """A process's resident set in bytes (None: gone, or not ours to read)."""
    import psutil

    try:
        return psutil.Process(pid).memory_info().rss
    except (psutil.Error, OSError):
        return None


def ineligible(cfg: Config) -> Optional[str]:
    """Why this run's worker cannot be prewarmed, or None when it can and is configured to be."""
    if not cfg.restart.prewarm:
        return "restart.prewarm is off"
    if cfg.worker.command:
        return "worker.command is set: only the built-in worker can wait for a release"
    if cfg.worker.nnodes > 1:
        return f"worker.nnodes is {cfg.worker.nnodes}: a multi-node attempt is a new rendezvous, not a held process"
    if cfg.worker.nproc_per_node > 1:
        return f"worker.nproc_per_node is {cfg.worker.nproc_per_node}: only a single-process worker is prewarmed"
    if cfg.model.load_in_4bit:
        return (
            "model.load_in_4bit: a quantised model is placed on the GPU as it loads, and a standby must hold no GPU "
            "memory"
        )
    return None


def wanted(intent: Intent, decision: Optional[Decision]) -> bool:
    """Does what is being handled lead to a restart?  A stall's outcome is not decided yet (None): it
    usually does, and a standby that turns out not to be needed is discarded."""
    if intent is Intent.RESTART:
        return True
    if intent is not Intent.NONE:
        return False
    return decision is None or decision.action == "restart"


def release_line(attempt: int, resume_from: str) -> bytes:
    """What the standby reads on its stdin (daemon.prewarm.read_release)."""
    return (json.dumps({"attempt": attempt, "resume_from": resume_from}) + "\n").encode()


# ---- the process ------------------------------------------------------------------------------


class StandbyProcess(Protocol):
    worker: Worker

    def release(self, line: bytes) -> None:
        """Send the release and close the pipe; OSError (BrokenPipeError) when the standby is gone."""

    def close(self) -> None:
        """Close the pipe without a release (the standby sees end of file)."""


@dataclass
class PipeStandby:
    worker: Worker
    stdin: Optional[IO[bytes]]

    def release(self, line: bytes) -> None:
        if self.stdin is None:
            raise BrokenPipeError("the standby's release pipe is closed")
        try:
            self.stdin.write(line)  # far shorter than a pipe's buffer: never blocks
            self.stdin.flush()
        finally:
            self.close()

    def close(self) -> None:
        if self.stdin is not None:
            try:
                self.stdin.close()
            except OSError:  # the flush on close of a pipe whose reader died
                pass
            self.stdin = None


SpawnStandby = Callable[..., StandbyProcess]


def spawn_standby(
    argv: list[str], *, env: dict, cwd: Optional[str], log_path: Path, now: float, deathsig: int = signal.SIGKILL
) -> StandbyProcess:
    """`argv` started as `process.spawn` starts a worker (own session, dying with us, output to `log_path`,
    which starts empty), with its stdin a pipe for the release.  OSError when it cannot be executed."""
    try:
        log_path.unlink()  # a discarded standby's log is not this one's
    except FileNotFoundError:
        pass
    worker = spawn(argv, env=env, cwd=cwd, log_path=log_path, now=now, deathsig=deathsig, stdin_pipe=True)
    return PipeStandby(worker, worker.popen.stdin)


# ---- the lifecycle ----------------------------------------------------------------------------


@dataclass
class Standby:
    number: int  # the attempt it is for
    proc: StandbyProcess
    spawned_at: float
    why: str

    @property
    def worker(self) -> Worker:
        return self.proc.worker


@dataclass
class Prewarm:
    cfg: Config
    config_path: Path
    table: ProcessTable
    fs: FsOps = field(default_factory=FsOps)
    spawn: SpawnStandby = spawn_standby
    rss: Callable[[int], Optional[int]] = rss_of
    standby: Optional[Standby] = None
    dying: list[Worker] = field(default_factory=list)  # discarded, killed, not reaped yet
    why_not: Optional[str] = None
    deaths: int = 0  # standbys that died in a row (`always` backs off their replacement)
    replace_at: Optional[float] = None  # `always`: not before this after a death

    def __post_init__(self):
        self.why_not = ineligible(self.cfg)
        if self.why_not is not None and self.cfg.restart.prewarm:
            log.warning("prewarm_off", why=self.why_not)

    @property
    def always(self) -> bool:
        return self.why_not is None and self.cfg.restart.prewarm == "always"

    @property
    def log_path(self) -> Path:
        return Path(self.cfg.run_dir) / STANDBY_LOG_NAME

    @property
    def ready_path(self) -> Path:
        return standby_ready_path(self.cfg.run_dir)

    def keep(self, current: attempts.Attempt, now: float) -> None:
        """`always`: the current attempt trains (it has stepped) — have its successor's standby loading or ready."""
        if not self.always or self.standby is not None or (self.replace_at is not None and now < self.replace_at):
            return
        self._spawn(
            current,
            now,
            "always" if not self.deaths else f"always (replacing a standby that died, {self.deaths} in a row)",
        )

    def begin(
        self, current: attempts.Attempt, intent: Intent, decision: Optional[Decision], now: float, why: str
    ) -> None:
        """A restart is (probably) coming: spawn the next attempt's standby now, unless there is one."""
        if self.why_not is not None or self.standby is not None or not wanted(intent, decision):
            return
        self._spawn(current, now, why)

    def _spawn(self, current: attempts.Attempt, now: float, why: str) -> None:
        number = current.number + 1
        argv = attempts.worker_argv(self.cfg, self.config_path) + [STANDBY_FLAG]
        env = attempts.worker_env(self.cfg, number)  # HANGWATCH_RESUME_FROM is empty until the release
        self._forget_ready()
        try:
            proc = self.spawn(argv, env=env, cwd=self.cfg.worker.cwd, log_path=self.log_path, now=now)
        except OSError as exc:  # the restart spawns cold, and a real problem shows there
            log.warning("standby_spawn_failed", attempt=number, error=str(exc))
            self._died(now)
            return
        current.foreign.add(proc.worker.pid)
        self.standby = Standby(number, proc, now, why)
        self.replace_at = None
        log.info("standby_spawned", attempt=number, pid=proc.worker.pid, why=why, log=str(self.log_path))

    def _died(self, now: float) -> None:
        """A standby died (or could not be spawned): `always` replaces it, later each time it happens again."""
        self.deaths += 1
        if self.always:
            self.replace_at = now + min(REPLACE_AFTER_MAX_S, REPLACE_AFTER_S * 2 ** (self.deaths - 1))

    def describe(self, now: float) -> Optional[dict]:
        """What `status` shows of the standby: attempt, pid, loading or ready, its RAM (no GPU memory before its
        release), its age; None when there is none."""
        sb = self.standby
        if sb is None:
            return None
        ready = read_json(self.ready_path)
        ready = ready if isinstance(ready, dict) and ready.get("pid") == sb.worker.pid else None
        rss = self.rss(sb.worker.pid)
        state = "loading" if ready is None else ("ready" if not ready.get("error") else "preload failed")
        return {
            "attempt": sb.number,
            "pid": sb.worker.pid,
            "state": state,
            "why": sb.why,
            "rss_mb": None if rss is None else round(rss / (1 << 20), 1),
            "age_s": round(now - sb.spawned_at, 3),
            "preload_s": ready.get("preload_s") if ready else None,
            "error": ready.get("error") if ready else None,
        }

    def poll(self, now: float) -> None:
        """Reap what died: the standby (then there is none) and the discarded ones."""
        sb = self.standby
        if sb is not None and self._reaped(sb.worker, now):
            self.standby = None
            sb.proc.close()
            self._forget_ready()
            self._died(now)
            note = (
                f"replaced in {self.replace_at - now:g}s"
                if self.replace_at is not None
                else "the restart will spawn cold"
            )
            log.warning(
                "standby_died",
                attempt=sb.number,
                pid=sb.worker.pid,
                code=sb.worker.exit_code,
                signal=sb.worker.exit_signal,
                log=str(self.log_path),
                note=note,
            )
        self.dying = [w for w in self.dying if not self._reaped(w, now)]

    def take(self, number: int, adir: Path, resume_from: str, now: float) -> Optional[Worker]:
        """Release the standby as attempt `number` (its directory `adir` exists): its log moves there,
        the release line goes out, and its `Worker` is the attempt's.  None: spawn cold instead."""
        self.poll(now)
        sb, self.standby = self.standby, None
        if sb is None:
            return None
        w = sb.worker
        if sb.number != number or not self.table.matches(w.ref):
            self._kill(
                sb,
                now,
                f"spawned for attempt {sb.number}, now starting {number}"
                if sb.number != number
                else "gone before its release",
            )
            return None
        log_path = adir / WORKER_LOG_NAME
        self._forget_ready()
        try:
            self.fs.rename(self.log_path, log_path)  # the standby keeps writing to the same file
            sb.proc.release(release_line(number, resume_from))
        except OSError as exc:
            self._kill(sb, now, f"release failed: {exc}")
            return None
        w.log_path, w.started_at = log_path, now
        self.deaths = 0
        log.info(
            "standby_released",
            attempt=number,
            pid=w.pid,
            resume_from=resume_from or None,
            standby_age_s=round(now - sb.spawned_at, 3),
            why_spawned=sb.why,
        )
        return w

    def discard(self, now: float, why: str) -> None:
        """No restart will use it: kill it (reaped by a later `poll`)."""
        sb, self.standby = self.standby, None
        if sb is not None:
            self._kill(sb, now, why)

    def _kill(self, sb: Standby, now: float, why: str) -> None:
        sb.proc.close()
        w = sb.worker
        if not w.exited:
            self.table.signal_group(w.pgid, signal.SIGKILL)  # its own session: whatever it started goes too
            self.table.signal(w.ref, signal.SIGKILL)
            self.dying.append(w)
        self._remove(self.log_path)  # a discarded standby's log says nothing about any attempt
        self._forget_ready()
        log.info("standby_discarded", attempt=sb.number, pid=w.pid, why=why)
        self.dying = [d for d in self.dying if not self._reaped(d, now)]

    def _forget_ready(self) -> None:
        self._remove(self.ready_path)

    def _remove(self, path: Path) -> None:
        try:
            self.fs.unlink(path)
        except OSError:  # a file that cannot go is left: nothing depends on its absence
            pass

    def close(self, now: float, timeout_s: float = 1.0) -> None:
        """The supervisor is leaving (its loop is over, or it is failing): no standby outlives it, none is
        left a zombie.  The one place that waits — a SIGKILLed process is gone within milliseconds."""
        self.discard(now, "the supervisor is exiting")
        deadline = time.monotonic() + timeout_s
        while self.dying and time.monotonic() < deadline:
            time.sleep(0.01)
            self.dying = [w for w in self.dying if not self._reaped(w, now)]

    def pids(self) -> set[int]:
        """Our children that belong to no attempt: the standby and the discarded ones not yet reaped."""
        return {w.pid for w in self.dying} | ({self.standby.worker.pid} if self.standby else set())

    def _reaped(self, w: Worker, now: float) -> bool:
        if w.exited:
            return True
        if not self.table.is_gone(w.ref):  # a zombie counts as gone: asked first, so a death is never half-seen
            return False
        status = self.table.reap(w.pid)  # None: reaped elsewhere (an attempt's tree scan adopted it) or not our child
        if status is not None:
            w.record_exit(status, now)
        return True
