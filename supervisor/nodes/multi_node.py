"""This node's part in a multi-node run (`worker.nnodes` > 1): generations, peers' restarts, lost peers.

Each node runs its own supervisor; they meet through the rendezvous store (`supervisor.peers`).  The
unit of coordination is the **generation**, a counter in the store: every attempt of every node runs
torchrun with `--rdzv-id <rdzv_id>-g<generation>`, so a restart is a fresh rendezvous that every node
joins, never a round of one that a failed torchrun closed for good.

    a node restarts for a reason of its own (a stall, a crash)
        → once its dumps are read and before it kills anything, it bumps the generation (from its attempt's:
          one bump per failure, whoever is first) with a notice — node, kind, the words of its incident; a
          node whose ranks were only victims leaves the bump to the culprit's node and makes it itself only
          when nobody did by the time it restarts; its incident takes the peer's words when they come;
    a node sees a generation newer than its attempt's
        → a `peer_restart` episode: its ranks are dumped (where they waited), killed, and restarted into
          the new generation at once; its incident says "peer node B restarted (…); local ranks were
          waiting in all_reduce";
    a node whose attempt waits at the rendezvous (spawned, no rank started) longer than
    `worker.rdzv_timeout_s` while peers are missing
        → the `lost_peer` incident and alert ("waiting for 1 of 2 nodes at the rendezvous since …"); it
          keeps waiting, and the peer's return resumes the run.

Restart budgets stay per node and follow the evidence: a failure counts against this node's budget
(`RestartPolicy`) only when its own ranks hold the culprit, or the evidence cannot tell and no peer
said it restarted first.  Ranks that only waited in (or broke out of) a collective are victims: their
restart is free, so a healthy node's budget is never burnt by a crash-looping peer — which fails cleanly
on its own budget, and its record saying `failed` ends the others `failed` too.

Pure decisions (`peer_cause`, `missing_words`, `present_nodes`, at the end of this module) are functions of what
the link saw; `MultiNode` keeps the little state there is (the attempt's generation, the rendezvous wait) and every
method takes `now`.  The loop sees it only through the `nodes.interface.Nodes` interface.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import structlog

from hangwatch.common.config import Config
from hangwatch.common.exitcodes import NO_RESTART_CODES
from hangwatch.supervisor.nodes.interface import Nodes
from hangwatch.supervisor.nodes.node_incident import (
    amend_exit,
    amend_late,
    amend_stall,
    exit_own_culprit,
    lost_peer_incident,
    peer_words,
)
from hangwatch.supervisor.nodes.peers import (
    HELPER_LOG_NAME,
    PeerLink,
    SpawnHelper,
    default_node_name,
    helper_argv,
    spawn_helper,
)
from hangwatch.supervisor.processes.attempt import Attempt, rdzv_id_for
from hangwatch.supervisor.processes.process import ProcessTable
from hangwatch.supervisor.rules.answer import Answer
from hangwatch.supervisor.rules.policy import FINISH_REASONS, Decision

if TYPE_CHECKING:  # annotations only
    from hangwatch.supervisor.incidents import IncidentStore
    from hangwatch.supervisor.records.run_state import RunRecord
    from hangwatch.supervisor.watch.deadlines import Deadlines

log = structlog.get_logger("hangwatch")

BUMP_RETRY_S = 5.0  # a bump unanswered this long (the store went away meanwhile) is sent again
FAILED_RETRY_S = 0.5  # an order the helper could not carry out (no store yet) is sent again after this long
LATE_NOTICE_S = 30.0  # a victims' incident waits this long for the culprit node's notice
PEER_GRACE_S = 3.0  # a victims-only node waits this long for the culprit node's bump before it bumps itself
# torchrun's agent, its ranks done, waits for every node's agent at its exit barrier this long
# (torch.distributed.elastic's SimpleElasticAgent(exit_barrier_timeout=300); torchrun has no option for it),
# then exits all the same.
EXIT_BARRIER_S = 300.0
EXIT_BARRIER_MARGIN_S = 30.0  # the agent's own shutdown after the barrier


@dataclass
class Wait:
    since: float  # monotonic
    since_wall: float
    gen: int
    reported: bool = False
    startup_armed: bool = False  # every node is here: the startup deadline counts from then


class MultiNode(Nodes):
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        incidents: IncidentStore,
        facts: Callable[[], RunRecord],
        deadlines: Deadlines,
        table: ProcessTable,
        spawn: SpawnHelper = spawn_helper,
        poke=lambda: None,
    ):
        """`incidents`, `facts` (the run's record now), `deadlines` and `table`: the loop's, for the incidents this
        node writes (a lost peer), the deadlines it re-arms (torchrun between rounds) and the processes it reads."""
        self.incidents, self.facts, self.deadlines, self.table = incidents, facts, deadlines, table
        self.attempt_number = 0  # the attempt last spawned
        w = cfg.worker
        self.cfg = w
        self.name = w.node_name or default_node_name(run_dir)
        self.endpoint = w.rdzv_endpoint or ""
        self.link = PeerLink(
            helper_argv(self.endpoint, w.rdzv_id, self.name, w.nnodes),
            Path(run_dir) / HELPER_LOG_NAME,
            spawn=spawn,
            poke=poke,
        )
        self.attempt_gen: Optional[int] = None
        self.wait: Optional[Wait] = None  # at the rendezvous (spawned, no rank started) or waiting for the store
        self.bump_id: Optional[str] = None  # this node's bump for the current episode
        self.rounds: dict[int, int] = {}  # rank → torchrun's restart count seen in this attempt
        self.round_changes = 0
        self.store_wait: Optional[Wait] = None
        self.barrier_excused: Optional[int] = None  # the attempt whose agent was given torchrun's exit barrier
        self.bump_sent_at: Optional[float] = None
        self.awaiting_notice: Optional[tuple] = None  # (victims' incident, its attempt's generation, since)
        self.victims_since: Optional[float] = None  # the last attempt ended with only victims here (no notice yet)
        self.resume_id: Optional[str] = None  # the agree_resume order for the generation about to start
        self.resume_sent_gen: Optional[int] = None
        self.resume_sent_at: Optional[float] = None
        self.resume_gen: Optional[int] = None
        self.resume_choice: Optional[dict] = None  # the store's answer: {"gen", "choice": {"path","step","by"}}
        self.outage: Optional[str] = None  # the store went away during the current attempt

    # ---- life

    @property
    def helper_pid(self) -> Optional[int]:
        return self.link.pid

    def start(self, now: float) -> None:
        self.link.start(now)
        self.link.status(node=self.name, state="starting", gen=None, attempt=None)

    def close(self) -> None:
        self.link.close()

    def poll(self, now: float) -> list[str]:
        kinds = self.link.poll(now)
        v = self.link.view
        if not v.store_ok and v.store_lost_at is not None and self.attempt_gen is not None and self.outage is None:
            self.outage = v.store_error or "unreachable"
            log.warning("rendezvous_store_lost", node=self.name, endpoint=self.endpoint, error=self.outage)
        return kinds

    @property
    def gen(self) -> Optional[int]:
        return self.link.view.gen

    def ready(self, now: float) -> bool:
        """The store was reached and its generation is known: an attempt can be spawned."""
        v = self.link.view
        if v.gen is not None and v.store_ok:
            self.store_wait = None
            return True
        if self.store_wait is None:
            self.store_wait = Wait(now, time.time(), -1)
        return False

    def ready_for_attempt(self, now: float) -> bool:
        """An attempt may be spawned: the store is reached and — for every attempt after this supervisor's first —
        the generation is newer than the last attempt's (a peer's bump, or this node's own, sent here when nobody
        made one: a graceful restart).  A bump whose reply is lost is sent again after BUMP_RETRY_S."""
        if not self.ready(now):
            return False
        if self.attempt_gen is None or (self.gen or 0) > self.attempt_gen:
            return True
        if self.bump_id is not None and self.link.reply(self.bump_id) is None:
            if self.bump_sent_at is None:
                self.bump_sent_at = now
            retry = FAILED_RETRY_S if self.link.failed(self.bump_id) else BUMP_RETRY_S
            if now - self.bump_sent_at < retry:
                return False
        if self.victims_since is not None and now - self.victims_since < PEER_GRACE_S:
            return False  # only victims here: the culprit's node bumps with the notice that names the culprit
        self.bump_id = None
        self.local_failure("restart", "restarting into a new rendezvous generation", now=now)
        return False

    # ---- the resume point: chosen once per generation, the same on every node

    def offer(self, path: Optional[str], step: Optional[int]) -> None:
        """This node's newest good checkpoint (its ledger saw rank 0 announce and confirm it), in its record: a peer
        that proposes the generation's resume point takes the newest any node offers."""
        self.link.status(resume={"path": path, "step": step} if path else None)

    def agreed_resume(self, own: Optional[dict], now: float) -> tuple[bool, Optional[dict]]:
        """(settled, the resume point every node's ranks get in this generation).  The first node to propose for the
        generation decides for all (the store keeps the first proposal); its proposal is the newest good checkpoint
        that it or any present peer offers — rank 0's node knows the checkpoints, the others learn them here."""
        gen = self.gen or 0
        if self.resume_gen == gen and self.resume_choice is not None:
            return True, self.resume_choice.get("choice")
        reply = self.link.reply(self.resume_id)
        if reply is not None and reply.get("gen") == gen:
            self.resume_gen, self.resume_choice = gen, reply
            log.info("resume_agreed", node=self.name, generation=gen, choice=reply.get("choice"))
            return True, reply.get("choice")
        if (
            self.resume_id is None
            or self.resume_sent_gen != gen
            or (self.link.failed(self.resume_id) and now - (self.resume_sent_at or now) >= FAILED_RETRY_S)
        ):
            offers = [own] if own and own.get("path") else []
            for name in present_nodes(self.link.view.nodes, -1):
                r = (self.link.view.nodes[name].get("record") or {}).get("resume")
                if isinstance(r, dict) and r.get("path") and isinstance(r.get("step"), int):
                    offers.append(r)
            best = max(offers, key=lambda r: r.get("step") or 0, default=None)
            self.resume_id = self.link.agree_resume(gen, {"path": best["path"], "step": best["step"]} if best else None)
            self.resume_sent_gen, self.resume_sent_at = gen, now
        return False, None

    def resume_point(self, own: Optional[dict], now: float) -> tuple[bool, str]:
        settled, agreed = self.agreed_resume(own, now)
        return settled, (agreed or {}).get("path") or ""

    def rdzv_id(self) -> str:
        return rdzv_id_for(self.cfg.rdzv_id, self.gen or 0)

    # ---- an attempt

    def spawned(self, attempt: int, now: float) -> None:
        self.attempt_number = attempt
        self.attempt_gen = self.gen or 0
        self.wait = Wait(now, time.time(), self.attempt_gen)
        self.bump_id = None
        self.outage = None
        self.victims_since = None
        self.rounds = {}
        self.link.status(state="rendezvous", gen=self.attempt_gen, attempt=attempt)
        log.info("rendezvous", node=self.name, rdzv_id=self.rdzv_id(), endpoint=self.endpoint, nnodes=self.cfg.nnodes)

    def rank_started(self, rec: dict, now: float, attempt: int) -> Optional[str]:
        """A `start` beat: the rendezvous is over; a new torchrun round is noted (not a fault).  Returns a note
        for the log when this start is torchrun's restart of a rank within the attempt."""
        note = None
        if self.wait is not None:
            self.wait = None
            self.link.status(state="running", gen=self.attempt_gen, attempt=attempt)
        info = rec.get("torchrun") or {}
        rank, count = rec.get("rank"), info.get("restart_count")
        if isinstance(rank, int) and isinstance(count, int):
            before = self.rounds.get(rank)
            self.rounds[rank] = count
            if before is not None and count > before:
                self.round_changes += 1
                note = f"torchrun restarted rank {rank} within attempt {attempt} (round {count + 1}); not a fault"
        return note

    def overdue(self, attempt, expired, now: float) -> bool:
        """Whether a deadline that fired is not a stall on a multi-node run (True: the deadlines were re-armed):
        * torchrun (`worker.max_restarts`) ended the rank and starts a new rendezvous round by itself: like a new
          start, the startup deadline from when every node is back, the lost-peer report before;
        * the startup deadline while peers are missing at the rendezvous: ranks start only once every node is
          there, waiting for peers is `rdzv_timeout_s`'s business, and the startup deadline counts from then;
        * the `exit` deadline once every local rank has exited while torchrun lives: its agent waits for the other
          nodes at torchrun's exit barrier (`EXIT_BARRIER_S`), once per attempt; still there after it, it is killed."""
        if self.between_rounds(attempt, expired, self.table):
            log.info(
                "torchrun_round_gap",
                attempt=attempt.number,
                rank=expired.rank,
                deadline=expired.name,
                note="the rank's process is gone while torchrun lives: a new round of the same attempt",
            )
            self.deadlines.arm_startup(now)
            self.round_wait(now)
            return True
        if expired.name == "exit" and self.barrier_excused != attempt.number and at_exit_barrier(attempt, self.table):
            # Every local rank said it was done and has exited; torchrun's agent waits for the other nodes' agents
            # (a peer's rank 0 still saving the final weights): torchrun's business, for its barrier's time.
            self.barrier_excused = attempt.number
            wait_s = EXIT_BARRIER_S + EXIT_BARRIER_MARGIN_S
            self.deadlines.arm_extra("exit", now, wait_s, "torchrun's exit barrier")
            log.info(
                "torchrun_exit_barrier",
                attempt=attempt.number,
                node=self.name,
                pid=attempt.worker.pid,
                wait_s=wait_s,
                note="every local rank has exited; torchrun waits for the other nodes at its exit barrier",
            )
            return True
        if expired.name != "startup" or self.wait is None:
            return False
        if not self.all_present():
            self.deadlines.arm_startup(now)
            return True
        if not self.wait.startup_armed:
            self.wait.startup_armed = True
            self.deadlines.arm_startup(now)
            return True
        return False

    def between_rounds(self, attempt, expired, table) -> bool:
        """A rank's deadline fired, but torchrun (allowed `max_restarts`) ended that rank's process and lives on:
        it is between rendezvous rounds of the same attempt."""
        if self.cfg.max_restarts <= 0 or attempt is None or attempt.worker.exited or expired.rank is None:
            return False
        a = attempt.announced.get(expired.rank)
        return a is not None and a.ref is not None and table.is_gone(a.ref)

    def round_wait(self, now: float) -> None:
        """torchrun rendezvouses again within the attempt: a wait like the first one (lost peers are reported)."""
        if self.wait is None:
            self.wait = Wait(now, time.time(), self.attempt_gen or 0)
            self.link.status(state="rendezvous")

    def waiting(self) -> bool:
        return self.wait is not None

    def peer_restart(self) -> Optional[tuple[int, dict]]:
        """A generation newer than this attempt's, made by a peer: (generation, its notice)."""
        v = self.link.view
        if self.attempt_gen is None or v.gen is None or v.gen <= self.attempt_gen:
            return None
        notice = v.notices.get(v.gen) or {"node": "?", "summary": "no notice in the store"}
        if notice.get("node") == self.name and self.bump_id is not None:
            return None  # our own bump: this node is already restarting
        return v.gen, notice

    def store_lost(self) -> Optional[str]:
        """The store went away during the current attempt (or is away now)."""
        v = self.link.view
        return self.outage or (None if v.store_ok or v.store_lost_at is None else (v.store_error or "unreachable"))

    # ---- failures

    def local_failure(self, kind: str, summary: str, *, step=None, rank=None, now: Optional[float] = None) -> None:
        """This node restarts for a reason of its own: tell the peers first (one bump per episode)."""
        if self.bump_id is not None or self.attempt_gen is None:
            return
        self.bump_sent_at = now
        notice = {
            "node": self.name,
            "kind": kind,
            "summary": summary,
            "step": step,
            "rank": rank,
            "time": time.time(),
            "from_gen": self.attempt_gen,
        }
        self.bump_id = self.link.bump(self.attempt_gen, notice)
        log.info("peers_notified", node=self.name, from_gen=self.attempt_gen, kind=kind, summary=summary)

    def await_notice(self, incident, now: float) -> None:
        """A victims-only incident written before any peer said why it restarted: amended when it does
        (`late_notice`), for up to LATE_NOTICE_S; meanwhile this node gives the culprit's node PEER_GRACE_S to
        bump the generation before it does (`ready_for_attempt`)."""
        self.awaiting_notice = (incident, self.attempt_gen, now)
        self.victims_since = now

    def late_notice(self, now: float) -> Optional[tuple]:
        """(incident, notice) once a peer's notice of a generation after the victims' attempt arrived; None
        meanwhile."""
        if self.awaiting_notice is None:
            return None
        inc, gen, since = self.awaiting_notice
        v = self.link.view
        for g in sorted(x for x in v.notices if gen is not None and x > gen):
            if v.notices[g].get("node") != self.name:
                self.awaiting_notice = None
                return inc, {**v.notices[g], "gen": g}
        if now - since > LATE_NOTICE_S:
            self.awaiting_notice = None
        return None

    def bump_won(self) -> Optional[bool]:
        r = self.link.reply(self.bump_id)
        return None if r is None else bool(r.get("mine"))

    def newer_notice(self) -> Optional[dict]:
        """A peer's notice of a generation newer than this attempt's, if any."""
        v = self.link.view
        if self.attempt_gen is None:
            return None
        for gen in sorted(g for g in v.notices if g > self.attempt_gen):
            n = v.notices[gen]
            if n.get("node") != self.name:
                return {**n, "gen": gen}
        return None

    # ---- the end

    def ended(self, state: str, why: str) -> None:
        """This supervisor reached a final state: its record says so (the helper writes it before it quits)."""
        self.link.status(state=state, why=why)

    def failed_peer(self) -> Optional[str]:
        """A peer whose supervisor ended `failed` (its own crash loop, no progress, a do-not-restart exit): the run
        cannot go on without it."""
        for name, info in sorted(self.link.view.nodes.items()):
            rec = info.get("record") or {}
            if name != self.name and rec.get("state") == "failed":
                return f"peer node {name} failed: {rec.get('why') or 'no reason given'}"
        return None

    # ---- the rendezvous wait

    def overdue_wait(self, now: float) -> Optional[str]:
        """The words of the `lost_peer` incident when this node has waited at the rendezvous (or for the store)
        longer than `rdzv_timeout_s` with peers missing; once per wait."""
        w = self.wait if self.wait is not None else self.store_wait
        if w is None or w.reported or now - w.since < self.cfg.rdzv_timeout_s:
            return None
        v = self.link.view
        if self.wait is None:
            w.reported = True
            return (
                f"waiting for the rendezvous store at {self.endpoint} since "
                f"{time.strftime('%H:%M:%S', time.localtime(w.since_wall))}: {v.store_error or 'unreachable'}"
            )
        present = present_nodes(v.nodes, w.gen)
        if len(present) >= self.cfg.nnodes:
            return None  # everyone is here: torchrun's own rendezvous is what is slow
        w.reported = True
        return missing_words(
            self.cfg.nnodes,
            present,
            v.nodes,
            w.since_wall,
            f"{rdzv_id_for(self.cfg.rdzv_id, w.gen)} at {self.endpoint}",
        )

    def all_present(self) -> bool:
        w = self.wait
        return w is not None and len(present_nodes(self.link.view.nodes, w.gen)) >= self.cfg.nnodes

    def next_due_s(self, now: float) -> Optional[float]:
        due = [self.link.next_due_s(now)]
        for w in (self.wait, self.store_wait):
            if w is not None and not w.reported:
                due.append(max(0.0, w.since + self.cfg.rdzv_timeout_s - now))
        if self.victims_since is not None:
            due.append(max(0.0, self.victims_since + PEER_GRACE_S - now))
        if self.wait is not None or self.attempt_gen is not None:
            due.append(0.5)  # a peer's notice arrives through the link's poke; this only bounds a lost one
        due = [d for d in due if d is not None]
        return min(due) if due else None

    # ---- what the loop asks at each turn of an attempt (the `Nodes` seam)

    def while_running(self, attempt, now: float) -> Optional[str]:
        late = self.late_notice(now)
        if late is not None:
            amend_late(self.incidents, *late)
        words = self.overdue_wait(now)
        if words:
            lost_peer_incident(self.incidents, self.facts(), self, self.attempt_number, words)
        return self.failed_peer()

    def stall_read(self, ep, attempt, now: float) -> None:
        """A stall's dumps are read: the incident says what the local ranks and the peers say; the peers hear
        of it before anything is killed, so a peer whose ranks break when ours go already knows why."""
        amend_stall(ep, attempt, self.name, ep.peer_notice or self.newer_notice(), now)
        # Only victims here: leave the bump to the culprit's node (its notice names the culprit); if nobody
        # bumps, this node does when it restarts (`ready_for_attempt`).  Local ranks that had all finished their
        # work and only hung on the way out (`work_done`): this node finishes, the peers go on undisturbed.
        if ep.kind != "peer_restart" and ep.own_culprit is not False and ep.work_done is None:
            inc = ep.incident
            self.local_failure(
                ep.kind or "stall",
                inc.data.get("summary") if inc else ep.reason,
                step=inc.data.get("step") if inc else None,
                rank=inc.data.get("culprit_rank") if inc else None,
            )

    def exit_cause(self, attempt, code: Optional[int], stop_reason: Optional[str]) -> Optional[Decision]:
        """A worker exit that is not this node's failure (`peer_cause`): a restart at once that leaves the restart
        budget alone.  None: the policy decides (a finish, a do-not-restart code, this node's own failure)."""
        if (code == 0 and stop_reason in FINISH_REASONS) or code in NO_RESTART_CODES:
            return None
        if code == 0 and stop_reason == "terminated":  # no stop was asked here: a peer node's stop reached our ranks
            return Decision(
                "restart",
                f"the ranks stopped at a step boundary without a request on node {self.name} "
                "(a peer node was stopped); waiting for it at a new rendezvous (this node's restart budget "
                "is untouched)",
            )
        cause = peer_cause(exit_own_culprit(attempt), self.newer_notice(), None, self.store_lost())
        if cause is None:
            return None
        return Decision("restart", f"{cause}; not a failure of node {self.name} (its restart budget is untouched)")

    def exit_read(self, ep, decision: Decision, attempt, now: float) -> None:
        """After an exit: the incident says what the local ranks' last words and the peers say; a node that
        restarts for a reason of its own tells its peers."""
        own = exit_own_culprit(attempt)
        ep.own_culprit = own
        notice = self.newer_notice()
        amend_exit(
            ep, self.name, own, notice, None if own else (decision.reason if decision.action == "restart" else None)
        )
        if notice is None and own is False and ep.incident is not None:
            self.await_notice(ep.incident, now)
        if decision.action != "finish" and notice is None and own is not False:
            self.local_failure(
                ep.kind or "exit",
                ep.incident.data.get("summary") if ep.incident else ep.reason,
                step=ep.incident.data.get("step") if ep.incident else None,
            )

    def decision(self, attempt, ep, decision, now: float) -> Optional[Answer]:
        """A stall's end with nothing decided: free when the evidence puts the culprit elsewhere (`peer_cause`); the
        peer's notice and, with only victims here, the victim's kind for the incident."""
        if decision is not None or not ep.kind:
            return None
        notice = ep.peer_notice or self.newer_notice()
        cause = peer_cause(ep.own_culprit, notice, self.bump_won(), self.store_lost())
        if ep.kind == "peer_restart" and ep.peer_notice is not None:
            cause = f"peer node {ep.peer_notice.get('node')} restarted"  # the peer's doing, whatever ours were in
        inc = ep.incident
        fields: dict = {}
        kind = None
        if inc is not None and notice is not None and "peer_notice" not in inc.data:
            fields["peer_notice"] = notice
            if not ep.own_culprit:
                fields["summary"] = f"{peer_words(notice)}; {inc.data.get('summary')}"
        if inc is not None and notice is not None and ep.own_culprit is False and inc.kind != "peer_restart":
            # Only victims here, and a peer said it restarted: this node's incident is a victim's, whichever
            # deadline fired first (they tie).
            kind = "peer_restart"
        decision = None
        if cause is not None:
            decision = Decision(
                "restart", f"{cause}; not a failure of node {self.name} (its restart budget is untouched)"
            )
        if inc is not None and notice is None and ep.own_culprit is False:
            self.await_notice(inc, now)  # the culprit's node may say why a moment later: the incident is amended then
        return Answer(decision, fields, kind=kind)

    def status(self) -> dict:
        v = self.link.view
        return {
            "node": self.name,
            "nnodes": self.cfg.nnodes,
            "endpoint": self.endpoint,
            "generation": v.gen,
            "attempt_generation": self.attempt_gen,
            "store": "ok" if v.store_ok else (v.store_error or "not reached"),
            "store_role": v.role,
            "rdzv_id": rdzv_id_for(self.cfg.rdzv_id, self.attempt_gen or 0),
            "waiting_since": self.wait.since_wall if self.wait else None,
            "torchrun_rounds": dict(sorted(self.rounds.items())),
            "torchrun_round_changes": self.round_changes,
            "peers": {
                name: {
                    "age_s": info.get("age_s"),
                    **{k: (info.get("record") or {}).get(k) for k in ("state", "gen", "attempt")},
                }
                for name, info in sorted(v.nodes.items())
            },
        }


# ---- pure rules, from what the peer link saw (no state, no I/O)

STALE_S = 3.0  # a node whose record has not changed for this long is not present (the helper writes it every 0.5 s)


def present_nodes(nodes: dict, gen: int, stale_s: float = STALE_S) -> list[str]:
    """The nodes alive (their record changed within `stale_s`) whose attempt runs in generation `gen` or later."""
    out = []
    for name, info in nodes.items():
        rec = info.get("record") or {}
        age = info.get("age_s")
        if isinstance(age, (int, float)) and age < stale_s and isinstance(rec.get("gen"), int) and rec["gen"] >= gen:
            out.append(name)
    return sorted(out)


def missing_words(
    nnodes: int, present: list[str], nodes: dict, since_wall: float, where: str, stale_s: float = STALE_S
) -> str:
    """ "waiting for 1 of 2 nodes at the rendezvous since 10:02:03 (…); missing: b (last seen 4.1 s ago, gen 2)"."""
    absent = nnodes - len(present)
    since = time.strftime("%H:%M:%S", time.localtime(since_wall))
    gone = []
    for name, info in sorted(nodes.items()):
        if name in present:
            continue
        rec = info.get("record") or {}
        age = info.get("age_s")
        seen = f"last seen {age:.1f} s ago" if isinstance(age, (int, float)) else "never seen"
        gone.append(f"{name} ({seen}, generation {rec.get('gen')}, state {rec.get('state')})")
    never = absent - len(gone)
    tail = "; missing: " + ", ".join(gone) if gone else ""
    if never > 0:
        tail += f"{'; ' if not gone else ', and '}{never} node(s) never seen at this store"
    return f"waiting for {absent} of {nnodes} nodes at the rendezvous since {since} ({where}){tail}"


def peer_cause(
    own_culprit: Optional[bool],
    peer_notice: Optional[dict],
    own_bump_won: Optional[bool],
    store_lost: Optional[str] = None,
) -> Optional[str]:
    """Why an attempt's end is not this node's fault, or None when it counts against this node's budget.

    `own_culprit`: the node's own ranks hold the culprit (True), only victims — waiting in, or broken out
    of, a collective — (False), or the evidence cannot tell (None).  `peer_notice`: a peer's notice of a
    restart newer than this attempt.  `own_bump_won`: this node's bump made the new generation.  `store_lost`: the
    rendezvous store went away during the attempt (its host node was lost), which ends every node's torchrun."""
    if own_culprit:
        return None
    if peer_notice is not None and not own_bump_won:
        return f"peer node {peer_notice.get('node')} restarted first"
    if own_culprit is False:
        return "local ranks were only waiting for their peers (victims)"
    if store_lost:
        return f"the rendezvous store was lost ({store_lost})"
    return None


def at_exit_barrier(attempt: Attempt, table: ProcessTable) -> bool:
    """torchrun's agent outlived every rank it announced: all its local ranks' processes are gone (what torchrun's
    exit barrier looks like from this node; a rank that is still there is a rank that hangs on its way out)."""
    refs = [a.ref for a in attempt.announced.values()]
    return bool(refs) and all(ref is not None and table.is_gone(ref) for ref in refs)
