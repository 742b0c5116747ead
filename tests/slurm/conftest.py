"""A real one-host Slurm cluster for the tests of this directory: munged, slurmctld and slurmd with a private
configuration under a temporary directory (`scripts/slurm-cluster.sh`, which a person can run too), started once
per session and stopped after.  It needs slurm-wlm and munge installed (scripts/test.sh installs them, through
`scripts/setup.sh --with-slurm`, when it runs
as root with apt) and root; where it cannot start, every test here is skipped with the reason (shown by `-ra`).

`slurm` (the fixture) submits jobs with the cluster's SLURM_CONF, and reads a job's state both ways the cluster
offers: `scontrol show job` (the controller's live record: state, restarts, exit code) and `sacct -c` (the job
completion log, jobcomp/filetxt: one record per end of the job, a requeue included).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest
from fixtures.fakes.workers import ROOT, worker_env

from hangwatch.supervisor.ops.signal_source import job_fields

SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
CLIENTS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sacct", "scancel")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE")


def why_no_cluster() -> Optional[str]:
    missing = [c for c in CLIENTS if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "the test cluster's slurmd must run as root"
    return None


class Cluster:
    def __init__(self, directory: Path):
        self.dir = directory
        self.env = worker_env({"SLURM_CONF": str(directory / "slurm.conf")})
        self.env = {k: v for k, v in self.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}

    def run(self, *argv: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr or done.stdout}")
        return done

    def sbatch(self, script: Path) -> str:
        out = self.run("sbatch", "--parsable", str(script)).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The controller's record of the job (`scontrol show job -o`)."""
        return job_fields(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def state(self, job_id: str) -> str:
        return self.job(job_id).get("JobState", "")

    def wait(self, job_id: str, states=ENDED, timeout: float = 240) -> dict[str, str]:
        """Until the job's state is one of `states` (and, for an end, no longer completing); its record."""
        t0 = time.monotonic()
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states and "COMPLETING" not in fields.get("JobState", ""):
                return fields
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"job {job_id} still {fields.get('JobState')} after {timeout:g} s: {fields}")
            time.sleep(0.5)

    def completions(self, job_id: str) -> list[str]:
        """Each end of the job in the completion log, in order (`sacct -c`): its state."""
        out = self.run("sacct", "-c", "-j", job_id, "-n", "-P", "-o", "JobID,State").stdout
        return [line.split("|")[1] for line in out.splitlines() if line.split("|")[0] == job_id]

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            f = self.dir / "log" / name
            if f.exists():
                parts.append(f"--- {name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-30:]))
        return "\n".join(parts)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    why = why_no_cluster()
    if why is not None:
        pytest.skip(why)
    directory = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(
        ["bash", str(SCRIPT), "start", str(directory)], capture_output=True, text=True, timeout=120
    )
    try:
        if started.returncode != 0:
            pytest.skip(f"the test Slurm cluster did not start (exit {started.returncode}): {started.stderr[-1500:]}")
        yield Cluster(directory)
    finally:
        subprocess.run(["bash", str(SCRIPT), "stop", str(directory)], capture_output=True, timeout=120)
