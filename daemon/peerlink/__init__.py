"""The peer link: the torch-side helper through which the supervisors of a multi-node job agree.

    python -m hangwatch.daemon.peerlink --endpoint HOST:PORT --rdzv-id ID --node NAME --nnodes N
            [--host auto|always|never] [--beat-s 0.5] [--connect-timeout-s 2.0]

The supervisor never imports torch; it spawns this helper, writes commands to its stdin and reads events
from its stdout (one JSON object per line each way).  The helper talks to the `torch.distributed.TCPStore`
at the rendezvous endpoint — the store torchrun's c10d rendezvous uses too (torchrun runs with
`is_host=false`; a helper on the endpoint's machine hosts the store, so it outlives torchrun's restarts).

Keys, all under `hangwatch/<rdzv_id>/`:
    gen            the generation (decimal); bumped once per coordinated restart, never goes backwards
    bump/<G>       the claim that decides who bumps G → G+1: {"by","pid","id","nonce","notice"}
    notice/<G>     the notice of the bump that made generation G
    members        JSON list of every node that ever joined
    node/<NAME>    {"seq","node","pid","host", ...the last `status` record}, written every beat
    resume/<G>     {"path","step","by"}: the resume point agreed for generation G (first proposal wins)

TCPStore.compare_set, as found on torch 2.13 (libuv server):
    key missing, expected ""      → sets desired, returns desired
    key missing, expected != ""   → sets nothing, returns *expected* (looks like success!)
    key present, current == exp.  → sets desired, returns desired
    key present, current != exp.  → sets nothing, returns current
So the return value cannot tell "I swapped G → G+1" from "someone else already did" (both return "G+1").
Every decision therefore goes through a key created from missing with expected "" and a value unique
to the proposer (node, pid, nonce): the value returned is the winner's, and it is ours only if we won.

A bump from G: claim `bump/<G>` (the claim carries the notice), then write `notice/<G+1>` from the
claim, then compare_set `gen` G → G+1.  Whoever sees a claim — the loser of the race, or any helper's
beat — finishes it the same way (idempotent writes of the same values), so a winner that dies between
its claim and the gen still moves the generation, and a reader that sees gen G+1 always finds its
notice already written.  A loser's notice is never written anywhere.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import time
import uuid
from typing import Any, Callable, Optional

Emit = Callable[[dict], None]


# ---------------------------------------------------------------- pure parts


def parse_endpoint(text: str) -> tuple[str, int]:
    """'HOST:PORT' or '[V6]:PORT' → (host, port); ValueError naming the value otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"endpoint {text!r}: write an IPv6 address as [ADDR]:PORT")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {text!r} is not HOST:PORT with a port in 1..65535")
    return host, int(port)


def is_local(host: str, hostname: str, local_addrs: set[str], resolved: list[str]) -> bool:
    """Is the endpoint's host this machine?  `resolved`: the addresses `host` resolves to."""
    if host.lower() in {"localhost", hostname.lower()}:
        return True
    for a in [host, *resolved]:
        try:
            ip = ipaddress.ip_address(a.split("%")[0])
        except ValueError:
            continue
        if (
            ip.is_loopback
            or str(ip) in local_addrs
            or (ip.version == 6 and ip.ipv4_mapped and str(ip.ipv4_mapped) in local_addrs)
        ):
            return True
    return False


class KV:
    """The store under our prefix; values are str.  Store errors propagate (the caller marks an outage)."""

    def __init__(self, store: Any, prefix: str):
        self.store, self.prefix = store, prefix

    def read(self, key: str) -> Optional[str]:
        k = self.prefix + key
        return self.store.get(k).decode() if self.store.check([k]) else None  # get on a missing key blocks

    def write(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)

    def cas(self, key: str, expected: str, desired: str) -> str:
        r = self.store.compare_set(self.prefix + key, expected, desired)
        return r.decode() if isinstance(r, bytes) else r


def create_once(kv: KV, key: str, value: str) -> str:
    """Create `key` = value unless it exists; the value it holds afterwards (ours iff we created it)."""
    return kv.cas(key, "", value)


def ensure_gen_at_least(kv: KV, floor: int) -> int:
    """Initialise `gen` (to `floor`) if missing, raise it to `floor` if lower; the store's gen after."""
    cur = int(create_once(kv, "gen", str(floor)))
    while cur < floor:  # compare_set's answer is the current value either way: loop until it is high enough
        cur = int(kv.cas("gen", str(cur), str(floor)))
    return cur


def join_members(kv: KV, node: str) -> list[str]:
    """Append `node` to `members` (compare_set retry loop); the list after."""
    members = json.loads(create_once(kv, "members", json.dumps([node])))
    while node not in members:
        members = json.loads(kv.cas("members", json.dumps(members), json.dumps(members + [node])))
    return members


def read_json(kv: KV, key: str) -> Any:
    raw = kv.read(key)
    return None if raw is None else json.loads(raw)


def finish_bump(kv: KV, g: int, claim: dict) -> int:
    """Complete the claimed bump g → g+1 (anyone may, any number of times); the store's gen after."""
    kv.write(f"notice/{g + 1}", json.dumps(claim.get("notice")))
    return int(kv.cas("gen", str(g), str(g + 1)))


def bump(kv: KV, g: int, notice: Any, me: dict) -> tuple[bool, int, Any]:
    """Bump from g if gen is still g: (mine, gen now, notice of gen now)."""
    cur = int(kv.read("gen") or 0)
    if cur == g:
        ours = json.dumps({**me, "nonce": uuid.uuid4().hex, "notice": notice})
        won = create_once(kv, f"bump/{g}", ours)
        cur = finish_bump(kv, g, json.loads(won))
        if cur == g + 1:
            return won == ours, cur, json.loads(won).get("notice")
    return False, cur, read_json(kv, f"notice/{cur}")


def roll_forward(kv: KV, g: int) -> int:
    """Finish a bump of g that was claimed but not completed (its claimer died); the gen after."""
    claim = read_json(kv, f"bump/{g}")
    return finish_bump(kv, g, claim) if claim is not None else g


def agree_resume(kv: KV, g: int, proposal: Optional[dict], node: str) -> dict:
    """First proposal for generation g wins; the winner {"path","step","by"}.  None proposes 'no checkpoint'."""
    p = proposal or {}
    ours = json.dumps({"path": p.get("path"), "step": p.get("step"), "by": node})
    return json.loads(create_once(kv, f"resume/{g}", ours))


class Pending(Exception):
    """Raised by a connect() whose attempt is still under way: not connected yet, nothing to report."""


class Ages:
    """Seconds since each node's `seq` was last seen to change, on our own monotonic clock."""

    def __init__(self, clock: Callable[[], float]):
        self.clock, self.seen = clock, {}  # node → (seq, when it changed, record)

    def saw(self, node: str, record: dict) -> None:
        seq = record.get("seq")
        old = self.seen.get(node)
        when = old[1] if old is not None and old[0] == seq else self.clock()
        self.seen[node] = (seq, when, record)

    def table(self, own: str, own_record: Optional[dict]) -> dict:
        now = self.clock()
        out = {n: {"age_s": round(max(0.0, now - t), 3), "record": r} for n, (_, t, r) in self.seen.items()}
        if own_record is not None:
            out[own] = {"age_s": 0.0, "record": own_record}
        return out


class Peerlink:
    """Everything but the process: commands in, events out, a store reached through `connect`.

    `connect()` returns (store, role) or raises (Pending: still trying); a store op that raises marks an
    outage, and every beat tries `connect` again until it works.  Commands that need the store while there is
    none are answered at once with an error (the supervisor retries)."""

    def __init__(
        self,
        rdzv_id: str,
        node: str,
        connect: Callable[[], tuple[Any, str]],
        emit: Emit,
        clock: Callable[[], float] = time.monotonic,
        endpoint: str = "",
        pid: Optional[int] = None,
        hostname: Optional[str] = None,
    ):
        self.prefix, self.node, self.endpoint = f"hangwatch/{rdzv_id}/", node, endpoint
        self.connect, self.emit = connect, emit
        self.pid = os.getpid() if pid is None else pid
        self.hostname = socket.gethostname() if hostname is None else hostname
        self.kv: Optional[KV] = None
        self.down = False  # an outage was reported and not yet over
        self.known_gen, self.known_notice = 0, None  # the highest generation seen and its notice (seed a new store)
        self.reported_gen: Optional[int] = None
        self.seq, self.extra, self.own_record = 0, {}, None
        self.ages = Ages(clock)

    # -- store state
    def outage(self, err: BaseException | str) -> None:
        self.kv = None
        if not self.down:
            self.down = True
            self.emit({"ev": "store", "ok": False, "error": str(err).splitlines()[0] if str(err) else repr(err)})

    def ensure(self, reconnect: bool = True) -> bool:
        if self.kv is not None:
            return True
        if not reconnect:
            return False
        try:
            store, role = self.connect()
        except Pending:
            return False
        except Exception as e:  # noqa: BLE001 — any failure to connect is an outage, retried next beat
            self.outage(e)
            return False
        try:
            kv = KV(store, self.prefix)
            gen = ensure_gen_at_least(kv, self.known_gen)
            self._restore_notice(kv, gen)
            join_members(kv, self.node)
            self.kv = kv
            self._write_record()
        except Exception as e:  # noqa: BLE001 — the new store failed at once: an outage too
            self.outage(e)
            return False
        self.down = False
        self.emit({"ev": "store", "ok": True, "role": role, "endpoint": self.endpoint})
        self.reported_gen = None  # a gen event after every (re)connect
        return self._store_op(lambda: self._see_gen(gen))

    def _store_op(self, fn: Callable[[], Any], reconnect: bool = True) -> Any:
        """Run fn on the store; on a store error report the outage and return False.  Only beats reconnect."""
        if not self.ensure(reconnect):
            return False
        try:
            return fn() or True
        except Exception as e:  # noqa: BLE001 — RuntimeError/DistStoreError/TimeoutError/OSError alike
            self.outage(e)
            return False

    def _restore_notice(self, kv: KV, gen: int) -> None:
        """A store re-hosted fresh knows the gen we seeded but not its notice: write the one we knew."""
        if gen == self.known_gen and self.known_notice is not None and kv.read(f"notice/{gen}") is None:
            kv.write(f"notice/{gen}", json.dumps(self.known_notice))

    def _see_gen(self, gen: int, notice: Any = ...) -> None:
        if gen != self.reported_gen:
            if notice is ...:
                notice = read_json(self.kv, f"notice/{gen}")
            self.reported_gen = gen
            if gen >= self.known_gen:
                self.known_gen, self.known_notice = gen, notice
            self.emit({"ev": "gen", "gen": gen, "notice": notice})

    def _write_record(self) -> None:
        self.seq += 1
        self.own_record = {**self.extra, "seq": self.seq, "node": self.node, "pid": self.pid, "host": self.hostname}
        self.kv.write(f"node/{self.node}", json.dumps(self.own_record))

    # -- the beat
    def beat(self) -> None:
        self._store_op(self._beat)
        self.emit({"ev": "peers", "nodes": self.ages.table(self.node, self.own_record)})

    def _beat(self) -> None:
        gen = roll_forward(self.kv, int(self.kv.read("gen") or 0))
        if gen < self.known_gen:  # a store re-hosted by a node that knew less: generations never go back
            gen = ensure_gen_at_least(self.kv, self.known_gen)
            self._restore_notice(self.kv, gen)
        self._see_gen(gen)
        self._write_record()
        for n in read_json(self.kv, "members") or []:
            if n != self.node and (rec := read_json(self.kv, f"node/{n}")) is not None:
                self.ages.saw(n, rec)

    # -- commands
    def handle(self, line: str) -> bool:
        """One command line; False when the helper should exit."""
        try:
            cmd = json.loads(line)
            if not isinstance(cmd, dict):
                raise ValueError("a command is a JSON object")
        except ValueError as e:
            self.emit({"ev": "error", "error": f"unparseable line: {e}", "line": line[:200]})
            return True
        op, cid = cmd.get("op"), cmd.get("id")
        try:
            if op == "quit":  # the supervisor ends: its last record (a final state) is written before leaving
                self._store_op(self._write_record, False)
                return False
            if op == "status":
                rec = cmd.get("record")
                if not isinstance(rec, dict):
                    raise KeyError("record (an object)")
                self.extra = rec
            elif op == "bump":
                g, notice = self._int(cmd, "from"), cmd.get("notice")
                self._need(cmd, "id")
                self._store_op(lambda: self._bump(cid, g, notice), False) or self._unavailable(op, cid)
            elif op == "agree_resume":
                g, proposal = self._int(cmd, "gen"), cmd.get("proposal")
                self._need(cmd, "id")
                if proposal is not None and not isinstance(proposal, dict):
                    raise KeyError("proposal (an object or null)")
                self._store_op(
                    lambda: self.emit(
                        {"ev": "resume", "id": cid, "gen": g, "choice": agree_resume(self.kv, g, proposal, self.node)}
                    ),
                    False,
                ) or self._unavailable(op, cid)
            else:
                self.emit({"ev": "error", "id": cid, "error": f"unknown op {op!r}"})
        except KeyError as e:
            self.emit({"ev": "error", "id": cid, "op": op, "error": f"missing or bad field {e.args[0]}"})
        return True

    def _bump(self, cid: Any, g: int, notice: Any) -> None:
        mine, gen, cur_notice = bump(self.kv, g, notice, {"by": self.node, "pid": self.pid, "id": cid})
        self.emit({"ev": "bumped", "id": cid, "from": g, "gen": gen, "mine": mine, "notice": cur_notice})
        self._see_gen(gen, cur_notice)

    def _unavailable(self, op: str, cid: Any) -> None:
        self.emit({"ev": "error", "id": cid, "op": op, "error": "store unavailable; retry"})

    @staticmethod
    def _need(cmd: dict, field: str) -> None:
        if field not in cmd:
            raise KeyError(field)

    @staticmethod
    def _int(cmd: dict, field: str) -> int:
        v = cmd.get(field)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise KeyError(f"{field} (a generation, an int >= 0)")
        return v


# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ()
