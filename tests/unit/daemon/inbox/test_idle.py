"""Continuous mode's idle wait on a fake clock: when the examples in hand are flushed as a partial
step (`data.flush_after_s` with nothing new arriving), when the run ends (`data.idle_exit_s`), what
resets the quiet clock, and that the wait keeps beating in phase `idle` and never oversleeps a
decision."""

from __future__ import annotations

import io

import pytest
from fixtures.fakes.inbox_support import FakeClock, RecordingHeartbeat, ScriptedInbox, jsonl, validator  # noqa: E402

from hangwatch.common.inbox_layout import Stage
from hangwatch.daemon.inbox.feed import InboxFeed
from hangwatch.daemon.inbox.idle import FLUSH, IDLE, IdlePolicy
from hangwatch.daemon.inbox.source import ContinuousSource
from hangwatch.daemon.signals import StopRequest

STEP = 4  # examples in a full step


@pytest.mark.parametrize(
    "flush_after,idle_exit,quiet,flushed,decision",
    [
        (2, None, 0.0, False, None),
        (2, None, 1.99, False, None),
        (2, None, 2.0, False, FLUSH),  # due exactly at flush_after_s
        (2, None, 50.0, True, None),  # once per quiet spell
        (2, 5, 4.99, True, None),
        (2, 5, 5.0, True, IDLE),
        (2, 5, 5.0, False, IDLE),  # the end wins: finishing trains and checkpoints what is in hand too
        (10, 3, 3.0, False, IDLE),  # idle_exit_s below flush_after_s: the run ends before any flush
    ],
)
def test_idle_decision(flush_after, idle_exit, quiet, flushed, decision):
    assert IdlePolicy(flush_after, idle_exit).decide(quiet, flushed) == decision


@pytest.mark.parametrize(
    "flush_after,idle_exit,quiet,flushed,wait",
    [
        (30, None, 0.0, False, 1.0),  # a beat is owed first
        (2, None, 1.5, False, 0.5),  # the flush is due first: wake exactly then
        (2, None, 2.5, False, 0.0),  # overdue: do not block
        (2, None, 10.0, True, 1.0),  # flushed, no end: beat every second for ever
        (2, 5, 4.75, True, 0.25),
    ],
)
def test_idle_wait_never_oversleeps_a_decision_or_a_beat(flush_after, idle_exit, quiet, flushed, wait):
    assert IdlePolicy(flush_after, idle_exit).wait_s(quiet, flushed, beat_every_s=1.0) == pytest.approx(wait)


def make_feed(run, script=None, *, flush_after_s=2.5, idle_exit_s=None, files=None):
    clock = FakeClock()
    inbox = ScriptedInbox(run, clock, script)
    for name, content in (files or {}).items():
        inbox.arrive(name, content)()
    inbox.intakes = 0
    hb = RecordingHeartbeat(clock)
    stop = StopRequest()
    feed = InboxFeed(
        ContinuousSource(run, validator),
        inbox,
        hb,
        stop,
        flush_after_s=flush_after_s,
        idle_exit_s=idle_exit_s,
        clock=clock,
        out=io.StringIO(),
    )
    feed.restore(None)
    return feed, clock, inbox, hb, stop


def lines_of(examples) -> list[int]:
    return [e["line"] for e in examples]


def test_examples_in_hand_are_flushed_after_flush_after_s_of_quiet_and_only_once(tmp_path):
    feed, clock, inbox, hb, _ = make_feed(
        tmp_path, flush_after_s=2.3, idle_exit_s=7.0, files={"a.jsonl": jsonl(7, "a")}
    )
    examples, end = feed.take_step(STEP)
    assert (lines_of(examples), end, clock.now) == ([1, 2, 3, 4], None, 0.0)  # a full step: no wait at all

    examples, end = feed.take_step(STEP)
    assert (lines_of(examples), end) == ([5, 6, 7], FLUSH)
    assert clock.now == pytest.approx(2.3)  # on the dot, not at the next beat
    idle = hb.of("phase", phase="idle")
    assert [b["waiting_examples"] for b in idle] == [3]
    beats = [b["at"] for b in hb.of("progress")]
    assert beats and all(b2 - b1 <= 1.0 for b1, b2 in zip([0.0] + beats, beats))  # beating all along
    assert hb.current_phase != "idle"  # the partial step trains in the phase it came from
    assert [(b["at"], b.get("decision")) for b in hb.of("progress")][-1] == (pytest.approx(2.3), FLUSH)

    # Nothing new: the quiet spell was flushed already, so the next wait only beats, until the end.
    examples, end = feed.take_step(STEP)
    assert (examples, end) == ([], IDLE) and clock.now == pytest.approx(9.3)
    assert max(timeout for _, timeout in inbox.waits) <= 1.0


def test_an_arrival_before_the_flush_fills_the_step_instead(tmp_path):
    feed, clock, inbox, hb, _ = make_feed(tmp_path, files={"a.jsonl": jsonl(3, "a")})
    inbox.script[1.5] = inbox.arrive("b.jsonl", jsonl(2, "b"))
    examples, end = feed.take_step(STEP)
    assert end is None and [e["prompt"] for e in examples] == ["a q0", "a q1", "a q2", "b q0"]
    assert clock.now == 1.5


def test_any_arrival_restarts_the_quiet_clock_even_a_rejected_file(tmp_path):
    feed, clock, inbox, hb, _ = make_feed(tmp_path, files={"a.jsonl": jsonl(3, "a")})
    inbox.script[1.5] = inbox.arrive("bad.jsonl", "{not json\n")
    examples, end = feed.take_step(STEP)
    assert (len(examples), end) == (3, FLUSH)
    assert clock.now == 4.0  # flush_after_s after the last arrival, not after the wait began
    assert (tmp_path / "rejected" / "bad.jsonl").exists()


def test_a_new_quiet_spell_after_new_examples_flushes_again_and_a_stop_ends_the_wait(tmp_path):
    feed, clock, inbox, hb, stop = make_feed(tmp_path, files={"a.jsonl": jsonl(2, "a")})
    assert feed.take_step(STEP)[1] == FLUSH and clock.now == 2.5
    inbox.script[3.0] = inbox.arrive("b.jsonl", jsonl(1, "b"))
    examples, end = feed.take_step(STEP)
    assert ([e["prompt"] for e in examples], end, clock.now) == (["b q0"], FLUSH, 5.5)

    def request_stop():
        stop.requested = "SIGTERM"

    inbox.script[6.0] = request_stop
    assert feed.take_step(STEP) == ([], "stop")
    assert clock.now == 6.0


def test_a_fresh_attempt_flushes_once_even_with_nothing_in_hand(tmp_path):
    """With nothing in hand the flush asks the trainer to make the last step durable and settle its
    checkpoint (the one an attempt resumed from, too)."""
    feed, clock, _, hb, _ = make_feed(tmp_path, flush_after_s=2.5, idle_exit_s=4.0)
    assert feed.take_step(STEP) == ([], FLUSH) and clock.now == 2.5
    assert feed.take_step(STEP) == ([], IDLE) and clock.now == 6.5
    assert not list(Stage.PROCESSING.dir(tmp_path).glob("0*"))
