"""The run's last word for Kubernetes: why it ended, in the container's termination message (at most 4 KiB).

When a container exits, the kubelet reads its termination-message file (`/dev/termination-log` unless the pod names
another `terminationMessagePath`) and keeps the text in the pod's status, where `kubectl describe pod` shows it under
the container's state.  It keeps 4096 bytes at most, so the message is bounded here: the most important line first,
cut on a character boundary, never half a character.

    compose(end)       pure: how the run ended (`RunEnd`) → the message's bytes
    RunEnd.of(…)       gathered from the loop's read model, the final state's reason and the incident store
    target(setting)    where `logging.termination_log` sends it: `auto` (/dev/termination-log when it is there and
                       writable, i.e. in a pod), a path, or nowhere ("")
    leave(…)           `app.run`'s one call after the loop: compose and write; never raises

The file is written in place (`FsOps.write_in_place`), not replaced by a rename: in a pod it is a file bind-mounted on
its own, which a rename cannot replace, in a /dev the container may not write.  A refused write is logged once and
swallowed: the run's exit status matters more than its summary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.durable import FsOps, describe_write_error
from hangwatch.common.exitcodes import DO_NOT_RETRY, EXIT_OK, run_code_meaning
from hangwatch.supervisor.incidents import IncidentStore, frame_str, signal_name
from hangwatch.supervisor.read_model.view import View
from hangwatch.supervisor.rules.outcome import SIGNALLED, shell_status

log = structlog.get_logger("hangwatch")

DEFAULT_PATH = Path("/dev/termination-log")  # the kubelet's default terminationMessagePath
AUTO = "auto"
MAX_BYTES = 4096  # what the kubelet keeps of a container's termination message
LINE_BYTES = 1024  # no single line (a huge incident summary) may crowd out the lines after it
MIN_PART_BYTES = 24  # a line cut shorter than this says nothing: left out instead
OUTPUT_LINES = 3  # the last lines of the command's output an incident quotes, at most
CUT = "…"
FINAL_STATES = ("finished", "stopped", "failed")


@dataclass(frozen=True)
class RunEnd:
    """How the run ended: what the message is composed from (no I/O, no loop)."""

    state: str  # finished, stopped, failed (or the state a supervisor that never ran a worker stopped in)
    why: str  # the reason of the transition into it
    exit_code: int  # what `hangwatch run` exits with
    command_status: Optional[int]  # how the last attempt's command ended, as a shell says it (128+N: signal N)
    run_dir: str
    attempt: int = 0
    restarts: int = 0
    incidents: int = 0
    incident: Optional[dict] = None  # the last incident's record (incident.json), or its summary
    last_good_checkpoint: Optional[str] = None
    last_good_step: Optional[int] = None

    @classmethod
    def of(cls, view: View, why: str, exit_code: int, store: IncidentStore) -> "RunEnd":
        """From the read model at the end, the final state's reason and the run's incidents: the last incident's whole
        record when it can be read (its decision, culprit, output), else the summary the run's record keeps."""
        w = view.worker
        last = view.last_incident
        record = store.get(last["id"]) if isinstance(last, dict) and last.get("id") else None
        if not isinstance(record, dict) or "error" in record:
            record = dict(last) if isinstance(last, dict) else None
        return cls(
            state=view.state.value,
            why=why,
            exit_code=exit_code,
            command_status=shell_status(w.exit_code, w.exit_signal) if w is not None else None,
            run_dir=view.run_dir,
            attempt=view.attempt,
            restarts=view.restarts,
            incidents=view.incidents,
            incident=record,
            last_good_checkpoint=view.last_good_checkpoint,
            last_good_step=view.last_good_step,
        )


# ---- the words -------------------------------------------------------------------------------------------------


def exit_meaning(code: int, command_status: Optional[int]) -> str:
    """What exit `code` says, from `common.exitcodes.RUN_CODES`: hangwatch's own code, or the command's own status
    passed on (the same number as the last attempt's end: a torchrun's 1 is not hangwatch's "could not go on")."""
    own = run_code_meaning(code)
    if own is not None and (code == EXIT_OK or code in DO_NOT_RETRY or code != command_status):
        words, then = own
        return words if code == EXIT_OK or then in words else f"{words} — {then}"
    if code > SIGNALLED:
        name = signal_name(code - SIGNALLED)
        if name and not name.startswith("signal "):
            return f"the command's own status: it died of {name}"
    return "the command's own exit status, passed on"


def one_line(value: Any) -> str:
    """A field as one line of text (a summary with newlines, a number)."""
    return " ".join(str(value).split())


def _frame(value: Any) -> Optional[str]:
    if isinstance(value, dict) and {"function", "file", "line"} <= value.keys():
        return frame_str(value)
    return None


def message_lines(end: RunEnd) -> list[str]:
    """The message, one line per fact, the most important first (`compose` cuts from the end)."""
    state = f"run {end.state}" if end.state in FINAL_STATES else f"run refused before starting an attempt ({end.state})"
    lines = [f"hangwatch: {state}, exit {end.exit_code}: {exit_meaning(end.exit_code, end.command_status)}"]
    why = one_line(end.why or "")
    if why:
        lines.append(f"why: {why}")
    inc = end.incident if isinstance(end.incident, dict) else None
    if inc:
        lines += incident_lines(inc, why)
    if end.last_good_checkpoint:
        step = f" (step {end.last_good_step})" if end.last_good_step is not None else ""
        lines.append(f"last good checkpoint: {one_line(end.last_good_checkpoint)}{step}")
    else:
        lines.append("no good checkpoint")
    counts = f"attempt {end.attempt}, {end.restarts} restart(s), {end.incidents} incident(s)"
    lines.append(f"run dir: {one_line(end.run_dir)} ({counts})")
    said = inc.get("last_output") if inc else None
    if isinstance(said, list) and said:
        lines.append("its output ended:")
        lines += [f"  {one_line(line)}" for line in said[-OUTPUT_LINES:]]
    return lines


def incident_lines(inc: dict, why: str) -> list[str]:
    """The last incident: its head and summary, the culprit, the decision, the failure a closing incident follows —
    what the run's `why` already says is not said again."""
    where = [f"{k} {inc[k]}" for k in ("attempt", "step") if isinstance(inc.get(k), int)]
    head = f"incident {one_line(inc.get('id', '?'))} [{one_line(inc.get('kind', '?'))}]"
    head += f" ({', '.join(where)})" if where else ""
    summary = one_line(inc.get("summary") or "")
    lines = [f"{head}: {summary}" if summary and summary != why else head]
    frame = _frame(inc.get("user_frame")) or _frame(inc.get("stuck_frame"))  # the user's own code first
    culprit = inc.get("culprit_rank")
    if isinstance(culprit, int) or frame:
        rank = f"rank {culprit}" if isinstance(culprit, int) else ""
        lines.append("culprit: " + " at ".join(x for x in (rank, frame) if x))
    decision = inc.get("decision")
    if isinstance(decision, dict) and decision.get("action"):
        reason = one_line(decision.get("reason") or "")
        said = f" — {reason}" if reason and reason != why else ""
        lines.append(f"decision: {one_line(decision['action'])}{said}")
    before = inc.get("last_incident")  # a run's closing incident (a crash loop, no progress) follows the failure
    if inc.get("status") == "final" and isinstance(before, dict) and before.get("id"):
        summary = one_line(before.get("summary") or "")
        lines.append(f"after incident {one_line(before['id'])} [{one_line(before.get('kind', '?'))}]: {summary}")
    return lines


# ---- the bound -------------------------------------------------------------------------------------------------


def utf8(text: str) -> bytes:
    """`text` in UTF-8; a lone surrogate (undecodable output read back from JSON) becomes "?" rather than an error."""
    return text.encode("utf-8", "replace")


def cut(text: str, limit: int) -> str:
    """`text` in at most `limit` bytes of UTF-8, ending in "…" when it was cut, and never in half a character."""
    data = utf8(text)
    if len(data) <= limit:
        return data.decode()
    marker = CUT if limit >= len(CUT.encode()) else ""
    # a prefix of valid UTF-8 decodes whole but for its last, incomplete character: "ignore" drops exactly that
    return data[: max(0, limit - len(marker.encode()))].decode("utf-8", "ignore") + marker


def compose(end: RunEnd, limit: int = MAX_BYTES) -> bytes:
    """The termination message: `message_lines`, each at most LINE_BYTES, in `limit` bytes of UTF-8 — whole lines
    while they fit, then the next one cut to the room left (when that says anything), then nothing."""
    out = bytearray()
    for line in message_lines(end):
        data = utf8(cut(line, LINE_BYTES) + "\n")
        room = limit - len(out)
        if len(data) <= room:
            out += data
            continue
        if room >= MIN_PART_BYTES:
            out += utf8(cut(line, room - 1) + "\n")
        break
    return bytes(out)


# ---- where it goes ---------------------------------------------------------------------------------------------


def target(setting: str, default: Path = DEFAULT_PATH) -> Optional[Path]:
    """Where `logging.termination_log` sends the message; None: nowhere.  `auto`: `default` when it is a file this
    process may write — the kubelet's, in a pod; anywhere else there is none, and nothing is written."""
    if not setting:
        return None
    if setting == AUTO:
        return default if default.is_file() and os.access(default, os.W_OK) else None
    return Path(setting)


def write(path: Path, message: bytes, fs: FsOps) -> bool:
    """Write the message into `path`; False (logged once) when the file cannot be written."""
    try:
        fs.write_in_place(path, message)
    except OSError as exc:
        log.warning("termination_message_not_written", path=str(path), error=describe_write_error(exc, path))
        return False
    log.info("termination_message_written", path=str(path), bytes=len(message))
    return True


def leave(
    setting: str,
    view: Callable[[], View],
    why: str,
    exit_code: int,
    store: IncidentStore,
    *,
    fs: Optional[FsOps] = None,
    default: Path = DEFAULT_PATH,
) -> Optional[Path]:
    """As `hangwatch run` ends: the message written where `setting` says (the path, or None).  `view` builds the read
    model only when there is somewhere to write.  Never raises: a message that cannot be made or written is logged
    and the run ends as it would have."""
    try:
        path = target(setting, default)
        if path is None:
            return None
        message = compose(RunEnd.of(view(), why, exit_code, store))
    except Exception:  # a record of an unexpected shape must not cost the run its exit status
        log.exception("termination_message_failed")
        return None
    return path if write(path, message, fs if fs is not None else FsOps()) else None
