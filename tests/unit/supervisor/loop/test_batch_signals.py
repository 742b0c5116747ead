"""Signals from a batch scheduler, on the fake supervisor: SIGUSR1 (a Slurm job's warning that its time limit is
near) stops the run to be run again — the worker asked to checkpoint and stop, state `stopped`, exit 75 — and a
stop says who asked for it; in a Slurm job a second signal does not force the kill."""

from __future__ import annotations

import json
import signal

from fixtures.fakes.fake_supervisor import Harness

from hangwatch.common.exitcodes import EXIT_OK, EXIT_TEMPFAIL


class FakeSource:
    """The `signal_source` seam: fixed words, in a batch job or not."""

    def __init__(self, batch: bool):
        self.batch = batch
        self.asked: list[int] = []

    def describe(self, signum: int) -> str:
        self.asked.append(signum)
        return f"{signal.Signals(signum).name} from Slurm (scancel of job 12)" if self.batch else "SIGTERM"


def harness(tmp_path, batch: bool) -> tuple[Harness, FakeSource]:
    h = Harness(tmp_path)
    h.sup.seams.signal_source = source = FakeSource(batch)
    return h, source


def state_json(h: Harness) -> dict:
    return json.loads(h.sup.state_path.read_text())


def test_sigusr1_checkpoints_stops_and_exits_75_to_be_run_again(tmp_path):
    h, source = harness(tmp_path, batch=True)
    w = h.running()
    h.sup.wakeup.record(signal.SIGUSR1)
    h.until(lambda: h.state == "stopping")
    assert h.table.signals() == ["SIGTERM"]  # the worker is asked to checkpoint and stop, as for `stop`
    w.graceful_exit()
    h.until(lambda: h.state == "stopped")
    assert h.sup.exit_code == EXIT_TEMPFAIL
    st = state_json(h)
    assert st["state"] == "stopped"
    assert st["why"] == "stopped to be run again (requeue) (SIGUSR1 from Slurm (scancel of job 12))"
    assert source.asked == [signal.SIGUSR1]
    assert h.incident_kinds() == []


def test_sigterm_in_a_slurm_job_says_who_and_a_second_one_does_not_force_the_kill(tmp_path):
    h, _ = harness(tmp_path, batch=True)
    w = h.running()
    h.sup.wakeup.record(signal.SIGTERM)
    h.sup.wakeup.record(signal.SIGTERM)  # the step's task and srun may each pass it on
    h.until(lambda: h.state == "stopping")
    assert not h.sup.intents.force
    w.graceful_exit()
    h.until(lambda: h.state == "stopped")
    assert h.table.signals() == ["SIGTERM", "-SIGTERM"]  # the graceful stop, then what is left of the group: no KILL
    assert h.sup.exit_code == EXIT_OK
    assert state_json(h)["why"] == "stop requested (SIGTERM from Slurm (scancel of job 12))"


def test_outside_a_batch_job_a_second_signal_still_forces_the_kill(tmp_path):
    h, _ = harness(tmp_path, batch=False)
    h.running()
    h.sup.wakeup.record(signal.SIGTERM)
    h.sup.wakeup.record(signal.SIGTERM)
    h.until(lambda: h.state == "stopped")
    assert h.sup.exit_code == EXIT_OK
    assert "-SIGKILL" in h.table.signals()
    assert state_json(h)["why"] == "stop requested (SIGTERM)"


def test_a_stop_after_the_warning_keeps_the_requeue(tmp_path):
    """The time limit's own SIGTERM after the warning's SIGUSR1: the run still ends to be run again."""
    h, _ = harness(tmp_path, batch=True)
    w = h.running()
    h.sup.wakeup.record(signal.SIGUSR1)
    h.until(lambda: h.state == "stopping")
    h.sup.wakeup.record(signal.SIGTERM)
    w.graceful_exit()
    h.until(lambda: h.state == "stopped")
    assert h.sup.exit_code == EXIT_TEMPFAIL
