"""The supervisor's end of the peer link: the helper process that talks to the rendezvous store for it.

A multi-node run (`worker.nnodes` > 1) has one supervisor per node, and they coordinate through the
c10d store torchrun's rendezvous uses (`worker.rdzv_endpoint`).  The supervisor never imports torch, so
a small helper (`python -m hangwatch.daemon.peerlink`) holds the store — hosting it when the endpoint is
this machine's, so it outlives torchrun's restarts — and speaks JSON lines on its stdin/stdout:

    events  store (reachable or not), gen (the generation and the notice of whoever bumped it), peers
            (every node's record and how long since it last changed), bumped / resume (replies)
    orders  status (this node's record), bump (from generation G, with a notice), agree_resume, quit

A reader thread only queues the helper's lines and pokes the loop (`poke`); the loop takes them in its
drain step (`poll`), so the loop itself never blocks on the helper or the network.  A helper that dies is
started again (after RESPAWN_S); what it said stays the view until the new one speaks.

`LinkView` is what the helper said last; `PeerLink` keeps it and sends orders.  The decisions made from
it are `nodes.multi_node`.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

log = structlog.get_logger("hangwatch")

RESPAWN_S = 1.0  # a helper that died is started again after this long (it only holds a store connection) …
RESPAWN_MAX_S = 30.0  # … doubling while it keeps dying young (a broken environment), up to this
HEALTHY_S = 30.0  # a helper that lived this long died of something else: the delay starts over
HELPER_LOG_NAME = "peerlink.log"


@dataclass
class LinkView:
    """What the helper said last."""

    store_ok: bool = False
    store_error: Optional[str] = None
    role: Optional[str] = None  # "host" or "client"
    gen: Optional[int] = None  # the store's generation; None until the store was reached once
    notices: dict[int, dict] = field(default_factory=dict)  # generation → the notice of the bump that made it
    nodes: dict[str, dict] = field(default_factory=dict)  # node → {"age_s": s, "record": {...}}
    replies: dict[str, dict] = field(default_factory=dict)  # order id → its reply
    store_lost_at: Optional[float] = None  # when the store became unreachable (monotonic), while it is
    failed: set = field(default_factory=set)  # ids of orders the helper could not carry out

    def take(self, msg: dict, now: float) -> Optional[str]:
        """Fold one event in; returns its kind (or None when it is not one)."""
        ev = msg.get("ev")
        if ev == "store":
            ok = bool(msg.get("ok"))
            if ok:
                self.store_lost_at = None
                self.role = msg.get("role")
                self.store_error = None
            elif self.store_lost_at is None:
                self.store_lost_at = now
            if not ok:
                self.store_error = str(msg.get("error") or "unreachable")
            self.store_ok = ok
        elif ev == "gen" and isinstance(msg.get("gen"), int):
            self.gen = msg["gen"] if self.gen is None else max(self.gen, msg["gen"])
            if isinstance(msg.get("notice"), dict):
                self.notices[msg["gen"]] = msg["notice"]
        elif ev == "peers" and isinstance(msg.get("nodes"), dict):
            self.nodes = {str(k): v for k, v in msg["nodes"].items() if isinstance(v, dict)}
        elif ev in ("bumped", "resume") and msg.get("id") is not None:
            self.replies[str(msg["id"])] = msg
            if ev == "bumped" and isinstance(msg.get("gen"), int):
                self.gen = msg["gen"] if self.gen is None else max(self.gen, msg["gen"])
                if isinstance(msg.get("notice"), dict):
                    self.notices[msg["gen"]] = msg["notice"]
        elif ev == "error":
            if msg.get("id") is not None:  # an order that could not be carried out (no store): sent again later
                self.failed.add(str(msg["id"]))
            log.warning("peerlink_error", error=msg.get("error"), order=msg.get("id"))
        else:
            return None
        return ev


SpawnHelper = Callable[[list, Path], Any]  # (argv, log path) → a Popen-like object with stdin/stdout/poll/kill/wait


def spawn_helper(argv: list, log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as err:
        return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, close_fds=True)


def helper_argv(endpoint: str, rdzv_id: str, node: str, nnodes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "hangwatch.daemon.peerlink",
        "--endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--node",
        node,
        "--nnodes",
        str(nnodes),
    ]


class PeerLink:
    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        *,
        spawn: SpawnHelper = spawn_helper,
        poke: Callable[[], None] = lambda: None,
    ):
        self.argv = argv
        self.log_path = log_path
        self._spawn = spawn
        self.poke = poke
        self.view = LinkView()
        self._proc: Any = None
        self._lines: deque = deque()
        self._ids = itertools.count(1)
        self._died_at: Optional[float] = None
        self._started_at: Optional[float] = None
        self._respawn_s = RESPAWN_S
        self._record: dict = {}
        self._sent_record = False
        self.starts = 0

    # ---- the helper process

    def start(self, now: float) -> None:
        try:
            self._proc = self._spawn(self.argv, self.log_path)
        except OSError as exc:
            self._proc, self._died_at = None, now
            log.error("peerlink_spawn_failed", error=str(exc), argv=self.argv)
            return
        self.starts += 1
        self._died_at, self._started_at = None, now
        out = getattr(self._proc, "stdout", None)
        if out is not None:
            threading.Thread(target=self._reader, args=(out,), name="peerlink-reader", daemon=True).start()
        log.info("peerlink_started", pid=getattr(self._proc, "pid", None), argv=self.argv, log=str(self.log_path))
        if self._record:
            self.send({"op": "status", "record": self._record})

    def _reader(self, out) -> None:
        """Off the loop: queue each line, wake the loop.  Ends at EOF (the helper exited)."""
        for raw in iter(out.readline, b""):
            self.feed(raw)
        self.feed(None)  # EOF marker

    def feed(self, raw: Optional[bytes]) -> None:
        """One line from the helper (None: its EOF), for the next `poll`; wakes the loop."""
        self._lines.append(raw)
        self.poke()

    def poll(self, now: float) -> list[str]:
        """Take the queued lines into the view; start a helper that died again.  Returns the event kinds seen."""
        kinds = []
        while self._lines:
            raw = self._lines.popleft()
            if raw is None:
                continue
            try:
                msg = json.loads(raw)
            except ValueError:
                log.warning("peerlink_garbled", line=raw[:200].decode("utf-8", "replace"))
                continue
            if isinstance(msg, dict):
                kind = self.view.take(msg, now)
                if kind:
                    kinds.append(kind)
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            young = self._started_at is not None and now - self._started_at < HEALTHY_S
            self._respawn_s = min(RESPAWN_MAX_S, self._respawn_s * 2) if young and self.starts > 1 else RESPAWN_S
            log.warning("peerlink_exited", code=proc.returncode, log=str(self.log_path), restart_in_s=self._respawn_s)
            self._proc, self._died_at = None, now
            if self.view.store_lost_at is None:
                self.view.store_lost_at = now
            self.view.store_ok, self.view.store_error = False, f"the peer-link helper exited ({proc.returncode})"
        if self._proc is None and self._died_at is not None and now - self._died_at >= self._respawn_s:
            self.start(now)
        return kinds

    def next_due_s(self, now: float) -> Optional[float]:
        """When a dead helper is due to be started again (for the loop's wait)."""
        if self._proc is None and self._died_at is not None:
            return max(0.0, self._died_at + self._respawn_s - now)
        return None

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.send_to(proc, {"op": "quit"})
        try:
            proc.wait(timeout=2)
        except Exception:
            try:
                proc.kill()
                proc.wait(timeout=2)
            except Exception:
                pass

    # ---- orders

    def send(self, msg: dict) -> bool:
        return self.send_to(self._proc, msg)

    @staticmethod
    def send_to(proc, msg: dict) -> bool:
        if proc is None or getattr(proc, "stdin", None) is None:
            return False
        try:
            proc.stdin.write((json.dumps(msg, default=str) + "\n").encode())
            proc.stdin.flush()
            return True
        except (OSError, ValueError):  # the helper is gone: poll starts another
            return False

    def status(self, **record: Any) -> None:
        """This node's record in the store (what its peers see): merged over the last one; sent when it changed."""
        merged = {**self._record, **record}
        if merged == self._record and self._sent_record:
            return
        self._record = merged
        self._sent_record = self.send({"op": "status", "record": self._record})

    def bump(self, from_gen: int, notice: dict) -> str:
        oid = f"b{next(self._ids)}"
        self.send({"op": "bump", "id": oid, "from": from_gen, "notice": notice})
        return oid

    def agree_resume(self, gen: int, proposal: Optional[dict]) -> str:
        oid = f"r{next(self._ids)}"
        self.send({"op": "agree_resume", "id": oid, "gen": gen, "proposal": proposal})
        return oid

    def reply(self, oid: Optional[str]) -> Optional[dict]:
        return self.view.replies.get(oid) if oid else None

    def failed(self, oid: Optional[str]) -> bool:
        return bool(oid) and oid in self.view.failed

    @property
    def pid(self) -> Optional[int]:
        return getattr(self._proc, "pid", None)


def default_node_name(run_dir: Path) -> str:
    """`<hostname>:<run dir>`: unique per node however the nodes are laid out (the same config on every machine, or
    two nodes sharing a host with run dirs of the same name), and it says where that node's incidents are."""
    import socket

    return f"{socket.gethostname()}:{Path(run_dir).resolve()}"
