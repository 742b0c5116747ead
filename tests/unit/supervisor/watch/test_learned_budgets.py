"""Step and token budgets learned from the first few steps and tokens, on a fake clock (`now` is a parameter).

A step budget is learned from the first few step intervals (heartbeat `step` lines, or the step lines of a script
known only by its output), the warm-up interval left out; a token budget from the gaps between a generate's tokens,
from its first call on.  Every table row is checked two ways: nothing fires while the run keeps its pace (×3 jitter
included), and a stop is caught at the budget the run taught — seconds, not the silence deadline's 120 s.
"""

from __future__ import annotations

import json
import random

import pytest
from fixtures.fakes.beat_lines import beat

from hangwatch.common.config import WatchdogCfg
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines


def line(event, *, phase="train", **kw):
    return beat(event, phase=phase, **kw)


def make(**wd) -> Deadlines:
    cfg = WatchdogCfg(
        **wd
    )  # the defaults: learned after 2 intervals (+ warm-up), 5 × p99, at least 10 s; silence 120 s
    return Deadlines(cfg, Calibration(cfg))


def quiet_until(d: Deadlines, start: float, end: float) -> None:
    """Nothing is due anywhere in [start, end): the fast answer and the full one agree."""
    due = d.next_due_s(start)
    assert due is None or start + due >= end, (start, due, d.active(start))
    assert d.check(end - 1e-6) is None


def fired_at(d: Deadlines, now: float):
    """(when, Expired) of the first deadline due after `now`, nothing else happening."""
    at = now + d.next_due_s(now) + 1e-9  # (the sum rounded down would be a hair early)
    e = d.check(at)
    assert e is not None and d.check(at - 1e-3) is None
    return at, e


# ---- steps, through the optimizer's step lines ------------------------------------------------------------------


def stepping(d: Deadlines, times: list[float], t0: float = 1.0) -> float:
    """A rank starts in `load` at t0, its first optimizer step enters `train` (as the automatic instrumentation
    does); step i ends `times[i]` after step i-1.  Checks that nothing fires in between; returns the last step's
    time."""
    d.arm_startup(0.0)
    d.observe(line("start", phase="load"), t0)
    t = t0 + 2.0  # loading
    d.observe(line("phase", phase="train"), t)
    d.observe(line("step", step=1), t)
    for i, dt in enumerate(times, start=2):
        quiet_until(d, t, t + dt)
        t += dt
        d.observe(line("step", step=i), t)
    return t


@pytest.mark.parametrize(
    "times, budget, source",
    [
        # fast steps: the floor; a spin in step 5 is caught 10 s after step 4
        ([0.2] * 3, 10.0, "learned: 5 × p99 0.2s of 2 steps, at least 10s"),
        ([0.2] * 6, 10.0, "learned: 5 × p99 0.2s of 5 steps, at least 10s"),
        # a compile in step 2 is warm-up: it neither trips the first-step budget nor inflates the learned one
        ([45.0] + [0.2] * 4, 10.0, "learned: 5 × p99 0.2s of 4 steps, at least 10s"),
        # slow steps: 5 × the longest of the first three (the first interval left out)
        ([30.0, 20.0, 30.0, 40.0], 200.0, "learned: 5 × p99 40s of 3 steps"),
    ],
)
def test_the_step_budget_is_learned_from_the_first_few_steps(times, budget, source):
    d = make(silence_timeout_s=10_000)  # (by default a step over 120 s without a beat is a silence first)
    last = stepping(d, times)
    assert d.step_budget() == (pytest.approx(budget), source)
    at, e = fired_at(d, last)  # the loop spins after its last step
    assert (e.name, e.source, e.step) == ("step", source, len(times) + 1) and at - last == pytest.approx(budget)


def test_before_two_intervals_after_the_warm_up_the_first_steps_budget_and_silence_govern():
    d = make()
    last = stepping(d, [0.2, 0.2])  # steps 1-3: one sample (1 → 2 is warm-up)
    assert d.step_budget() == (600.0, "first_steps")
    at, e = fired_at(d, last)
    assert e.name == "silence" and at - last == pytest.approx(120.0)


@pytest.mark.parametrize("t", [0.05, 1.0, 8.0, 60.0])
@pytest.mark.parametrize("seed", range(3))
def test_steps_that_vary_three_fold_never_trip_it_and_a_spin_is_caught_at_the_budget(t, seed):
    rnd = random.Random(seed)
    d = make(silence_timeout_s=10_000)
    times = [rnd.uniform(t, 3 * t) for _ in range(300)]
    last = stepping(d, times)  # asserts that nothing fired between steps
    budget = d.step_budget()[0]
    assert max(10.0, 5 * t) <= budget <= max(10.0, 15 * t)  # 5 × p99 of what it saw, refined as steps came
    at, e = fired_at(d, last)
    assert e.name == "step" and at - last == pytest.approx(budget)


def test_a_rank_restarted_with_a_learned_budget_still_gets_its_warm_up():
    d = make()
    stepping(d, [0.2] * 6)
    assert d.step_budget()[0] == 10.0
    # The next attempt (same calibration): its first two steps may take a compile's time.
    d.arm_startup(100.0)
    d.observe(line("start", phase="load"), 101.0)
    d.observe(line("phase", phase="train"), 105.0)
    d.observe(line("step", step=1), 105.0)
    e = d.check(105.0 + 600.0)  # step 2 compiles: the first-steps budget
    assert (e.name, e.source) == ("silence", "config")  # (silence, 120 s, is what catches a stuck step 2)
    assert [a for a in d.active(106.0) if a["name"] == "step"][0]["source"] == "first_steps"
    d.observe(line("step", step=2), 150.0)  # 45 s: warm-up, not a sample
    assert len(d.calibration.step_samples) == 5
    d.observe(line("step", step=3), 150.2)
    assert [a for a in d.active(151.0) if a["name"] == "step"][0]["budget_s"] == 10.0


def test_a_fixed_step_timeout_is_kept_even_for_the_first_steps():
    d = make(step_timeout_s=3)
    stepping(d, [])
    assert [a for a in d.active(3.5) if a["name"] == "step"][0]["source"] == "config"


# ---- steps, through the command's own output ---------------------------------------------------------------------


def output_run(d: Deadlines, reads: list[tuple[float, int, bool]], t0: float = 1.0) -> None:
    """A rank that beats only its `start` (phase `load`: it steps no optimizer); `reads` are the supervisor's reads
    of worker.log that grew: (time the log was last written, step numbers its lines named, a progress line)."""
    d.arm_startup(0.0)
    d.observe(line("start", phase="load"), t0)
    for at, steps, progress in reads:
        d.output_seen(at, progress or steps > 0, steps)


def test_the_first_step_line_ends_load_and_the_next_ones_teach_the_budget():
    d = make()
    output_run(d, [(3.0, 0, False), (4.0, 0, True)])  # "loading…", then a tqdm bar: still loading
    assert d.ranks[0].phase == "load"
    assert d.check(4.0 + 300.0 - 0.01) is None and d.check(4.0 + 300.0).name == "phase"  # load's budget, as before
    # a read finds six step lines written within the 1.2 s since the previous read's output: load is over
    d.output_seen(5.2, True, 6)
    tr = d.ranks[0]
    assert (tr.phase, tr.output_steps, tr.steps_seen) == ("train", True, 6)
    assert list(d.calibration.step_samples) == pytest.approx([0.24] * 4)  # 1.2 s over 5 gaps; 1 → 2 left out
    budget, source = d.step_budget()
    assert budget == 10.0 and source.startswith("learned: 5 × p99 0.24s")
    at, e = fired_at(d, 5.2)  # it spins after step 6
    assert (e.name, e.phase, e.source) == ("step", "train", source) and at == pytest.approx(15.2)


@pytest.mark.parametrize("split", [(4,), (2, 2), (1, 3), (1, 1, 2), (1, 1, 1, 1), (3, 1)])
def test_four_step_lines_teach_the_budget_however_the_reads_split_them(split):
    """Steps 1-4 printed 0.2 s apart, read in passes that find `split` lines each; then it spins in step 5."""
    d = make()
    output_run(d, [(3.0, 0, False)])  # "loading…"
    step_at = [3.5 + 0.2 * i for i in range(4)]
    k = 0
    for n in split:
        k += n
        d.output_seen(step_at[k - 1], True, n)
    assert d.step_budget() == (10.0, d.calibration.step_source()) and d.step_budget()[1].startswith("learned")
    at, e = fired_at(d, step_at[-1])
    assert e.name == "step" and at - step_at[-1] == pytest.approx(10.0)


def test_output_steps_refine_the_budget_one_read_at_a_time():
    d = make(silence_timeout_s=10_000)
    output_run(d, [(2.0, 1, True)])  # a single step line: no spacing to learn from yet
    assert d.step_budget()[1] == "first_steps" and not d.calibration.step_samples
    t = 2.0
    for dt in (25.0, 31.0, 28.0, 30.0, 35.0):  # slow steps, one per read
        quiet_until(d, t, t + dt)
        t += dt
        d.output_seen(t, True, 1)
    assert list(d.calibration.step_samples) == [31.0, 28.0, 30.0, 35.0]  # (2.0 → 27.0: step 1 → 2, warm-up)
    assert d.step_budget()[0] == pytest.approx(175.0)
    at, e = fired_at(d, t)
    assert e.name == "step" and at - t == pytest.approx(175.0)


def test_a_rank_stepping_by_its_output_is_alive_while_its_output_grows():
    d = make()
    output_run(d, [(2.0, 5, True)])
    # No heartbeat since its start at 1.0; the output is its sign of life.
    assert [a for a in d.active(100.0) if a["name"] == "silence"][0]["elapsed_s"] == pytest.approx(98.0)
    d.output_seen(50.0, False)  # a warning printed: alive, but no step
    assert [a for a in d.active(100.0) if a["name"] == "silence"][0]["elapsed_s"] == pytest.approx(50.0)
    assert d.check(59.0).name == "step"  # 2.0 + 10 s (learned) is long past


def test_its_own_lines_saying_load_do_not_undo_the_train_its_output_showed():
    d = make()
    output_run(d, [(2.0, 5, True)])
    d.observe(line("warn", phase="load", message="x"), 3.0)  # the writer still says `load`
    assert d.ranks[0].phase == "train"
    # a generate in between: its phase, then back to `load` (the writer's phase), then the next step line
    d.observe(line("phase", phase="generate"), 4.0)
    d.observe(line("phase", phase="load"), 6.0)
    assert (d.ranks[0].phase, d.ranks[0].output_steps) == ("load", False)
    d.output_seen(7.0, True, 1)
    assert (d.ranks[0].phase, d.ranks[0].output_steps) == ("train", True)
    assert d.ranks[0].train_since == 7.0  # no step interval across the generate


def test_heartbeat_steps_take_over_from_the_output():
    d = make()
    output_run(d, [(2.0, 5, True)])
    d.observe(line("step", step=1), 3.0)  # the script's first optimizer step (still in train: no new phase)
    assert not d.ranks[0].output_steps
    samples = len(d.calibration.step_samples)
    d.output_seen(4.0, True, 3)  # its `step N` lines say nothing more
    assert len(d.calibration.step_samples) == samples and d.ranks[0].last_step_at == 3.0


def test_step_lines_before_the_rank_entered_load_end_nothing():
    d = make()
    d.arm_startup(0.0)
    d.output_seen(0.5, True, 2)  # no rank yet: only the startup deadline is met
    d.observe(line("start", phase="load"), 1.0)
    assert d.ranks[0].phase == "load"


# ---- tokens --------------------------------------------------------------------------------------------------


def generating(d: Deadlines, gaps: list[float], every: int = 8, t: float = 10.0, prefill: float = 0.3) -> float:
    """A rank in `generate` at t (its first call), tokens `gaps` apart after the first (which comes after
    `prefill`); a beat every `every` tokens with the longest gap since the previous one (the first gap left out),
    as GenerateWatch writes them.  Checks that nothing fires in between; returns the time of the last token."""
    d.observe(line("phase", phase="generate"), t)
    t += prefill
    longest = None
    for n, gap in enumerate(gaps, start=2):
        quiet_until(d, t, t + gap)
        t += gap
        if n > 2:
            longest = gap if longest is None else max(longest, gap)
        if n % every == 0:
            beat = {"token_s": longest} if longest is not None else {}
            d.observe(line("progress", phase="generate", tokens=n, **beat), t)
            longest = None
    return t


def test_a_generate_whose_tokens_stop_is_caught_at_its_first_call():
    d = make()
    d.arm_startup(0.0)
    d.observe(line("start", phase="init"), 1.0)
    last = generating(d, [0.02] * 11)  # 12 tokens, then the tokens stop (a beat at 8)
    at, e = fired_at(d, last)
    assert (e.name, e.phase) == ("token", "generate")
    assert e.budget_s == 10.0 and e.source == "learned: 5 × 8 tokens × p99 gap 0.02s, at least 10s"
    assert at - last < 10.0  # counted from the beat at token 8


@pytest.mark.parametrize("lo, hi", [(0.01, 0.03), (0.2, 1.5), (2.0, 6.0)])
@pytest.mark.parametrize("seed", range(3))
def test_a_slow_generate_that_keeps_producing_tokens_is_never_a_stall(lo, hi, seed):
    rnd = random.Random(seed)
    d = make(silence_timeout_s=10_000, phase_budgets_s={"generate": 100_000})
    d.arm_startup(0.0)
    d.observe(line("start", phase="init"), 1.0)
    t = 1.0
    for call in range(4):  # from the first call on; each call its own phase, as GenerateWatch makes them
        t = generating(d, [rnd.uniform(lo, hi) for _ in range(63)], t=t + 1.0)
        d.observe(line("phase", phase="init"), t)
    assert d.token_gap() <= hi


def test_beats_that_do_not_time_their_tokens_arm_nothing():
    d = make()
    d.arm_startup(0.0)
    d.observe(line("start", phase="init"), 1.0)
    d.observe(line("phase", phase="generate"), 2.0)
    d.observe(line("progress", phase="generate", tokens=8), 3.0)  # a writer that counts but does not time
    assert [a["name"] for a in d.active(4.0)] == ["silence", "phase"]
    d.observe(line("progress", phase="generate", tokens=16, token_s=0.01), 4.0)
    assert "token" in [a["name"] for a in d.active(4.5)]
    off = make(token_deadline=False)
    off.arm_startup(0.0)
    off.observe(line("start", phase="generate"), 1.0)
    off.observe(line("progress", phase="generate", tokens=16, token_s=0.01), 2.0)
    assert "token" not in [a["name"] for a in off.active(3.0)]


def test_a_beat_stands_for_the_tokens_since_the_previous_and_a_new_call_starts_over():
    d = make(token_timeout_min_s=1.0)
    d.arm_startup(0.0)
    d.observe(line("start", phase="generate"), 1.0)
    d.observe(line("progress", phase="generate", tokens=8, token_s=0.1), 2.0)
    assert d.ranks[0].tokens_per_beat == 8 and d.next_due_s(2.0) == pytest.approx(5 * 8 * 0.1)
    d.observe(line("progress", phase="generate", tokens=12, token_s=0.1), 3.0)  # a short last beat (a truncation)
    assert d.ranks[0].tokens_per_beat == 4
    d.observe(line("progress", phase="generate", tokens=8, token_s=0.1), 5.0)  # the next call in the same phase
    assert d.ranks[0].tokens_per_beat == 8
    d.observe(line("phase", phase="init"), 6.0)  # out of generate: no token deadline
    assert "token" not in [a["name"] for a in d.active(7.0)]


def test_a_suspension_moves_the_token_anchor_and_teaches_no_gap():
    d = make()
    d.arm_startup(0.0)
    d.observe(line("start", phase="generate"), 1.0)
    d.observe(line("progress", phase="generate", tokens=8, token_s=0.01), 2.0)
    d.shift(500.0)
    assert d.check(503.0) is None and d.check(512.0).name == "token"
    d.observe(line("progress", phase="generate", tokens=16, token_s=480.0), 505.0)  # the gap spans the suspension
    assert list(d.calibration.token_samples) == [0.01]


def test_token_gaps_are_persisted_and_read_back(tmp_path):
    cfg = WatchdogCfg()
    cal = Calibration(cfg, tmp_path / "calibration.json")
    for x in (0.02, 0.03, 0.05):
        cal.add_token_gap(x)
    cal.save()
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert data["tokens"]["count"] == 3 and data["tokens"]["p99_gap_s"] == 0.05
    again, problem = Calibration.load(cfg, tmp_path / "calibration.json")
    assert problem is None and list(again.token_samples) == [0.02, 0.03, 0.05]
    assert again.token_budget(8) == 10.0 and again.token_budget(100) == pytest.approx(25.0)
    del data["tokens"]  # a file written before tokens were learned
    (tmp_path / "old.json").write_text(json.dumps(data))
    old, problem = Calibration.load(cfg, tmp_path / "old.json")
    assert problem is None and not old.token_samples and old.token_budget(8) == 10.0


# ---- the fast answers agree with the full ones -------------------------------------------------------------------


def test_next_due_and_check_agree_with_output_steps_and_token_beats():
    rnd = random.Random(11)
    for _ in range(40):
        d = make(
            first_steps_timeout_s=6,
            silence_timeout_s=9,
            startup_timeout_s=12,
            step_timeout_min_s=0.5,
            token_timeout_min_s=0.7,
            default_phase_budget_s=4,
        )
        t = 0.0
        d.arm_startup(t)
        tokens = {0: 0, 1: 0}
        for _ in range(60):
            t += rnd.choice((0.1, 0.5, 1.0, 2.5))
            what = rnd.random()
            rank = rnd.choice((0, 1))
            if what < 0.1:
                d.observe(line("start", rank=rank, phase=rnd.choice(("load", "train"))), t)
            elif what < 0.3:
                d.observe(line("step", rank=rank, step=int(t * 10)), t)
            elif what < 0.4:
                phase = rnd.choice(("train", "generate", "load", "eval"))
                d.observe(line("phase", rank=rank, phase=phase), t)
                tokens[rank] = 0
            elif what < 0.55:
                tokens[rank] += rnd.choice((4, 8))
                beat = {"token_s": rnd.choice((0.01, 0.2))} if rnd.random() < 0.8 else {}
                d.observe(line("progress", rank=rank, phase="generate", tokens=tokens[rank], **beat), t)
            elif what < 0.75:
                d.output_seen(t, rnd.random() < 0.7, rnd.choice((0, 0, 1, 3)))
            elif what < 0.8:
                d.shift(rnd.choice((0.5, 2.0)))
            elif what < 0.83:
                d.observe(line("stop", rank=rank, reason="finished"), t)
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
