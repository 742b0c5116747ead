"""hangwatch's own lines on a person's screen (`ops/narrator.py`): which logged events become a line, and what it
says; everything else stays in supervisor.log."""

from __future__ import annotations

import pytest

from hangwatch.supervisor.ops.narrator import Narrator, line

STALL = {
    "event": "stall_detected",
    "kind": "stall",
    "incident": "0003",
    "deadline": "step",
    "budget_s": 4.2,
    "elapsed_s": 4.31,
    "phase": "train",
    "step": 5,
    "rank": None,
}


@pytest.mark.parametrize(
    "ev, expected",
    [
        (
            STALL,
            "stall at step 5 in train: no progress for 4.3s, its budget 4.2s (stall); incident 0003: taking the stacks",
        ),
        (
            {"event": "worker_failed", "attempt": 2, "step": 0, "incident": "0002", "classification": "exited 2"},
            "attempt 2 failed: exited 2; incident 0002",
        ),
        (
            {"event": "worker_failed", "attempt": 1, "step": 7, "incident": "0001", "code": 3},
            "attempt 1 failed at step 7: exit 3; incident 0001",
        ),
        (
            {"event": "tree_gone", "next": "backoff", "why": "worker exited 1; next attempt in 2s"},
            "worker exited 1; next attempt in 2s",
        ),
        ({"event": "tree_gone", "next": "finished", "why": "worker exited 0"}, None),  # the summary says it
        ({"event": "tree_gone", "next": "failed", "why": "crash loop"}, None),
        ({"event": "worker_spawned", "attempt": 1}, None),  # supervisor.log only
        ({"event": "state", "to": "running"}, None),
        ({"event": "graceful_stop", "say": "SIGINT: passed on to the command"}, "SIGINT: passed on to the command"),
        ({"event": "unkillable", "text": "pid 7 survives SIGKILL (D state)"}, "pid 7 survives SIGKILL (D state)"),
        ({"event": "stall_detected", "budget_s": 1, "elapsed_s": "x"}, None),  # a field of another shape: no line
    ],
)
def test_which_events_are_said_and_how(ev, expected):
    assert line(ev) == expected


def test_the_tap_says_only_lines():
    said = []
    tap = Narrator(said.append)
    tap({"event": "state"})
    tap(STALL)
    assert len(said) == 1 and said[0].startswith("stall at step 5")
