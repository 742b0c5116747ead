"""Process control: spawn the worker in its own session, signal and reap its tree, end leftovers.

Identity of a process is (pid, create_time): a pid alone can be reused by an unrelated process
after the original died, so nothing here signals a pid without checking that its start time is
still the recorded one.  Signals go through a `kill(pid, sig)` callable (os.kill by default;
a negative pid addresses a process group) so that tests can watch or replace them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import psutil

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
CREATE_TIME_TOLERANCE_S = 0.05  # psutil derives it from clock ticks; the same process reads the same value

Kill = Callable[[int, int], None]

_libc = None


def _prctl():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc.prctl


@dataclass(frozen=True)
class ProcRef:
    """A process as (pid, create_time): survives pid reuse."""

    pid: int
    create_time: float

    def matches(self) -> bool:
        ct = create_time(self.pid)
        return ct is not None and abs(ct - self.create_time) < CREATE_TIME_TOLERANCE_S

    def as_dict(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time}

    @classmethod
    def of(cls, pid: int) -> Optional["ProcRef"]:
        ct = create_time(pid)
        return cls(pid, ct) if ct is not None else None

    @classmethod
    def from_dict(cls, d) -> Optional["ProcRef"]:
        try:
            return cls(int(d["pid"]), float(d["create_time"]))
        except (KeyError, TypeError, ValueError):
            return None


def create_time(pid: int) -> Optional[float]:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
        return None


def is_gone(ref: ProcRef) -> bool:
    """Dead, reaped, a zombie, or the pid now belongs to someone else."""
    try:
        p = psutil.Process(ref.pid)
        if abs(p.create_time() - ref.create_time) >= CREATE_TIME_TOLERANCE_S:
            return True
        return p.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.AccessDenied:
        return False


@dataclass
class Worker:
    """The direct child: a session and process-group leader (pgid == sid == pid)."""

    pid: int
    create_time: float
    argv: list[str]
    log_path: Path
    started_at: float  # supervisor monotonic clock
    popen: Optional[subprocess.Popen] = field(default=None, repr=False)
    exit_code: Optional[int] = None
    exit_signal: Optional[int] = None
    exited_at: Optional[float] = None

    @property
    def pgid(self) -> int:
        return self.pid

    @property
    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.create_time)

    @property
    def exited(self) -> bool:
        return self.exited_at is not None

    def as_dict(self) -> dict:
        return {"pid": self.pid, "pgid": self.pgid, "sid": self.pid, "create_time": self.create_time, "argv": self.argv,
                "exit_code": self.exit_code, "exit_signal": self.exit_signal}


def _child_setup(parent_pid: int, deathsig: int):
    prctl = _prctl()

    def preexec():  # runs in the child between fork and exec (after setsid)
        prctl(PR_SET_PDEATHSIG, deathsig, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), deathsig)

    return preexec


def spawn(argv: list[str], *, env: dict, cwd: Optional[str], log_path: Path, now: float,
          deathsig: int = signal.SIGKILL) -> Worker:
    """Start `argv` in a new session, stdout+stderr appended to `log_path`, dying with us.

    Raises OSError (FileNotFoundError, PermissionError, …) when it cannot be executed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
            start_new_session=True, preexec_fn=_child_setup(os.getpid(), deathsig), close_fds=True,
        )
    ct = create_time(popen.pid)
    if ct is None:  # exited (or is a zombie) already; identity still needs a value
        ct = time.time()
    return Worker(pid=popen.pid, create_time=ct, argv=list(argv), log_path=log_path, started_at=now, popen=popen)


def set_child_subreaper() -> bool:
    """Orphaned descendants (a grandchild whose parent died) are re-parented to us, not init."""
    try:
        return _prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def decode_status(status: int) -> tuple[Optional[int], Optional[int]]:
    """waitpid status → (exit code, signal): exactly one is set."""
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status), None
    return None, None


def reap(pid: int) -> Optional[int]:
    """Non-blocking waitpid: the raw status once `pid` exited, None while it runs or is not our child."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # ECHILD: not our child, or reaped already
        return None
    except InterruptedError:
        return None
    if got == 0:
        return None
    return status


def signal_group(pgid: int, sig: int, kill: Kill = os.kill) -> bool:
    """Signal a process group; False when it no longer exists (ESRCH)."""
    try:
        kill(-pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def signal_ref(ref: ProcRef, sig: int, kill: Kill = os.kill) -> bool:
    """Signal a process only if it is still the one recorded (its create time matches)."""
    if not ref.matches():
        return False
    try:
        kill(ref.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def descendants(pid: int) -> list[ProcRef]:
    """Every live descendant of `pid` (including those that left its process group)."""
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return []
    out = []
    for p in procs:
        try:
            out.append(ProcRef(p.pid, p.create_time()))
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return out


def group_members(pgid: int) -> list[ProcRef]:
    # Called on every loop pass while a tree is being killed: one getpgid syscall per pid, and a
    # psutil lookup only for the few members (process_iter would build an object for every process).
    out = []
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) == pgid:
                out.append(ProcRef(pid, psutil.Process(pid).create_time()))
        except (ProcessLookupError, psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, PermissionError):
            pass
    return out


def own_children(exclude: Iterable[int] = ()) -> list[ProcRef]:
    excluded = set(exclude)
    out = []
    try:
        for p in psutil.Process(os.getpid()).children(recursive=False):
            if p.pid not in excluded:
                try:
                    out.append(ProcRef(p.pid, p.create_time()))
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    pass
    except psutil.Error:
        pass
    return out


def alive(refs: Iterable[ProcRef]) -> list[ProcRef]:
    return [r for r in refs if not is_gone(r)]


# --------------------------------------------------------------------------------------------
# What a previous supervisor left behind


def leftovers(state: dict, now_wall: Optional[float] = None) -> tuple[list[ProcRef], Optional[int], list[str]]:
    """Processes recorded in a dead supervisor's state.json that still run.

    Returns (refs to end, the process group to end or None, notes).  A recorded pid counts only
    while its create time matches.  Members of the recorded process group count when the group
    leader is still the recorded process, or — the leader having died — when they are in the
    recorded session and started between the leader's start and the last state update (Linux does
    not hand out a pid that is still some group's id, so such members are the old tree's).
    """
    notes: list[str] = []
    refs: dict[int, ProcRef] = {}
    worker = state.get("worker") or {}
    wref = ProcRef.from_dict(worker)
    recorded = [wref] if wref else []
    recorded += [r for r in (ProcRef.from_dict(d) for d in (state.get("pids") or {}).values()) if r]
    recorded += [r for r in (ProcRef.from_dict(d) for d in state.get("descendants") or []) if r]
    for r in recorded:
        if r.matches():
            refs[r.pid] = r
        elif create_time(r.pid) is not None:
            notes.append(f"pid {r.pid} now belongs to another process (start time differs): left alone")
    group = None
    if wref is not None:
        pgid = int(worker.get("pgid", wref.pid))
        sid = int(worker.get("sid", wref.pid))
        leader_alive = wref.pid in refs
        updated = float(state.get("updated_wall") or (now_wall or time.time()))
        for m in group_members(pgid):
            try:
                same_session = os.getsid(m.pid) == sid
            except (ProcessLookupError, PermissionError):
                continue
            if leader_alive or (same_session and wref.create_time - 1 <= m.create_time <= updated + 1):
                refs.setdefault(m.pid, m)
            else:
                notes.append(f"pid {m.pid} in process group {pgid} started after the old tree: left alone")
        if leader_alive:
            group = pgid
    return list(refs.values()), group, notes


def end_processes(refs: list[ProcRef], group: Optional[int], *, grace_s: float, kill: Kill = os.kill,
                  sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> list[ProcRef]:
    """SIGTERM, wait up to `grace_s`, SIGKILL what is left, wait for it to be gone (blocking).

    Used at start-up for a previous supervisor's leftovers, which are not our children: they are
    reaped by init once dead, so "gone" is judged with psutil.  Returns what was still alive after
    the SIGKILL wait (normally nothing).
    """
    if group is not None:
        signal_group(group, signal.SIGTERM, kill)
    for r in refs:
        signal_ref(r, signal.SIGTERM, kill)
    deadline = clock() + grace_s
    while alive(refs) and clock() < deadline:
        sleep(0.05)
    if group is not None:
        signal_group(group, signal.SIGKILL, kill)
    for r in alive(refs):
        signal_ref(r, signal.SIGKILL, kill)
    deadline = clock() + 5.0
    while alive(refs) and clock() < deadline:
        sleep(0.05)
    return alive(refs)


def describe(ref: ProcRef) -> dict:
    """pid, name and state of a process that would not die, for the incident."""
    try:
        p = psutil.Process(ref.pid)
        with p.oneshot():
            return {"pid": ref.pid, "name": p.name(), "state": p.status(), "cmdline": p.cmdline()[:6]}
    except psutil.Error:
        return {"pid": ref.pid, "state": "gone"}
