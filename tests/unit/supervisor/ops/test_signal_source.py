"""Who sent a stopping signal, from a Slurm job's state as `scontrol show job -o` gives it (a fake `run`)."""

from __future__ import annotations

import signal
import subprocess

from hangwatch.supervisor.ops.signal_source import SignalSource, job_fields, seconds

JOB = {"SLURM_JOB_ID": "12"}


def scontrol(state: str, code: int = 0, stderr: str = "", run_time: str = "00:00:40"):
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        out = (
            f"JobId=12 JobName=train JobState={state} Reason=None RunTime={run_time} TimeLimit=00:02:00 "
            "EndTime=2026-11-28T21:17:00\n"
        )
        return subprocess.CompletedProcess(argv, code, out if code == 0 else "", stderr)

    run.calls = calls
    return run


def test_outside_slurm_the_signal_name_alone_and_no_scontrol():
    run = scontrol("RUNNING")
    src = SignalSource(env={}, run=run)
    assert not src.batch
    assert src.describe(signal.SIGTERM) == "SIGTERM"
    assert run.calls == []


def test_the_jobs_state_says_who():
    assert SignalSource(JOB, scontrol("CANCELLED")).describe(signal.SIGTERM) == "SIGTERM from Slurm (scancel of job 12)"
    assert (
        SignalSource(JOB, scontrol("TIMEOUT")).describe(signal.SIGTERM)
        == "SIGTERM from Slurm (the time limit of job 12)"
    )
    assert (
        SignalSource(JOB, scontrol("PREEMPTED")).describe(signal.SIGTERM) == "SIGTERM from Slurm (preemption of job 12)"
    )
    # what the controller shows until the job's last process is gone: before its limit a cancel, at it the limit
    assert (
        SignalSource(JOB, scontrol("COMPLETING")).describe(signal.SIGTERM) == "SIGTERM from Slurm (scancel of job 12)"
    )
    assert (
        SignalSource(JOB, scontrol("COMPLETING", run_time="00:02:14")).describe(signal.SIGTERM)
        == "SIGTERM from Slurm (the time limit of job 12)"
    )
    src = SignalSource(JOB, scontrol("RUNNING"))
    assert src.batch
    assert src.describe(signal.SIGUSR1) == (
        "SIGUSR1 in Slurm job 12 (running, time limit at 2026-11-28T21:17:00: its --signal warning, "
        "scancel --signal or a person)"
    )
    # read while the controller is delivering that very signal: still a running job
    assert SignalSource(JOB, scontrol("SIGNALING")).describe(signal.SIGUSR1) == src.describe(signal.SIGUSR1)


def test_a_controller_that_does_not_answer_is_said():
    def slow(argv, **kw):
        raise subprocess.TimeoutExpired(argv, kw["timeout"])

    assert SignalSource(JOB, slow).describe(signal.SIGTERM) == (
        "SIGTERM in Slurm job 12 (its state unknown: scontrol gave no answer in 3 s)"
    )
    failed = scontrol("", code=1, stderr="slurm_load_jobs error: Invalid job id specified")
    assert SignalSource(JOB, failed).describe(signal.SIGTERM) == (
        "SIGTERM in Slurm job 12 (its state unknown: scontrol: slurm_load_jobs error: Invalid job id specified)"
    )

    def missing(argv, **kw):
        raise FileNotFoundError(2, "No such file", "scontrol")

    assert "no scontrol on PATH" in SignalSource(JOB, missing).describe(signal.SIGTERM)


def test_slurm_durations():
    assert seconds("00:02:00") == 120 and seconds("1-00:00:01") == 86401 and seconds("05:30") == 330
    assert seconds("UNLIMITED") is None and seconds("Partition_Limit") is None and seconds("") is None


def test_job_fields_reads_the_one_line_form():
    fields = job_fields("JobId=7 JobState=COMPLETING Restarts=1 Command=/x/job.sh")
    assert fields["JobState"] == "COMPLETING" and fields["Restarts"] == "1"
