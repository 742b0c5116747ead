"""What every section shares: the child environment, starting and ending process trees, the summary of
samples, and readers of what a run directory holds afterwards (layout from hangwatch.common.rundir)."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import psutil
import yaml

from hangwatch.common import rundir
from hangwatch.common.protocol import decode_line

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BASELINES = ROOT / "scripts" / "baselines"
STALL_WORKER = BASELINES / "stall_worker.py"
SYNTHETIC_RANKS = BASELINES / "synthetic_ranks.py"
CRON_WATCHDOG = BASELINES / "cron_watchdog.py"
DEMO_CONFIG = ROOT / "configs" / "demo.yaml"


def summary(values: list) -> dict:
    """n, min, median, p95 (nearest rank), max of the samples, Nones left out; {"n": 0} when there are none."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"n": 0}
    p95 = vals[max(0, math.ceil(0.95 * len(vals)) - 1)]
    return {"n": len(vals), "min": vals[0], "median": statistics.median(vals), "p95": p95, "max": vals[-1]}


def env() -> dict:
    """This environment without HANGWATCH_* (a bench run inside a supervised one must not join it), offline."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    e.setdefault("HF_HUB_OFFLINE", "1")
    e.setdefault("TRANSFORMERS_OFFLINE", "1")
    e["PYTHONUNBUFFERED"] = "1"
    return e


def supervisor_argv(cfg_path: Path, run_dir: Optional[Path] = None) -> list[str]:
    """`hangwatch run CONFIG [--run-dir DIR]`, through the same wiring (python -m hangwatch.supervisor)."""
    return [PY, "-m", "hangwatch.supervisor", "run", str(cfg_path)] + (["--run-dir", str(run_dir)] if run_dir else [])


def spawn(argv: list[str], out_path: Path, environ: Optional[dict] = None) -> subprocess.Popen:
    """`argv` in a session of its own (so its whole tree can be found and killed), output appended to `out_path`;
    `environ`: its environment (default `env()`)."""
    with open(out_path, "ab") as out:
        return subprocess.Popen(
            argv,
            cwd=ROOT,
            env=environ if environ is not None else env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def hangwatch_run(
    cfg_path: Path, out_path: Path, run_dir: Optional[Path] = None, environ: Optional[dict] = None
) -> subprocess.Popen:
    """`hangwatch run CONFIG` as a user starts it (control socket, supervisor.log), in its own session."""
    return spawn(supervisor_argv(cfg_path, run_dir), out_path, environ)


def control(run_dir: Path, command: str, timeout: float, **args) -> tuple[Any, Optional[str]]:
    """(result, None) from the supervisor that owns `run_dir` for one request, or (None, why) when the
    request could not be made or was refused (no socket yet, a timeout, a refusal)."""
    # imported here: only the sections that talk to a supervisor need the client
    from hangwatch.supervisor.cli.client import Client, ClientError
    from hangwatch.supervisor.control import socket_path_in

    try:
        return Client(socket_path_in(run_dir), timeout=timeout).call(command, **args), None
    except (ClientError, OSError) as exc:
        return None, str(exc) or type(exc).__name__


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant (torchrun puts its workers in sessions of their own)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def wait_exit(proc: subprocess.Popen, timeout: float) -> Optional[int]:
    """The exit code, or None when it had to be killed (with its tree) after `timeout`."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return None


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def demo_worker_config(run_dir: Path, **changes) -> dict:
    """configs/demo.yaml with absolute data paths, `run_dir`, and `changes` merged one level deep."""
    cfg = yaml.safe_load(DEMO_CONFIG.read_text())
    cfg["run_dir"] = str(run_dir)
    cfg["data"] = {
        **cfg["data"],
        "train": str(ROOT / "configs/data/train.jsonl"),
        "eval": str(ROOT / "configs/data/eval.jsonl"),
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


# ---------------------------------------------------------------- run-dir readers


def read_beats_file(path: Path) -> list[dict]:
    """The well-formed heartbeat lines of one file (torn or foreign lines skipped); [] when there is none."""
    with contextlib.suppress(OSError):
        return [rec for rec in map(decode_line, path.read_bytes().splitlines()) if rec is not None]
    return []


def read_beats(run_dir: Path, attempt: int, rank: int = 0) -> list[dict]:
    return read_beats_file(rundir.heartbeat_path(rundir.attempt_dir(run_dir, attempt), rank))


def steps_of(beats: list[dict]) -> list[dict]:
    return [b for b in beats if b["event"] == "step"]


def first(beats: list[dict], event: str) -> Optional[dict]:
    return next((b for b in beats if b["event"] == event), None)


def last_step(beats: list[dict]) -> int:
    return max((b["step"] for b in steps_of(beats)), default=0)


attempts_of = rundir.attempt_numbers


def incidents_of(run_dir: Path) -> list[dict]:
    """Every incident.json under incidents/, oldest first, each with its directory under `_dir`."""
    base = run_dir / rundir.INCIDENTS
    found = ((d, rundir.read_json(d / "incident.json")) for d in sorted(base.iterdir())) if base.is_dir() else ()
    return [{**inc, "_dir": str(d)} for d, inc in found if inc is not None]


def stall_incidents(run_dir: Path) -> list[dict]:
    """The incidents a deadline raised (a hang), as opposed to crashes."""
    return [i for i in incidents_of(run_dir) if i.get("deadline")]


def has_stack_dump(run_dir: Path) -> Optional[str]:
    """The first file under `run_dir` that holds a Python stack dump (faulthandler or py-spy), or None."""
    for pattern in ("incidents/*/stack-rank*.txt", "incidents/*/py-spy-rank*.txt", "attempts/*/stack-rank*.txt"):
        for f in sorted(run_dir.glob(pattern)):
            with contextlib.suppress(OSError):
                text = f.read_text(errors="replace")
                if "most recent call first" in text or text.startswith("Process "):  # faulthandler / py-spy
                    return str(f.relative_to(run_dir))
    return None


def finished_at(run_dir: Path) -> Optional[float]:
    """Wall time of a `stop finished` line in any attempt, or None."""
    for a in attempts_of(run_dir):
        for b in read_beats(run_dir, a):
            if b["event"] == "stop" and b.get("reason") == "finished":
                return b["t"]
    return None


def supervisor_log(run_dir: Path) -> list[dict]:
    """supervisor.log's JSON records (structlog), unreadable lines skipped."""
    out = []
    with contextlib.suppress(OSError):
        for line in (run_dir / rundir.SUPERVISOR_LOG_NAME).read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
    return out


def supervisor_log_time(run_dir: Path, event: str) -> Optional[float]:
    """Wall time of the first `event` record in supervisor.log (ISO timestamps in UTC)."""
    for rec in supervisor_log(run_dir):
        if rec.get("event") == event and rec.get("timestamp"):
            with contextlib.suppress(ValueError, AttributeError):
                return dt.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    return None


def suspension_gaps(run_dir: Path) -> list[float]:
    """Gaps the supervisor logged in its own loop (it was not scheduled: an overloaded or paused machine)."""
    return [
        rec["gap_s"] for rec in supervisor_log(run_dir) if rec.get("event") == "supervisor_suspended" and "gap_s" in rec
    ]
