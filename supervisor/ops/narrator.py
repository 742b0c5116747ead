"""hangwatch's own words on a person's screen: a few plain lines, `hangwatch: …`, never the structured log.

In the foreground `hangwatch run` keeps its structured log in supervisor.log (`-v` also puts it on stderr); on the
screen a person sees the command's output and, between it, one line for each thing hangwatch did that they would
want to know at once: a stall and what is done about it, a failed attempt, a recovery, a stop they asked for.
The narrator is a log tap (`logsetup.add_tap`): it reads the events the loop logs anyway, turns the few that
matter into one line each (`line`, a pure function, table-tested) and hands them to `say` — the relay, which puts
them on stderr in order with the command's output.  It runs on the thread that logged and only queues.
"""

from __future__ import annotations

from typing import Callable, Optional


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, (int, float)) else str(v)


def _at(ev: dict) -> str:
    return f" at step {ev['step']}" if ev.get("step") else ""  # 0: before a first step, which says nothing


def _stall(ev: dict) -> str:
    where = _at(ev)
    where += f" in {ev['phase']}" if ev.get("phase") else ""
    rank = f" (rank {ev['rank']})" if ev.get("rank") else ""  # rank 0 alone is the command itself
    budget = ""
    if ev.get("budget_s") is not None:
        budget = f": no progress for {float(ev.get('elapsed_s') or 0):.1f}s, its budget {float(ev['budget_s']):.1f}s"
    return f"stall{where}{rank}{budget} ({ev.get('kind') or 'stall'}); incident {ev.get('incident')}: taking the stacks"


def _failed(ev: dict) -> str:
    what = ev.get("classification") or (
        f"exit {ev['code']}" if ev.get("code") is not None else f"signal {ev.get('signal')}"
    )
    where = _at(ev)
    return f"attempt {ev.get('attempt')} failed{where}: {what}; incident {ev.get('incident')}"


def _gone(ev: dict) -> Optional[str]:
    if ev.get("next") not in ("backoff", "starting"):
        return None  # finished, stopped, failed: the summary says how the run ended
    return str(ev.get("why"))


def _recovered(ev: dict) -> str:
    return (
        f"incident {ev.get('incident')}: recovered in the worker's process (the stuck step abandoned, the last good "
        "state put back); nothing restarted"
    )


def _text(ev: dict) -> Optional[str]:
    return str(ev["text"]) if ev.get("text") else None


LINES: dict[str, Callable[[dict], Optional[str]]] = {
    "stall_detected": _stall,
    "restart_now": lambda ev: f"restart requested; incident {ev.get('incident')}: taking the stacks",
    "worker_failed": _failed,
    "tree_gone": _gone,
    "recovered_in_process": _recovered,
    "oom_adapted": lambda ev: f"out of memory at step {ev.get('step')}: {ev.get('text') or 'the step adapted'}",
    "nonfinite_rolled_back": lambda ev: f"non-finite loss at step {ev.get('step')}: rolled back in the process",
    "unkillable": _text,
    "generate_truncated": _text,
    "resume_ignored": lambda ev: ev.get("note") or "the command ignored the checkpoint it was handed",
}


def line(ev: dict) -> Optional[str]:
    """The screen's line for a logged event, or None.  An event may carry its own words (`say`)."""
    if ev.get("say"):
        return str(ev["say"])
    fn = LINES.get(str(ev.get("event")))
    if fn is None:
        return None
    try:
        return fn(ev)
    except Exception:  # a field of an unexpected shape: the line is a courtesy, the log has the event
        return None


class Narrator:
    """The log tap: `say` each event's line (the relay's `say`)."""

    def __init__(self, say: Callable[[str], None]):
        self._say = say

    def __call__(self, ev: dict) -> None:
        text = line(ev)
        if text:
            self._say(text)
