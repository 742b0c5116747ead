"""Section 4, footprint: the supervisor's RSS and CPU while it watches 8 synthetic ranks beating at 20 Hz
(scripts/baselines/synthetic_ranks.py), run alone; and how long it takes to start."""
from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil

from hangwatch.common import rundir

from .harness import PY, SYNTHETIC_RANKS, control, hangwatch_run, summary, wait_exit, write_yaml

RANKS, HZ = 8, 20.0


def line_count(files: list[Path]) -> int:
    return sum(f.read_bytes().count(b"\n") for f in files)


def cpu_s(proc: psutil.Process) -> float:
    c = proc.cpu_times()
    return c.user + c.system


def sample(sup: psutil.Process, window: float) -> tuple[list[int], list[float], float, float]:
    """RSS and CPU% of `sup` once a second for `window` s; also its CPU seconds and the wall seconds in all."""
    rss, cpu_pct = [], []
    c0 = prev_c = cpu_s(sup)
    w0 = prev_w = time.monotonic()
    while time.monotonic() - w0 < window:
        time.sleep(1.0)
        c, now = cpu_s(sup), time.monotonic()
        rss.append(sup.memory_info().rss)
        cpu_pct.append(100.0 * (c - prev_c) / (now - prev_w))
        prev_c, prev_w = c, now
    return rss, cpu_pct, cpu_s(sup) - c0, time.monotonic() - w0


def supervisor_start_trial(tmp: Path) -> dict:
    """Spawn of `hangwatch run` → its worker spawned, and → its control socket answering `status`."""
    run_dir = tmp / "run"
    cfg = {"run_dir": str(run_dir), "worker": {"command": [PY, "-c", "import time; time.sleep(600)"]},
           "watchdog": {"py_spy": False, "startup_timeout_s": 600}}
    cfg_path = write_yaml(tmp / "cfg.yaml", cfg)
    t0 = time.monotonic()
    proc = hangwatch_run(cfg_path, tmp / "supervisor.out")
    got: dict = {}
    limit = t0 + 30
    while len(got) < 2 and time.monotonic() < limit and proc.poll() is None:
        if "to_worker_spawned_s" not in got and rundir.worker_log_path(run_dir, 1).exists():
            got["to_worker_spawned_s"] = time.monotonic() - t0
        if "to_socket_ready_s" not in got and run_dir.is_dir() and control(run_dir, "status", 1)[1] is None:
            got["to_socket_ready_s"] = time.monotonic() - t0
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    got["supervisor_exit"] = wait_exit(proc, 30)
    return got


def section(work: Path, quick: bool) -> dict:
    window = 3.0 if quick else 60.0
    settle = 1.0 if quick else 2.0
    run_dir = work / "run"
    cfg = {"run_dir": str(run_dir),
           "worker": {"command": [PY, str(SYNTHETIC_RANKS), "--ranks", str(RANKS), "--hz", str(HZ),
                                  "--seconds", str(window + settle + 20)]},
           "watchdog": {"py_spy": False}}
    proc = hangwatch_run(write_yaml(work / "cfg.yaml", cfg), work / "supervisor.out")
    sup = psutil.Process(proc.pid)
    hb_files = [rundir.heartbeat_path(rundir.attempt_dir(run_dir, 1), r) for r in range(RANKS)]
    limit = time.monotonic() + 60
    while not all(f.exists() and f.stat().st_size for f in hb_files):
        if time.monotonic() > limit or proc.poll() is not None:
            wait_exit(proc, 1)
            raise RuntimeError(f"the synthetic ranks did not all start (see {work})")
        time.sleep(0.05)
    time.sleep(settle)  # a measured settling time before the window, not synchronisation
    lines_before = line_count(hb_files)
    rss, cpu_pct, cpu_total, wall = sample(sup, window)
    lines = line_count(hb_files) - lines_before
    threads = sup.num_threads()
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 60)
    state = rundir.read_json(run_dir / rundir.STATE_NAME) or {}
    starts = [supervisor_start_trial(work / f"start-{i}") for i in range(2 if quick else 10)]
    return {
        "method": f"`hangwatch run` watching {RANKS} synthetic ranks (scripts/baselines/synthetic_ranks.py) "
                  f"beating a step line at {HZ:g} Hz each, nothing else of this benchmark running; after all ranks "
                  f"started and {settle:g} s to settle, the supervisor process (all its threads) sampled every 1 s "
                  f"for {window:g} s with psutil: CPU% = CPU time / wall time (100% = one core), RSS. Start time: "
                  "spawn of `hangwatch run` → the worker spawned (attempts/0001/worker.log created) and → the "
                  "control socket answering `status`, sequential trials.",
        "ranks": RANKS, "hz": HZ, "window_s": wall,
        "cpu_percent_whole_window": 100.0 * cpu_total / wall,
        "cpu_percent_per_second": cpu_pct, "cpu_percent": summary(cpu_pct),
        "rss_bytes_samples": rss, "rss_mib": summary([r / 2**20 for r in rss]),
        "threads": threads,
        "heartbeat_lines_in_window": lines, "lines_per_s": lines / wall,
        "torn_lines": state.get("torn_lines"), "supervisor_exit": code,
        "start": starts,
        "start_to_worker_spawned_s": summary([s.get("to_worker_spawned_s") for s in starts]),
        "start_to_socket_ready_s": summary([s.get("to_socket_ready_s") for s in starts]),
    }
