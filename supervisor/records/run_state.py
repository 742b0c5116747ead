"""`<run_dir>/state.json`: the supervisor's state, replaced atomically so a reader never sees half.

On a disk with no free block the replace is refused; the file is written `reserved` (padded with spaces
to whole blocks, `durable.reserved`) so that the news still fits in its own blocks: it is rewritten in
place (`durable.overwrite_in_place`) and a run that ends for lack of space still says `failed` and why.

It records enough for the next supervisor to find what this one leaves behind if it dies:
its own pid and start time, the worker's pid, process group, session and start time, the pids
each rank announced and the descendants seen, each with its start time (see `leftovers`).
`hangwatch status` without a socket and `hangwatch report` read it too.  The loop fills it from its
read model (`read_model.view.state_record`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable, Optional

from hangwatch.common.durable import NO_ROOM_ERRNOS, FsOps, reserved
from hangwatch.supervisor.processes.process import ProcRef, Worker
from hangwatch.supervisor.records.checkpoint_ledger import CheckpointLedger

FORMAT_VERSION = 1


class RunRecord:
    """What the run has established so far, kept across attempts (and, via state.json and the checkpoint
    ledger, across supervisors).  `last_good_checkpoint`/`last_good_step` are the ledger's answer
    (`checkpoint_ledger`); state.json keeps showing them for `status` and `report`."""

    def __init__(
        self,
        restarts: int = 0,
        last_good_checkpoint: Optional[str] = None,
        last_good_step: Optional[int] = None,
        torn_lines: int = 0,
        last_incident: Optional[dict] = None,
        last_step: Optional[dict] = None,
        checkpoints: Optional[CheckpointLedger] = None,
    ):
        self.restarts = restarts
        self.torn_lines = torn_lines
        self.last_incident = last_incident  # {"id", "kind", "summary"}
        self.last_step = last_step if last_step is not None else {}  # the last `step` line (metrics for `status`)
        self.checkpoints = checkpoints if checkpoints is not None else CheckpointLedger()
        if last_good_checkpoint and not self.checkpoints.entries:
            # A run dir from a supervisor that kept no ledger (or whose ledger was unreadable): its
            # state.json is the only record there is.
            self.checkpoints.adopt(
                str(last_good_checkpoint),
                last_good_step if isinstance(last_good_step, int) else None,
                "recorded in state.json by an earlier supervisor",
            )

    @property
    def last_good_checkpoint(self) -> Optional[str]:
        e = self.checkpoints.last_good()
        return e.path if e else None

    @property
    def last_good_step(self) -> Optional[int]:
        e = self.checkpoints.last_good()
        return e.step if e else None

    @classmethod
    def from_previous(cls, data: Optional[dict], checkpoints: Optional[CheckpointLedger] = None) -> "RunRecord":
        data = data or {}
        return cls(
            restarts=int(data.get("restarts") or 0),
            last_good_checkpoint=data.get("last_good_checkpoint"),
            last_good_step=data.get("last_good_step"),
            checkpoints=checkpoints,
        )

    def note_incident(self, inc) -> None:
        self.last_incident = {"id": inc.id, "kind": inc.kind, "summary": inc.data.get("summary")}


def record(
    *,
    state: str,
    final: bool,
    tree_gone: bool,
    supervisor: Optional[ProcRef],
    worker: Optional[Worker],
    announced: dict[int, ProcRef],
    descendants: Iterable[ProcRef],
    attempt: int,
    restarts: int,
    last_good_checkpoint: Optional[str],
    last_good_step: Optional[int],
    last_incident: Optional[dict],
    torn_lines: int,
    incidents: int,
    socket: str,
    run_dir: str,
    exit_code: int,
    paused: bool = False,
    wall: Optional[float] = None,
    why: Optional[str] = None,
) -> dict:
    """The state.json object.  `tree_gone`: the worker's tree was seen gone, so no pid is recorded —
    until then the worker stays recorded even after its exit, since its group may still hold processes.
    `paused`: an operator's pause must outlive this supervisor (the next supervisor on this run dir
    starts paused, not training).  `why`: the reason of the transition into a final state (what
    `status` and `report` say about a run that is over; None before the end)."""
    return {
        "state": state,
        "updated_wall": time.time() if wall is None else wall,
        "supervisor": supervisor.as_dict() if supervisor else {"pid": os.getpid()},
        "worker": worker.as_dict() if worker and not tree_gone else None,
        "pids": {} if tree_gone else {str(rank): ref.as_dict() for rank, ref in announced.items()},
        "descendants": [] if tree_gone else [r.as_dict() for r in descendants],
        "attempt": attempt,
        "restarts": restarts,
        "last_good_checkpoint": last_good_checkpoint,
        "last_good_step": last_good_step,
        "incidents": incidents,
        "last_incident": last_incident,
        "torn_lines": torn_lines,
        "socket": socket,
        "run_dir": run_dir,
        "exit_code": exit_code if final else None,
        "why": why if final else None,
        "intent": "pause" if paused and not final else None,
    }


def paused_before(previous: Optional[dict]) -> bool:
    """Did the supervisor that wrote `previous` leave the run paused (or on its way to a pause)?"""
    return bool(previous) and previous.get("intent") == "pause" and previous.get("state") not in FINAL_STATES


FINAL_STATES = ("finished", "failed", "stopped")


def write(path: Path, data: dict, fs: Optional[FsOps] = None) -> None:
    """Durably replace `path` (temporary file, fsync, rename, fsync the directory), padded to whole blocks.

    When the disk has no room for the temporary (ENOSPC, EDQUOT) the record is rewritten in the file's own
    blocks instead (indented if it fits, else on one line), and the refusal is raised all the same: the
    disk is full, which the caller must hear (the run cannot go on), but state.json says what happened."""
    fs = fs or FsOps()
    data = {"version": FORMAT_VERSION, **data}
    try:
        fs.write_file(path, reserved(_text(data, indent=1)))
    except OSError as exc:
        if exc.errno not in NO_ROOM_ERRNOS:
            raise
        for indent in (1, None):
            try:
                fs.overwrite(path, _text(data, indent))
                break
            except OSError:  # no file yet (nothing to overwrite), or the news does not fit in it
                continue
        raise


def _text(data: dict, indent: Optional[int]) -> bytes:
    return (json.dumps(data, indent=indent, default=str) + "\n").encode()


READ_TRIES = 3  # an in-place rewrite caught half done reads as not JSON: read again
READ_AGAIN_S = 0.02


def read(path: Path) -> tuple[Optional[dict], Optional[str]]:
    """(state, problem): (None, None) when there is no file; an unreadable one is reported, not fatal."""
    path = Path(path)
    for attempt in range(READ_TRIES):
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, f"{path}: unreadable ({exc})"
        try:
            data = json.loads(text)
            break
        except ValueError as exc:
            if attempt == READ_TRIES - 1:
                return None, f"{path}: not JSON ({exc})"
            time.sleep(READ_AGAIN_S)
    if not isinstance(data, dict):
        return None, f"{path}: expected an object, got {type(data).__name__}"
    return data, None
