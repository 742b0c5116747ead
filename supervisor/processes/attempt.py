"""One worker attempt: how it is started, which processes belong to it, which ranks announced themselves.

`attempts/NNNN/` holds the attempt's heartbeat files, worker log, stack dumps and last words.  The
worker learns where they go from its environment (`HANGWATCH_RUN_DIR`, `HANGWATCH_ATTEMPT`,
`HANGWATCH_HEARTBEAT_DIR`), and what to resume from (`HANGWATCH_RESUME_FROM`, the last good
checkpoint).  Its tree is tracked by (pid, create time): the direct child and its process group,
the pids the ranks announced in their `start` lines, descendants seen by the tree scan, and — with
the supervisor as subreaper — orphans re-parented to it, which is the only way to find a child that
left the group (setsid) once the worker itself has exited.

With `restart.prewarm` the worker of an attempt may be a standby spawned while the previous attempt
was being torn down (`supervisor.prewarm`): `start` then hands the attempt that process, released,
instead of spawning one (`prewarmed`).  Until then the standby is one of our children that is not the
failed attempt's: `foreign` keeps the tree scan from adopting it as an orphan of that tree.

Every worker also gets torch's NCCL flight recorder switched on (`flight_env`: a
dump pipe and dump files per rank in the attempt directory, unless the user configured them), and
each attempt watches its ranks for stragglers (`stragglers.StragglerWatch`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Collection, Mapping, Optional

from hangwatch.common.config import Config, WatchdogCfg
from hangwatch.common.config.rules import torchrun_command
from hangwatch.common.durable import FsOps
from hangwatch.common.instrumentation import instrument_env
from hangwatch.common.protocol import ENV_ATTEMPT, ENV_HEARTBEAT_DIR, ENV_RESUME_FROM, ENV_RUN_DIR
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.processes.launcher import multinode_argv
from hangwatch.supervisor.processes.process import ProcessTable, ProcRef, Worker
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.output_tail import OutputTail
from hangwatch.supervisor.watch.stragglers import StragglerWatch

Spawn = Callable[..., Worker]


# torch's NCCL flight recorder, switched on in every worker's environment (`episode.flight_recorder` reads the dumps)
ENV_BUFFER = "TORCH_NCCL_TRACE_BUFFER_SIZE"
ENV_DUMP_ON_TIMEOUT = "TORCH_NCCL_DUMP_ON_TIMEOUT"
ENV_TRACE_FILE = "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
ENV_PIPE_FILE = "TORCH_NCCL_DEBUG_INFO_PIPE_FILE"
ALIASES = {ENV_BUFFER: "TORCH_FR_BUFFER_SIZE", ENV_TRACE_FILE: "TORCH_FR_DUMP_TEMP_FILE"}  # torch's newer names
TORCH_DEFAULT_TRACE_PREFIX = "/tmp/nccl_trace_rank_"
BUFFER_ENTRIES = "2000"  # torch's own default size, made explicit: without it the pipe is never created
TRACE_STEM, PIPE_STEM = "nccl-trace-rank", "nccl-pipe-rank"


def flight_env(attempt_dir: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The flight-recorder settings to add to a worker's environment `env` (those the user set are kept)."""
    wanted = {
        ENV_BUFFER: BUFFER_ENTRIES,
        ENV_DUMP_ON_TIMEOUT: "1",
        ENV_TRACE_FILE: str(attempt_dir / TRACE_STEM),
        ENV_PIPE_FILE: str(attempt_dir / PIPE_STEM),
    }
    return {k: v for k, v in wanted.items() if k not in env and ALIASES.get(k) not in env}


@dataclass(frozen=True)
class FlightPaths:
    """Where a worker's ranks keep their dump pipes and write their dumps (from the environment they got)."""

    pipe_stem: Optional[str]
    trace_prefix: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "FlightPaths":
        trace = env.get(ALIASES[ENV_TRACE_FILE]) or env.get(ENV_TRACE_FILE) or TORCH_DEFAULT_TRACE_PREFIX
        return cls(env.get(ENV_PIPE_FILE) or None, trace)

    def pipe(self, rank: int) -> Optional[Path]:
        return Path(f"{self.pipe_stem}{rank}.pipe") if self.pipe_stem else None

    def trace(self, rank: int) -> Path:
        return Path(f"{self.trace_prefix}{rank}")


@dataclass
class DumpTarget:
    rank: int
    ref: ProcRef
    dump_path: Path
    offset: int = 0  # size before the signal: only what is appended belongs to this dump


@dataclass
class Announced:
    """A process that sent `start`: the only ones that get SIGUSR1."""

    rank: int
    ref: Optional[ProcRef]
    dump_path: Optional[Path]
    dump_signal: Optional[str]


@dataclass
class Attempt:
    number: int
    dir: Path
    worker: Worker
    tail: HeartbeatTail
    announced: dict[int, Announced] = field(default_factory=dict)
    starts: dict[int, dict] = field(default_factory=dict)  # pid → its `start` line (every process that announced)
    tree: dict[int, ProcRef] = field(default_factory=dict)  # descendants seen, by pid
    stop_lines: dict[int, dict] = field(default_factory=dict)  # rank → its last `stop` line's reason and code
    last_tree_scan: float = float("-inf")
    oom_kills_at_start: Optional[int] = None  # the memory cgroup's OOM-kill count when it started (evidence)
    flight: FlightPaths = field(default_factory=lambda: FlightPaths(None, ""))  # where its ranks' NCCL dumps go
    stragglers: StragglerWatch = field(default_factory=lambda: StragglerWatch.from_config(WatchdogCfg()))
    cwd: Optional[str] = None  # the worker's working directory (its relative source paths)
    resume_from: str = ""  # the checkpoint handed in HANGWATCH_RESUME_FROM ("" for none)
    resume_checked: bool = False  # its `start` beat's `resumed_from` was compared with it
    started: set = field(default_factory=set)  # (rank, pid) whose start was logged: a process that starts twice
    # (the automatic instrumentation's start, then the script's own callback's) is one worker started
    prewarmed: bool = False  # its worker was a standby, released (restart.prewarm), not spawned cold
    foreign: set[int] = field(default_factory=set)  # our children that are not this attempt's (a standby for the next)
    started_wall: float = field(
        default_factory=time.time
    )  # wall clock: only to tell this attempt's files from older ones
    output: Optional[OutputTail] = None  # its worker.log as evidence: output and progress lines (`watch.output_tail`)
    instrumentation: str = "built-in"  # "built-in" (the daemon beats itself), or worker.instrument: "auto" | "off"
    output_read_at: float = float("-inf")  # the loop's clock at the last read of it

    def stop_reason(self, rank: int) -> Optional[str]:
        """The reason of the rank's last `stop` line, None when it said none."""
        stop = self.stop_lines.get(rank)
        return str(stop["reason"]) if stop is not None else None

    def announce(self, rec: dict, table: ProcessTable) -> Announced:
        """A `start` line: remember the rank's process (by identity) and where its dumps go."""
        rank = int(rec.get("rank") or 0)
        pid = rec.get("pid")
        dump_path = rec.get("dump_path")
        a = Announced(
            rank,
            table.ref_of(pid) if isinstance(pid, int) else None,
            Path(dump_path) if dump_path else None,
            rec.get("dump_signal"),
        )
        self.announced[rank] = a
        if isinstance(pid, int):
            self.starts[pid] = rec
        return a

    def follow(self, rec: dict, table: ProcessTable) -> Optional[Announced]:
        """A line of a rank from another process than the one it announced last: when that one is gone and this one
        announced itself before (a subprocess took the rank over from a wrapper, then ended, while the wrapper's
        own training went on), this one is the rank's again.  The announced process when it changed, else None."""
        rank, pid = rec.get("rank"), rec.get("pid")
        a = self.announced.get(rank) if isinstance(rank, int) else None
        if a is None or a.ref is None or a.ref.pid == pid or pid not in self.starts:
            return None
        if not table.is_gone(a.ref):
            return None
        return self.announce(self.starts[pid], table)

    def announced_refs(self) -> dict[int, ProcRef]:
        return {rank: a.ref for rank, a in self.announced.items() if a.ref}

    def dump_targets(self) -> list[DumpTarget]:
        return [
            DumpTarget(a.rank, a.ref, a.dump_path)
            for a in self.announced.values()
            if a.ref is not None and a.dump_path is not None and a.dump_signal
        ]

    def known_refs(self, table: ProcessTable, subreaper: bool) -> list[ProcRef]:
        """Every process known to belong to this attempt besides the worker's group."""
        refs = list(self.tree.values()) + list(self.announced_refs().values())
        return refs + list(adopted(table, subreaper, exclude={self.worker.pid, *self.foreign}).values())

    def kill_all(self, table: ProcessTable) -> None:
        """SIGKILL to the group and every known member at once (the supervisor itself is failing)."""
        table.signal_group(self.worker.pgid, signal.SIGKILL)
        for ref in [*self.tree.values(), self.worker.ref]:
            table.signal(ref, signal.SIGKILL)

    def reap(self, table: ProcessTable, now: float, orphans: bool, also: Collection[int] = ()) -> bool:
        """Wait for the worker (True when its exit is recorded now) and, when `orphans`, for the adopted orphans of
        its tree and `also` (processes being killed): we are their subreaper; not our child otherwise."""
        w = self.worker
        ended = False
        if not w.exited:
            status = table.reap(w.pid)
            if status is not None:
                w.record_exit(status, now)
                ended = True
        if orphans:
            for pid in (set(self.tree) | set(also)) - {w.pid}:
                table.reap(pid)
        return ended

    def rescan(self, table: ProcessTable, subreaper: bool, now: float, every_s: float) -> bool:
        """`scan_tree` at most every `every_s` while the worker runs; True when a new descendant was found."""
        if self.worker.exited or now - self.last_tree_scan < every_s:
            return False
        self.last_tree_scan = now
        return self.scan_tree(table, subreaper)

    def scan_tree(self, table: ProcessTable, subreaper: bool) -> bool:
        """Remember the worker's descendants (with start times) to find those that leave the group.
        True when a new one was found."""
        seen = {r.pid: r for r in table.descendants(self.worker.pid)}
        for pid, r in adopted(table, subreaper, exclude={self.worker.pid, *self.foreign}).items():
            seen.setdefault(pid, r)
        changed = bool(set(seen) - set(self.tree))
        self.tree = {**{p: r for p, r in self.tree.items() if not table.is_gone(r)}, **seen}
        return changed


def alive(attempt: Optional[Attempt]) -> bool:
    """An attempt's worker is running (None: no attempt)."""
    return attempt is not None and not attempt.worker.exited


def adopted(table: ProcessTable, subreaper: bool, exclude: set[int]) -> dict[int, ProcRef]:
    """Orphans of the worker's tree that were re-parented to us (we are their subreaper), with their
    descendants."""
    if not subreaper:
        return {}
    found: dict[int, ProcRef] = {}
    for r in table.own_children(exclude=exclude):
        found.setdefault(r.pid, r)
        for d in table.descendants(r.pid):
            found.setdefault(d.pid, d)
    return found


BARE_PYTHONS = ("python", "python3")


def worker_argv(
    cfg: Config,
    config_path: Path,
    rdzv_id: Optional[str] = None,
    resume_from: str = "",
    resume_step: Optional[int] = None,
) -> list[str]:
    """The worker's command line: `worker.command` as configured, or the built-in daemon (under torchrun
    when `worker.nproc_per_node` > 1).  Several nodes (`worker.nnodes` > 1): under torchrun's c10d rendezvous
    as `rdzv_id` (`launcher.multinode_argv`: the generation's id).

    A bare `python` or `python3` as the first word of `worker.command` means the supervisor's own
    interpreter (`sys.executable`): configs and examples say `python train.py`, and under systemd PATH
    holds no virtual environment, so PATH's python would lack hangwatch and the user's packages.  Any
    other first word — `python3.11`, `/usr/bin/python`, `torchrun`, `accelerate` — is used as given.

    `worker.resume_args` follow the command when the attempt has a checkpoint to resume from (`resume_from`),
    `{checkpoint}` and `{step}` filled in: an unedited script's own `--resume PATH`."""
    if cfg.worker.nnodes > 1:
        argv = multinode_argv(
            cfg,
            config_path,
            rdzv_id or rdzv_id_for(cfg.worker.rdzv_id, 0),
            bool(cfg.worker.command) and torchrun_command(list(cfg.worker.command)),
        )
        return argv + resume_args(cfg, resume_from, resume_step)
    if cfg.worker.command:
        argv = list(cfg.worker.command)
        if argv[0] in BARE_PYTHONS:
            argv[0] = sys.executable
        return argv + resume_args(cfg, resume_from, resume_step)
    daemon = ["-m", "hangwatch.daemon", "--config", str(config_path), "--run-dir", str(cfg.run_dir)]
    n = cfg.worker.nproc_per_node
    if n > 1:  # torch's own launcher, never a home-made one (it is only named here: no torch import)
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *daemon]
    return [sys.executable, *daemon]


def resume_args(cfg: Config, resume_from: str, step: Optional[int]) -> list[str]:
    """`worker.resume_args` with the checkpoint filled in; none without a checkpoint to resume from."""
    if not resume_from or not cfg.worker.command:
        return []
    return [arg.format(checkpoint=resume_from, step="" if step is None else step) for arg in cfg.worker.resume_args]


def worker_env(
    cfg: Config,
    number: int,
    environ: Optional[Mapping[str, str]] = None,
    resume_from: str = "",
    resume_step: Optional[int] = None,
) -> dict:
    """The supervisor's environment, the configured additions, where this attempt writes, and what it
    resumes from: `HANGWATCH_RESUME_FROM` is the last good checkpoint (`checkpoint_ledger`), or empty
    when there is none — set for every attempt, over any value inherited or configured, so a worker
    never resumes from a checkpoint the supervisor did not choose.  A `worker.command` of the user's
    gets the bootstrap that instruments its Python processes (`worker.instrument: auto`,
    `common.instrumentation`), told the step it resumes from so its step beats count on from there."""
    env = dict(os.environ if environ is None else environ)
    env.update(cfg.worker.env)
    if cfg.worker.command and cfg.worker.instrument == "auto":
        env.update(instrument_env(env, resume_step if resume_from else None))
    env[ENV_RUN_DIR] = str(cfg.run_dir)
    env[ENV_ATTEMPT] = str(number)
    env[ENV_HEARTBEAT_DIR] = str(attempt_dir(cfg.run_dir, number))
    env[ENV_RESUME_FROM] = resume_from
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(flight_env(attempt_dir(cfg.run_dir, number), env))
    return env


TakeStandby = Callable[
    [int, Path, str, float], Optional[Worker]
]  # (number, its dir, resume_from, now) → released worker


def rdzv_id_for(base: str, gen: int) -> str:
    """The rendezvous id of generation `gen` (see `nodes.multi_node`)."""
    return f"{base}-g{gen}"


def start(
    cfg: Config,
    number: int,
    config_path: Path,
    spawn: Spawn,
    now: float,
    fs: Optional[FsOps] = None,
    resume_from: str = "",
    take_standby: Optional[TakeStandby] = None,
    rdzv_id: Optional[str] = None,
    resume_step: Optional[int] = None,
) -> Attempt:
    """Create the attempt's directory and give it a worker, handing it `resume_from` (the last good
    checkpoint, "" for none): the standby `take_standby` releases (`prewarm.Prewarm.take`), or a worker
    spawned now when there is none.  OSError when it cannot be executed."""
    adir = attempt_dir(cfg.run_dir, number)
    (fs or FsOps()).mkdir(adir)
    env = worker_env(
        cfg, number, resume_from=resume_from, resume_step=resume_step
    )  # a standby: the same, less the resume
    worker = take_standby(number, adir, resume_from, now) if take_standby is not None else None
    prewarmed = worker is not None
    if worker is None:
        worker = spawn(
            worker_argv(cfg, config_path, rdzv_id, resume_from, resume_step),
            env=env,
            cwd=cfg.worker.cwd,
            log_path=adir / WORKER_LOG_NAME,
            now=now,
        )
    return Attempt(
        number,
        adir,
        worker,
        HeartbeatTail(adir),
        flight=FlightPaths.from_env(env),
        cwd=cfg.worker.cwd,
        stragglers=StragglerWatch.from_config(cfg.watchdog),
        resume_from=resume_from,
        prewarmed=prewarmed,
        output=OutputTail(adir / WORKER_LOG_NAME, cfg.watchdog.progress_pattern),
        instrumentation=cfg.worker.instrument if cfg.worker.command else "built-in",
    )
