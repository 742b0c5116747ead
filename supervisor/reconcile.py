"""Step 3 of every loop pass: bring the processes in line with the state, one handler per state.

The handlers are the only code that acts on processes and incidents — spawn an attempt, ask the
worker to stop (SIGTERM), start an episode (snapshot, SIGUSR1, SIGTERM/SIGKILL to the tree, the
incident), back off — and they act on what the loop's first two steps recorded: the worker's exit
(`Worker.exited`), an operator's intent (`after_teardown`, `escalate_now`, `force`), the overdue
deadline (`expired`).  A pass runs handlers until the state settles, so a fired deadline is
snapshotted in the same pass and a finished backoff spawns at once.

`Reconciler` works on its `Supervisor`'s state (like `Commands`); what follows a finished episode
or a request is decided by the pure `outcome.resolve`.

With `restart.prewarm` the reconciler also keeps the next attempt's standby (`prewarm.Prewarm`):
spawned where a restart becomes likely (a stall, an exit the policy restarts, a graceful `restart`),
released by `start_attempt` — in the same place, after the tree is gone, where a worker is spawned
otherwise — and discarded by any outcome that is not a restart.
"""
from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import structlog

from hangwatch.common.durable import disk_error
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_IOERR
from hangwatch.common.rundir import attempt_dir
from hangwatch.supervisor import attempt as attempts, prewarm, remediation
from hangwatch.supervisor.episode import Episode
from hangwatch.supervisor.exit_incidents import crash_loop_incident, spawn_failed_incident
from hangwatch.supervisor.outcome import Intent, Outcome, resolve
from hangwatch.supervisor.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.runner import Supervisor

log = structlog.get_logger("hangwatch")


class Reconciler:
    def __init__(self, sup: "Supervisor", spawn_standby: prewarm.SpawnStandby = prewarm.spawn_standby):
        self.sup = sup
        self.prewarm = prewarm.Prewarm(sup.cfg, sup.config_path, sup.table, fs=sup.fs, spawn=spawn_standby)
        self.remediation = remediation.OomRemediation(sup.cfg, sup.run_dir)
        self.handlers: dict[State, Callable[[float], None]] = {
            State.STARTING: self.running, State.RUNNING: self.running, State.STOPPING: self.stopping,
            State.STALLED: self.stalled, State.DUMPING: self.dumping, State.KILLING: self.killing,
            State.BACKOFF: self.backoff, State.PAUSED: self.paused,
        }

    def __call__(self, now: float) -> None:
        """Run the current state's handler until the state settles (each handler moves at most one step)."""
        self.prewarm.poll(now)
        for _ in range(len(State)):
            st = self.sup.lifecycle.state
            handler = self.handlers.get(st)  # final states have none
            if handler is None:
                return
            handler(now)
            if self.sup.lifecycle.state is st:
                return

    # ================================================================================ per state

    def running(self, now: float) -> None:  # STARTING, RUNNING
        if self.sup.current is None:
            self.start_attempt(now)
        elif not self._escalated(now) and self.sup.after_teardown is not Intent.NONE:
            self.graceful_stop(now)

    def stopping(self, now: float) -> None:
        if not self._escalated(now) and self.sup.force:
            self.sup.force = False
            self.begin_kill(Episode(None, None, now, reason="forced stop"), now, send_term=False)

    def _escalated(self, now: float) -> bool:
        """A worker exit, `restart now` or an overdue deadline starts an episode (True when one did)."""
        sup = self.sup
        if sup.current.worker.exited:
            self.worker_exited(now)
        elif sup.escalate_now or sup.expired is not None:
            ex = None if sup.escalate_now else sup.expired
            sup.escalate_now = False
            sup.episode = Episode.stall(sup.tools, sup.current, sup.deadlines, sup.facts, now,
                                        ex.incident_kind if ex else "manual", ex)
            sup.deadlines.disarm_extra("stop")
            sup.transition(State.STALLED, sup.episode.reason, now)
            self.prewarm.begin(sup.current, sup.after_teardown, None, now, why=sup.episode.kind or "stall")
        else:
            return False
        return True

    def stalled(self, now: float) -> None:
        sup = self.sup
        if sup.episode.sample_then_dump(sup.tools, sup.current, now):
            sup.transition(State.DUMPING, f"snapshot taken; dumps of {[t.ref.pid for t in sup.episode.dumps.targets]} under way (signalled at detection)", now)

    def dumping(self, now: float) -> None:
        ep = self.sup.episode
        if ep.dumps.advance(now):
            ep.collect_dumps(self.sup.current, now)
            self.begin_kill(ep, now)

    def killing(self, now: float) -> None:
        killer = self.sup.episode.killer
        if self.sup.force and killer.kill_at is None:
            self.sup.force = False
            killer.kill_now(now)
        if killer.advance(now):
            self.finish_episode(now)

    def backoff(self, now: float) -> None:
        out = resolve(self.sup.after_teardown, None, during="backoff", reason=self.sup.fail_reason)
        if out is not None:
            self.apply(out, now)
        elif self.sup.backoff_until is None or now >= self.sup.backoff_until:
            self.start_attempt(now)

    def paused(self, now: float) -> None:
        out = resolve(self.sup.after_teardown, None, during="paused", reason=self.sup.fail_reason)
        if out is not None and out.state is not State.PAUSED:
            self.apply(out, now)

    # ================================================================================ actions

    def start_attempt(self, now: float) -> None:
        sup = self.sup
        if sup.current is not None:
            sup.facts.restarts += 1
        sup.attempt += 1
        if sup.lifecycle.state is not State.STARTING:
            sup.transition(State.STARTING, f"attempt {sup.attempt}", now)
        sup.episode, sup.backoff_until, sup.expired, sup.escalate_now = None, None, None, False
        try:
            sup.current = attempts.start(sup.cfg, sup.attempt, sup.config_path, sup.spawn, now, fs=sup.fs,
                                         resume_from=sup.resume_point(), take_standby=self.prewarm.take)
            sup.current.foreign |= self.prewarm.pids()  # discarded standbys not reaped yet are not its orphans
            sup.current.oom_kills_at_start = sup.tools.kernel.oom_kills()
        except OSError as exc:
            sup.current = None
            if disk_error(exc):  # the attempt's directory or log cannot be made: the disk, not the config
                sup.write_failed(exc, Path(exc.filename or attempt_dir(sup.run_dir, sup.attempt)))
                self.finish(Outcome(State.FAILED, sup.fail_reason, EXIT_IOERR), now)
                return
            spawn_failed_incident(sup.incidents, sup.attempt, attempts.worker_argv(sup.cfg, sup.config_path),
                                  sup.cfg.worker.cwd, exc, sup.facts)
            self.finish(Outcome(State.FAILED, f"cannot start the worker: {exc}", EXIT_CONFIG), now)
            return
        sup.deadlines.arm_startup(now)
        sup.policy.attempt_started(now)
        w = sup.current.worker
        log.info("worker_spawned", attempt=sup.attempt, pid=w.pid, argv=w.argv, log=str(w.log_path),
                 prewarmed=sup.current.prewarmed)
        sup.spawned(now)

    def graceful_stop(self, now: float) -> None:
        sup = self.sup
        sup.transition(State.STOPPING, f"{sup.after_teardown.value} requested", now)
        w = sup.current.worker
        sent = sup.table.signal(w.ref, signal.SIGTERM)
        budget, source = sup.deadlines.step_budget()
        bound = sup.watchdog_cfg.term_grace_s + budget
        sup.deadlines.arm_extra("stop", now, bound, f"term_grace + {source} step budget")
        log.info("graceful_stop", intent=sup.after_teardown.value, pid=w.pid, sigterm_sent=sent, bound_s=round(bound, 3))
        self.prewarm.begin(sup.current, sup.after_teardown, None, now, why=f"{sup.after_teardown.value} requested")

    def worker_exited(self, now: float) -> None:
        sup = self.sup
        cur, w = sup.current, sup.current.worker
        if sup.lifecycle.state is State.STOPPING:
            ep = Episode.exited(sup.tools, cur, sup.deadlines, sup.facts, now,
                                stopping=f"graceful stop ({sup.after_teardown.value})")
        else:
            stop_reason = cur.last_stop.get(sup.deadlines.main_rank())
            decision = sup.policy.on_exit(now, w.exit_code if w.exit_signal is None else None, stop_reason)
            ep = Episode.exited(sup.tools, cur, sup.deadlines, sup.facts, now, decision=decision)
            remediation.on_episode(self.remediation, ep, cur.number, sup.run_dir)  # an OOM: a smaller micro-batch, or failed
            self.prewarm.begin(cur, sup.after_teardown, ep.decision, now, why=ep.kind or "worker exited")
        self.begin_kill(ep, now, why="worker exited; ending what is left of its tree")

    def begin_kill(self, ep: Episode, now: float, send_term: bool = True, why: Optional[str] = None) -> None:
        sup = self.sup
        sup.episode = ep
        ep.begin_kill(sup.tools, sup.current, now, send_term)
        sup.deadlines.disarm_extra("stop")
        sup.transition(State.KILLING, why or ("SIGTERM to the process group" if send_term else "SIGKILL to the tree"), now)

    def finish_episode(self, now: float) -> None:
        """The tree is gone: decide what follows, complete the incident, go there."""
        sup = self.sup
        ep, cur = sup.episode, sup.current
        cur.tail.finish()
        sup.ledger.attempt_ended(cur.number)  # what it left unconfirmed stays unconfirmed
        sup.save_calibration()
        if ep.decision is None and sup.after_teardown is Intent.NONE:
            ep.decision = sup.policy.on_failure(now, ep.reason)
        out = resolve(sup.after_teardown, ep.decision, cur.worker.exit_code, reason=sup.fail_reason)
        ep.finish(cur, sup.facts, now, out.state.value, out.why, sup.deadlines.main_rank())
        log.info("tree_gone", attempt=sup.attempt, next=out.state.value, why=out.why,
                 gone_after_s=ep.killer.timings()["tree_gone_after_s"])
        sup.episode = None
        if out.state is State.FAILED and ep.decision is not None and ep.decision.crash_loop:
            crash_loop_incident(sup.incidents, sup.attempt, ep.decision, sup.policy, sup.cfg.restart, sup.facts)
        self.apply(out, now)

    def apply(self, out: Outcome, now: float) -> None:
        sup = self.sup
        if out.state not in (State.STARTING, State.BACKOFF):
            self.prewarm.discard(now, f"no restart: {out.state.value} ({out.why})")
        if out.state is State.STARTING:
            sup.after_teardown = Intent.NONE
            self.start_attempt(now)
        elif out.state is State.BACKOFF:
            sup.backoff_until = now + out.delay_s
            sup.transition(State.BACKOFF, out.why, now)
        elif out.state is State.PAUSED:
            sup.after_teardown = Intent.NONE
            sup.transition(State.PAUSED, out.why, now)
        else:
            self.finish(out, now)

    def finish(self, out: Outcome, now: float) -> None:
        self.prewarm.discard(now, f"the run ends {out.state.value}")
        self.sup.exit_code = out.exit_code
        if out.state is not State.FAILED:
            self.sup.notify("stopping")
        self.sup.transition(out.state, out.why, now)
