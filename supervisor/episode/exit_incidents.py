"""Incidents of a worker that ended by itself, of a worker that could not start, and of a crash loop.

A worker's end is classified from the evidence in order of trust (`incidents.classify_exit`): its last
words (exit.json), its exit code or signal — a SIGKILL hangwatch did not send is put to the kernel's
records (`evidence.sigkill_cause`) — torchrun's root-cause report of the rank that failed first, the
log tail.  A fatal signal makes faulthandler write the stack into the rank's dump file: its frame is
the stuck frame, and the call it died in (`landmarks.read_stack`) is named in the summary.  With several ranks the incident names the culprit rank (the one whose dump holds the
fatal error, else the one torchrun says failed first) and keeps every rank's dump; dumps the NCCL
flight recorder wrote by itself during the attempt (on its own timeout) are kept too.
"""
from __future__ import annotations

import re
import signal
from typing import TYPE_CHECKING, Optional

import structlog

from hangwatch.common.config import RestartCfg
from hangwatch.common.rundir import EXIT_NAME, rank_exit_name, read_json, tail_text
from hangwatch.supervisor.processes.attempt import Attempt
from hangwatch.supervisor.watch.deadlines import Deadlines
from hangwatch.supervisor.episode.kernel_evidence import sigkill_cause, torchrun_root_cause
from hangwatch.supervisor.episode.flight_recorder import FlightDumps, into_incident
from hangwatch.supervisor.incidents import (Incident, IncidentStore, classify_exit, fatal_error, frame_str, main_stack,
                                            signal_name, stuck_frame)
from hangwatch.supervisor.incidents.landmarks import read_stack, user_landmarks
from hangwatch.supervisor.loop.policy import Decision, RestartPolicy
from hangwatch.supervisor.records.statefile import RunFacts

if TYPE_CHECKING:
    from hangwatch.supervisor.episode.episode import Tools

log = structlog.get_logger("hangwatch")
MAX_DUMP_BYTES = 4 << 20


def exit_info(attempt: Attempt, main_rank: int = 0) -> dict:
    w = attempt.worker
    return {"code": w.exit_code, "signal": w.exit_signal, "signal_name": signal_name(w.exit_signal),
            "last_words": read_json(attempt.dir / EXIT_NAME), "stop_reason": attempt.last_stop.get(main_rank)}


def stragglers_field(attempt: Attempt) -> dict:
    """The straggler warnings of this attempt, for the incident record (nothing when there were none)."""
    recorded = attempt.stragglers.recorded
    return {"stragglers": [s.as_dict() for s in recorded]} if recorded else {}


def rank_last_words(attempt: Attempt) -> dict[int, dict]:
    """Each rank's last words (exit.json for rank 0, exit-rank<R>.json for the others), where written."""
    out = {}
    for rank in sorted(set(attempt.announced) | {0}):
        words = read_json(attempt.dir / rank_exit_name(rank))
        if words is not None:
            out[rank] = words
    return out


def own_failure(words: dict[int, dict]) -> Optional[int]:
    """The rank whose last words are its own failure — not a collective that broke because a peer died
    (`collective_error: true`, which makes a victim); the lowest such rank, or None."""
    return next((r for r, w in sorted(words.items()) if not w.get("collective_error")), None)


def classify(tools: "Tools", attempt: Attempt) -> tuple[str, str, Optional[int]]:
    """(kind, classification, the culprit rank or None).

    With several ranks the culprit comes first from its own evidence: the rank whose dump holds a fatal
    signal's stack (a segfault has no last words), else the rank whose last words are its own failure,
    else the rank torchrun reports as failing first; victims' collective errors never name the failure."""
    w = attempt.worker
    if len(attempt.announced) > 1:
        found = _classify_ranks(tools, attempt)
        if found is not None:
            return found
    last_words = read_json(attempt.dir / EXIT_NAME)
    cause = launcher = None
    if w.exit_signal == signal.SIGKILL:
        pids = {w.pid} | {a.ref.pid for a in attempt.announced.values() if a.ref}
        cause = sigkill_cause(pids, attempt.oom_kills_at_start, tools.kernel.oom_kills(), tools.kernel.log())
    elif last_words is None:
        launcher = torchrun_root_cause(tail_text(w.log_path, 400))
        if launcher and launcher.get("signal") == "SIGKILL":
            rank_cause = sigkill_cause({launcher["pid"]}, attempt.oom_kills_at_start, tools.kernel.oom_kills(),
                                       tools.kernel.log())
            launcher = {**launcher, "signal": f"SIGKILL: {rank_cause}"}
    kind, text = classify_exit(w.exit_code, w.exit_signal, last_words, tail_text(w.log_path, 80), sigkill_cause=cause,
                               launcher=launcher)
    return kind, text, launcher.get("rank") if launcher else None


def _classify_ranks(tools: "Tools", attempt: Attempt) -> Optional[tuple[str, str, Optional[int]]]:
    w = attempt.worker
    log_tail = tail_text(w.log_path, 400)
    launcher = torchrun_root_cause(log_tail)
    for rank, text in _rank_dumps(attempt).items():
        fatal = fatal_error(text)
        if fatal:
            sig = launcher.get("signal") if launcher and launcher.get("rank") == rank else None
            what = f"killed by {sig}" if sig else "died of a fatal signal"
            return "signal", f"{what} (Fatal Python error: {fatal})", rank
    words = rank_last_words(attempt)
    rank = own_failure(words)
    if rank is not None:
        lw = words[rank]
        kind, text = classify_exit(lw.get("exit_code"), None, lw, "")
        return kind, text, rank
    if launcher and launcher.get("rank") is not None:
        kind, text = classify_exit(w.exit_code, w.exit_signal, None, log_tail, launcher=launcher)
        return kind, text, launcher["rank"]
    return None


def raising_frame(traceback_text: str) -> Optional[dict]:
    """The innermost `File "…", line N, in F` of a traceback: where the exception was raised."""
    found = re.findall(r'^\s*File "(.+?)", line (\d+), in (.+?)\s*$', traceback_text or "", re.M)
    if not found:
        return None
    file, line, function = found[-1]
    return {"file": file, "line": int(line), "function": function}


def _rank_dumps(attempt: Attempt) -> dict[int, str]:
    """Each announced rank's dump file as it stands (a fatal signal's stack, earlier SIGUSR1 dumps)."""
    out = {}
    for rank, a in sorted(attempt.announced.items()):
        try:
            with open(a.dump_path, "rb") as f:
                text = f.read(MAX_DUMP_BYTES).decode("utf-8", "replace")
        except (OSError, TypeError):  # no file, or the rank announced none
            continue
        if text.strip():
            out[rank] = text
    return out


def exit_incident(tools: "Tools", attempt: Attempt, deadlines: Deadlines, facts: RunFacts, kind: str, classification: str,
                  summary: str, decision: Optional[Decision] = None, failed_rank: Optional[int] = None) -> Incident:
    w = attempt.worker
    tr = deadlines.ranks.get(deadlines.main_rank())
    info = exit_info(attempt, deadlines.main_rank())
    frame = stack = user = fatal_rank = reading = None
    dumps = _rank_dumps(attempt)
    for rank, text in dumps.items():  # a fatal signal makes faulthandler write the stack too
        if fatal_error(text):
            fatal = text[text.rfind("Fatal Python error"):]
            frame, stack, user = stuck_frame(fatal)
            reading = read_stack(stack, extra=user_landmarks(tools.watchdog_cfg.landmarks), truncated=main_stack(fatal)[1])
            info["fatal_error"] = fatal_error(text)
            fatal_rank = rank
            break
    if reading is not None and reading.innermost_frame is not None:
        summary = f"{summary}; {reading.summary()}"
    several = len(attempt.announced) > 1
    culprit = (fatal_rank if fatal_rank is not None else failed_rank) if several else None
    words = rank_last_words(attempt) if several else {}
    if several and culprit is not None:
        # The culprit first, with its own frame: the fatal signal's stack, else where its exception was raised.
        where = frame or raising_frame((words.get(culprit) or {}).get("traceback") or "")
        if frame is None and where is not None:
            frame = where
        victims = sorted(r for r, lw in words.items() if r != culprit and lw.get("collective_error"))
        summary = (f"rank {culprit}: {classification}" + (f" at {frame_str(where)}" if where else "")
                   + (f", {reading.words()}" if reading is not None and fatal_rank == culprit and reading.landmark else "")
                   + "".join(f"; rank {r}: its collective broke when rank {culprit} failed (victim)" for r in victims))
    inc = tools.incidents.create(
        kind, attempt=attempt.number, phase=tr.phase if tr else None, step=tr.step if tr else None, deadline=None,
        exit=info, classification=classification, summary=summary, stuck_frame=frame, main_stack=stack or [],
        user_frame=user, **(reading.fields() if reading is not None else {}),
        status="in progress", worker_pid=w.pid, last_good_checkpoint=facts.last_good_checkpoint,
        decision=decision.as_dict() if decision else None, **stragglers_field(attempt),
        **({"culprit_rank": culprit} if several else {}),
    )
    if info.get("last_words"):
        inc.add_file(EXIT_NAME, (attempt.dir / EXIT_NAME).read_text(errors="replace"))
    for rank in words:
        if rank != 0:
            name = rank_exit_name(rank)
            inc.add_file(name, (attempt.dir / name).read_text(errors="replace"))
    if several:
        inc.data["last_words_by_rank"] = {r: {k: lw.get(k) for k in ("kind", "message", "collective_error")}
                                          for r, lw in words.items()}
    if several:
        for rank, text in dumps.items():
            inc.add_file(f"stack-rank{rank}.txt", text)
        inc.data["dumps"] = {r: f"stack-rank{r}.txt" for r in dumps}
    flight = FlightDumps(attempt.flight, sorted(attempt.announced)).collect(since_wall=attempt.started_wall)
    if any(r["data"] is not None for r in flight.values()):  # written by the ranks themselves (dump on timeout)
        inc.data["flight_recorder"] = into_incident(inc, flight)
    log.warning("worker_failed", kind=kind, incident=inc.id, classification=classification, attempt=attempt.number,
                step=inc.data.get("step"), code=w.exit_code, signal=signal_name(w.exit_signal),
                **({"culprit_rank": culprit} if several else {}))
    return inc


def spawn_failed_incident(incidents: IncidentStore, attempt: int, argv: list[str], cwd: Optional[str], exc: OSError,
                          facts: RunFacts) -> Incident:
    """The worker command cannot be executed: a configuration error, recorded before the run fails."""
    inc = incidents.create("config_error", attempt=attempt, phase=None, step=None,
                           classification=f"cannot start the worker: {exc}",
                           summary=f"cannot start {argv[0]!r}: {exc.strerror or exc}", argv=argv, cwd=cwd)
    facts.note_incident(inc)
    log.error("spawn_failed", argv=argv, error=str(exc))
    return inc


def crash_loop_incident(incidents: IncidentStore, attempt: int, decision: Decision, policy: RestartPolicy,
                        restart_cfg: RestartCfg, facts: RunFacts) -> Incident:
    """The final incident of a run the restart policy gave up on."""
    inc = incidents.create(
        "crash_loop", attempt=attempt, phase=None, step=policy.best_step, classification="crash loop",
        summary=decision.reason, status="final", restarts_in_window=len(policy.recent), window_s=restart_cfg.window_s,
        max_restarts=restart_cfg.max_restarts, last_incident=facts.last_incident,
        last_good_checkpoint=facts.last_good_checkpoint)
    facts.note_incident(inc)
    log.error("crash_loop", incident=inc.id, reason=decision.reason)
    return inc
