"""What a multi-node incident says about this node's own ranks and about its peers — from local evidence only.

Each node sees only its own ranks.  After the dumps of a stall (its own deadline, or a peer's restart), every
local rank is read on its own (`verdict.read_rank`: process state, CPU, the collective its stack waits in):

    all waiting in a collective   → no culprit here: "local ranks were waiting in all_reduce (rank 0)"
    one (or the verdict's) outside → the culprit is here: "rank 1 (on node b) is the culprit: busy loop …"
    no stack to tell               → "cannot tell" (the evidence does not say)
    probably waiting               → "cannot tell" either: a rank idle in backward() without a C stack probably
                                     waits in DDP's all-reduce for a peer (`verdict.read_rank`), never the culprit

`own_culprit` (True / False / None) is what `nodes.peer_cause` weighs for the restart budget.  After a
worker exit the ranks' last words decide: only collective errors (a peer went away mid-collective) are
victims.  The words of a peer's notice are quoted as the peer wrote them, never re-judged here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import structlog

from hangwatch.supervisor.escalation import rank_evidence
from hangwatch.supervisor.escalation.episode import own_failure, rank_last_words
from hangwatch.supervisor.incidents.verdict import CULPRIT, decide, read_rank

if TYPE_CHECKING:
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.processes.attempt import Attempt

log = structlog.get_logger("hangwatch")


def local_findings(evidence: list, landmarks: tuple = ()) -> tuple[list, Optional[int]]:
    """Each local rank read on its own, and the culprit the verdict over them names outside any collective (None
    when it names none, or only one that waits and is behind: that says nothing of the node's ranks alone)."""
    findings = [read_rank(e, landmarks) for e in evidence]
    verdict = decide(evidence, landmarks) if len(evidence) > 1 else None
    culprit = (
        verdict.culprit_rank
        if verdict is not None and any(f.role == CULPRIT and f.collective is None for f in verdict.ranks)
        else None
    )
    return findings, culprit


def local_reading(findings: list, verdict_culprit: Optional[int]) -> tuple[Optional[bool], str, Optional[int]]:
    """(own_culprit, words, culprit rank) from the local ranks' findings."""
    if not findings:
        return None, "no local rank had announced itself", None
    waiting = [f for f in findings if f.collective is not None]
    if len(waiting) == len(findings):
        groups: dict[str, list[int]] = {}
        for f in waiting:
            groups.setdefault(f.collective, []).append(f.rank)
        what = "; ".join(
            f"{c} ({'ranks' if len(rs) > 1 else 'rank'} {', '.join(map(str, sorted(rs)))})" for c, rs in groups.items()
        )
        return False, f"local ranks were waiting in {what}", None
    outside = [f for f in findings if not f.waits and (f.has_stack or f.condition in ("gone", "io", "stopped", "busy"))]
    if verdict_culprit is not None:
        culprit = next(f for f in findings if f.rank == verdict_culprit)
    elif len(outside) == 1 and sum(not f.waits for f in findings) == 1:
        culprit = outside[0]
    else:
        return (
            None,
            "cannot tell from the local evidence: "
            + "; ".join(f"rank {f.rank}: {f.words}" + ("" if f.has_stack else " (no stack)") for f in findings),
            None,
        )
    return True, f"rank {culprit.rank}: {culprit.words}", culprit.rank


def amend_stall(ep: "Episode", attempt: "Attempt", node: str, notice: Optional[dict], now: float) -> None:
    """After a stall's (or a peer restart's) dumps: say what the local ranks were doing, and what the peer said."""
    inc = ep.incident
    if inc is None or ep.dumps is None:
        return
    texts, spy = ep.dumps.texts(), ep.dumps.py_spy_texts()
    evidence = rank_evidence.gather(attempt, ep.deadlines, ep.procs, texts, spy, {}, now)
    findings, culprit = local_findings(evidence, ep.landmarks)
    own, words, rank = local_reading(findings, culprit)
    ep.own_culprit = own
    fields = {"node": node, "own_culprit": own, "local_ranks": [f.as_dict() for f in findings], "local_reading": words}
    if ep.kind == "peer_restart" and notice is not None:
        summary = f"{peer_words(notice)}; " + (words if own is False else f"local {words}")
    elif own is False:
        summary = (
            f"{peer_words(notice)}; {words}"
            if notice
            else f"no culprit on node {node}: {words}; the culprit is on another node"
        ) + f"; {ep.reason}"
    elif own:
        summary = f"{words.replace(':', ' is the culprit:', 1)} (node {node}); {ep.reason}"
        fields["culprit_rank"] = rank
    else:
        summary = f"{inc.data.get('summary')}; {words}"
    if notice is not None:
        fields["peer_notice"] = notice
    ep.amend({**fields, "summary": summary})


def exit_own_culprit(attempt: "Attempt") -> Optional[bool]:
    """After an exit: True when a local rank failed by itself, False when every local rank's last words are a
    broken collective (a peer went away), None without last words."""
    words = rank_last_words(attempt)
    if not words:
        return None
    return own_failure(words) is not None


def amend_exit(ep: "Episode", node: str, own: Optional[bool], notice: Optional[dict], cause: Optional[str]) -> None:
    inc = ep.incident
    if inc is None:
        return
    fields: dict = {"node": node, "own_culprit": own}
    summary = inc.data.get("summary") or ep.reason
    if notice is not None:
        fields["peer_notice"] = notice
        if not own:
            summary = f"{peer_words(notice)}; local ranks: {summary}"
    elif cause and not own:
        summary = f"{cause}; {summary}"
    ep.amend({**fields, "summary": summary})


def amend_late(store, inc, notice: dict) -> None:
    """A victims' incident, written before the peer said why it restarted: now it says, and is the peer's restart."""
    if "peer_notice" in inc.data:
        return
    if inc.kind != "peer_restart":
        inc.rekind("peer_restart")
    store.amend(inc, peer_notice=notice, summary=f"{peer_words(notice)}; {inc.data.get('summary')}")
    log.info(
        "incident_amended", incident=inc.id, peer=notice.get("node"), why="the peer's notice came after the incident"
    )


def peer_words(notice: dict) -> str:
    """ "peer node b restarted (stall: rank 1 is the culprit: busy loop …)"."""
    what = notice.get("summary") or notice.get("kind") or "no reason given"
    return f"peer node {notice.get('node')} restarted ({what})"


def lost_peer_incident(incidents, facts, nodes, attempt: int, words: str) -> None:
    """This node waited at the rendezvous past `worker.rdzv_timeout_s` with peers missing: the `lost_peer`
    incident, and the `peer_lost` event the alerts listen for.  The node keeps waiting."""
    inc = incidents.open_for_run(
        "lost_peer",
        facts,
        attempt=attempt,
        summary=words,
        classification=words,
        status="waiting",
        node=nodes.name,
        nodes=nodes.status(),
    )
    log.error("peer_lost", incident=inc.id, node=nodes.name, why=words, reason=words, attempt=attempt)
