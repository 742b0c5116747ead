"""Section 5, side by side: the same hung worker (busy_loop, hang_generate) under hangwatch, plain
`torchrun --max-restarts=3`, and a cron-style watchdog (scripts/baselines/cron_watchdog.py), each with
the same wall-clock allowance."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Optional

import psutil

from .harness import (
    CRON_WATCHDOG,
    PY,
    attempts_of,
    demo_worker_config,
    finished_at,
    has_stack_dump,
    incidents_of,
    kill_tree,
    read_beats,
    spawn,
    supervisor_argv,
    suspension_gaps,
    write_yaml,
)

CONTENDERS = ("hangwatch", "torchrun", "cron_watchdog")
BASELINES = ("torchrun", "cron_watchdog")
FAULTS = {"hang_generate": {"kind": "hang_generate", "at_step": 20}, "busy_loop": {"kind": "busy_loop", "at_step": 15}}
BASELINE_NICE = 19
CRON_REPORT_GRACE_S = 15.0  # the cron watchdog ends itself at the allowance and prints its report; wait for that
WORKER_MODULE = "hangwatch.daemon"


def contender_argv(contender: str, cfg_path: Path, run_dir: Path, allowance: float) -> list[str]:
    worker = ["-m", WORKER_MODULE, "--config", str(cfg_path), "--run-dir", str(run_dir)]
    if contender == "hangwatch":
        return supervisor_argv(cfg_path, run_dir)
    nice = ["nice", "-n", str(BASELINE_NICE)] if shutil.which("nice") else []
    if contender == "torchrun":  # --standalone: a free rendezvous port, so several can run at once
        return (
            nice
            + [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=3"]
            + worker
        )
    return (
        nice
        + [
            PY,
            str(CRON_WATCHDOG),
            "--status-file",
            str(run_dir / "worker-stdout.log"),
            "--poll-s",
            "30",
            "--threshold-s",
            "600",
            "--allowance-s",
            str(allowance),
            "--",
            PY,
        ]
        + worker
    )


def cron_report(out_path: Path) -> dict:
    """The cron watchdog's last JSON report line in its output, or {}."""
    for line in reversed(out_path.read_text(errors="replace").splitlines()):
        with contextlib.suppress(ValueError):
            obj = json.loads(line)
            if isinstance(obj, dict) and "noticed" in obj:
                return obj
    return {}


class Contender:
    """One contender on one faulty run: started, then `finish()`ed once its allowance is over."""

    def __init__(self, tmp: Path, contender: str, fault: str, allowance: float):
        self.tmp, self.contender, self.fault, self.allowance = tmp, contender, fault, allowance
        self.run_dir = tmp / "run"
        self.run_dir.mkdir(parents=True, exist_ok=True)
        cfg = demo_worker_config(
            self.run_dir,
            train={"max_steps": 30, "sleep_per_step_s": 0.0},
            eval={"every_steps": 10},
            checkpoint={"every_steps": 10, "confirm_steps": 2},
            faults=[FAULTS[fault]],
        )
        self.argv = contender_argv(contender, write_yaml(tmp / "cfg.yaml", cfg), self.run_dir, allowance)
        self.out_path = tmp / "contender.out"
        self.started = time.time()
        self.t0 = time.monotonic()
        self.proc = spawn(self.argv, self.out_path)

    def fault_fired_at(self) -> Optional[float]:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            return json.loads((self.run_dir / "faults-fired.json").read_text())["fired"][0]["t"]
        return None

    def limit(self) -> float:
        return self.t0 + self.allowance + (CRON_REPORT_GRACE_S if self.contender == "cron_watchdog" else 0)

    def done(self) -> bool:
        return self.proc.poll() is not None or time.monotonic() >= self.limit()

    def still_running(self) -> list[dict]:
        """The workers still alive under the contender, and their state (sleeping in C, spinning, …)."""
        hung = []
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if WORKER_MODULE in p.cmdline():
                        hung.append({"pid": p.pid, "status": p.status(), "cpu_percent": p.cpu_percent(interval=0.5)})
        return hung

    def noticed(self, row: dict) -> tuple[Optional[float], Optional[str]]:
        """When (wall time) and how this contender noticed the hang, or (None, None); adds its own details to `row`."""
        if self.contender == "hangwatch":
            incs = incidents_of(self.run_dir)
            if not incs:
                return None, None
            d = incs[0].get("deadline") or {}
            row["classification"] = incs[0].get("classification")
            row["supervisor_suspended_gaps_s"] = suspension_gaps(self.run_dir)
            how = f"{d.get('name')} deadline, {d.get('budget_s'):g} s ({d.get('source')})" if d else incs[0]["kind"]
            return incs[0]["time_unix"], how
        if self.contender == "torchrun":
            later = [a for a in attempts_of(self.run_dir) if a > 1]
            if not later:
                return None, None
            beats = read_beats(self.run_dir, later[0])  # torchrun restarted the worker: its first line says when
            return (beats[0]["t"] if beats else None), "restarted the worker"
        report = row["cron_report"] = cron_report(self.out_path)
        if not report.get("noticed"):
            return None, None
        return report.get("noticed_unix"), f"status file older than {report.get('threshold_s'):g} s"

    def finish(self) -> dict:
        while not self.done():
            time.sleep(0.2)
        ended_by_itself = self.proc.poll() is not None
        hung = [] if ended_by_itself else self.still_running()
        if not ended_by_itself:
            kill_tree(self.proc.pid)
        code = self.proc.wait()
        hang_t = self.fault_fired_at()
        fin = finished_at(self.run_dir)
        row = {
            "contender": self.contender,
            "fault": self.fault,
            "allowance_s": self.allowance,
            "argv": self.argv,
            "started_unix": self.started,
            "wall_s": time.monotonic() - self.t0,
            "exit_code": code,
            "ended_by_itself": ended_by_itself,
            "still_running_at_end": hung,
            "hang_began_after_s": None if hang_t is None else hang_t - self.started,
            "attempts": len(attempts_of(self.run_dir)),
            "stack_dump": has_stack_dump(self.run_dir),
            "dir": str(self.tmp),
            "finished": fin is not None,
            "finished_after_s": None if fin is None else fin - self.started,
        }
        noticed_t, how = self.noticed(row)
        row["noticed"] = noticed_t is not None
        row["noticed_how"] = how
        row["noticed_after_hang_s"] = None if noticed_t is None or hang_t is None else noticed_t - hang_t
        return row


def section(work: Path, allowance: float) -> dict:
    """The four baseline runs start together (at nice 19); once their faults fired, or after half the
    allowance, the two hangwatch runs start together; every run gets `allowance` from its own start."""
    t0 = time.monotonic()
    runs = [Contender(work / f"{f}-{c}", c, f, allowance) for f in FAULTS for c in BASELINES]
    limit = time.monotonic() + allowance / 2
    while time.monotonic() < limit and not all(r.fault_fired_at() or r.done() for r in runs):
        time.sleep(0.2)
    waited = time.monotonic() - t0
    runs += [Contender(work / f"{f}-hangwatch", "hangwatch", f, allowance) for f in FAULTS]
    rows = [r.finish() for r in runs]
    order = {(f, c): i for i, (f, c) in enumerate((f, c) for f in FAULTS for c in CONTENDERS)}
    rows.sort(key=lambda r: order[(r["fault"], r["contender"])])
    return {
        "method": f"The built-in worker on the demo model (configs/demo.yaml: max_steps 30, eval every 10, checkpoint "
        f"every 10 confirmed after 2, no sleeps) with one fault: hang_generate (generate() waits forever at "
        f"the eval of step 20) or busy_loop (a pure-Python loop in attention's forward from step 15). Each "
        f"run gets {allowance:g} s of wall clock from its own start; then whatever still runs is killed. "
        f"hangwatch: `hangwatch run` with the demo's watchdog settings; torchrun: `python -m "
        f"torch.distributed.run --standalone --nproc-per-node=1 --max-restarts=3 -m hangwatch.daemon …`; cron "
        f"watchdog: scripts/baselines/cron_watchdog.py, status file = the worker's stdout log, polled every "
        f"30 s, threshold 600 s, kill -9 and restart. Schedule: the four torchrun/cron runs start together "
        f"at nice {BASELINE_NICE} (a hung busy_loop spins a core for the whole allowance; the niceness "
        f"cannot change whether they notice: torchrun reacts only to a worker's exit, the cron watchdog "
        f"only to the status file's age); the two hangwatch runs start together once those four faults "
        f"fired ({waited:.0f} s later). 'Noticed' = an incident (hangwatch), a new attempt (torchrun), "
        f"the watchdog's own report (cron), timed from the fault's record in faults-fired.json; 'stack "
        f"dump' = a file under the run dir holding a Python stack; 'finished' = a `stop finished` "
        f"heartbeat line.",
        "allowance_s": allowance,
        "baselines_alone_s": waited,
        "wall_s": time.monotonic() - t0,
        "runs": rows,
    }
