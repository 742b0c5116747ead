"""Deadlines and calibration on a fake clock: no sleeps, every boundary checked exactly."""

from __future__ import annotations

import json

import pytest
from fixtures.fakes.beat_lines import beat

from hangwatch.common.config import WatchdogCfg
from hangwatch.supervisor.watch.calibration import Calibration, p99
from hangwatch.supervisor.watch.deadlines import Deadlines, SuspensionDetector


def line(event, *, phase="init", **kw):
    return beat(event, phase=phase, **kw)


def make(**wd):
    base = dict(
        startup_timeout_s=30,
        silence_timeout_s=20,
        first_steps_timeout_s=50,
        calibrate_after=5,
        calibration_factor=4.0,
        step_timeout_min_s=1.0,
        step_timeout_max_s=100.0,
        phase_budgets_s={"eval": 15, "checkpoint": 40},
    )
    base.update(wd)
    cfg = WatchdogCfg(**base)
    return Deadlines(cfg, Calibration(cfg))


def started(d, now=1.0, phase="train"):
    d.arm_startup(0.0)
    d.observe(line("start", phase="init"), now)
    d.observe(line("phase", phase=phase), now)
    return d


def test_startup_fires_exactly_at_budget_and_start_line_disarms_it():
    d = make()
    d.arm_startup(100.0)
    assert d.check(129.999) is None
    e = d.check(130.0)
    assert e.name == "startup" and e.budget_s == 30 and e.overdue_s == 0
    assert d.check(135.5).overdue_s == pytest.approx(5.5)
    d.observe(line("start"), 131.0)
    assert d.check(140.0) is None  # init phase has no budget; silence is at 131 + 20
    assert d.check(151.0).name == "silence"


def test_silence_fires_and_any_line_resets_it():
    d = started(make(), phase="idle")
    assert d.check(20.99) is None
    assert d.check(21.0).name == "silence"
    d.observe(line("progress", phase="idle"), 15.0)
    assert d.check(34.99) is None
    e = d.check(35.0)
    assert e.name == "silence" and e.rank == 0 and e.phase == "idle"


def test_step_deadline_first_steps_then_each_step_resets_it():
    d = started(make(silence_timeout_s=1000))
    assert d.check(50.99) is None
    e = d.check(51.0)
    assert (e.name, e.source, e.budget_s) == ("step", "first_steps", 50)
    d.observe(line("step", step=1, phase="train"), 10.0)
    assert d.check(59.99) is None
    e = d.check(60.0)
    assert (e.name, e.step) == ("step", 1)


def test_progress_resets_only_silence_so_a_livelock_is_caught_by_the_step_deadline():
    d = started(make(silence_timeout_s=10))
    for t in range(2, 60, 2):  # alive every 2 s, never a step
        d.observe(line("progress", phase="train"), float(t))
        e = d.check(float(t))
        if e is not None:
            break
    assert e.name == "step" and e.progress_lines > 0 and e.livelock
    assert t == 52  # 1 + 50 → due at 51, seen at the next check (52)
    assert e.overdue_s == pytest.approx(1.0)


def test_one_progress_beat_then_quiet_is_a_stall_not_a_livelock():
    d = started(make(silence_timeout_s=1000))
    d.observe(line("progress", phase="train"), 2.0)  # first micro-batch done, then stuck
    e = d.check(51.0)
    assert e.name == "step" and e.progress_lines == 1 and e.last_progress_age_s == 49.0 and not e.livelock


def test_phase_budget_from_line_then_config_then_default():
    d = started(make(default_phase_budget_s=7))
    d.observe(line("phase", phase="eval", budget_s=3), 10.0)
    assert d.check(12.99) is None
    e = d.check(13.0)
    assert (e.name, e.source, e.budget_s, e.phase) == ("phase", "line", 3, "eval")
    d.observe(line("phase", phase="eval"), 20.0)
    assert d.check(34.99) is None
    assert (d.check(35.0).source, d.check(35.0).budget_s) == ("config", 15)
    d.observe(line("phase", phase="mine"), 40.0)
    e = d.check(47.0)
    assert (e.name, e.source, e.budget_s) == ("phase", "default", 7)
    # train has no phase budget (the step deadline governs it); idle has none either
    d.observe(line("phase", phase="idle"), 50.0)
    assert d.check(69.0) is None


def test_phase_without_any_budget_has_no_phase_deadline():
    d = started(make())
    d.observe(line("phase", phase="mine"), 2.0)
    assert [a["name"] for a in d.active(3.0)] == ["silence"]


def test_time_in_eval_does_not_count_for_the_step_deadline():
    d = started(make(phase_budgets_s={"eval": 1000}, silence_timeout_s=1000))
    d.observe(line("step", step=1, phase="train"), 5.0)
    d.observe(line("phase", phase="eval", step=1), 6.0)
    for t in range(10, 100, 10):
        d.observe(line("progress", phase="eval", step=1), float(t))
    d.observe(line("phase", phase="train", step=1), 100.0)
    assert d.check(149.0) is None
    assert d.check(150.0).name == "step"


def test_calibration_is_factor_times_p99_clamped():
    d = started(make())
    t = 1.0
    for i in range(1, 8):  # 6 intervals of 2 s after the first step, the first of them warm-up
        t += 2.0
        d.observe(line("step", step=i, phase="train"), t)
    budget, source = d.step_budget()
    assert (budget, source) == (8.0, "learned: 4 × p99 2s of 5 steps")  # 4 × 2
    assert d.check(t + 7.99) is None
    assert d.check(t + 8.0).name == "step"
    # clamps
    cfg = WatchdogCfg(calibrate_after=2, calibration_factor=5, step_timeout_min_s=3, step_timeout_max_s=9)
    cal = Calibration(cfg)
    cal.add_step(0.1), cal.add_step(0.1)
    assert cal.step_budget() == 3
    cal.add_step(10.0)
    assert cal.step_budget() == 9


def test_step_intervals_across_another_phase_are_not_samples():
    d = started(make())
    d.observe(line("step", step=1, phase="train"), 2.0)
    d.observe(line("phase", phase="checkpoint", step=1), 2.5)
    d.observe(line("phase", phase="train", step=1), 30.0)
    d.observe(line("step", step=2, phase="train"), 31.0)
    assert list(d.calibration.step_samples) == []
    assert list(d.calibration.phase_samples["checkpoint"]) == [27.5]


def test_p99_nearest_rank():
    assert p99([1.0]) == 1.0
    assert p99(range(1, 101)) == 99
    assert p99([5] * 98 + [50, 60]) == 50


def test_fixed_step_timeout_wins_over_calibration():
    d = started(make(step_timeout_s=3))
    assert d.step_budget() == (3.0, "config")
    assert d.check(3.99) is None and d.check(4.0).name == "step"


def test_calibration_persisted_and_reloaded_with_current_factor(tmp_path):
    cfg = WatchdogCfg(calibrate_after=3, calibration_factor=5, step_timeout_min_s=0.5, step_timeout_max_s=100)
    cal = Calibration(cfg, tmp_path / "calibration.json")
    for x in (1.0, 2.0, 3.0):
        cal.add_step(x)
    for x in (4.0, 4.0, 6.0):
        cal.add_phase("eval", x)
    cal.save()
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert data["steps"]["budget_s"] == 15 and data["steps"]["count"] == 3 and data["phases"]["eval"]["budget_s"] == 30
    again, problem = Calibration.load(cfg, tmp_path / "calibration.json")
    assert problem is None and again.step_budget() == 15 and again.phase_budget("eval") == 30
    stricter = WatchdogCfg(calibrate_after=3, calibration_factor=2, step_timeout_min_s=0.5, step_timeout_max_s=100)
    assert Calibration.load(stricter, tmp_path / "calibration.json")[0].step_budget() == 6
    # the next attempt's Deadlines start calibrated
    d = Deadlines(cfg, again)
    assert d.step_budget() == (15, "learned: 5 × p99 3s of 3 steps")


def test_unreadable_calibration_is_reported_not_fatal(tmp_path):
    p = tmp_path / "calibration.json"
    p.write_text('{"steps": {"samples_s": [1, "x"]}}')
    cal, problem = Calibration.load(WatchdogCfg(), p)
    assert cal.step_budget() is None and "steps.samples_s" in problem and str(p) in problem


def test_a_phase_learns_its_budget_after_a_few_completions():
    d = started(make(calibrate_after=5))
    t = 2.0
    for i in range(3):
        assert d.phase_budget("mine") == (None, "none"), i  # no default for it: nothing until learned
        d.observe(line("phase", phase="mine"), t)
        d.observe(line("phase", phase="train"), t + 2.0)
        t += 3.0
    assert d.phase_budget("mine") == (10.0, "learned: 5 × longest 2s")  # 5 × the longest (and the floor)


@pytest.mark.parametrize(
    "settings, took, expect",
    [
        ({}, [2.0, 2.4, 1.8], (12.0, "learned: 5 × longest 2.4s")),  # the default 300 s gives way to the run's
        ({}, [0.2, 0.3, 0.1], (10.0, "learned: 5 × longest 0.3s")),  # never below the floor
        ({"phase_learn_floor_s": 2.0, "phase_learn_factor": 3.0}, [1.0, 1.0, 1.0], (3.0, "learned: 3 × longest 1s")),
        ({}, [1.0, 1.2], (300.0, "default")),  # fewer than phase_learn_after completions: the default still
        ({"phase_budgets_s": {"generate": 60}}, [1.0, 1.2, 0.9], (60.0, "config")),  # yours is kept
        ({"phase_learn": False}, [1.0, 1.2, 0.9], (300.0, "default")),
        ({"phase_learn_after": 1}, [40.0], (200.0, "learned: 5 × longest 40s")),  # above the default, too
    ],
)
def test_a_default_phase_budget_gives_way_to_the_one_learned_from_the_run(settings, took, expect):
    d = started(make(silence_timeout_s=10_000, **settings))
    t = 2.0
    for seconds in took:
        d.observe(line("phase", phase="generate"), t)
        d.observe(line("phase", phase="train"), t + seconds)
        t += seconds + 1.0
    budget, source = d.phase_budget("generate")
    assert (budget, source) == (pytest.approx(expect[0]), expect[1])
    d.observe(line("phase", phase="generate"), t)  # the next generate runs under it
    assert d.check(t + budget - 0.01) is None
    fired = d.check(t + budget + 0.01)
    assert fired.name == "phase" and fired.source == source


def test_suspension_gap_extends_every_deadline():
    d = started(make())
    det = SuspensionDetector(period=0.25)
    for t in (1.0, 1.25, 1.5):
        assert det.observe(t) == 0
    # the supervisor was SIGSTOPped for 100 s: without the shift silence and step would both fire
    now = 101.5
    assert d.check(now) is not None
    gap = det.observe(now)
    assert gap == pytest.approx(99.75)
    d.shift(gap)
    assert d.check(now) is None
    assert d.check(now + 19.0) is None
    assert d.check(1.0 + 20 + gap).name == "silence"
    # a line read right after the gap does not produce a step sample spanning it
    d.observe(line("step", step=1, phase="train"), now + 0.1)
    d.observe(line("step", step=2, phase="train"), now + 0.2)
    assert list(d.calibration.step_samples) == []


def test_suspension_gap_extends_startup():
    d = make()
    d.arm_startup(0.0)
    d.shift(40.0)
    assert d.check(69.0) is None and d.check(70.0).name == "startup"


def test_known_blocking_work_is_not_a_suspension():
    det = SuspensionDetector(period=0.25)
    det.observe(0.0)
    det.touch(5.0)
    assert det.observe(5.2) == 0


def test_stopped_rank_has_no_deadlines_and_other_ranks_still_do():
    d = make()
    d.arm_startup(0.0)
    for r in (0, 1):
        d.observe(line("start", rank=r), 1.0)
        d.observe(line("phase", rank=r, phase="train"), 1.0)
    d.observe(line("stop", rank=0, phase="train", reason="finished"), 2.0)
    e = d.check(21.0)
    assert e.name == "silence" and e.rank == 1


def test_most_overdue_deadline_is_reported():
    d = started(make(silence_timeout_s=60))
    d.observe(line("phase", phase="eval"), 2.0)
    e = d.check(40.0)
    assert (e.name, e.overdue_s) == ("phase", 23.0)


def test_extra_deadline_for_stopping():
    d = started(make())
    d.arm_extra("stop", 5.0, 3.0, "term_grace+step")
    e = d.check(8.0)
    assert e.name == "stop" and e.source == "term_grace+step"
    d.disarm_extra("stop")
    assert d.check(8.0) is None


def test_load_is_quiet_and_bounded_by_the_startup_budget():
    d = make(phase_budgets_s={})
    d.arm_startup(0.0)
    d.observe(line("start"), 1.0)
    d.observe(line("phase", phase="load"), 1.0)
    assert d.check(30.99) is None  # silence (20 s) does not apply while loading
    e = d.check(31.0)
    assert (e.name, e.source, e.budget_s, e.phase) == ("phase", "startup", 30, "load")
    d2 = make(phase_budgets_s={"load": 50})
    d2.arm_startup(0.0)
    d2.observe(line("start"), 1.0)
    d2.observe(line("phase", phase="load"), 1.0)
    assert d2.check(50.0) is None and d2.check(51.0).source == "config"
    d2.observe(line("phase", phase="train"), 40.0)
    assert d2.check(60.0).name == "silence"


def test_a_pass_on_time_after_a_long_planned_sleep_is_not_a_suspension():
    det = SuspensionDetector(period=0.25)
    det.observe(0.0)
    det.expect(60.0)  # nothing due for a minute: the loop sleeps that long
    assert det.observe(60.3) == 0
    det.expect(61.0)
    assert det.observe(65.0) == pytest.approx(4.0)  # 4 s later than planned: this process was not running


def test_sigcont_makes_the_whole_time_since_the_last_pass_a_suspension():
    det = SuspensionDetector(period=0.25)
    det.observe(10.0)
    det.expect(40.0)
    assert det.observe(25.0, continued=True) == pytest.approx(15.0)  # stopped and continued before the wake-up was due
    assert det.total_s == pytest.approx(15.0)


def test_next_due_and_check_agree_with_every_armed_deadline():
    """The fast answers (`next_due_s`, the early "nothing due" of `check`) against the deadlines built in full,
    over random sequences of lines, arms and shifts on two ranks."""
    import random

    rnd = random.Random(7)
    for _ in range(40):
        d = make(
            step_timeout_s=None,
            first_steps_timeout_s=6,
            silence_timeout_s=9,
            calibrate_after=3,
            step_timeout_min_s=0.5,
            default_phase_budget_s=4,
        )
        t = 0.0
        d.arm_startup(t)
        for _ in range(60):
            t += rnd.choice((0.1, 0.5, 1.0, 2.5))
            what = rnd.random()
            rank = rnd.choice((0, 1))
            if what < 0.1:
                d.observe(line("start", rank=rank, phase=rnd.choice(("init", "train"))), t)
            elif what < 0.5:
                d.observe(line("step", rank=rank, step=int(t * 10), phase="train"), t)
            elif what < 0.6:
                d.observe(line("phase", rank=rank, phase=rnd.choice(("train", "eval", "mine", "load", "idle"))), t)
            elif what < 0.7:
                d.observe(line("progress", rank=rank, phase="train"), t)
            elif what < 0.75:
                d.arm_extra("stop", t, rnd.choice((1.0, 3.0)))
            elif what < 0.8:
                d.disarm_extra("stop")
            elif what < 0.85:
                d.shift(rnd.choice((0.5, 2.0)))
            elif what < 0.88:
                d.observe(line("stop", rank=rank, phase="train", reason="finished"), t)
            for probe in (t, t + 0.3, t + 1.7, t + 5.0):
                full = d._candidates(probe)
                due = [e for e in full if e.elapsed_s >= e.budget_s]
                expect_due = max(due, key=lambda e: (e.elapsed_s - e.budget_s, e.name != "silence")) if due else None
                assert d.check(probe) == expect_due
                expect_next = min((e.budget_s - e.elapsed_s for e in full), default=None)
                got = d.next_due_s(probe)
                assert (got is None) == (expect_next is None)
                if got is not None:
                    assert got == pytest.approx(expect_next)


def test_the_calibrated_step_budget_follows_the_samples_it_is_given():
    d = make(calibrate_after=5, calibration_factor=2.0, step_timeout_min_s=0.1)
    started(d, now=0.0)
    t = 0.0
    for i in range(7):  # step lines 1 s apart: the 5th sample (7th line: 1 → 2 is warm-up) calibrates at once
        t += 1.0
        d.observe(line("step", step=i + 1, phase="train"), t)
        assert d.step_budget()[1].startswith("learned") == (i >= 6), i
    assert d.step_budget()[0] == pytest.approx(2.0)
    for x in [9.0] * 5:
        d.calibration.add_step(x)  # samples from elsewhere (a reload): the budget follows at once
    assert d.step_budget()[0] == pytest.approx(18.0)
