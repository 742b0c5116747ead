"""torch's NCCL flight recorder: switched on for every worker, dumped on a stall, decoded into the incident.

torch's ProcessGroupNCCL reads, from each rank's environment (names checked against torch 2.13):

    TORCH_NCCL_TRACE_BUFFER_SIZE     ring-buffer entries; > 0 also makes the rank create its dump pipe
                                     (alias TORCH_FR_BUFFER_SIZE, which wins for the buffer)
    TORCH_NCCL_DUMP_ON_TIMEOUT=1     the rank dumps by itself when its own collective timeout fires
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE  dump file prefix; torch appends the global rank: <prefix><rank>
                                     (alias TORCH_FR_DUMP_TEMP_FILE, which wins)
    TORCH_NCCL_DEBUG_INFO_PIPE_FILE  a FIFO stem: the rank makes <stem><rank>.pipe, opens it O_RDONLY|O_NONBLOCK
                                     and polls it from its monitor thread; anything written into it makes the
                                     rank dump — even while its main thread is stuck in a collective

The supervisor sets them unless the user did (`processes.attempt.flight_env`), both files in the attempt directory.  On
a stall (`FlightDumps`) it writes one byte into each rank's pipe — opened O_NONBLOCK, and only if it is
a FIFO: a missing pipe means the rank has no NCCL process group, so there is nothing to wait for —
then waits, within the stall's dump settle, for the dump files to appear and stop growing.  Each dump
is kept raw in the incident and decoded: a pickle of plain types (dicts, lists, tuples, strings,
numbers) read by an unpickler that refuses every global, so no class is ever instantiated; one that
cannot be decoded is kept raw and the incident says so.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hangwatch.supervisor.escalation.dump_collector import SETTLE_S
from hangwatch.supervisor.processes.attempt import FlightPaths

MAX_TRACE_BYTES = 64 << 20


def poke(pipe: Optional[Path]) -> str:
    """Ask one rank for a dump through its pipe, never blocking; the outcome in words ("triggered", …)."""
    if pipe is None:
        return "no dump pipe configured (TORCH_NCCL_DEBUG_INFO_PIPE_FILE unset)"
    try:
        if not stat.S_ISFIFO(os.lstat(pipe).st_mode):
            return f"not triggered: {pipe} is not a FIFO (left alone)"
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return "no dump pipe: this rank has no NCCL process group"
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody holds open for reading: the rank is gone or never polled it
            return "not triggered: nobody reads the dump pipe"
        return f"not triggered: {exc.strerror or exc}"
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):  # swapped after the check: still leave it alone
            return f"not triggered: {pipe} is not a FIFO (left alone)"
        os.write(fd, b"1")
        return "triggered"
    except BlockingIOError:
        return "triggered (the pipe was full: a dump request was already pending)"
    except OSError as exc:
        return f"not triggered: {exc.strerror or exc}"
    finally:
        os.close(fd)


def _signature(path: Path) -> Optional[tuple[int, int]]:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@dataclass
class FlightDumps:
    """One stall's flight-recorder dumps: triggered at once, settled like the stack dumps."""

    paths: FlightPaths
    ranks: list[int]
    status: dict[int, str] = field(default_factory=dict)  # rank → what poking its pipe did
    _before: dict[int, Optional[tuple]] = field(default_factory=dict)
    _seen: dict[int, Optional[tuple]] = field(default_factory=dict)
    _changed_at: float = 0.0

    def trigger(self, now: float) -> None:
        self._changed_at = now
        for rank in self.ranks:
            self._before[rank] = self._seen[rank] = _signature(self.paths.trace(rank))
            self.status[rank] = poke(self.paths.pipe(rank))

    def settled(self, now: float) -> bool:
        """Every triggered rank's dump has appeared and not changed for SETTLE_S."""
        triggered = [r for r in self.ranks if self.status.get(r, "").startswith("triggered")]
        if not triggered:
            return True  # no rank runs NCCL (gloo, CPU): nothing to wait for
        waiting = False
        for rank in triggered:
            sig = _signature(self.paths.trace(rank))
            if sig != self._seen[rank]:
                self._seen[rank], self._changed_at = sig, now
            if sig is None or sig == self._before[rank]:
                waiting = True
        return not waiting and now - self._changed_at >= SETTLE_S

    def collect(self, since_wall: Optional[float] = None) -> dict[int, dict]:
        """rank → {status, data (raw bytes or None), decoded summary}; a dump counts if written after the
        trigger (or, for an exit, after `since_wall`, the attempt's start)."""
        out = {}
        for rank in self.ranks:
            path = self.paths.trace(rank)
            sig = _signature(path)
            fresh = sig is not None and (
                sig != self._before.get(rank)
                if rank in self._before
                else since_wall is None or sig[1] / 1e9 >= since_wall
            )
            data = None
            if fresh:
                try:
                    with open(path, "rb") as f:
                        data = f.read(MAX_TRACE_BYTES)
                except OSError:
                    data = None
            entry = {"status": self.status.get(rank, "not triggered"), "data": data, "path": str(path)}
            if data is None:
                entry["summary"] = "no dump written"
            else:
                entry.update(summarize(decode(data)))
            out[rank] = entry
        return out


class DataOnlyUnpickler(pickle.Unpickler):
    """Refuses every global: only the pickle opcodes of plain data (dict, list, tuple, str, numbers, None) load."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refused global {module}.{name}: a flight-recorder dump holds plain data only")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("refused persistent id: a flight-recorder dump holds plain data only")


def decode(data: bytes) -> tuple[Optional[object], str]:
    """(the dump's object, "") or (None, why it could not be decoded)."""
    try:
        return DataOnlyUnpickler(io.BytesIO(data)).load(), ""
    except Exception as exc:  # any malformed or refused pickle: the raw bytes are kept either way
        return None, f"{type(exc).__name__}: {exc}"


def summarize(decoded: tuple[Optional[object], str]) -> dict:
    """A short account of one rank's dump: per process group the last collective enqueued and completed,
    and the oldest still pending; `last_enqueued` of the default group for the verdict."""
    obj, problem = decoded
    if not isinstance(obj, dict):
        why = problem or f"not a flight-recorder dump (a {type(obj).__name__})"
        return {"decoded": False, "summary": f"kept raw, could not be decoded: {why}", "last_enqueued": None}
    status = obj.get("pg_status") if isinstance(obj.get("pg_status"), dict) else {}
    entries = [e for e in obj.get("entries") or [] if isinstance(e, dict)]
    parts, last_enqueued = [], None
    for pg, st in sorted(status.items(), key=lambda kv: str(kv[0])):
        if not isinstance(st, dict):
            continue
        enq, done = st.get("last_enqueued_collective"), st.get("last_completed_collective")
        if str(pg) == "0" and isinstance(enq, int):
            last_enqueued = enq
        pending = [
            e
            for e in entries
            if str(e.get("pg_id")) == str(pg) and not e.get("retired") and e.get("state") != "completed"
        ]
        text = f"pg {pg}: enqueued #{enq}, completed #{done}"
        if pending:
            p = min(
                pending, key=lambda e: e.get("collective_seq_id") if isinstance(e.get("collective_seq_id"), int) else 0
            )
            text += (
                f", pending {p.get('profiling_name')} #{p.get('collective_seq_id')} ({p.get('state')}, "
                f"sizes {p.get('input_sizes')})"
            )
        parts.append(text)
    summary = "; ".join(parts) or f"{len(entries)} entries, no process-group status"
    return {"decoded": True, "summary": f"version {obj.get('version')}: {summary}", "last_enqueued": last_enqueued}


def into_incident(inc, results: dict[int, dict]):
    """Keep each rank's raw dump in the incident (`nccl-trace-rank<R>.pkl`) and return what goes under the
    record's `flight_recorder`: per rank what the trigger did and the decoded summary — or, when no rank has
    an NCCL process group, one line saying so."""
    if not any(r["data"] is not None or r["status"].startswith("triggered") for r in results.values()):
        return "; ".join(sorted({r["status"] for r in results.values()})) or "no rank announced itself"
    out = {}
    for rank, r in sorted(results.items()):
        entry = {k: v for k, v in r.items() if k != "data"}
        if r["data"] is not None:
            entry["file"] = inc.add_file(f"nccl-trace-rank{rank}.pkl", r["data"]).name
        out[str(rank)] = entry
    return out
