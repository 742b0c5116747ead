"""Who sent the signal that stops `hangwatch run`, in words for state.json and the log.

A signal handler cannot tell who sent a signal (Python's handlers get no siginfo), but the job it runs in can:
in a Slurm job (SLURM_JOB_ID set) the job's record at the moment the loop reads the signal says why Slurm sent
it.  Once the controller has decided to end a job it shows COMPLETING until the job's last process is gone
(this one among them), whatever ended it: one at or past its limit (RunTime at least TimeLimit, Reason=TimeLimit)
reached it, one COMPLETING before its time limit was cancelled (`scancel`).  CANCELLED, TIMEOUT, PREEMPTED,
… are read as they are where the controller shows them.  A job still RUNNING got the signal from its `--signal`
warning (SIGUSR1 N seconds before the limit), from `scancel --signal`, or from a person.  So:

    SIGTERM from Slurm (scancel of job 12)
    SIGTERM from Slurm (the time limit of job 12)
    SIGUSR1 in Slurm job 12 (running, time limit at 2026-11-28T21:17:00: its --signal warning, scancel --signal
            or a person)
    SIGTERM                                    outside Slurm

The state comes from `scontrol show job -o <id>` (the controller keeps a job's record for MinJobAge after its
end, 300 s by default), asked once per signal, from the loop, never from the handler, with a short timeout: a
controller that does not answer costs the stop at most SCONTROL_TIMEOUT_S and the words say so.

`batch` is true inside a Slurm job: the scheduler follows its SIGTERM with SIGKILL after its own KillWait, and
both the step's tasks and srun may pass a signal on, so a second signal there is not a person's second Ctrl-C
(which kills at once) but the same request again.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Callable, Mapping, Optional

SCONTROL_TIMEOUT_S = 3.0
WHY = {
    "CANCELLED": "scancel of job {job}",
    "TIMEOUT": "the time limit of job {job}",
    "PREEMPTED": "preemption of job {job}",
    "DEADLINE": "the deadline of job {job}",
    "NODE_FAIL": "a node failure in job {job}",
    "REQUEUED": "a requeue of job {job}",
}

Run = Callable[..., "subprocess.CompletedProcess[str]"]


def job_fields(text: str) -> dict[str, str]:
    """`scontrol show job -o` output (one line of Key=Value words) → its fields; values with spaces are cut at the
    first space, which no field read here has."""
    out = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def seconds(text: str) -> Optional[int]:
    """Slurm's `[D-]HH:MM:SS` (or `MM:SS`) → seconds; None for UNLIMITED, Partition_Limit and the like."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    total = 0
    for p in parts:
        total = total * 60 + int(p)
    return total + int(days or 0) * 86400


def limit_reached(fields: Mapping[str, str]) -> bool:
    run, limit = seconds(fields.get("RunTime", "")), seconds(fields.get("TimeLimit", ""))
    return run is not None and limit is not None and run >= limit


class SignalSource:
    """`describe(signum)`: who sent it, in words; `batch`: the process runs under a batch scheduler."""

    def __init__(self, env: Optional[Mapping[str, str]] = None, run: Run = subprocess.run):
        self.env = os.environ if env is None else env
        self.run = run

    @property
    def job(self) -> Optional[str]:
        return self.env.get("SLURM_JOB_ID") or None

    @property
    def batch(self) -> bool:
        return self.job is not None

    def describe(self, signum: int) -> str:
        name = signal.Signals(signum).name
        job = self.job
        if job is None:
            return name
        fields, problem = self.job_state(job)
        state = (fields.get("JobState") or "").split("+")[0]
        if state == "SIGNALING":  # a running job whose signal (its --signal warning) is being delivered right now
            state = "RUNNING"
        if state == "COMPLETING":
            state = "TIMEOUT" if limit_reached(fields) or fields.get("Reason") == "TimeLimit" else "CANCELLED"
        if state in WHY:
            return f"{name} from Slurm ({WHY[state].format(job=job)})"
        if state:
            end = fields.get("EndTime")
            limit = f", time limit at {end}" if end and end not in ("Unknown", "None") else ""
            return (
                f"{name} in Slurm job {job} ({state.lower()}{limit}: its --signal warning, "
                f"scancel --signal or a person)"
            )
        return f"{name} in Slurm job {job} (its state unknown: {problem})"

    def job_state(self, job: str) -> tuple[dict[str, str], str]:
        """The job's fields from the controller, or ({}, why not)."""
        try:
            done = self.run(
                ["scontrol", "show", "job", "-o", job],
                capture_output=True,
                text=True,
                timeout=SCONTROL_TIMEOUT_S,
                env=dict(self.env),
            )
        except FileNotFoundError:
            return {}, "no scontrol on PATH"
        except subprocess.TimeoutExpired:
            return {}, f"scontrol gave no answer in {SCONTROL_TIMEOUT_S:g} s"
        except OSError as exc:
            return {}, f"scontrol: {exc}"
        if done.returncode != 0:
            return {}, f"scontrol: {(done.stderr or done.stdout).strip()[:200] or f'exit {done.returncode}'}"
        return job_fields(done.stdout), ""
