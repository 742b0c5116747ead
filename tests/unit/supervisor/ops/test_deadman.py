"""The dead-man's switch on a fake clock: pinged only while healthy, every interval, never queued behind a slow ping."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.ops.deadman import DeadMan, Pinger, healthy
from hangwatch.supervisor.ops.notify import Stats
from hangwatch.supervisor.rules.states import State
from hangwatch.supervisor.watch.deadlines import RankTrack


def track(
    phase="train", last_step_at=95.0, last_line_at=99.0, phase_since=50.0, budget=None, started=True, stopped=False
):
    return RankTrack(
        rank=0,
        started=started,
        stopped=stopped,
        phase=phase,
        last_step_at=last_step_at,
        last_line_at=last_line_at,
        phase_since=phase_since,
        phase_budget=budget,
    )


@pytest.mark.parametrize(
    "state, tr, ok, why",
    [
        (State.RUNNING, track(), True, "stepping"),
        (
            State.RUNNING,
            track(last_step_at=89.0),
            False,
            "no step for more than 10s",
        ),  # a stall, or a livelock's progress
        (State.RUNNING, track(last_step_at=None), False, "no step for more than 10s"),
        (State.RUNNING, track(phase="idle", last_step_at=None, last_line_at=95.0), True, "idle"),
        (State.RUNNING, track(phase="idle", last_line_at=80.0), False, "no beat for more than 10s in phase 'idle'"),
        (State.RUNNING, track(phase="eval", last_line_at=98.0, phase_since=60.0, budget=900), True, "in phase 'eval'"),
        (
            State.RUNNING,
            track(phase="generate", last_line_at=98.0, phase_since=60.0, budget=30),
            False,
            "phase 'generate' is past its budget",
        ),
        (State.RUNNING, None, False, "no start beat yet"),
        (State.RUNNING, track(started=False), False, "no start beat yet"),
        (State.RUNNING, track(stopped=True), False, "the worker is stopping"),
        (State.STARTING, track(), False, "state starting"),
        (State.STALLED, track(), False, "state stalled"),
        (State.BACKOFF, track(), False, "state backoff"),
    ],
)
def test_healthy(state, tr, ok, why):
    assert healthy(state, tr, 100.0, 10.0) == (ok, why)


class FakeOutbox:
    def __init__(self):
        self.items, self.busy = [], False

    def idle(self):
        return not self.busy

    def put(self, item):
        self.items.append(item)
        return True


def test_pings_every_interval_while_stepping_and_stop_within_one_interval_of_the_stall():
    box = FakeOutbox()
    dm = DeadMan(10.0, box)
    tr = track(last_step_at=0.0, last_line_at=0.0)
    for tenth in range(0, 400):  # a pass every 0.1 s; a step every second until t=20, then nothing
        now = tenth / 10
        if now <= 20 and tenth % 10 == 0:
            tr.last_step_at = tr.last_line_at = now
        dm.pass_done(State.RUNNING, tr, now)
    assert box.items == [0.0, 10.0, 20.0, 30.0]  # none later than one interval after the last step
    tr.last_step_at = 45.0  # recovered: the next attempt steps
    dm.pass_done(State.RUNNING, tr, 45.0)
    assert box.items[-1] == 45.0


def test_a_ping_still_on_its_way_is_not_joined_by_another():
    box = FakeOutbox()
    dm = DeadMan(1.0, box)
    tr = track()
    box.busy = True
    tr.last_step_at = 99.5
    assert dm.pass_done(State.RUNNING, tr, 100.0) is False
    box.busy = False
    assert dm.pass_done(State.RUNNING, tr, 100.1) is True


def test_a_failing_ping_is_counted_and_logged_once_per_streak():
    stats, codes = Stats(), iter([503, 503, 200, 500])

    def get(url, timeout):
        code = next(codes)
        if code == 500:
            raise OSError("timed out")
        return code

    p = Pinger("https://hc-ping.example/secret-uuid", 5.0, stats, get=get)
    for _ in range(4):
        p(0.0)
    assert stats.snapshot() == {("deadman_failed", ""): 3, ("deadman_pings", ""): 1}
    assert p.failing is True
