"""GenerateOverrun alone (no Supervisor): real Deadlines fed heartbeat lines as the loop feeds them, a real
IncidentStore, a fake clock (plain `now` floats).  The order file and its token limit, when a deadline is left to
escalate, the `generate_truncated` incident once every ordered rank left its generate, and what a stall during an
order adds to its incident."""

from __future__ import annotations

import json
from pathlib import Path

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.common.protocol import GENERATE_STOP_NAME, TRUNCATED_FIELD
from hangwatch.common.rundir import WORKER_LOG_NAME, attempt_dir
from hangwatch.supervisor.concerns.base import RunContext
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat
from hangwatch.supervisor.concerns.generate_overrun import GenerateOverrun
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.processes.process import Worker
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.watch.beat_files import HeartbeatTail
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines, Expired

T0 = 1000.0
BUDGET = 5.0


def make_run(tmp_path: Path, **watchdog) -> RunContext:
    cfg = Config.model_validate(
        {
            "run_dir": str(tmp_path / "run"),
            "data": {"train": "train.jsonl"},
            "watchdog": {"phase_budgets_s": {"generate": BUDGET}, "silence_timeout_s": 120, **watchdog},
        }
    )
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    run = RunContext(
        cfg,
        run_dir,
        FsOps(),
        IncidentStore(run_dir),
        Deadlines(cfg.watchdog, Calibration(cfg.watchdog)),
        RunRecord(),
    )
    return run


def make_attempt(run: RunContext, number: int = 1) -> Attempt:
    d = attempt_dir(run.run_dir, number)
    d.mkdir(parents=True, exist_ok=True)
    return Attempt(number, d, Worker(4000 + number, 1.0, ["python"], d / WORKER_LOG_NAME, T0), HeartbeatTail(d))


def feed(run: RunContext, concern: GenerateOverrun, attempt: Attempt, now: float, **rec):
    """One heartbeat line, as the loop hands it: the deadlines first, then the concern (with the phase it left)."""
    rec = {"rank": 0, "pid": 1, **rec}
    before = run.deadlines.ranks.get(rec["rank"])
    left = before.phase if before is not None else None
    tr = run.deadlines.observe(rec, now)
    concern.observe(Beat(attempt, tr, rec, left, now, now))
    return tr


def started(tmp_path, ranks=(0,), **watchdog):
    """An attempt whose ranks started in train and stepped to step 3."""
    run = make_run(tmp_path, **watchdog)
    concern = GenerateOverrun(run)
    attempt = make_attempt(run)
    run.deadlines.arm_startup(T0)
    concern.observe(AttemptStarted(attempt, None, T0))
    for r in ranks:
        feed(run, concern, attempt, T0, rank=r, event="start", phase="train", step=0)
        for s in (1, 2, 3):
            feed(run, concern, attempt, T0 + s * 0.1, rank=r, event="step", step=s)
    return run, concern, attempt


def generate(run, concern, attempt, at: float, *, rank=0, every_s=0.5, per_line=8, until: float):
    """Rank `rank` enters generate at `at` and beats `per_line` more tokens every `every_s` until `until`.
    Returns the tokens it produced."""
    feed(run, concern, attempt, at, rank=rank, event="phase", phase="generate", budget_s=BUDGET)
    n, t = 0, at + every_s
    while t <= until + 1e-9:
        n += per_line
        feed(run, concern, attempt, t, rank=rank, event="progress", tokens=n)
        t += every_s
    return n


def overdue_now(run, now: float) -> Expired:
    expired = run.deadlines.check(now)
    assert expired is not None and expired.name == "phase" and expired.phase == "generate", expired
    return expired


def order_of(attempt: Attempt) -> dict:
    return json.loads((attempt.dir / GENERATE_STOP_NAME).read_text())


def obey(run, concern, attempt, now: float, limit: int, *, rank=0, order=1):
    """The rank read the order: its truncation report, then back to train."""
    report = {"order": order, "limit": limit, "tokens": limit, "prompt": "Once upon", "output_tail": "and and"}
    feed(run, concern, attempt, now, rank=rank, event="progress", tokens=limit, **{TRUNCATED_FIELD: report})
    feed(run, concern, attempt, now, rank=rank, event="phase", phase="train")


def kinds(run) -> list[str]:
    return [i["kind"] for i in run.incidents.list()]


# ---- overdue ------------------------------------------------------------------------------------


def test_tokens_flowing_past_the_budget_order_a_limit_ahead_of_the_rank_and_grant_a_grace(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    produced = generate(run, concern, attempt, g0, until=g0 + BUDGET)  # 16 tokens/s, last line at the budget
    now = g0 + BUDGET
    assert concern.overdue(attempt, overdue_now(run, now), now) is True
    order = order_of(attempt)
    # the last point (80 tokens) + 16 tokens/s × (0 s since it + ORDER_LEAD_S 0.5 s) + 1
    assert produced == 80 and order["tokens"] == 80 + 8 + 1
    assert order["order"] == 1 and order["budget_s"] == BUDGET
    # the grace re-armed the deadline: nothing is due now, and the generate may run a while longer
    assert run.deadlines.grace == (now, 5.0)
    assert run.deadlines.check(now) is None and run.deadlines.check(now + 4.9) is None
    assert run.deadlines.check(now + 5.1) is not None
    assert concern.pending is not None and concern.pending.ranks == [0] and concern.pending.limit == 89
    assert kinds(run) == []  # an order is no incident (yet)


def test_the_limit_is_ahead_of_the_fastest_of_several_ranks_and_every_rank_in_generate_is_ordered(tmp_path):
    run, concern, attempt = started(tmp_path, ranks=(0, 1))
    g0 = T0 + 1
    slow = generate(run, concern, attempt, g0, rank=0, per_line=4, until=g0 + BUDGET)
    fast = generate(run, concern, attempt, g0, rank=1, per_line=12, until=g0 + BUDGET)
    now = g0 + BUDGET
    assert concern.overdue(attempt, overdue_now(run, now), now) is True
    limit = order_of(attempt)["tokens"]
    assert (slow, fast) == (40, 120)
    assert limit == fast + 12 + 1  # 24 tokens/s × 0.5 s ahead of rank 1, not of rank 0
    assert concern.pending.ranks == [0, 1]


def test_a_generate_without_a_token_lately_is_left_to_escalate(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + 1)  # tokens for a second, then nothing
    now = g0 + 12.5  # the last token 11.5 s ago: more than max(budget / 2, 10 s)
    assert concern.overdue(attempt, overdue_now(run, now), now) is False
    assert not (attempt.dir / GENERATE_STOP_NAME).exists() and concern.pending is None
    assert run.deadlines.grace is None


def test_a_generate_that_never_produced_a_token_is_left_to_escalate(tmp_path):
    run, concern, attempt = started(tmp_path)
    feed(run, concern, attempt, T0 + 1, event="phase", phase="generate", budget_s=BUDGET)
    now = T0 + 1 + BUDGET + 0.5
    expired = overdue_now(run, now)
    assert expired.progress_lines == 0
    assert concern.overdue(attempt, expired, now) is False
    assert not (attempt.dir / GENERATE_STOP_NAME).exists()


def test_other_phases_and_other_deadlines_are_not_its_business(tmp_path):
    run, concern, attempt = started(tmp_path, phase_budgets_s={"eval": BUDGET})
    feed(run, concern, attempt, T0 + 1, event="phase", phase="eval")
    for i in range(1, 11):
        feed(run, concern, attempt, T0 + 1 + i * 0.5, event="progress", tokens=8 * i)
    now = T0 + 1 + BUDGET
    expired = run.deadlines.check(now)
    assert expired is not None and expired.phase == "eval" and expired.livelock
    assert concern.overdue(attempt, expired, now) is False
    step = Expired("step", 2.0, 3.0, rank=0, phase="generate", progress_lines=3, last_progress_age_s=0.1)
    assert concern.overdue(attempt, step, now) is False
    assert not (attempt.dir / GENERATE_STOP_NAME).exists()


def test_a_generate_already_ordered_that_is_overdue_again_is_escalated(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    assert concern.overdue(attempt, overdue_now(run, now), now) is True
    produced = generate_more(run, concern, attempt, now, until=now + 5.5)  # it ignores the order, tokens go on
    later = now + 5.5
    assert produced > order_of(attempt)["tokens"]
    assert concern.overdue(attempt, overdue_now(run, later), later) is False
    assert order_of(attempt)["order"] == 1 and concern.orders == 1  # no second order


def generate_more(run, concern, attempt, since: float, *, until: float, start_tokens=80, every_s=0.5, per_line=8):
    n, t = start_tokens, since + every_s
    while t <= until + 1e-9:
        n += per_line
        feed(run, concern, attempt, t, event="progress", tokens=n)
        t += every_s
    return n


def test_an_order_that_cannot_be_written_is_left_to_escalate(tmp_path):
    run, concern, attempt = started(tmp_path)

    class FullDisk(FsOps):
        def write_json(self, path, data, durable=True):
            raise OSError(28, "No space left on device")

    run.fs = FullDisk()
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    assert concern.overdue(attempt, overdue_now(run, now), now) is False
    assert concern.pending is None and run.deadlines.grace is None


# ---- while_running: the incident ----------------------------------------------------------------


def test_once_the_rank_left_generate_with_its_report_a_generate_truncated_incident_is_written_once(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    concern.overdue(attempt, overdue_now(run, now), now)
    limit = order_of(attempt)["tokens"]
    assert concern.while_running(attempt, now + 0.1) is None and kinds(run) == []  # still in generate
    obey(run, concern, attempt, now + 0.7, limit)
    assert concern.while_running(attempt, now + 0.8) is None  # the run goes on: no reason to end it
    assert kinds(run) == ["generate_truncated"]
    inc = run.incidents.get(run.incidents.list()[0]["id"])
    assert inc["status"] == "final" and inc["tokens"] == {"0": limit} and inc["limit"] == limit
    assert inc["order"] == 1 and inc["ranks"] == [0] and inc["step"] == 3 and inc["attempt"] == 1
    assert inc["prompt"] == "Once upon" and inc["output_tail"] == "and and"
    assert inc["budget_s"] == BUDGET and inc["budget_source"] == "line"
    assert f"ended at token {limit}" in inc["summary"] and "nothing restarted" in inc["summary"]
    assert run.facts.last_incident["kind"] == "generate_truncated"
    # once: the order is over
    assert concern.pending is None
    concern.while_running(attempt, now + 2)
    assert kinds(run) == ["generate_truncated"]


def test_no_incident_while_one_ordered_rank_is_still_in_generate(tmp_path):
    run, concern, attempt = started(tmp_path, ranks=(0, 1))
    g0 = T0 + 1
    generate(run, concern, attempt, g0, rank=0, until=g0 + BUDGET)
    generate(run, concern, attempt, g0, rank=1, until=g0 + BUDGET)
    now = g0 + BUDGET
    assert concern.overdue(attempt, overdue_now(run, now), now) is True
    limit = order_of(attempt)["tokens"]
    obey(run, concern, attempt, now + 0.5, limit, rank=0)
    concern.while_running(attempt, now + 0.6)
    assert kinds(run) == [] and concern.pending is not None
    obey(run, concern, attempt, now + 0.9, limit, rank=1)
    concern.while_running(attempt, now + 1.0)
    assert kinds(run) == ["generate_truncated"]
    inc = run.incidents.get("1")
    assert inc["tokens"] == {"0": limit, "1": limit} and inc["ranks"] == [0, 1]
    assert "on rank 0" in inc["summary"]


def test_a_generate_that_ended_by_itself_before_the_order_writes_no_incident(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    concern.overdue(attempt, overdue_now(run, now), now)
    feed(run, concern, attempt, now + 0.2, event="phase", phase="train")  # no truncation report
    assert concern.while_running(attempt, now + 0.3) is None
    assert kinds(run) == [] and concern.pending is None


def test_an_order_of_an_earlier_attempt_is_dropped(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    concern.overdue(attempt, overdue_now(run, now), now)
    obey(run, concern, attempt, now + 0.5, order_of(attempt)["tokens"])
    assert concern.while_running(make_attempt(run, 2), now + 0.6) is None
    assert kinds(run) == [] and concern.pending is None


# ---- episode_opened -----------------------------------------------------------------------------


def test_a_stall_during_an_order_says_that_the_order_was_not_obeyed(tmp_path):
    run, concern, attempt = started(tmp_path)
    g0 = T0 + 1
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    concern.overdue(attempt, overdue_now(run, now), now)
    limit = order_of(attempt)["tokens"]
    generate_more(run, concern, attempt, now, until=now + 5.5)
    later = now + 5.5
    expired = overdue_now(run, later)
    assert concern.overdue(attempt, expired, later) is False
    inc = run.incidents.create(expired.incident_kind, attempt=1)
    fields = concern.episode_opened(attempt, Episode("livelock", inc, later, expired=expired), None, later)
    t = fields["truncation_ordered"]
    assert t["limit"] == limit and t["order"] == 1 and t["ranks"] == [0]
    assert t["grace_s"] == 5.0 and t["ordered_s_ago"] == 5.5 and t["reports"] == {}
    assert f"ordered to stop at token {limit} and did not within 5.0 s" in t["note"]
    assert concern.pending is None  # the order ends with the episode


def test_an_exit_or_no_order_adds_nothing_to_the_episode(tmp_path):
    run, concern, attempt = started(tmp_path)
    inc = run.incidents.create("stall", attempt=1)
    stall = Expired("phase", BUDGET, 6.0, rank=0, phase="generate")
    assert concern.episode_opened(attempt, Episode("stall", inc, T0 + 9, expired=stall), None, T0 + 9) == {}
    g0 = T0 + 10
    generate(run, concern, attempt, g0, until=g0 + BUDGET)
    now = g0 + BUDGET
    concern.overdue(attempt, overdue_now(run, now), now)
    crash = run.incidents.create("crash", attempt=1)
    assert concern.episode_opened(attempt, Episode("crash", crash, now + 1), None, now + 1) == {}
