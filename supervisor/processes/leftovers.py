"""What a dead supervisor left behind: find its worker tree from its `state.json`, and end it.

A new supervisor on the same run dir first reads the previous `state.json`.  A supervisor recorded
there that still runs means "refuse to start"; a recorded worker tree that still runs is ended
(SIGTERM, grace, SIGKILL) before the first attempt, so two trainings never write one run dir.
Blocking is fine here: it happens once, before the loop.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import structlog

from hangwatch.supervisor.processes.process import ProcessTable, ProcRef

log = structlog.get_logger("hangwatch")

KILL_WAIT_S = 5.0  # after SIGKILL to leftovers (not our children: init reaps them), how long to wait


def find(
    state: dict, table: ProcessTable, now_wall: Optional[float] = None
) -> tuple[list[ProcRef], Optional[int], list[str]]:
    """Processes recorded in a dead supervisor's state.json that still run.

    Returns (refs to end, the process group to end or None, notes).  A recorded pid counts only
    while its create time matches.  Members of the recorded process group count when the group
    leader is still the recorded process, or — the leader having died — when they are in the
    recorded session and started between the leader's start and the last state update (Linux does
    not hand out a pid that is still some group's id, so such members are the old tree's).
    """
    notes: list[str] = []
    refs: dict[int, ProcRef] = {}
    worker = state.get("worker") or {}
    wref = ProcRef.from_dict(worker)
    recorded = [wref] if wref else []
    recorded += [r for r in (ProcRef.from_dict(d) for d in (state.get("pids") or {}).values()) if r]
    recorded += [r for r in (ProcRef.from_dict(d) for d in state.get("descendants") or []) if r]
    for r in recorded:
        if table.matches(r):
            refs[r.pid] = r
        elif table.create_time(r.pid) is not None:
            notes.append(f"pid {r.pid} now belongs to another process (start time differs): left alone")
    group = None
    if wref is not None:
        pgid = int(worker.get("pgid", wref.pid))
        sid = int(worker.get("sid", wref.pid))
        leader_alive = wref.pid in refs
        updated = float(state.get("updated_wall") or (now_wall or time.time()))
        for m in table.group_members(pgid):
            session = table.session_id(m.pid)
            if session is None:
                continue
            if leader_alive or (session == sid and wref.create_time - 1 <= m.create_time <= updated + 1):
                refs.setdefault(m.pid, m)
            else:
                notes.append(f"pid {m.pid} in process group {pgid} started after the old tree: left alone")
        if leader_alive:
            group = pgid
    return list(refs.values()), group, notes


def end(
    refs: list[ProcRef],
    group: Optional[int],
    table: ProcessTable,
    *,
    grace_s: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> list[ProcRef]:
    """SIGTERM, wait up to `grace_s`, SIGKILL what is left, wait for it to be gone (blocking).

    The leftovers are not our children: they are reaped by init once dead, so "gone" is judged
    by the table.  Returns what was still alive after the SIGKILL wait (normally nothing).
    """
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILL_WAIT_S)):
        if group is not None:
            table.signal_group(group, sig)
        for r in table.alive(refs):
            table.signal(r, sig)
        deadline = clock() + wait_s
        while table.alive(refs) and clock() < deadline:
            sleep(0.05)
    return table.alive(refs)


def clear(
    previous: dict, table: ProcessTable, *, state_path: Path, grace_s: float, end_leftovers: bool = True
) -> Optional[str]:
    """End what a dead supervisor left; refuse (return why) to run beside a live one."""
    sup = ProcRef.from_dict(previous.get("supervisor") or {})
    if sup is not None and sup.pid != os.getpid() and table.matches(sup):
        return (
            f"another supervisor (pid {sup.pid}) is running on {state_path.parent} (from {state_path}); stop it first"
        )
    if not end_leftovers or not (previous.get("worker") or previous.get("pids") or previous.get("descendants")):
        return None
    refs, group, notes = find(previous, table)
    for note in notes:
        log.info("leftover_skipped", note=note)
    if refs or group:
        log.warning("leftovers_found", pids=[r.pid for r in refs], pgid=group, state_file=str(state_path))
        survivors = end(refs, group, table, grace_s=grace_s)
        log.info("leftovers_ended", pids=[r.pid for r in refs], survivors=[r.pid for r in survivors])
    return None
