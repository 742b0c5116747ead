"""Section weight: what the supervisor and its command line cost, each figure the median of ROUNDS rounds.

* the RSS and CPU of `hangwatch run` watching 8 synthetic ranks beating at 20 Hz (footprint.py's load, a
  shorter window per round), and which heavy packages that supervisor process imported (its `sys.modules` at
  its exit, on one more run);
* `hangwatch status` and `status --json` against that kind of supervisor, as a user runs them (spawn → exit,
  cli_latency.py's measurement, fewer runs per round);
* `hangwatch run` from its spawn to the worker's spawn: a foreign `worker.command` (instrument auto, which asks
  the command's Python for its version, and off) and the built-in worker on the demo config, whose cheap doctor
  preflight runs first (and with --no-doctor).

Every figure under two conditions, whatever the environment the benchmark runs in: hangwatch's bytecode cached
(as an installed package runs: pip writes it at install time, an editable install at the first import), and
hangwatch's own modules compiled from source at every start (a checkout under PYTHONDONTWRITEBYTECODE=1); the
libraries' bytecode is cached in both.  Both through a bytecode cache of this section's own
(PYTHONPYCACHEPREFIX), filled by an untimed warm-up round; for the second condition hangwatch's part of it is
removed and PYTHONDONTWRITEBYTECODE set.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Optional

from hangwatch.common import rundir

from . import cli_latency, footprint
from .harness import PY, demo_worker_config, env, spawn, summary, supervisor_argv, wait_exit, write_yaml

ROUNDS = 3
RANKS, HZ = 8, 20.0
RSS_GOAL_MIB = 40.0
STATUS_GOAL_S = 0.150
SPAWN_GOAL_S = 0.5
CONDITIONS = ("cached", "compiled")
CONDITION_NAMES = {"cached": "bytecode cached", "compiled": "hangwatch compiled at each start"}
# what a supervisor process could import and never should on a plain run: the packages named in the table
HEAVY = (
    "pydantic",
    "yaml",
    "structlog",
    "click",
    "psutil",
    "watchdog",
    "rich",
    "pygments",
    "asyncio",
    "ssl",
    "attr",
    "apprise",
    "prometheus_client",
    "plotly",
    "jinja2",
    "tokenizers",
    "torch",
    "transformers",
    "numpy",
)
SLEEPER = [PY, "-c", "import time; time.sleep(600)"]
DOCTOR_LINE = re.compile(r"doctor: (\d+) checks in ([0-9.]+)s")
KINDS = ("command_auto", "command_off", "builtin", "builtin_no_doctor")


def median_of(values: list) -> Optional[float]:
    return summary(values).get("median")


# ---------------------------------------------------------------- the two conditions


def environments(prefix: Path) -> dict[str, dict]:
    """The child environment of each condition (both with the section's own bytecode cache)."""
    base = {k: v for k, v in env().items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    cached = {**base, "PYTHONPYCACHEPREFIX": str(prefix)}
    return {"cached": cached, "compiled": {**cached, "PYTHONDONTWRITEBYTECODE": "1"}}


def drop_own_bytecode(prefix: Path) -> list[str]:
    """Remove hangwatch's modules from the bytecode cache (wherever hangwatch is imported from: the checkout, or
    what PYTHONPATH puts first); the libraries' stay."""
    gone = []
    for name in ("hangwatch.common", "hangwatch.daemon", "hangwatch.supervisor"):
        spec = importlib.util.find_spec(name)
        for where in (spec.submodule_search_locations or []) if spec else []:
            mirror = prefix / Path(where).relative_to("/")
            if mirror.exists():
                shutil.rmtree(mirror)
            gone.append(str(where))
    return gone


# ---------------------------------------------------------------- memory and CPU


MODULES_AT_EXIT = (
    "import atexit, json, runpy, sys\n"
    "listing = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(listing, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "runpy.run_module('hangwatch.supervisor', run_name='__main__', alter_sys=True)\n"
)


def imported_by_supervisor(work: Path, environ: dict) -> dict:
    """One `hangwatch run` of the synthetic ranks, its modules written when it exits (its `sys.modules`, after the
    first attempt ran and a few seconds of watching): the heavy packages and the number of modules."""
    run_dir = work / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {
            "command": [PY, str(footprint.SYNTHETIC_RANKS), "--ranks", str(RANKS), "--hz", str(HZ), "--seconds", "60"],
            "instrument": "off",
        },
        "watchdog": {"py_spy": False},
    }
    listing = work / "modules.json"
    argv = [PY, "-c", MODULES_AT_EXIT, str(listing), "run", str(write_yaml(work / "cfg.yaml", cfg))]
    proc = spawn(argv, work / "supervisor.out", environ)
    hb_files = [rundir.heartbeat_path(rundir.attempt_dir(run_dir, 1), r) for r in range(RANKS)]
    limit = time.monotonic() + 60
    while (
        not all(h.exists() and h.stat().st_size for h in hb_files) and time.monotonic() < limit and proc.poll() is None
    ):
        time.sleep(0.05)
    time.sleep(3.0)  # a few passes of watching (the inotify binding loads at the first attempt)
    proc.send_signal(signal.SIGTERM)
    wait_exit(proc, 60)
    try:
        names = json.loads(listing.read_text())
    except (OSError, ValueError):
        return {"modules": None, "heavy": [], "error": f"no module list (see {work / 'supervisor.out'})"}
    return {"modules": len(names), "heavy": sorted({n.split(".")[0] for n in names} & set(HEAVY))}


def memory_round(work: Path, window: float, settle: float, environ: dict) -> dict:
    ld = footprint.watch_load(work, RANKS, HZ, window, settle, environ)
    return {
        k: ld[k]
        for k in (
            "rss_mib",
            "cpu_percent_whole_window",
            "wakeups_per_s",
            "lines_per_s",
            "torn_lines",
            "threads",
            "supervisor_exit",
        )
    }


# ---------------------------------------------------------------- `run` → worker spawned


def start_config(kind: str, run_dir: Path) -> tuple[dict, list[str]]:
    """(config, extra `run` arguments) for one kind of start."""
    if kind in ("builtin", "builtin_no_doctor"):
        cfg = demo_worker_config(run_dir)
        # the worker (killed while it imports torch) keeps the libraries' own bytecode, not this section's cache
        cfg["worker"] = {**(cfg.get("worker") or {}), "env": {"PYTHONPYCACHEPREFIX": ""}}
        return cfg, (["--no-doctor"] if kind == "builtin_no_doctor" else [])
    cfg = {
        "run_dir": str(run_dir),
        "worker": {"command": SLEEPER},
        "watchdog": {"py_spy": False, "startup_timeout_s": 600},
    }
    if kind == "command_off":
        cfg["worker"]["instrument"] = "off"
    return cfg, []


def start_trial(tmp: Path, kind: str, environ: dict) -> dict:
    """Spawn of `hangwatch run` → its worker spawned (attempts/0001/worker.log created), and → its control socket
    answering `status`; then SIGTERM."""
    run_dir = tmp / "run"
    cfg, extra = start_config(kind, run_dir)
    argv = supervisor_argv(write_yaml(tmp / "cfg.yaml", cfg)) + extra
    out = tmp / "supervisor.out"
    t0 = time.monotonic()
    proc = spawn(argv, out, environ)
    got = footprint.started(proc, run_dir, t0, 60)
    m = DOCTOR_LINE.search(out.read_text(errors="replace"))
    if m:
        got["doctor_checks"], got["doctor_own_s"] = int(m.group(1)), float(m.group(2))
    if "to_worker_spawned_s" not in got:
        got["error"] = f"{kind}: no worker spawned within 60 s (see {out})"
    return got


def start_round(work: Path, per_round: int, environ: dict) -> dict[str, list[dict]]:
    trials: dict[str, list[dict]] = {k: [] for k in KINDS}
    for i in range(per_round):
        for kind in KINDS:  # interleaved, so that a busy moment of the machine spreads over every kind
            trials[kind].append(start_trial(work / f"{kind}-{i}", kind, environ))
    return trials


# ---------------------------------------------------------------- the section


def condition(
    work: Path, environ: dict, rounds: int, window: float, settle: float, n_status: int, per_round: int
) -> dict:
    mem, status, starts = [], [], {k: [] for k in KINDS}
    for r in range(rounds):
        mem.append(memory_round(work / f"memory-{r}", window, settle, environ))
        status.append(cli_latency.status_figures(work / f"status-{r}", n_status, environ))
        for kind, ts in start_round(work / f"start-{r}", per_round, environ).items():
            starts[kind] += ts

    def status_med(key: str) -> Optional[float]:
        return median_of([p[key].get("median") for p in status])

    return {
        "memory": {
            "rounds": mem,
            "rss_mib_per_round": [m["rss_mib"].get("median") for m in mem],
            "cpu_percent_per_round": [m["cpu_percent_whole_window"] for m in mem],
            "rss_mib": median_of([m["rss_mib"].get("median") for m in mem]),
            "cpu_percent": median_of([m["cpu_percent_whole_window"] for m in mem]),
        },
        "status": {
            "rounds": [
                {
                    k: p[k]
                    for k in (
                        "python_startup_s",
                        "status_s",
                        "status_json_s",
                        "status_instant_s",
                        "status_json_instant_s",
                    )
                }
                for p in status
            ],
            **{
                k: status_med(k)
                for k in ("status_s", "status_json_s", "status_instant_s", "status_json_instant_s", "python_startup_s")
            },
            "status_p50_per_round": [p["status_s"].get("median") for p in status],
            "status_json_p50_per_round": [p["status_json_s"].get("median") for p in status],
            "status_imports": status[-1]["status_imports"],
            "status_json_imports": status[-1]["status_json_imports"],
            "errors": [e for p in status for e in p["errors"]],
        },
        "start": {
            kind: {
                "to_worker_spawned_s": summary([t.get("to_worker_spawned_s") for t in ts]),
                "to_socket_ready_s": summary([t.get("to_socket_ready_s") for t in ts]),
                "doctor_own_s": summary([t.get("doctor_own_s") for t in ts]),
                "errors": [t["error"] for t in ts if "error" in t],
                "trials": ts,
            }
            for kind, ts in starts.items()
        },
    }


def warm_up(work: Path, environ: dict) -> None:
    """One untimed pass over everything measured: the bytecode cache fills with what each process imports."""
    memory_round(work / "memory", 2.0, 1.0, environ)
    cli_latency.status_figures(work / "status", 1, environ)
    start_round(work / "start", 1, environ)


def section(work: Path, quick: bool) -> dict:
    rounds = 1 if quick else ROUNDS
    window, settle = (3.0, 1.0) if quick else (20.0, 3.0)
    n_status, per_round = (5, 1) if quick else (15, 2)
    envs = environments(work / "pycache")
    warm_up(work / "warm-up", envs["cached"])
    imports = imported_by_supervisor(work / "imports", envs["cached"])
    results = {"cached": condition(work / "cached", envs["cached"], rounds, window, settle, n_status, per_round)}
    dropped = drop_own_bytecode(work / "pycache")
    results["compiled"] = condition(work / "compiled", envs["compiled"], rounds, window, settle, n_status, per_round)
    return {
        "method": f"{rounds} round(s) of each measurement under each condition, the figure is the median of the "
        f"rounds' figures (the starts: the median of every trial). Memory and CPU: `hangwatch run` watching "
        f"{RANKS} synthetic ranks each beating a step line at {HZ:g} Hz (scripts/baselines/synthetic_ranks.py, "
        f"instrument off), after {settle:g} s to settle sampled every 1 s for {window:g} s with psutil (RSS: "
        "the median sample; CPU: CPU time / wall time, 100 % = one core), as in the footprint section; the "
        "imports: one more such run, cached, its `sys.modules` written when it exits after a few seconds of "
        "watching. Status: "
        f"`hangwatch status --run-dir RUN` (and `--json`), the console script, spawned {n_status} times a round "
        "against a real supervisor watching a sleeping worker, spawn → exit, beside a socket that answers at "
        "once (cli_latency.py). Start: spawn of `python -m hangwatch.supervisor run CFG` → the worker spawned "
        f"(attempts/0001/worker.log created), {per_round} trial(s) of each kind a round, interleaved: a "
        "foreign `worker.command` (`python -c 'sleep'`; instrument auto, which asks that Python for its "
        "version, and off) and the built-in worker on configs/demo.yaml (the cheap doctor preflight, a child "
        "process, before the supervisor starts; and with --no-doctor). Conditions: 'bytecode cached' = "
        "hangwatch's modules and the libraries' from a bytecode cache (PYTHONPYCACHEPREFIX of the section, "
        "filled by an untimed warm-up round), as an installed package runs; 'compiled at each start' = "
        "the same cache without hangwatch's modules, PYTHONDONTWRITEBYTECODE=1: hangwatch compiled from "
        "source in every process, as in a checkout under PYTHONDONTWRITEBYTECODE.",
        "rounds": rounds,
        "goals": {"rss_mib": RSS_GOAL_MIB, "status_s": STATUS_GOAL_S, "spawn_s": SPAWN_GOAL_S},
        "imports": imports,
        "dropped_bytecode_of": dropped,
        "conditions": results,
    }


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    from .report import stats_cell

    goals, conds = s["goals"], s["conditions"]

    def ms(v: Optional[float]) -> str:
        return "–" if v is None else f"{v * 1000:.0f} ms"

    def meets(v: Optional[float], g: float) -> str:
        return "" if v is None else (" — meets" if v <= g else " — misses")

    def each(cell) -> list[str]:
        return [cell(conds[c]) for c in CONDITIONS]

    def rss(c: dict) -> str:
        m = c["memory"]
        per = ", ".join(f"{v:.1f}" for v in m["rss_mib_per_round"] if v is not None)
        return f"{m['rss_mib']:.1f} MiB ({per}){meets(m['rss_mib'], goals['rss_mib'])}"

    def cpu(c: dict) -> str:
        m = c["memory"]
        return f"{m['cpu_percent']:.2f} % ({', '.join(f'{v:.2f}' for v in m['cpu_percent_per_round'])})"

    def status(key: str):
        def cell(c: dict) -> str:
            st = c["status"]
            per = ", ".join(ms(v) for v in st[f"{key}_p50_per_round"])
            return f"{ms(st[key + '_s'])} ({per}){meets(st[key + '_s'], goals['status_s'])}"

        return cell

    def spawned(kind: str):
        def cell(c: dict) -> str:
            sp = c["start"][kind]["to_worker_spawned_s"]
            return stats_cell(sp, "s", 1, 3) + meets(sp.get("median"), goals["spawn_s"])

        return cell

    errors = [
        e
        for c in CONDITIONS
        for e in conds[c]["status"]["errors"] + [x for k in KINDS for x in conds[c]["start"][k]["errors"]]
    ]
    rows = [
        [f"supervisor RSS, {RANKS} ranks × {HZ:g} Hz (goal ≤ {goals['rss_mib']:g} MiB; rounds)", *each(rss)],
        [f"supervisor CPU, {RANKS} ranks × {HZ:g} Hz, % of one core (rounds)", *each(cpu)],
        ["`hangwatch status` (rich view), spawn → exit, p50 (goal ≤ 150 ms; rounds)", *each(status("status"))],
        ["`hangwatch status --json`, spawn → exit, p50 (rounds)", *each(status("status_json"))],
        [
            "`status` / `--json` against a socket that answers at once; `python -c pass`",
            *each(
                lambda c: (
                    f"{ms(c['status']['status_instant_s'])} / {ms(c['status']['status_json_instant_s'])}; "
                    f"{ms(c['status']['python_startup_s'])}"
                )
            ),
        ],
        ["`run` → worker spawned: foreign command, instrument auto (goal ≤ 0.5 s)", *each(spawned("command_auto"))],
        ["`run` → worker spawned: foreign command, instrument off", *each(spawned("command_off"))],
        ["`run` → worker spawned: built-in worker, demo config (doctor preflight first)", *each(spawned("builtin"))],
        [
            "· the doctor's own checks (its line: `doctor: N checks in Xs`)",
            *each(lambda c: stats_cell(c["start"]["builtin"]["doctor_own_s"], "s", 1, 2)),
        ],
        ["`run --no-doctor` → worker spawned: built-in worker", *each(spawned("builtin_no_doctor"))],
        [
            "heavy packages the supervisor imported (modules in all)",
            f"{', '.join(s['imports']['heavy']) or 'none'} ({s['imports']['modules']})",
            "–",
        ],
        ["runs that failed", "; ".join(errors) or "none", ""],
    ]
    return (
        "13. The supervisor's weight: memory, `status`, start",
        ["figure", *(CONDITION_NAMES[c] for c in CONDITIONS)],
        rows,
        f"{s['method']} (bench/weight.py).",
    )


__all__ = ["section", "render"]
