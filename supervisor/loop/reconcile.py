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
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_IOERR, NO_RESTART_CODES
from hangwatch.common.rundir import attempt_dir
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes import prewarm
from hangwatch.supervisor.records import remediation
from hangwatch.supervisor.episode.episode import Episode
from hangwatch.supervisor.episode.exit_incidents import crash_loop_incident, spawn_failed_incident
from hangwatch.supervisor.nodes.node_incident import (amend_exit, amend_late, amend_stall, exit_own_culprit, lost_peer_incident,
                                                peer_words)
from hangwatch.supervisor.nodes.peer_rules import peer_cause
from hangwatch.supervisor.loop.outcome import Intent, Outcome, resolve
from hangwatch.supervisor.loop.policy import FINISH_REASONS, Decision
from hangwatch.supervisor.loop.states import State

if TYPE_CHECKING:
    from hangwatch.supervisor.loop.supervisor import Supervisor

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
        sup = self.sup
        nodes = sup.nodes
        if nodes is not None:
            late = nodes.late_notice(now)
            if late is not None:
                amend_late(*late)
            words = nodes.overdue_wait(now)
            if words:
                lost_peer_incident(sup.incidents, sup.facts, nodes, sup.attempt, words)
                sup.write_state(now, force=True)
            failed = nodes.failed_peer()
            if failed and sup.after_teardown is Intent.NONE:
                log.error("peer_failed", node=nodes.name, why=failed)
                sup.after_teardown, sup.fail_reason = Intent.PEER_FAILED, failed
        if sup.current is None or sup.awaiting_rendezvous:
            out = resolve(sup.after_teardown, None, during="the wait for the rendezvous", reason=sup.fail_reason)
            if out is not None and sup.awaiting_rendezvous:
                if out.state is not State.STARTING:
                    self.apply(out, now)  # no worker to stop: a stop, a pause, a failed peer end the wait at once
                    return
                sup.after_teardown = Intent.NONE  # a restart while waiting to start: it is starting
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
        peer = sup.nodes.peer_restart() if sup.nodes is not None else None
        if sup.current.worker.exited:
            self.worker_exited(now)
        elif peer is not None and not sup.escalate_now and sup.expired is None:
            # A peer node restarted: its ranks are gone from the collective ours wait in.  Dump ours (where they
            # waited), kill, and join the new generation at once.
            gen, notice = peer
            if not sup.current.announced:  # still at the rendezvous: nothing ran, nothing to dump or report
                why = f"peer node {notice.get('node')} restarted into generation {gen} before this attempt's ranks started"
                log.info("rendezvous_moved", node=sup.nodes.name, generation=gen, attempt=sup.attempt, why=why)
                self.begin_kill(Episode(None, None, now, reason=why, decision=Decision("restart", f"{why}; joining it")),
                                now, why=why)
                return True
            sup.episode = Episode.peer(sup.tools, sup.current, sup.deadlines, sup.facts, now, notice, gen)
            sup.deadlines.disarm_extra("stop")
            sup.transition(State.STALLED, sup.episode.reason, now)
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
            nodes = self.sup.nodes
            if nodes is not None:
                # Local evidence first, then the peers hear of it — before anything is killed, so a peer whose ranks
                # break when ours go already knows why.
                amend_stall(ep, self.sup.current, nodes.name, ep.peer_notice or nodes.newer_notice(), now)
                # Only victims here: leave the bump to the culprit's node (its notice names the culprit); if nobody
                # bumps, this node does when it restarts (`Nodes.ready_for_attempt`).
                if ep.kind != "peer_restart" and ep.own_culprit is not False:
                    nodes.local_failure(ep.kind or "stall", ep.incident.data.get("summary") if ep.incident else ep.reason,
                                        step=ep.incident.data.get("step") if ep.incident else None,
                                        rank=ep.incident.data.get("culprit_rank") if ep.incident else None)
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
        if sup.nodes is not None and not sup.nodes.ready_for_attempt(now):
            # Several nodes: no torchrun before the store is reached and — after a failure — a new generation
            # exists (the old one's rendezvous may be closed); the peer link wakes the loop when it is.
            if sup.lifecycle.state is not State.STARTING:
                sup.transition(State.STARTING, f"attempt {sup.attempt + 1}: waiting for the rendezvous store and a "
                               "new generation", now)
            sup.awaiting_rendezvous = True
            return
        resume, step = sup.resume_entry(sup.attempt + 1)  # the attempt about to start
        if sup.nodes is not None:
            settled, agreed = sup.nodes.agreed_resume({"path": resume, "step": step} if resume else None, now)
            if not settled:  # the store answers within a pass or two; the peer link wakes the loop
                if sup.lifecycle.state is not State.STARTING:
                    sup.transition(State.STARTING, f"attempt {sup.attempt + 1}: agreeing on the resume point", now)
                sup.awaiting_rendezvous = True
                return
            resume = (agreed or {}).get("path") or ""
        sup.awaiting_rendezvous = False
        if sup.current is not None:
            sup.facts.restarts += 1
        sup.attempt += 1
        if sup.lifecycle.state is not State.STARTING:
            sup.transition(State.STARTING, f"attempt {sup.attempt}", now)
        sup.episode, sup.backoff_until, sup.expired, sup.escalate_now = None, None, None, False
        try:
            sup.current = attempts.start(sup.cfg, sup.attempt, sup.config_path, sup.spawn, now, fs=sup.fs,
                                         resume_from=resume, take_standby=self.prewarm.take,
                                         rdzv_id=sup.nodes.rdzv_id() if sup.nodes is not None else None)
            sup.current.foreign |= self.prewarm.pids()  # discarded standbys not reaped yet are not its orphans
            if sup.nodes is not None and sup.nodes.link.pid:
                sup.current.foreign.add(sup.nodes.link.pid)  # the peer-link helper: ours, not the tree's
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
        if sup.nodes is not None:
            sup.nodes.spawned(sup.attempt, now)
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
            code = w.exit_code if w.exit_signal is None else None
            free = self._peer_caused_exit(code, stop_reason)
            decision = free or sup.policy.on_exit(now, code, stop_reason)
            if free is not None and code == 0:  # a clean stop a peer's stop caused: nothing failed here
                ep = Episode(None, None, now, decision=decision, reason=decision.reason)
            else:
                ep = Episode.exited(sup.tools, cur, sup.deadlines, sup.facts, now, decision=decision)
            if sup.nodes is not None and ep.incident is not None:
                self._node_exit(ep, decision, now)
            remediation.on_episode(self.remediation, ep, cur.number, sup.run_dir)  # an OOM: a smaller micro-batch, or failed
            self.prewarm.begin(cur, sup.after_teardown, ep.decision, now, why=ep.kind or "worker exited")
        self.begin_kill(ep, now, why="worker exited; ending what is left of its tree")

    # ================================================================================ multi-node

    def _peer_caused_exit(self, code: Optional[int], stop_reason: Optional[str]) -> Optional[Decision]:
        """A worker exit that is not this node's failure (`nodes.peer_cause`): a restart at once that leaves the
        restart budget alone.  None: the policy decides (a finish, a do-not-restart code, this node's own failure)."""
        nodes = self.sup.nodes
        if nodes is None or (code == 0 and stop_reason in FINISH_REASONS) or code in NO_RESTART_CODES:
            return None
        if code == 0 and stop_reason == "terminated":  # no stop was asked here: a peer node's stop reached our ranks
            return Decision("restart", f"the ranks stopped at a step boundary without a request on node {nodes.name} "
                            "(a peer node was stopped); waiting for it at a new rendezvous (this node's restart budget "
                            "is untouched)")
        own = exit_own_culprit(self.sup.current)
        notice = nodes.newer_notice()
        cause = peer_cause(own, notice, None, nodes.store_lost())
        if cause is None:
            return None
        return Decision("restart", f"{cause}; not a failure of node {nodes.name} (its restart budget is untouched)")

    def _node_exit(self, ep: Episode, decision: Decision, now: float) -> None:
        """After an exit on a multi-node run: the incident says what the local ranks' last words and the peers
        say; a node that restarts for a reason of its own tells its peers."""
        nodes = self.sup.nodes
        own = exit_own_culprit(self.sup.current)
        ep.own_culprit = own
        notice = nodes.newer_notice()
        amend_exit(ep, nodes.name, own, notice, None if own else (decision.reason if decision.action == "restart" else None))
        if notice is None and own is False and ep.incident is not None:
            nodes.await_notice(ep.incident, now)
        if decision.action != "finish" and notice is None and own is not False:
            nodes.local_failure(ep.kind or "exit", ep.incident.data.get("summary") if ep.incident else ep.reason,
                                step=ep.incident.data.get("step") if ep.incident else None)

    def _node_decision(self, ep: Episode, now: float) -> None:
        """A stall's end on a multi-node run: free when the evidence puts the culprit elsewhere (`nodes.peer_cause`)."""
        nodes = self.sup.nodes
        notice = ep.peer_notice or nodes.newer_notice()
        cause = peer_cause(ep.own_culprit, notice, nodes.bump_won(), nodes.store_lost())
        if ep.kind == "peer_restart" and ep.peer_notice is not None:
            cause = f"peer node {ep.peer_notice.get('node')} restarted"  # the peer's doing, whatever ours were in
        inc = ep.incident
        if inc is not None and notice is not None and "peer_notice" not in inc.data:
            inc.data.update(peer_notice=notice)
            if not ep.own_culprit:
                inc.data["summary"] = f"{peer_words(notice)}; {inc.data.get('summary')}"
        if inc is not None and notice is not None and ep.own_culprit is False and inc.kind != "peer_restart":
            # Only victims here, and a peer said it restarted: this node's incident is a victim's, whichever
            # deadline fired first (they tie).
            inc.rekind("peer_restart")
            ep.kind = "peer_restart"
        if cause is not None:
            ep.decision = Decision("restart", f"{cause}; not a failure of node {nodes.name} (its restart budget is untouched)")
        if inc is not None and notice is None and ep.own_culprit is False:
            nodes.await_notice(inc, now)  # the culprit's node may say why a moment later: the incident is amended then

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
        if ep.decision is None and sup.after_teardown is Intent.NONE and sup.nodes is not None and ep.kind:
            self._node_decision(ep, now)
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
