"""The dead-man's switch: a ping to `alerts.ping_url` every `alerts.ping_every_s`, only while the run is healthy.

A service such as healthchecks.io expects the pings and raises its own alarm when they stop, so what
cannot send an alert itself is still noticed: a dead box, a wedged or stopped (SIGSTOP) supervisor, a
stuck run.  Hence the pings are decided by the supervisor's loop (`DeadMan.pass_done`, once a pass with
the pass's `now`) and only sent on a thread (`notify.Outbox`): when the loop stops, they stop.

Healthy (`healthy`, pure) means: the supervisor is RUNNING a worker and its main rank shows progress
within one ping interval —
  * in `train`: a step no older than `ping_every_s` (a loop that still beats `progress` but never steps is
    not healthy: liveness is not progress);
  * in `idle` (continuous mode, waiting for data): any beat no older than `ping_every_s`;
  * in another phase (eval, generate, checkpoint, …): any beat no older than `ping_every_s`, within the
    phase's budget.
So the pings stop within one interval of the run stalling, and resume with the first step after recovery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import structlog

from hangwatch.supervisor.ops.notify import Outbox, Stats
from hangwatch.supervisor.rules.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.watch.deadlines import RankTrack

log = structlog.get_logger("hangwatch")


def healthy(state: State, track: Optional["RankTrack"], now: float, window_s: float) -> tuple[bool, str]:
    """(healthy, why) for the main rank's tracker at `now`."""
    if state is not State.RUNNING:
        return False, f"state {state.value}"
    if track is None or not track.started:
        return False, "no start beat yet"
    if track.stopped:
        return False, "the worker is stopping"
    if track.phase == "train":
        if track.last_step_at is None or now - track.last_step_at > window_s:
            return False, f"no step for more than {window_s:g}s"
        return True, "stepping"
    if now - track.last_line_at > window_s:
        return False, f"no beat for more than {window_s:g}s in phase {track.phase!r}"
    if track.phase_budget is not None and now - track.phase_since > track.phase_budget:
        return False, f"phase {track.phase!r} is past its budget"
    return True, "idle" if track.phase == "idle" else f"in phase {track.phase!r}"


class DeadMan:
    """Decides the pings on the loop; `outbox` sends them.  `pass_done` is cheap: no I/O."""

    def __init__(self, every_s: float, outbox: Outbox):
        self.every_s = every_s
        self.outbox = outbox
        self.last_ping_at: Optional[float] = None
        self.was_healthy: Optional[bool] = None

    def next_due_s(self, now: float) -> float:
        """Seconds until a pass could ping (the loop's wait): the interval's end, or one interval from now
        when there was no ping yet (health is re-judged then)."""
        if self.last_ping_at is None:
            return min(1.0, self.every_s)
        return max(0.0, self.last_ping_at + self.every_s - now)

    def pass_done(self, state: State, track: Optional["RankTrack"], now: float) -> bool:
        """True when a ping was handed to the outbox in this pass."""
        ok, why = healthy(state, track, now, self.every_s)
        if ok != self.was_healthy:
            self.was_healthy = ok
            log.info("deadman_" + ("pinging" if ok else "silent"), why=why)
        if not ok:
            return False
        if self.last_ping_at is not None and now - self.last_ping_at < self.every_s:
            return False
        if not self.outbox.idle():
            return False  # the last ping is still on its way: never queue pings behind a slow endpoint
        self.last_ping_at = now
        return self.outbox.put(now)


class Pinger:
    """The outbox's deliverer: one HTTP GET with a timeout; a failure is logged (once per failing streak)
    and counted."""

    name = "deadman"

    def __init__(self, url: str, timeout_s: float, stats: Stats, get: Optional[Callable[[str, float], int]] = None):
        self.url, self.timeout_s, self.stats = url, timeout_s, stats
        self.get = get if get is not None else _http_get
        self.failing = False

    def __call__(self, _now: float) -> None:
        try:
            status = self.get(self.url, self.timeout_s)
            if status >= 400:
                raise OSError(f"HTTP {status}")
        except Exception as exc:  # network errors, HTTP errors, timeouts: counted, never raised to the loop
            self.stats.add("deadman_failed")
            if not self.failing:
                log.warning("deadman_ping_failed", url=_private(self.url), error=str(exc))
            self.failing = True
            return
        self.stats.add("deadman_pings")
        if self.failing:
            log.info("deadman_ping_ok_again", url=_private(self.url))
        self.failing = False


def _http_get(url: str, timeout_s: float) -> int:
    import urllib.request  # noqa: PLC0415 (only where a ping is configured: it pulls in http.client and email)

    req = urllib.request.Request(url, headers={"User-Agent": "hangwatch"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 (an http(s) URL, checked by the schema)
        resp.read(1024)
        return resp.status


def _private(url: str) -> str:
    """The URL without its path (a healthchecks URL's path is its secret)."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}/…"
