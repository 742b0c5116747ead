"""Pure rules of a multi-node run, from what the peer link saw: who is present, the words for who is missing, and
whether an attempt's end is this node's failure (`peer_cause`).  No state, no I/O; `nodes.Nodes` applies them."""
from __future__ import annotations

import time
from typing import Optional

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


def missing_words(nnodes: int, present: list[str], nodes: dict, since_wall: float, where: str,
                  stale_s: float = STALE_S) -> str:
    """"waiting for 1 of 2 nodes at the rendezvous since 10:02:03 (…); missing: b (last seen 4.1 s ago, gen 2)"."""
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


def peer_cause(own_culprit: Optional[bool], peer_notice: Optional[dict], own_bump_won: Optional[bool],
               store_lost: Optional[str] = None) -> Optional[str]:
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
