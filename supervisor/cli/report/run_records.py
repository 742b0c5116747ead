"""What a run dir says about the run, read into plain records for the report (no plotting here).

* steps: every `step` beat of the main rank (the lowest rank that wrote a heartbeat file) of every attempt:
  attempt, step, wall time, loss, lr, tokens/s and step time (the beat's own `step_time_s`, else the time
  since the attempt's previous step beat);
* attempts: number, first and last step, when they started, what they resumed from;
* incidents: incident.json of each, with the steps lost (the step it hit minus the step the next attempt
  resumed from) and the time to recover (its detection → the next attempt's first step beat);
* generations: `evolution.jsonl` (prompt, reference, output per eval step);
* goodput: goodput.json, the goodput ledger (seconds per category, the timeline of segments), or None;
* audits: resume-audit.json, one record per restart that resumed; where the file is missing, the records
  the incidents carry under `resume_audit`;
* state: state.json (the final or current state).
A torn or foreign line is skipped, a missing file is an empty list: a report of a run that is still
running, or of a partial copy, still renders.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from hangwatch.common.rundir import ATTEMPTS, INCIDENTS, STATE_NAME, read_json
from hangwatch.supervisor.incidents import frame_str
from hangwatch.supervisor.incidents.store import RECORD_NAME
from hangwatch.supervisor.records.goodput import read_goodput
from hangwatch.supervisor.watch.replay_check import AUDITS_NAME

EVOLUTION = "evolution.jsonl"
_RANK_FILE = re.compile(r"^heartbeat-rank(\d+)\.jsonl$")


@dataclass
class RunData:
    run_dir: Path
    state: dict = field(default_factory=dict)
    steps: list[dict] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)
    incidents: list[dict] = field(default_factory=list)
    generations: list[dict] = field(default_factory=list)
    goodput: Optional[dict] = None
    audits: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.run_dir.resolve().name


def _lines(path: Path) -> Iterator[dict]:
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    yield rec
    except OSError:
        return


def _num(v) -> Optional[float]:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def _main_rank_file(attempt_dir: Path) -> Optional[Path]:
    found = sorted(
        (int(m.group(1)), p) for p in attempt_dir.glob("heartbeat-rank*.jsonl") if (m := _RANK_FILE.match(p.name))
    )
    return found[0][1] if found else None


def read_attempts(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(steps, attempts) of every attempt's main rank, in attempt order."""
    steps, attempts = [], []
    base = run_dir / ATTEMPTS
    for d in sorted(base.iterdir() if base.is_dir() else ()):
        if not d.is_dir() or not d.name.isdigit():
            continue
        number = int(d.name)
        hb = _main_rank_file(d)
        info = {
            "attempt": number,
            "started_t": None,
            "resumed_from": None,
            "first_step": None,
            "last_step": None,
            "first_step_t": None,
            "stop": None,
        }
        prev_t: Optional[float] = None
        for rec in _lines(hb) if hb else ():
            ev, t = rec.get("event"), _num(rec.get("t"))
            if ev == "start" and info["started_t"] is None:
                info["started_t"], info["resumed_from"] = t, rec.get("resumed_from")
            elif ev == "stop":
                info["stop"] = rec.get("reason")
            elif ev == "step" and isinstance(rec.get("step"), int):
                own = _num(rec.get("step_time_s"))
                step_s = own if own is not None else (t - prev_t if t is not None and prev_t is not None else None)
                prev_t = t
                loss = _num(rec.get("loss"))
                steps.append(
                    {
                        "attempt": number,
                        "step": rec["step"],
                        "t": t,
                        "loss": loss,
                        "finite": loss is None or math.isfinite(loss),
                        "lr": _num(rec.get("lr")),
                        "tokens_per_s": _num(rec.get("tokens_per_s")),
                        "step_s": step_s,
                    }
                )
                if info["first_step"] is None:
                    info["first_step"], info["first_step_t"] = rec["step"], t
                info["last_step"] = rec["step"]
        attempts.append(info)
    return steps, attempts


def read_incidents(run_dir: Path, attempts: list[dict]) -> list[dict]:
    """Every incident, with the figures the report's table shows."""
    out = []
    base = run_dir / INCIDENTS
    by_number = {a["attempt"]: a for a in attempts}
    for d in sorted(base.iterdir() if base.is_dir() else ()):
        rec = read_json(d / RECORD_NAME) if d.is_dir() else None
        if not rec:
            continue
        nxt = by_number.get((rec.get("attempt") or 0) + 1)
        step = rec.get("step")
        resumed = nxt.get("first_step") - 1 if nxt and nxt.get("first_step") is not None else rec.get("last_good_step")
        lost = step - max(resumed, 0) if isinstance(step, int) and isinstance(resumed, int) else None
        detected = _num(rec.get("time_unix"))
        recover = nxt["first_step_t"] - detected if nxt and nxt.get("first_step_t") and detected else None
        deadline = rec.get("deadline") or {}
        rank = rec.get("culprit_rank", rec.get("dump_rank"))
        frame = rec.get("stuck_frame")
        what = str(rec.get("classification") or "")
        if frame and what.endswith(f" at {frame_str(frame)}"):  # the frame has its own column
            what = what[: -len(f" at {frame_str(frame)}")]
        out.append(
            {
                "id": rec.get("id"),
                "kind": rec.get("kind"),
                "attempt": rec.get("attempt"),
                "step": step,
                "time": rec.get("time"),
                "time_unix": detected,
                "dir": str(d),
                "culprit": (f"rank {rank}: " if rank is not None else "") + what,
                "frame": frame_str(frame) if frame else "",
                "frame_short": f"{frame['function']} ({Path(str(frame['file'])).name}:{frame['line']})"
                if frame
                else "",
                "detected_after_s": deadline.get("elapsed_s"),
                "deadline": deadline.get("name"),
                "steps_lost": lost if lost is None or lost >= 0 else 0,
                "recover_s": round(recover, 1) if recover else None,
                "summary": (rec.get("summary") or "") + healed_words(rec),
                "decision": (rec.get("decision") or {}).get("action"),
            }
        )
    return out


def healed_words(rec: dict) -> str:
    """What an incident's self-healing did, after its summary: a script's batch after an OOM."""
    fr = rec.get("framework_remediation")
    return f" — {fr['message']}" if isinstance(fr, dict) and fr.get("message") else ""


def read_generations(run_dir: Path) -> list[dict]:
    return [
        {
            k: rec.get(k)
            for k in (
                "step",
                "prompt",
                "reference",
                "output",
                "loss",
                "attempt",
                "truncated",
                "tokens",
                "skipped_prompts",
            )
        }
        for rec in _lines(run_dir / EVOLUTION)
        if isinstance(rec.get("step"), int) and "prompt" in rec
    ]


def read_resume_audits(run_dir) -> list[dict]:
    """The resume audits in attempt order: resume-audit.json, else what the incidents carry under `resume_audit`
    (a run dir copied without the file, or written before the audit had its own file)."""
    run_dir = Path(run_dir)
    data = read_json(run_dir / AUDITS_NAME)
    if isinstance(data, dict) and isinstance(data.get("audits"), list):
        return [a for a in data["audits"] if isinstance(a, dict)]
    out, seen = [], set()
    base = run_dir / INCIDENTS
    for d in sorted(base.iterdir() if base.is_dir() else ()):
        rec = read_json(d / RECORD_NAME) if d.is_dir() else None
        audit = rec.get("resume_audit") if isinstance(rec, dict) else None
        if not isinstance(audit, dict):
            continue
        attempt = audit.get("attempt")
        if attempt is not None and attempt in seen:  # one audit per restart, whichever incidents repeat it
            continue
        seen.add(attempt)
        out.append({**audit, "incident": audit.get("incident") or rec.get("id")})
    return sorted(out, key=lambda a: a.get("attempt") if isinstance(a.get("attempt"), int) else 0)


def read_run(run_dir) -> RunData:
    run_dir = Path(run_dir)
    steps, attempts = read_attempts(run_dir)
    return RunData(
        run_dir=run_dir,
        state=read_json(run_dir / STATE_NAME) or {},
        steps=steps,
        attempts=attempts,
        incidents=read_incidents(run_dir, attempts),
        generations=read_generations(run_dir),
        goodput=read_goodput(run_dir),
        audits=read_resume_audits(run_dir),
    )
