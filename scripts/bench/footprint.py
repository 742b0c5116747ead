"""Section 4, footprint: what watching costs.  The supervisor's CPU (% of one core), RSS and wake-ups a
second while it watches synthetic ranks (scripts/baselines/synthetic_ranks.py) — 8 ranks at 20 Hz and
64 ranks at 10 Hz, each against its goal — and while it watches a worker with nothing due (idle); how
long it takes to start; and what its reports on the worker's tracker runs cost (a worker logging to W&B
offline, MLflow and TensorBoard, hung once and resumed: the supervisor's RSS and CPU with the reports and
without, and each report's helper process)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Optional

import psutil

from hangwatch.common import rundir

from .harness import PY, ROOT, SYNTHETIC_RANKS, control, env, hangwatch_run, summary, wait_exit, write_yaml

# (ranks, beats a second per rank, goal: % of one core); the RSS goal is for every load
LOADS = ((8, 20.0, 1.0), (64, 10.0, 3.0))
RSS_GOAL_MIB = 40.0
RANKS, HZ = LOADS[0][:2]  # the headline load (the figures at the top level of the section's results)
IDLE_WORKER = (
    "from hangwatch.daemon.heartbeat import Heartbeat; import time; hb = Heartbeat.from_env(); "
    "hb.start(); hb.enter_phase('idle'); time.sleep(3600)"
)


def line_count(files: list[Path]) -> int:
    return sum(f.read_bytes().count(b"\n") for f in files if f.exists())


def cpu_s(proc: psutil.Process) -> float:
    c = proc.cpu_times()
    return c.user + c.system


def wakeups(proc: psutil.Process) -> int:
    """Voluntary context switches: every time the process went to sleep (so: woke up) since it started."""
    return proc.num_ctx_switches().voluntary


def sample(sup: psutil.Process, window: float) -> dict:
    """CPU% and RSS of `sup` once a second for `window` s; its CPU seconds, wake-ups and the wall seconds in all."""
    rss, cpu_pct = [], []
    c0 = prev_c = cpu_s(sup)
    k0 = wakeups(sup)
    w0 = prev_w = time.monotonic()
    while time.monotonic() - w0 < window:
        time.sleep(1.0)
        c, now = cpu_s(sup), time.monotonic()
        rss.append(sup.memory_info().rss)
        cpu_pct.append(100.0 * (c - prev_c) / (now - prev_w))
        prev_c, prev_w = c, now
    wall = time.monotonic() - w0
    return {
        "rss": rss,
        "cpu_pct": cpu_pct,
        "cpu_total_s": cpu_s(sup) - c0,
        "wall_s": wall,
        "wakeups_per_s": (wakeups(sup) - k0) / wall,
        "threads": sup.num_threads(),
    }


def start_synthetic(work: Path, ranks: int, hz: float, seconds: float, environ: Optional[dict] = None) -> tuple:
    """`hangwatch run` of `ranks` synthetic ranks beating a step line at `hz` each for `seconds`, once every rank has
    beaten: (the supervisor's Popen, the run dir, the heartbeat files).  `environ`: the supervisor's environment
    (default: the harness's)."""
    run_dir = work / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {
            "command": [PY, str(SYNTHETIC_RANKS), "--ranks", str(ranks), "--hz", str(hz), "--seconds", str(seconds)],
            "instrument": "off",
        },  # one process writing every rank's beats: the supervisor's cost alone
        "watchdog": {"py_spy": False},
    }
    cfg_path = write_yaml(work / "cfg.yaml", cfg)
    proc = hangwatch_run(cfg_path, work / "supervisor.out", environ=environ)
    hb_files = [rundir.heartbeat_path(rundir.attempt_dir(run_dir, 1), r) for r in range(ranks)]
    limit = time.monotonic() + 120
    while not all(f.exists() and f.stat().st_size for f in hb_files):
        if time.monotonic() > limit or proc.poll() is not None:
            wait_exit(proc, 1)
            raise RuntimeError(f"the synthetic ranks did not all start (see {work})")
        time.sleep(0.05)
    return proc, run_dir, hb_files


def watch_load(work: Path, ranks: int, hz: float, window: float, settle: float, environ: Optional[dict] = None) -> dict:
    """`hangwatch run` watching `ranks` synthetic ranks beating a step line at `hz` each, sampled for `window` s."""
    proc, run_dir, hb_files = start_synthetic(work, ranks, hz, window + settle + 60, environ)
    sup = psutil.Process(proc.pid)
    time.sleep(settle)  # a measured settling time before the window, not synchronisation
    lines_before = line_count(hb_files)
    s = sample(sup, window)
    lines = line_count(hb_files) - lines_before
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 60)
    state = rundir.read_json(run_dir / rundir.STATE_NAME) or {}
    return {
        "ranks": ranks,
        "hz": hz,
        "window_s": s["wall_s"],
        "cpu_percent_whole_window": 100.0 * s["cpu_total_s"] / s["wall_s"],
        "cpu_percent_per_second": s["cpu_pct"],
        "cpu_percent": summary(s["cpu_pct"]),
        "rss_bytes_samples": s["rss"],
        "rss_mib": summary([r / 2**20 for r in s["rss"]]),
        "wakeups_per_s": s["wakeups_per_s"],
        "threads": s["threads"],
        "heartbeat_lines_in_window": lines,
        "lines_per_s": lines / s["wall_s"],
        "torn_lines": state.get("torn_lines"),
        "supervisor_exit": code,
    }


def idle(work: Path, window: float) -> dict:
    """`hangwatch run` watching a worker that said `start`, entered `idle` and sleeps: nothing is due for
    minutes (the silence deadline, 120 s by default), so the supervisor should sleep too."""
    run_dir = work / "run"
    cfg = {"run_dir": str(run_dir), "worker": {"command": [PY, "-c", IDLE_WORKER]}, "watchdog": {"py_spy": False}}
    proc = hangwatch_run(write_yaml(work / "cfg.yaml", cfg), work / "supervisor.out")
    sup = psutil.Process(proc.pid)
    limit = time.monotonic() + 60
    hb = rundir.heartbeat_path(rundir.attempt_dir(run_dir, 1), 0)
    while b'"idle"' not in (hb.read_bytes() if hb.exists() else b""):
        if time.monotonic() > limit or proc.poll() is not None:
            wait_exit(proc, 1)
            raise RuntimeError(f"the idle worker did not start (see {work})")
        time.sleep(0.05)
    time.sleep(1.0)
    s = sample(sup, window)
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 60)
    return {
        "window_s": s["wall_s"],
        "cpu_percent_whole_window": 100.0 * s["cpu_total_s"] / s["wall_s"],
        "wakeups_per_s": s["wakeups_per_s"],
        "rss_mib": summary([r / 2**20 for r in s["rss"]]),
        "supervisor_exit": code,
    }


TRACKERS_SCRIPT = ROOT / "tests" / "fixtures" / "user_scripts" / "plain_trackers.py"
TRACKERS_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": "sqlite:///mlflow.db"}


def tracker_reports(work: Path, report: bool) -> dict:
    """`hangwatch run -- python plain_trackers.py`: 20 steps logged to W&B (offline), MLflow (sqlite) and
    TensorBoard, a hang at step 12 caught by the learned step deadline (its 3 s floor), attempt 2 resumed from step 10
    and finished.  The supervisor (its own process, all threads) sampled every 0.2 s from start to exit; the report
    helpers (the supervisor's children running report.py, with their own children) likewise.
    `report`: trackers.report."""
    try:
        import mlflow  # noqa: F401
        import tensorboard  # noqa: F401
        import wandb  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"a tracker library is missing here ({exc}); install hangwatch[trackers]"}
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {
            "command": [PY, str(TRACKERS_SCRIPT), "--steps", "20", "--save-every", "5", "--hang-once", "hang.marker"],
            "cwd": str(work),
            "resume_args": ["--resume", "{checkpoint}"],
            "env": TRACKERS_ENV,
        },
        # the learned step budget (its floor 3 s): a configured step_timeout_s would also bound the trackers' start-up
        "watchdog": {"py_spy": False, "step_timeout_min_s": 3, "first_steps_timeout_s": 120, "dump_grace_s": 1},
        "restart": {"backoff_initial_s": 0, "max_restarts": 1},
        "checkpoint": {"confirm_steps": 1},
        "trackers": {"report": report},
    }
    t0 = time.monotonic()
    proc = hangwatch_run(write_yaml(work / "cfg.yaml", cfg), work / "supervisor.out", environ=env())
    sup = psutil.Process(proc.pid)
    rss, helpers, helper_rss = [], {}, {}
    c0 = cpu_s(sup)
    cpu_end = c0
    while proc.poll() is None:
        try:
            rss.append(sup.memory_info().rss)
            cpu_end = cpu_s(sup)
            kids = sup.children()
        except psutil.NoSuchProcess:
            break
        for k in kids:
            try:
                if "report.py" not in " ".join(k.cmdline()):
                    continue
                tree = [k, *k.children(recursive=True)]
                total = sum(p.memory_info().rss for p in tree)
            except psutil.Error:
                continue
            helpers.setdefault(k.pid, time.monotonic())
            helper_rss[k.pid] = max(helper_rss.get(k.pid, 0), total)
        time.sleep(0.2)
    wall = time.monotonic() - t0
    code = wait_exit(proc, 60)
    took = []
    log_path = run_dir / "supervisor.log"
    for line in log_path.read_text().splitlines() if log_path.exists() else []:
        if '"tracker_reported"' in line:
            took.append(json.loads(line).get("took_s"))
    return {
        "report": report,
        "supervisor_exit": code,
        "wall_s": wall,
        "supervisor_rss_mib": summary([r / 2**20 for r in rss]),
        "supervisor_rss_peak_mib": max(rss, default=0) / 2**20,
        "supervisor_cpu_percent_whole_run": 100.0 * (cpu_end - c0) / wall if wall > 0 else None,
        "reports": len(helpers),
        "report_took_s": took,
        "helper_rss_peak_mib": [v / 2**20 for v in helper_rss.values()],
    }


def supervisor_start_trial(tmp: Path) -> dict:
    """Spawn of `hangwatch run` → its worker spawned, and → its control socket answering `status`."""
    run_dir = tmp / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {"command": [PY, "-c", "import time; time.sleep(600)"]},
        "watchdog": {"py_spy": False, "startup_timeout_s": 600},
    }
    cfg_path = write_yaml(tmp / "cfg.yaml", cfg)
    t0 = time.monotonic()
    proc = hangwatch_run(cfg_path, tmp / "supervisor.out")
    return started(proc, run_dir, t0, 30)


def started(proc, run_dir: Path, t0: float, limit_s: float) -> dict:
    """How long after `t0` the supervisor `proc` spawned its worker (attempts/0001/worker.log created) and its
    control socket answered `status`, each looked at every 5 ms for at most `limit_s`; then SIGTERM."""
    got: dict = {}
    limit = t0 + limit_s
    log = rundir.worker_log_path(run_dir, 1)
    while len(got) < 2 and time.monotonic() < limit and proc.poll() is None:
        if "to_worker_spawned_s" not in got and log.exists():
            got["to_worker_spawned_s"] = time.monotonic() - t0
        if "to_socket_ready_s" not in got and run_dir.is_dir() and control(run_dir, "status", 1)[1] is None:
            got["to_socket_ready_s"] = time.monotonic() - t0
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    got["supervisor_exit"] = wait_exit(proc, limit_s)
    return got


def against(value: Optional[float], goal: float) -> Optional[bool]:
    return None if value is None else value <= goal


def section(work: Path, quick: bool) -> dict:
    window = 3.0 if quick else 60.0
    settle = 1.0 if quick else 3.0
    loads = []
    for ranks, hz, goal in LOADS:
        f = watch_load(work / f"load-{ranks}x{hz:g}", ranks, hz, window, settle)
        f["cpu_goal_percent"], f["rss_goal_mib"] = goal, RSS_GOAL_MIB
        f["cpu_meets_goal"] = against(f["cpu_percent_whole_window"], goal)
        f["rss_meets_goal"] = against(f["rss_mib"].get("median"), RSS_GOAL_MIB)
        loads.append(f)
    quiet = idle(work / "idle", 3.0 if quick else 30.0)
    starts = [supervisor_start_trial(work / f"start-{i}") for i in range(2 if quick else 10)]
    reports = [tracker_reports(work / f"trackers-{on}", on) for on in (False, True)]
    head = loads[0]
    return {
        "method": "`hangwatch run` watching synthetic ranks (scripts/baselines/synthetic_ranks.py) each beating a "
        "step line at a fixed rate — "
        f"{', '.join(f'{r} ranks at {h:g} Hz (goal ≤ {g:g} % of one core)' for r, h, g in LOADS)}, RSS goal ≤ "
        f"{RSS_GOAL_MIB:g} MiB — one load at a time, nothing else of this benchmark running; after all ranks started "
        f"and {settle:g} s to settle, the supervisor process (all its threads) sampled every 1 s for {window:g} s with "
        "psutil: CPU% = CPU time / wall time (100% = one core), RSS, wake-ups = voluntary context switches a second. "
        "Idle: a worker that sent `start`, entered `idle` and sleeps (nothing due for 120 s), sampled the same way. "
        "Start time: spawn of `hangwatch run` → the worker spawned (attempts/0001/worker.log created) and → the "
        "control socket answering `status`, sequential trials.  Tracker reports: `hangwatch run` of "
        "tests/fixtures/user_scripts/plain_trackers.py (W&B offline, MLflow sqlite, TensorBoard), hung once at step 12 "
        "and resumed, with `trackers.report` false and true; the supervisor sampled every 0.2 s from start to exit, "
        "each report helper's process tree likewise (peak RSS), each report's time from the `tracker_reported` log.",
        "loads": loads,
        "idle": quiet,
        # the headline load (8 ranks at 20 Hz) at the top level, as before
        **{
            k: head[k]
            for k in (
                "ranks",
                "hz",
                "window_s",
                "cpu_percent_whole_window",
                "cpu_percent_per_second",
                "cpu_percent",
                "rss_bytes_samples",
                "rss_mib",
                "threads",
                "heartbeat_lines_in_window",
                "lines_per_s",
                "torn_lines",
                "supervisor_exit",
                "wakeups_per_s",
            )
        },
        "start": starts,
        "tracker_reports": reports,
        "start_to_worker_spawned_s": summary([s.get("to_worker_spawned_s") for s in starts]),
        "start_to_socket_ready_s": summary([s.get("to_socket_ready_s") for s in starts]),
    }
