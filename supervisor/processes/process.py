"""Processes: identity, spawning the worker in its own session, and the process table behind a seam.

Identity of a process is (pid, create_time): a pid alone can be reused by an unrelated process
after the original died, so nothing here signals a pid without checking that its start time is
still the recorded one.

Everything the supervisor asks the operating system about processes goes through a
`ProcessTable`: reap, descendants, group members, own children, create time, signal.  The real
one is `PsutilProcessTable` (psutil, waitpid, `kill(pid, sig)` — os.kill by default; a negative
pid addresses a process group); tests pass a fake table and run the whole lifecycle without a
single process.  The identity-checked helpers (`matches`, `ref_of`, `signal`, `signal_group`,
`alive`) live on the base class, so a fake inherits exactly the checks the real table makes.

Finding children means reading every process's parent: the real table reads /proc once and lets
the lookups made in the same instant (a tree scan asks for the worker's descendants, our own
children and theirs) share that one listing (PARENTS_TTL_S).
"""

from __future__ import annotations

import abc
import ctypes
import ctypes.util
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, NamedTuple, Optional

import psutil

if TYPE_CHECKING:
    from hangwatch.supervisor.processes.streams import Relay

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SIG_IGN = 1  # signal(2)'s SIG_IGN, as the handler pointer
CREATE_TIME_TOLERANCE_S = 0.05  # psutil derives it from clock ticks; the same process reads the same value
PARENTS_TTL_S = 0.01  # one listing of every process's parent serves the lookups of one scan, never a later pass

Kill = Callable[[int, int], None]

_libc = None


def _prctl():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc.prctl


@dataclass(frozen=True)
class ProcRef:
    """A process as (pid, create_time): survives pid reuse.  Pure data; the table checks it."""

    pid: int
    create_time: float

    def as_dict(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time}

    @classmethod
    def from_dict(cls, d) -> Optional["ProcRef"]:
        try:
            return cls(int(d["pid"]), float(d["create_time"]))
        except (KeyError, TypeError, ValueError):
            return None


class ExitStatus(NamedTuple):
    """How a reaped child ended: exactly one of the two is set."""

    code: Optional[int]
    signal: Optional[int]


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
    # its stdout or stderr still has bytes on the way into log_path (a relay's pipes: `processes.streams`)
    output_open: Callable[[], bool] = field(default=lambda: False, repr=False)

    @property
    def pgid(self) -> int:
        return self.pid

    @property
    def ref(self) -> ProcRef:
        return ProcRef(self.pid, self.create_time)

    @property
    def exited(self) -> bool:
        return self.exited_at is not None

    def record_exit(self, status: ExitStatus, now: float) -> None:
        self.exit_code, self.exit_signal = status
        self.exited_at = now
        if self.popen is not None:  # reaped by us: tell Popen, or it would wait on a pid that is gone
            self.popen.returncode = self.exit_code if self.exit_code is not None else -(self.exit_signal or 0)

    def as_dict(self) -> dict:
        return {
            "pid": self.pid,
            "pgid": self.pgid,
            "sid": self.pid,
            "create_time": self.create_time,
            "argv": self.argv,
            "exit_code": self.exit_code,
            "exit_signal": self.exit_signal,
        }


class ProcessTable(abc.ABC):
    """The operating system's processes, as the supervisor sees them.

    Subclasses provide the primitives (`create_time`, `reap`, `descendants`, `group_members`,
    `own_children`, `is_gone`, `session_id`, `describe`, `send`): abstract, so a table missing one cannot
    be built; the identity checks are shared.
    """

    # ---- primitives -----------------------------------------------------------------------

    @abc.abstractmethod
    def create_time(self, pid: int) -> Optional[float]: ...

    @abc.abstractmethod
    def reap(self, pid: int) -> Optional[ExitStatus]:
        """Non-blocking: how `pid` ended once it exited, None while it runs or is not our child."""

    @abc.abstractmethod
    def descendants(self, pid: int) -> list[ProcRef]:
        """Every live descendant of `pid` (including those that left its process group)."""

    @abc.abstractmethod
    def group_members(self, pgid: int) -> list[ProcRef]: ...

    @abc.abstractmethod
    def own_children(self, exclude: Iterable[int] = ()) -> list[ProcRef]: ...

    @abc.abstractmethod
    def is_gone(self, ref: ProcRef) -> bool:
        """Dead, reaped, a zombie, or the pid now belongs to someone else."""

    @abc.abstractmethod
    def session_id(self, pid: int) -> Optional[int]: ...

    @abc.abstractmethod
    def describe(self, ref: ProcRef) -> dict:
        """pid, name and state of a process that would not die, for the incident."""

    @abc.abstractmethod
    def send(self, pid: int, sig: int) -> None:
        """kill(2): raises ProcessLookupError / PermissionError like os.kill."""

    # ---- identity-checked helpers ---------------------------------------------------------

    def matches(self, ref: ProcRef) -> bool:
        ct = self.create_time(ref.pid)
        return ct is not None and abs(ct - ref.create_time) < CREATE_TIME_TOLERANCE_S

    def ref_of(self, pid: int) -> Optional[ProcRef]:
        ct = self.create_time(pid)
        return ProcRef(pid, ct) if ct is not None else None

    def signal(self, ref: ProcRef, sig: int) -> bool:
        """Signal a process only if it is still the one recorded (its create time matches)."""
        if not self.matches(ref):
            return False
        try:
            self.send(ref.pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def signal_group(self, pgid: int, sig: int) -> bool:
        """Signal a process group; False when it no longer exists (ESRCH)."""
        try:
            self.send(-pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def alive(self, refs: Iterable[ProcRef]) -> list[ProcRef]:
        return [r for r in refs if not self.is_gone(r)]


class PsutilProcessTable(ProcessTable):
    """The real table: psutil for listing, waitpid for reaping, `kill` for signals.  `helpers`: the pids of the
    supervisor's own helper processes (an alert command, a tracker report): its children, never a worker's orphans."""

    def __init__(
        self,
        kill: Kill = os.kill,
        clock: Callable[[], float] = time.monotonic,
        parents: Optional[Callable[[], dict[int, int]]] = None,
        helpers: Callable[[], Iterable[int]] = tuple,
    ):
        self._kill = kill
        self._helpers = helpers
        self._clock = clock
        self._parents = parents if parents is not None else _parents  # pid → parent pid, for every process
        self._children: dict[int, list[int]] = {}
        self._children_at = float("-inf")

    def _children_of(self) -> dict[int, list[int]]:
        """pid → its children's pids, for every process (read at most once per PARENTS_TTL_S)."""
        now = self._clock()
        if now - self._children_at > PARENTS_TTL_S:
            children: dict[int, list[int]] = {}
            for pid, ppid in self._parents().items():
                children.setdefault(ppid, []).append(pid)
            self._children, self._children_at = children, now
        return self._children

    def _below(self, pid: int, recursive: bool = True) -> list[int]:
        found, todo, seen = [], [pid], {pid}
        kids = self._children_of()
        while todo:
            for child in kids.get(todo.pop(), ()):
                if child not in seen:  # a listing taken while pids were reused could loop
                    seen.add(child)
                    found.append(child)
                    if recursive:
                        todo.append(child)
        return found

    def create_time(self, pid: int) -> Optional[float]:
        try:
            return psutil.Process(pid).create_time()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
            return None

    def reap(self, pid: int) -> Optional[ExitStatus]:
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except (ChildProcessError, InterruptedError):  # ECHILD: not our child, or reaped already
            return None
        return decode_status(status) if got else None

    def descendants(self, pid: int) -> list[ProcRef]:
        return self._refs_of(self._below(pid))

    def _refs_of(self, pids: Iterable[int]) -> list[ProcRef]:
        out = []
        for pid in pids:
            ct = self.create_time(pid)
            if ct is not None:
                out.append(ProcRef(pid, ct))
        return out

    def group_members(self, pgid: int) -> list[ProcRef]:
        # Called on every loop pass while a tree is being killed: one getpgid syscall per pid, and a
        # psutil lookup only for the few members (process_iter would build an object for every process).
        out = []
        for pid in psutil.pids():
            try:
                if os.getpgid(pid) == pgid:
                    out.append(ProcRef(pid, psutil.Process(pid).create_time()))
            except (
                ProcessLookupError,
                psutil.NoSuchProcess,
                psutil.ZombieProcess,
                psutil.AccessDenied,
                PermissionError,
            ):
                pass
        return out

    def own_children(self, exclude: Iterable[int] = ()) -> list[ProcRef]:
        excluded = set(exclude) | set(self._helpers())
        return self._refs_of(pid for pid in self._below(os.getpid(), recursive=False) if pid not in excluded)

    def is_gone(self, ref: ProcRef) -> bool:
        try:
            p = psutil.Process(ref.pid)
            if abs(p.create_time() - ref.create_time) >= CREATE_TIME_TOLERANCE_S:
                return True
            return p.status() == psutil.STATUS_ZOMBIE
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return True
        except psutil.AccessDenied:
            return False

    def session_id(self, pid: int) -> Optional[int]:
        try:
            return os.getsid(pid)
        except (ProcessLookupError, PermissionError):
            return None

    def describe(self, ref: ProcRef) -> dict:
        try:
            p = psutil.Process(ref.pid)
            with p.oneshot():
                out = {"pid": ref.pid, "name": p.name(), "state": p.status(), "cmdline": p.cmdline()[:6]}
        except psutil.Error:
            return {"pid": ref.pid, "state": "gone"}
        out.update(kernel_wait(ref.pid))
        return out

    def send(self, pid: int, sig: int) -> None:
        self._kill(pid, sig)


def kernel_wait(pid: int, proc: str = "/proc") -> dict:
    """Where in the kernel a process waits: `wchan` (the function it sleeps in, /proc/PID/wchan) and `kernel_stack`
    (/proc/PID/stack, readable by root only); each missing one says why (`*_unreadable`)."""
    out: dict = {}
    for key, name in (("wchan", "wchan"), ("kernel_stack", "stack")):
        try:
            with open(f"{proc}/{pid}/{name}") as f:
                text = f.read(8192).strip()
        except OSError as exc:
            out[f"{key}_unreadable"] = exc.strerror or type(exc).__name__
            continue
        out[key] = text if key == "kernel_stack" else (text if text and text != "0" else None)
    return out


def _parents() -> dict[int, int]:
    """pid → parent pid for every process: /proc/<pid>/stat on Linux (what psutil reads too), psutil elsewhere."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {
            p.info["pid"]: p.info["ppid"] for p in psutil.process_iter(["pid", "ppid"]) if p.info["ppid"] is not None
        }
    out = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # "pid (comm) state ppid …": comm may hold spaces and parentheses, so split after the last ')'
        fields = data[data.rfind(b")") + 2 :].split(None, 2)
        if len(fields) >= 2:
            out[int(name)] = int(fields[1])
    return out


def decode_status(status: int) -> ExitStatus:
    """waitpid status → (exit code, signal): exactly one is set."""
    if os.WIFSIGNALED(status):
        return ExitStatus(None, os.WTERMSIG(status))
    if os.WIFEXITED(status):
        return ExitStatus(os.WEXITSTATUS(status), None)
    return ExitStatus(None, None)


# --------------------------------------------------------------------------------------------
# Starting the worker


def _child_setup(parent_pid: int, deathsig: int):
    prctl = _prctl()
    set_disposition = _libc.signal
    set_disposition.restype = ctypes.c_void_p
    set_disposition.argtypes = (ctypes.c_int, ctypes.c_void_p)

    def preexec():  # runs in the child between fork and exec (after setsid)
        prctl(PR_SET_PDEATHSIG, deathsig, 0, 0, 0)
        # SIGUSR1 ignored, which exec keeps: a process of the tree that installs no handler of its own (torchrun, a
        # script not instrumented) survives a stray one — a Slurm job's time-limit warning (`--signal=USR1@N`)
        # goes to every process of the step.  faulthandler's dump handler (the ranks') replaces the disposition.
        set_disposition(signal.SIGUSR1, SIG_IGN)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), deathsig)

    return preexec


def spawn(
    argv: list[str],
    *,
    env: dict,
    cwd: Optional[str],
    log_path: Path,
    now: float,
    deathsig: int = signal.SIGKILL,
    stdin_pipe: bool = False,
    relay: Optional["Relay"] = None,
) -> Worker:
    """Start `argv` in a new session, dying with us.  Its output: with a `relay` (`hangwatch run` in the
    foreground), stdout and stderr are pipes or ptys the relay copies to our own streams and to `log_path`
    (`processes.streams`), and its stdin is ours; without one, both are appended to `log_path` and its stdin is
    /dev/null (a service), or a pipe with `stdin_pipe` (`Worker.popen.stdin`: a prewarmed standby waits on it for
    its release).

    Raises OSError (FileNotFoundError, PermissionError, …) when it cannot be executed.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    common = dict(
        cwd=cwd, env=env, start_new_session=True, preexec_fn=_child_setup(os.getpid(), deathsig), close_fds=True
    )
    if relay is not None and not stdin_pipe:
        ends = relay.open(log_path)
        try:
            popen = subprocess.Popen(argv, stdin=None, stdout=ends.stdout, stderr=ends.stderr, **common)
        except BaseException:
            ends.abandon()
            raise
        relay.attach(ends, popen.pid)
        opened = ends
    else:
        opened = None
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                **common,
            )
    ct = PsutilProcessTable().create_time(popen.pid)
    if ct is None:  # exited (or is a zombie) already; identity still needs a value
        ct = time.time()
    worker = Worker(pid=popen.pid, create_time=ct, argv=list(argv), log_path=log_path, started_at=now, popen=popen)
    if opened is not None:
        worker.output_open = lambda: relay.following(opened)
    return worker


def set_child_subreaper() -> bool:
    """Orphaned descendants (a grandchild whose parent died) are re-parented to us, not init."""
    try:
        return _prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
