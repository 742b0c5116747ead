"""StragglerReport alone (no Supervisor): step lines of several ranks handed to the concern as the loop hands them
(real Deadlines, the attempt's real StragglerWatch), a fake clock.  A rank that stays slow is said once in the log
and kept on the attempt (for `status` and its incidents); its first fast step says it recovered; time in another
phase is no step time; the line's own time, not the pass's, measures a step."""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.events import Beat
from hangwatch.supervisor.concerns.straggler_report import StragglerReport
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines
from hangwatch.supervisor.watch.stragglers import StragglerWatch

T0 = 1000.0


def setup(tmp_path: Path, steps: int = 3):
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": "train.jsonl"},
            "watchdog": {"straggler_factor": 2.0, "straggler_steps": steps},
        }
    )
    run_dir = Path(cfg.run_dir)
    d = attempt_dir(run_dir, 1)
    d.mkdir(parents=True)
    run = RunContext(
        cfg, run_dir, FsOps(), IncidentStore(run_dir), Deadlines(cfg.watchdog, Calibration(cfg.watchdog)), RunRecord()
    )
    attempt = Attempt(
        1,
        d,
        Worker(4001, 1.0, ["python"], d / WORKER_LOG_NAME, T0),
        HeartbeatTail(d),
        stragglers=StragglerWatch.from_config(cfg.watchdog),
    )
    return run, StragglerReport(run), attempt


def line(run, concern, attempt, rank: int, at: float, now=None, **rec) -> None:
    rec = {"rank": rank, "pid": 10 + rank, **rec}
    now = at if now is None else now
    before = run.deadlines.ranks.get(rank)
    left = before.phase if before is not None else None
    tr = run.deadlines.observe(rec, at)
    concern.observe(Beat(attempt, tr, rec, left, at, now))


def started(run, concern, attempt, ranks):
    for r in ranks:
        line(run, concern, attempt, r, T0, event="start", phase="train", step=0)


def events(logs, name):
    return [e for e in logs if e["event"] == name]


def test_a_rank_slow_for_straggler_steps_in_a_row_is_reported_once_then_recovers(tmp_path):
    run, concern, attempt = setup(tmp_path)
    started(run, concern, attempt, (0, 1, 2))
    with capture_logs() as logs:
        for s in range(1, 7):
            for r in (0, 1, 2):
                took = 3.0 if r == 2 and 2 <= s <= 5 else 1.0  # rank 2 slow for steps 2–5
                line(run, concern, attempt, r, T0 + s, event="step", step=s, step_time_s=took)
            if s == 4:
                (warned,) = events(logs, "straggler")
                assert warned["rank"] == 2 and warned["step"] == 4 and warned["since_step"] == 2
                assert warned["attempt"] == 1 and warned["step_time_s"] == 3.0 and warned["others_median_s"] == 1.0
                assert set(attempt.stragglers.status()) == {2}
    assert len(events(logs, "straggler")) == 1  # said once, not at each slow step
    (back,) = events(logs, "straggler_recovered")
    assert back["rank"] == 2 and back["step"] == 6 and back["slow_since_step"] == 2 and back["log_level"] == "info"
    assert attempt.stragglers.status() == {}
    assert [r.rank for r in attempt.stragglers.recorded] == [2]  # kept for the attempt's next incident


def test_the_lines_own_time_measures_a_step_not_the_pass_that_read_it(tmp_path):
    run, concern, attempt = setup(tmp_path)
    started(run, concern, attempt, (0, 1))
    with capture_logs() as logs:
        for s in range(1, 5):  # rank 1's lines 4 s apart, rank 0's 1 s apart; all read in passes 10 s apart
            line(run, concern, attempt, 0, T0 + s, now=T0 + 10 * s, event="step", step=s)
            line(run, concern, attempt, 1, T0 + 4 * s, now=T0 + 10 * s, event="step", step=s)
    (warned,) = events(logs, "straggler")
    assert warned["rank"] == 1 and warned["step_time_s"] == 4.0 and warned["others_median_s"] == 1.0


def test_time_in_another_phase_is_no_step_time(tmp_path):
    run, concern, attempt = setup(tmp_path, steps=1)  # a single slow step would make a straggler
    started(run, concern, attempt, (0, 1))
    with capture_logs() as logs:
        for s in (1, 2, 3):
            for r in (0, 1):
                line(run, concern, attempt, r, T0 + s, event="step", step=s)
        line(run, concern, attempt, 0, T0 + 3.5, event="phase", phase="eval")  # rank 0 evaluates for 20 s
        assert 0 not in attempt.stragglers.last_step_at
        line(run, concern, attempt, 0, T0 + 23.5, event="phase", phase="train")
        line(run, concern, attempt, 0, T0 + 24, event="step", step=4)
        line(run, concern, attempt, 0, T0 + 25, event="step", step=5)
    assert events(logs, "straggler") == []
    assert attempt.stragglers.last_time[0] == 1.0 and attempt.stragglers.status() == {}


def test_lines_other_than_steps_and_phases_change_nothing(tmp_path):
    run, concern, attempt = setup(tmp_path, steps=1)
    started(run, concern, attempt, (0,))
    line(run, concern, attempt, 0, T0 + 1, event="step", step=1)
    before = dict(attempt.stragglers.last_step_at)
    line(run, concern, attempt, 0, T0 + 2, event="progress", tokens=5)
    line(run, concern, attempt, 0, T0 + 3, event="checkpoint", step=1, path="c", good=True)
    assert attempt.stragglers.last_step_at == before and attempt.stragglers.last_time == {}
