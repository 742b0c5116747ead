"""`hangwatch status --run-dir DIR` when no supervisor answers: what the run dir's state.json last recorded.

A state.json that says `running` is only the truth while the supervisor that wrote it lives: one killed
by SIGKILL, the OOM killer or a reboot never writes its end.  So the record is shown as recorded, and
its supervisor (pid and start time, `ProcRef`: a reused pid is not mistaken for it) is looked up: a
state that is not final whose supervisor is gone says so, instead of passing for a live run.

Loaded only on that path: the socket's answer needs none of it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from hangwatch.common.rundir import STATE_NAME
from hangwatch.supervisor.records import run_state

SOURCE = "state.json"  # `--json`: the answer's `source`, where a live supervisor's has none


def supervisor_gone(rec: dict) -> Optional[bool]:
    """Is the supervisor that wrote `rec` gone?  None when the record does not say which one it was."""
    import psutil

    from hangwatch.supervisor.processes.process import ProcRef, PsutilProcessTable

    sup = rec.get("supervisor") if isinstance(rec.get("supervisor"), dict) else {}
    ref = ProcRef.from_dict(sup)
    if ref is not None:
        return PsutilProcessTable().is_gone(ref)
    pid = sup.get("pid")
    if isinstance(pid, int) and pid > 0:  # a record without a start time: the pid alone, reuse not ruled out
        return not psutil.pid_exists(pid)
    return None


def recorded(run_dir: Path) -> Optional[dict]:
    """state.json as recorded, with `source` and `supervisor_gone`; None when there is none to read."""
    rec, _ = run_state.read(Path(run_dir) / STATE_NAME)
    if rec is None:
        return None
    return {**rec, "source": SOURCE, "supervisor_gone": supervisor_gone(rec)}


def _ago(wall) -> str:
    if not isinstance(wall, (int, float)):
        return ""
    s = max(0, int(time.time() - wall))
    if s >= 2 * 86400:
        return f", {s // 86400} days ago"
    if s >= 3600:
        return f", {s // 3600}h{s % 3600 // 60:02d}m ago"
    return f", {s // 60}m{s % 60:02d}s ago" if s >= 60 else f", {s}s ago"


def recorded_text(rec: dict) -> str:
    """A few lines: the recorded state and what became of its supervisor, then the run's facts."""
    state = rec.get("state") or "unknown"
    pid = (rec.get("supervisor") or {}).get("pid") if isinstance(rec.get("supervisor"), dict) else None
    head = f"state: {state} (as last recorded{_ago(rec.get('updated_wall'))})"
    if state in run_state.FINAL_STATES:
        head += f": {rec['why']}" if rec.get("why") else ""
        head += f" — exit {rec['exit_code']}" if rec.get("exit_code") is not None else ""
    elif rec.get("supervisor_gone"):
        head += f" — the supervisor (pid {pid}) is gone: the run is not being watched"
    elif rec.get("supervisor_gone") is False:
        head += f" — the supervisor (pid {pid}) is alive but did not answer on its socket"
    else:
        head += " — no supervisor answered, and the record does not say which one wrote it"
    lines = [head]
    facts = [
        f"attempt {rec.get('attempt')}" if rec.get("attempt") is not None else None,
        f"{rec['restarts']} restart(s)" if rec.get("restarts") else None,
        f"{rec['incidents']} incident(s)" if rec.get("incidents") else None,
    ]
    if any(facts):
        lines.append("  " + ", ".join(f for f in facts if f))
    last = rec.get("last_incident")
    if isinstance(last, dict) and last.get("id"):
        lines.append(
            f"  last incident {last.get('id')} {last.get('kind') or ''}: {last.get('summary') or ''}".rstrip(": ")
        )
    if rec.get("last_good_checkpoint"):
        step = f" (step {rec['last_good_step']})" if rec.get("last_good_step") is not None else ""
        lines.append(f"  last good checkpoint {rec['last_good_checkpoint']}{step}")
    fr = rec.get("framework_remediation")
    if isinstance(fr, dict) and fr.get("words"):
        lines.append(f"  remediation {fr['words']}")
    if rec.get("run_dir"):
        lines.append(f"  run dir {rec['run_dir']}")
    return "\n".join(lines)
