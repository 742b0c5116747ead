"""OOM remediation for the built-in worker: what the next attempt runs with after an out-of-memory failure, and
`remediation.json`, where that is kept so that it survives a supervisor restart.  Pure decisions plus one small file.

The first OOM of a run restarts with a micro-batch picked from the memory evidence when it holds together
(`oom_evidence`); without it, and for every later OOM, the ladder (`next_setting`, table-tested): the micro-batch
halved and the accumulation doubled (the effective batch, the data order and the LR schedule unchanged), down to 1,
then gradient checkpointing, then the run ends `failed` naming everything tried.  Each remedy says its `basis`
("evidence" with the figures, or "ladder" with why).  The derivation, the file's format and what the worker does with
it: docs/self-healing.md ("An OOM fixes itself").  The worker reads the file at start (`daemon.trainer.remediation`); a
config whose batch no longer matches the file's `configured` setting ignores it.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from hangwatch.common.durable import write_json_atomic
from hangwatch.common.rundir import QUARANTINE_NAME, read_json, read_jsonl
from hangwatch.supervisor.concerns import oom_evidence
from hangwatch.supervisor.concerns.oom_evidence import gib

REMEDIATION_NAME = "remediation.json"
FORMAT_VERSION = 1
OOM_KIND = "oom"


@dataclass(frozen=True)
class Setting:
    """The memory-relevant training setting of an attempt."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool = False

    @property
    def effective(self) -> int:
        """Examples per optimizer step and rank (micro-batch × accumulation)."""
        return self.micro_batch_size * self.grad_accum

    def words(self) -> str:
        return f"micro_batch_size {self.micro_batch_size} × grad_accum {self.grad_accum}" + (
            ", gradient checkpointing" if self.gradient_checkpointing else ""
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def configured(cfg) -> Setting:
    """The setting the config asks for (`model.gradient_checkpointing` absent from older schemas counts as off)."""
    return Setting(
        int(cfg.train.micro_batch_size),
        int(cfg.train.grad_accum),
        bool(getattr(cfg.model, "gradient_checkpointing", False)),
    )


def smaller_micro(micro: int) -> Optional[int]:
    """The next micro-batch size down: half of it, or its largest divisor at most half (so that the effective
    batch stays exact); None at 1."""
    if micro <= 1:
        return None
    return max(d for d in range(1, micro // 2 + 1) if micro % d == 0)


def next_setting(s: Setting) -> Optional[Setting]:
    """The rung after `s` on the ladder; None: nothing is left to try."""
    m = smaller_micro(s.micro_batch_size)
    if m is not None:
        return Setting(m, s.grad_accum * (s.micro_batch_size // m), s.gradient_checkpointing)
    if not s.gradient_checkpointing:
        return Setting(s.micro_batch_size, s.grad_accum, True)
    return None


def tried_words(record: Optional[dict], base: Setting) -> str:
    """Everything tried so far, in order, for the message of a run that ran out of rungs."""
    steps = [base.words()] + [Setting(**h["to"]).words() for h in (record or {}).get("history", [])]
    return " → ".join(steps)


@dataclass(frozen=True)
class Remedy:
    """What one out-of-memory failure leads to: a new setting (`to`), or none (`exhausted`) with why; decided from
    the evidence (`basis` "evidence", its `evidence` figures) or by the ladder (`why` the evidence did not do)."""

    from_: Setting
    to: Optional[Setting]
    message: str
    basis: str = "ladder"
    evidence: Optional[dict] = None
    why: Optional[str] = None

    @property
    def exhausted(self) -> bool:
        return self.to is None

    def basis_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {"basis": self.basis}
        if self.evidence is not None:
            out["evidence"] = self.evidence
        if self.why:
            out["why"] = self.why
        return out

    def fields(self) -> dict[str, Any]:
        """The incident's `remediation` field."""
        return {
            "action": "failed" if self.exhausted else "restart_with",
            "from": self.from_.as_dict(),
            "to": self.to.as_dict() if self.to else None,
            "message": self.message,
            **self.basis_fields(),
        }


def decide(record: Optional[dict], cfg, evidence: Optional[oom_evidence.Evidence] = None) -> Remedy:
    """The remedy for an out-of-memory failure of a run whose remediation file holds `record` (None: none yet): the
    first one, above micro-batch 2, one rung down with the new process measuring (`measured_next`; `evidence` only
    said, a lower bound); every later one, and one at micro-batch 2 or less, the ladder."""
    base = configured(cfg)
    now = current(record, cfg)
    history = record.get("history") if valid_for(record, base) else None
    if isinstance(history, list) and history:
        why = (
            f"{len(history)} out-of-memory restart(s) already: the ladder goes on from micro-batch "
            f"{now.micro_batch_size}"
        )
    elif now.micro_batch_size <= 1:
        why = "micro-batch 1 already: nothing smaller to pick"
    else:
        try:
            est, _ = oom_evidence.estimate(evidence, now.micro_batch_size)
        except (ArithmeticError, LookupError, TypeError, ValueError):  # a file that says odd things: no figures
            est = None
        if smaller_micro(now.micro_batch_size) > 1:
            return measured_next(now, est)
        why = f"micro-batch {now.micro_batch_size}: the next rung down is 1, nothing smaller to measure for"
    return ladder(record, base, now, why)


def measured_next(now: Setting, est: Optional[oom_evidence.Estimate]) -> Remedy:
    """The first OOM of a run (micro-batch > 1): the restart goes to the ladder's next rung at most, and the new
    process, before training, measures one step at micro-batch 1 (the device's peak: an upper bound of an example's
    cost) and goes lower at once when that measure says so (`daemon.trainer.loop.Trainer.probe_micro_batch`).  The
    OOM's own figures are a lower bound of the failed step's need — torch raises at the first allocation that does not
    fit — so they are said, never picked from."""
    to = next_setting(now)
    lower = ""
    if est is not None:
        lower = (
            f"; the error's own figures say at least {gib(est.need_mb)} were needed at micro-batch "
            f"{now.micro_batch_size} — a lower bound (the error comes at the first allocation that does not "
            "fit), so nothing is picked from them"
        )
    return Remedy(
        now,
        to,
        f"out of memory: restarting from the last good checkpoint at micro-batch {to.micro_batch_size} at most "
        f"(accumulation {to.grad_accum}, effective batch {to.effective} unchanged); before training, the new process "
        f"measures one step at micro-batch 1 and takes the largest micro-batch that measure says fits{lower}",
        basis="probe",
        evidence={**est.fields(), "lower_bound": True} if est is not None else None,
    )


def ladder(record: Optional[dict], base: Setting, now: Setting, why: str) -> Remedy:
    """The ladder's next rung after `now` (`why`: why the evidence did not decide), or none left."""
    to = next_setting(now)
    if to is None:
        return Remedy(
            now,
            None,
            f"out of memory with every remedy tried ({tried_words(record, base)}); lower "
            "data.max_length, use a smaller model or model.load_in_4bit, or a device with more memory",
            why=why,
        )
    what = (
        "gradient checkpointing turned on"
        if to.gradient_checkpointing and not now.gradient_checkpointing
        else f"micro-batch {now.micro_batch_size} → {to.micro_batch_size}, accumulation {now.grad_accum} → "
        f"{to.grad_accum} (effective batch {to.effective} unchanged)"
    )
    return Remedy(
        now, to, f"out of memory: restarting from the last good checkpoint with {what}; the ladder: {why}", why=why
    )


def current(record: Optional[dict], cfg) -> Setting:
    """The setting attempts run with now: the record's, when it was made for this config; else the config's."""
    base = configured(cfg)
    if not valid_for(record, base):
        return base
    return Setting(int(record["micro_batch_size"]), int(record["grad_accum"]), bool(record["gradient_checkpointing"]))


def valid_for(record: Optional[dict], base: Setting) -> bool:
    """Whether `record` applies to a config whose own setting is `base` (not stale, well formed)."""
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        return False
    try:
        if Setting(**record["configured"]) != base:
            return False
        s = Setting(int(record["micro_batch_size"]), int(record["grad_accum"]), bool(record["gradient_checkpointing"]))
    except (KeyError, TypeError, ValueError):
        return False
    return s.micro_batch_size >= 1 and s.effective == base.effective


def applied(
    record: Optional[dict],
    cfg,
    remedy: Remedy,
    *,
    attempt: int,
    step: Optional[int],
    incident: Optional[str],
    now: Optional[float] = None,
) -> dict:
    """The record after `remedy` (not exhausted) is applied: the new setting, one more history entry."""
    base = configured(cfg)
    history = list(record.get("history", [])) if valid_for(record, base) else []
    history.append(
        {
            "attempt": attempt,
            "step": step,
            "incident": incident,
            "from": remedy.from_.as_dict(),
            "to": remedy.to.as_dict(),
            "t": time.time() if now is None else now,
            **remedy.basis_fields(),
        }
    )
    probe = {"probe": {"at_most": remedy.to.micro_batch_size, "incident": incident}} if remedy.basis == "probe" else {}
    return {
        "version": FORMAT_VERSION,
        "configured": base.as_dict(),
        **remedy.to.as_dict(),
        **probe,
        "history": history,
    }


def measured(record: dict, cfg, result: dict, *, attempt: int, now: Optional[float] = None) -> dict:
    """The record after the new process measured its micro-batch (`result`, its `remediation_probe`): the pick in
    force (when it is below the rung), the probe done, one more history entry when the setting changed."""
    out = {k: v for k, v in record.items() if k != "probe"}
    to = result.get("to")
    if not isinstance(to, dict):
        return out
    try:
        after = Setting(int(to["micro_batch_size"]), int(to["grad_accum"]), bool(to["gradient_checkpointing"]))
    except (KeyError, TypeError, ValueError):
        return out
    before = current(record, cfg)
    if after.effective != before.effective or after == before:
        return out
    history = list(out.get("history", []))
    history.append(
        {
            "attempt": attempt,
            "step": None,
            "incident": (record.get("probe") or {}).get("incident"),
            "from": before.as_dict(),
            "to": after.as_dict(),
            "t": time.time() if now is None else now,
            "basis": "measured",
            "evidence": {k: result.get(k) for k in ("weights_mb", "per_example_mb", "capacity_mb", "margin")},
        }
    )
    return {**out, **after.as_dict(), "history": history}


def path_for(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / REMEDIATION_NAME


def load(run_dir: os.PathLike | str) -> Optional[dict]:
    """The run's remediation record, or None (none yet, or unreadable: then the config's setting holds)."""
    return read_json(path_for(run_dir))


def save(run_dir: os.PathLike | str, record: dict) -> Path:
    """Durably: the next attempt, possibly started by another supervisor, must find it."""
    return write_json_atomic(path_for(run_dir), record, indent=2)


def summary(record: Optional[dict], cfg) -> Optional[dict]:
    """What `status` and state.json show: the setting in force when it is not the config's, else None."""
    base = configured(cfg)
    if not valid_for(record, base):
        return None
    now = current(record, cfg)
    if now == base:
        return None
    return {
        "configured": base.as_dict(),
        "now": now.as_dict(),
        "words": f"{base.words()} → {now.words()} (OOM)",
        "oom_restarts": len(record.get("history", [])),
    }


class OomRemediation:
    """The supervisor's handle: decides and persists the remedy of each OOM failure of the built-in worker."""

    def __init__(self, cfg, run_dir: os.PathLike | str):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        # A user's own script has no micro-batch we could change; `restart.oom_remediation: false` turns it off.
        self.enabled = cfg.worker.command is None and cfg.restart.oom_remediation

    def on_failure(
        self,
        kind: str,
        *,
        attempt: int,
        step: Optional[int],
        incident: Optional[str],
        now: Optional[float] = None,
        evidence: Optional[oom_evidence.Evidence] = None,
    ) -> Optional[Remedy]:
        """For an attempt that failed with `kind`: the remedy (already saved when it is a new setting), or None
        (not an OOM, or not the built-in worker).  `evidence`: what the failed attempt left about memory."""
        if not self.enabled or kind != OOM_KIND:
            return None
        record = load(self.run_dir)
        remedy = decide(record, self.cfg, evidence)
        if not remedy.exhausted:
            save(
                self.run_dir, applied(record, self.cfg, remedy, attempt=attempt, step=step, incident=incident, now=now)
            )
        return remedy

    def summary(self) -> Optional[dict]:
        return summary(load(self.run_dir), self.cfg) if self.enabled else None


def after_exit(
    handle: OomRemediation,
    kind: Optional[str],
    incident_id: Optional[str],
    decision,
    *,
    attempt: int,
    step: Optional[int],
    now: Optional[float] = None,
    evidence: Optional[oom_evidence.Evidence] = None,
) -> tuple[Any, dict]:
    """The restart policy's `decision` on an ended attempt, with OOM remediation applied, and the fields its incident
    gains: for an out-of-memory failure the policy restarts, the remedy is saved and named in the decision's reason
    and in the incident (`remediation`); with every remedy tried the run fails instead, with the message saying what
    was tried.  Anything else: `decision` unchanged, no field."""
    from hangwatch.supervisor.rules.policy import Decision

    if decision is None or decision.action != "restart" or kind is None:
        return decision, {}
    try:
        remedy = handle.on_failure(kind, attempt=attempt, step=step, incident=incident_id, now=now, evidence=evidence)
    except OSError as exc:  # the remedy must reach the next attempt through the file: without it, it would OOM again
        return Decision("fail", f"out of memory, and the smaller micro-batch could not be recorded: {exc}"), {}
    if remedy is None:
        return decision, {}
    fields = {"remediation": remedy.fields()}
    if remedy.exhausted:
        return Decision("fail", remedy.message), fields
    return Decision("restart", f"{decision.reason}; {remedy.message}", delay_s=decision.delay_s, rollback=True), fields


def file_summary(run_dir: os.PathLike | str) -> Optional[dict]:
    """`summary` from the file alone (its own `configured`), for state.json and `status`, which have no config
    at hand: what the next attempt runs with when it is not the config's, else None."""
    record = load(run_dir)
    if not isinstance(record, dict) or not isinstance(record.get("configured"), dict):
        return None
    try:
        base = Setting(**record["configured"])
    except TypeError:
        return None
    stand_in = _ConfigLike(base)
    return summary(record, stand_in)


class _ConfigLike:
    """Just enough of a config for `configured()`: the setting a record says its config had."""

    def __init__(self, s: Setting):
        from types import SimpleNamespace

        self.train = SimpleNamespace(micro_batch_size=s.micro_batch_size, grad_accum=s.grad_accum)
        self.model = SimpleNamespace(gradient_checkpointing=s.gradient_checkpointing)


def state_fields(run_dir: os.PathLike | str) -> dict:
    """state.json's and `status`'s self-healing fields: `remediation` (the setting in force after OOMs) and
    `quarantine` (the examples kept out after non-finite losses); None each when there is nothing."""

    return {"remediation": file_summary(run_dir), "quarantine": quarantine_summary(read_quarantine(run_dir))}


# ---- the quarantine: `<run_dir>/quarantine.jsonl`, the training examples the built-in worker set aside after a
# non-finite streak (written by the worker, `daemon.trainer.quarantine`; one JSON object a line: id, reason, step,
# attempt, t), read for `status`, state.json and the `nan` incident.

MAX_IDS_SHOWN = 20  # quarantined ids shown in status and state.json


def read_quarantine(run_dir: os.PathLike | str) -> list[dict]:
    """Every well-formed record (a torn last line is skipped)."""
    return [r for r in read_jsonl(Path(run_dir) / QUARANTINE_NAME) if isinstance(r.get("id"), str)]


def quarantined_by(records: list[dict], attempt: int) -> list[dict]:
    """The records an attempt added (the `nan` incident of that attempt lists them)."""
    return [r for r in records if r.get("attempt") == attempt]


def quarantine_summary(records: list[dict]) -> Optional[dict]:
    """For `status` and state.json: how many, which (the first `MAX_IDS_SHOWN`), None when none."""
    if not records:
        return None
    ids = [r["id"] for r in records]
    return {
        "count": len(ids),
        "ids": ids[:MAX_IDS_SHOWN],
        "more": max(0, len(ids) - MAX_IDS_SHOWN),
        "file": QUARANTINE_NAME,
    }


def quarantine_fields(run_dir: os.PathLike | str, attempt: int) -> dict:
    """The `quarantined` field of attempt `attempt`'s incident (nothing when it quarantined nothing)."""
    mine = quarantined_by(read_quarantine(run_dir), attempt)
    return {"quarantined": [{k: r.get(k) for k in ("id", "reason", "step")} for r in mine]} if mine else {}
