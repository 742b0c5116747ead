"""How long the supervisor's loop may sleep: until the earliest thing due, never on a fixed period it does not need.

The loop sleeps in one selector (`wakeup.Wakeup`) for `next_wait`: the time to the earliest deadline, the end of a
backoff, the notifier's next watchdog ping, the peer link's next due moment (multi-node), at most IDLE_WAIT_S;
FAST_PASS_S while escalating (an episode's own timers: snapshot interval, SIGKILL at the grace, a dump's quiet
period); `poll_interval_s` only where a heartbeat write or a control request cannot wake it.  Pure arithmetic on
the supervisor's state: no I/O.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from hangwatch.supervisor.loop.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.loop.supervisor import Supervisor

FAST_PASS_S = 0.1  # loop period while escalating or stopping: prompt, yet cheap (each pass scans the tree)
IDLE_WAIT_S = 5.0  # the longest sleep with nothing due: bounds what runs only in passes (idle control clients)
WATCHED = (State.STARTING, State.RUNNING, State.STOPPING)  # a worker runs and its deadlines apply


def next_wait(sup: "Supervisor", now: float) -> float:
    """How long the loop may sleep from `now` (see `Supervisor.next_wait`)."""
    st = sup.lifecycle.state
    if (sup.current is None or sup.awaiting_rendezvous) and st is State.STARTING and sup.nodes is None:
        return 0.0
    if st in (State.STALLED, State.DUMPING, State.KILLING, State.STOPPING) or sup.dump_requests:
        # land a pass on the episode's own timers (snapshot interval end, SIGKILL at the grace, quiet period)
        due = sup.episode.next_due_s(now, sup.tools.cpu_sample_s) if sup.episode is not None else None
        return FAST_PASS_S if due is None else min(FAST_PASS_S, due)
    cur = sup.current
    if cur is not None and cur.tail.backlog:
        return 0.0  # the last read stopped at its size bound with more lines waiting
    waits = [IDLE_WAIT_S]
    if st is State.BACKOFF and sup.backoff_until is not None:
        waits.append(sup.backoff_until - now)
    if st in WATCHED:
        due = sup.deadlines.next_due_s(now)
        if due is not None:
            waits.append(due)
        if sup.worker_alive() and not sup.wakeup.hears_beats:
            waits.append(sup.watchdog_cfg.poll_interval_s)  # no file events: read on a timer
    if sup.control is not None and sup._control_fd() is None:
        waits.append(sup.watchdog_cfg.poll_interval_s)  # requests are only seen in passes
    due = notifier_due(sup.notifier, now)
    if due is not None:
        waits.append(due)
    due = sup.nodes.next_due_s(now) if sup.nodes is not None else None
    if due is not None:
        waits.append(due)
    return max(0.0, min(waits))


def notifier_due(notifier: Any, now: float) -> Optional[float]:
    """Seconds until the notifier wants its next `watchdog` call (systemd's WatchdogSec, a ping), if it says."""
    due = getattr(notifier, "next_due_s", None)
    try:
        value = due(now) if callable(due) else getattr(notifier, "watchdog_interval_s", None)
    except Exception:  # a courtesy: never a reason to stop the loop
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
