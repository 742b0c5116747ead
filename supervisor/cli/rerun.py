"""Where `hangwatch run` goes when its run directory already holds a run: as a person typing it means it.

A run dir belongs to one run — one command with its arguments, one config (the effective config as its
`config.yaml` recorded it).  So:

    what the run dir holds            this same run                        another run
    --------------------------------  -----------------------------------  ---------------------------------
    nothing                           starts there                          starts there
    a failed, stopped or              continues it, and says so first:      a run dir of its own: the next
      interrupted run                   "continuing the stopped run in        free one of <dir>-2, <dir>-3, …
                                        runs/train: attempt 3, from …"        (said on screen) — or the one
    a finished run                    typed by a person: runs again, in a     that holds this same run, whose
                                        run dir of its own (runs/train-2,     own state then decides as here
                                        said on screen), as the bare command
                                        would; started again by systemd or a
                                        scheduler's requeue: reported, not
                                        trained again (`Plan.finished`: exit 0)

"This same run" is looked for along the chain <dir>, <dir>-2, … up to the first free one: the last that holds it (a
run dir that recorded no config is taken for it, as runs recorded before config.yaml existed).  Who started us
decides only for a finished run: a person who types the command again wants it run (the shell would run it), while
a service manager or a batch scheduler that starts it again after its end is restarting a job, not asking for a
second training — systemd (`INVOCATION_ID` set, or our stdout is the journal), or Slurm requeuing the job
(`SLURM_RESTART_COUNT` above 0, or the same `SLURM_JOB_ID` the run dir recorded: the job ran this very run).

Not compared (`compared`): how hangwatch watches and reports the run (the `watchdog`, `restart`, `control`,
`logging`, `alerts` and `metrics` sections) — a failed run whose deadline was too tight continues with the new one —
and where a job's nodes meet (`worker.rdzv_id`, `rdzv_endpoint`, `node_name`: a resubmitted Slurm job gets new
ones, and its nodes must find their runs again).  An inbox run (`continuous`) keeps its run dir whatever it holds:
new files are new work.  A run dir a live supervisor holds (its lock, `records.runlock`) is not "continued": nothing
is said, and the lock refuses the second supervisor (exit 73) — another run goes to a run dir of its own as above.

`decide` is the decision, pure (what the chain holds, the effective config, who started us); `plan` reads the run
dirs and the environment and asks it; `record_start` keeps the Slurm job that ran a run dir for the next decision.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from hangwatch.common.rundir import CONFIG_NAME, STATE_NAME, next_attempt, read_json
from hangwatch.supervisor.records.runlock import LOCK_NAME, locked

SHOWN_DIFFERENCES = 3
STARTED_NAME = "started.json"  # <run_dir>/started.json: {"slurm_job_id": …}, the job that last ran the run dir
# The sections that say how hangwatch watches and reports a run, not what it trains
WATCHING = ("watchdog.", "restart.", "control.", "logging.", "alerts.", "metrics.")
# Where a multi-node job's nodes meet: a new job (a resubmission) has its own
JOB_KEYS = ("worker.rdzv_id", "worker.rdzv_endpoint", "worker.node_name")
UNFINISHED_WORDS = {"failed": "failed", "stopped": "stopped", "paused": "paused"}  # any other state: interrupted


@dataclass
class Plan:
    run_dir: str  # where the run goes
    lines: list[str] = field(default_factory=list)  # what to tell the user first
    finished: bool = False  # this same run finished there, and we were started again by a machine: report, exit 0


@dataclass(frozen=True)
class Recorded:
    """What one run dir holds, as `read_recorded` reads it."""

    path: str
    state: Optional[str] = None  # state.json's state (None: none, or unreadable)
    config: Optional[dict] = None  # config.yaml (None: none recorded, or unreadable)
    busy: bool = False  # a live supervisor holds it
    next_attempt: int = 1
    checkpoint: Optional[str] = None  # the last good checkpoint (None: none yet)
    checkpoint_step: Optional[int] = None
    step: Optional[int] = None  # the last step it reported
    updated_wall: Optional[float] = None
    slurm_job: Optional[str] = None  # the Slurm job that last ran it, where recorded
    final_adapter: bool = False

    @property
    def free(self) -> bool:
        return self.state is None and self.config is None


@dataclass(frozen=True)
class Starter:
    """Who started this `hangwatch run`, as the environment says."""

    systemd: bool = False
    slurm_job: Optional[str] = None
    slurm_restarts: int = 0

    def restarting(self, rec: Recorded) -> Optional[str]:
        """In words, the machine that starts `rec`'s run again (a restart, not a request for another training);
        None: a person (or a new job)."""
        if self.systemd:
            return "systemd"
        if self.slurm_job and self.slurm_restarts > 0:
            return f"Slurm's requeue of job {self.slurm_job}"
        if self.slurm_job and self.slurm_job == rec.slurm_job:
            return f"Slurm job {self.slurm_job} again"
        return None


def started_by(env: Mapping[str, str], journal: bool = False) -> Starter:
    """Who started us: systemd (`INVOCATION_ID`, set for every unit it starts; or our stdout is its journal), a Slurm
    job and how often it was requeued."""
    try:
        restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
    except ValueError:
        restarts = 0
    return Starter(
        systemd=bool(env.get("INVOCATION_ID")) or journal,
        slurm_job=env.get("SLURM_JOB_ID") or None,
        slurm_restarts=restarts,
    )


# ---- the decision


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(_flat(v, key))
        else:
            out[key] = v
    return out


def compared(key: str) -> bool:
    return key != "run_dir" and key not in JOB_KEYS and not key.startswith(WATCHING)


def differences(effective: dict, recorded: Optional[dict]) -> Optional[list[str]]:
    """The dotted keys in which `effective` (a config's `model_dump(mode="json")`) differs from a recorded config in
    what makes a run (`compared`); None when none was recorded."""
    if not isinstance(recorded, dict):
        return None
    mine, theirs = _flat(effective), _flat(recorded)
    return sorted(k for k in set(mine) | set(theirs) if compared(k) and mine.get(k) != theirs.get(k))


def watch_differences(effective: dict, recorded: Optional[dict]) -> list[str]:
    """The keys of how the run is watched in which this config differs from the recorded one (said, not a new run)."""
    if not isinstance(recorded, dict):
        return []
    mine, theirs = _flat(effective), _flat(recorded)
    return sorted(k for k in set(mine) | set(theirs) if k.startswith(WATCHING) and mine.get(k) != theirs.get(k))


def same_run(effective: dict, rec: Recorded) -> bool:
    return not differences(effective, rec.config)  # none recorded: taken for this run


def _words(keys: list[str]) -> str:
    if any(k.startswith("worker.command") for k in keys):
        return "another command or other arguments"
    more = len(keys) - SHOWN_DIFFERENCES
    return f"another config ({', '.join(keys[:SHOWN_DIFFERENCES])}{f' and {more} more' if more > 0 else ''})"


def shown(path: os.PathLike | str) -> str:
    """A path as a person would type it here: relative when below the working directory."""
    rel = os.path.relpath(path)
    return str(path) if rel.startswith("..") else rel


def decide(
    effective: dict,
    chain: list[Recorded],
    starter: Starter,
    again: list[str],
    continuous: bool = False,
    pinned: bool = False,
) -> Plan:
    """Where this run goes.  `chain`: what <dir>, <dir>-2, … hold, in that order, up to and with the first free one
    (its last entry); `effective`: this run's config (`model_dump(mode="json")`); `again`: the `hangwatch run`
    arguments that started it (config and `-- CMD…`), for the hint of a finished run; `continuous`: an inbox run;
    `pinned`: the person named the run dir (`--run-dir DIR`): a run there that did not finish continues there even
    with another command or config (said, with what differs) — they said where."""
    base, free = chain[0], chain[-1]
    if continuous or base.free:
        return Plan(base.path)
    if pinned and base.state != "finished" and not base.busy and not same_run(effective, base):
        other = differences(effective, base.config) or []
        return Plan(base.path, [continuing(base, [], other=other)])
    mine = next((rec for rec in reversed(chain[:-1]) if same_run(effective, rec)), None)
    if mine is None:  # another run than any there: the first free run dir, said
        why = _words(differences(effective, base.config) or [])
        word = "finished" if base.state == "finished" else _unfinished(base)
        return Plan(
            free.path,
            [f"hangwatch: {shown(base.path)} holds a {word} run of {why}: this run goes to {shown(free.path)}"],
        )
    if mine.state != "finished":
        return Plan(mine.path, [] if mine.busy else [continuing(mine, watch_differences(effective, mine.config))])
    machine = starter.restarting(mine)
    if machine is not None:
        return Plan(mine.path, finished_lines(mine, again, machine), finished=True)
    return Plan(
        free.path,
        [
            f"hangwatch: {shown(mine.path)} holds this same run, finished{_facts(mine)}: it runs again, in "
            f"{shown(free.path)}"
        ],
    )


def _unfinished(rec: Recorded) -> str:
    if rec.busy:
        return "running"
    return UNFINISHED_WORDS.get(rec.state or "", "interrupted")


def continuing(rec: Recorded, watch: list[str], other: Optional[list[str]] = None) -> str:
    """The first line of a run that goes on where it stopped: which run, which attempt, from where (`other`: the
    keys in which this run differs from it, continued all the same in a run dir named with --run-dir)."""
    if rec.checkpoint:
        where = shown(rec.checkpoint) + (f" (step {rec.checkpoint_step})" if rec.checkpoint_step is not None else "")
    else:
        where = "the start"
    line = (
        f"hangwatch: continuing the {_unfinished(rec)} run in {shown(rec.path)}: attempt {rec.next_attempt}, "
        f"from {where}"
    )
    if watch:
        more = len(watch) - SHOWN_DIFFERENCES
        line += f"; with this config's {', '.join(watch[:SHOWN_DIFFERENCES])}{f' and {more} more' if more > 0 else ''}"
    if other:
        line += f", as --run-dir asks, with {_words(other)}"
    return line


def _facts(rec: Recorded) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.updated_wall)) if rec.updated_wall is not None else None
    facts = ", ".join(x for x in (f"at step {rec.step}" if rec.step is not None else None, when) if x)
    return f" ({facts})" if facts else ""


def finished_lines(rec: Recorded, again: list[str], machine: str) -> list[str]:
    """What `hangwatch run` says when a machine starts this very run again after it finished in `rec`: where it
    ended, its final adapter, and the command that starts it afresh (the new run dir before `--`, where it is
    `run`'s own option)."""
    path = Path(rec.path)
    lines = [
        f"hangwatch: {shown(path)} already finished{_facts(rec)}: this same run, started again by {machine} — "
        "reported, nothing started."
    ]
    if rec.final_adapter:
        lines.append(f"  its final adapter: {shown(path / 'final')}")
    fresh = shown(path.with_name(f"{path.name}-new"))
    lines.append(f"  to run it again from the start: hangwatch run --run-dir {fresh} {shlex.join(again)}".rstrip())
    lines.append(f"  (or remove it first: rm -r {shown(path)})")
    return lines


# ---- the edges: the run dirs and the environment, read


def read_recorded(run_dir: Path) -> Recorded:
    """What `run_dir` holds (nothing there: a free `Recorded`)."""
    import yaml

    from hangwatch.supervisor.records.checkpoint_ledger import read_record

    state = read_json(run_dir / STATE_NAME)
    state = state if isinstance(state, dict) else {}
    try:
        config = yaml.safe_load((run_dir / CONFIG_NAME).read_text())
    except (OSError, yaml.YAMLError):
        config = None
    config = config if isinstance(config, dict) else None
    if not state and config is None:
        return Recorded(str(run_dir))
    ledger = read_record(run_dir) or {}
    good = next(
        (
            e
            for e in ledger.get("checkpoints") or []
            if isinstance(e, dict) and e.get("path") == ledger.get("last_good")
        ),
        None,
    )
    checkpoint = good.get("path") if good else state.get("last_good_checkpoint")
    checkpoint_step = good.get("step") if good else state.get("last_good_step")
    step = state.get("step") if isinstance(state.get("step"), int) else state.get("last_good_step")
    wall = state.get("updated_wall")
    return Recorded(
        str(run_dir),
        state=state.get("state") if isinstance(state.get("state"), str) else None,
        config=config,
        busy=held(run_dir),
        next_attempt=next_attempt(run_dir),
        checkpoint=checkpoint if isinstance(checkpoint, str) and checkpoint else None,
        checkpoint_step=checkpoint_step if isinstance(checkpoint_step, int) else None,
        step=step if isinstance(step, int) else None,
        updated_wall=wall if isinstance(wall, (int, float)) else None,
        slurm_job=recorded_job(run_dir, config),
        final_adapter=(run_dir / "final").is_dir(),
    )


def recorded_job(run_dir: Path, config: Optional[dict]) -> Optional[str]:
    """The Slurm job that last ran `run_dir`: `record_start`'s record, else the job in a multi-node job's rendezvous id
    (`<SLURM_JOB_ID>.<SLURM_STEP_ID>`, as `config.slurm` derives it)."""
    rec = read_json(run_dir / STARTED_NAME)
    if isinstance(rec, dict) and rec.get("slurm_job_id"):
        return str(rec["slurm_job_id"])
    rdzv = str(((config or {}).get("worker") or {}).get("rdzv_id") or "")
    job = rdzv.split(".", 1)[0]
    return job if job.isdigit() and "." in rdzv else None


def held(run_dir: Path) -> bool:
    """A live supervisor holds the run dir's lock (`records.runlock`); asked without taking it."""
    return locked(run_dir / LOCK_NAME)


def stdout_is_journal(env: Mapping[str, str]) -> bool:
    """Our stdout is systemd's journal (`JOURNAL_STREAM` names its device and inode)."""
    try:
        dev, ino = (int(x) for x in env.get("JOURNAL_STREAM", "").split(":"))
        st = os.fstat(sys.stdout.fileno())
    except (ValueError, OSError, AttributeError):
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def chain_of(run_dir: str) -> list[Recorded]:
    """What <dir>, <dir>-2, … hold, up to and with the first free one."""
    base = Path(run_dir)
    chain = [read_recorded(base)]
    n = 2
    while not chain[-1].free:
        chain.append(read_recorded(base.with_name(f"{base.name}-{n}")))
        n += 1
    return chain


def plan(
    effective: dict,
    run_dir: str,
    again: list[str],
    continuous: bool = False,
    environ: Optional[Mapping[str, str]] = None,
    pinned: bool = False,
) -> Plan:
    """Where this run goes (`decide`), from the run dirs on disk and who started us (`environ`: this process's)."""
    env = os.environ if environ is None else environ
    starter = started_by(env, stdout_is_journal(env))
    return decide(effective, chain_of(run_dir), starter, again, continuous, pinned=pinned)


def record_start(run_dir: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Keep which Slurm job ran `run_dir` (nothing outside a job): the same job starting it again after it finished
    is a requeue.  Best effort: a run dir that cannot take it only loses that knowledge."""
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if not job:
        return
    try:
        (Path(run_dir) / STARTED_NAME).write_text(json.dumps({"slurm_job_id": job}) + "\n")
    except OSError:
        pass
