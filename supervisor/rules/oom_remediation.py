"""OOM remediation for the built-in worker: what the next attempt runs with after an out-of-memory failure, and the
record of it kept in `remediation.json` (read and written by `records.healing`) so that it survives a supervisor
restart.  Pure decisions.

The first OOM of a run restarts with a micro-batch picked from the memory evidence when it holds together
(`oom_evidence`); without it, and for every later OOM, the ladder (`common.oom_ladder.next_rung`, table-tested): the
micro-batch halved and the accumulation doubled (the effective batch, the data order and the LR schedule unchanged),
down to 1, then gradient checkpointing, then the run ends `failed` naming everything tried.  Each remedy says its
`basis` ("evidence" with the figures, or "ladder" with why).  The derivation, the file's format and what the worker
does with it: docs/self-healing.md ("An OOM fixes itself").  The worker reads the file at start
(`daemon.trainer.remediation`); a config whose batch no longer matches the file's `configured` setting ignores it.
The supervisor's handle that decides and saves (`OomRemediation`) is the `oom_recovery` concern's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from hangwatch.common.oom_ladder import Rung, next_rung, smaller_micro
from hangwatch.supervisor.rules import oom_evidence
from hangwatch.supervisor.rules.oom_evidence import gib

FORMAT_VERSION = 1
OOM_KIND = "oom"


def configured(cfg) -> Rung:
    """The setting the config asks for (`model.gradient_checkpointing` absent from older schemas counts as off)."""
    return Rung(
        int(cfg.train.micro_batch_size),
        int(cfg.train.grad_accum),
        bool(getattr(cfg.model, "gradient_checkpointing", False)),
    )


def tried_words(record: Optional[dict], base: Rung) -> str:
    """Everything tried so far, in order, for the message of a run that ran out of rungs."""
    steps = [base.words()] + [Rung(**h["to"]).words() for h in (record or {}).get("history", [])]
    return " → ".join(steps)


@dataclass(frozen=True)
class Remedy:
    """What one out-of-memory failure leads to: a new setting (`to`), or none (`exhausted`) with why; decided from
    the evidence (`basis` "evidence", its `evidence` figures) or by the ladder (`why` the evidence did not do)."""

    from_: Rung
    to: Optional[Rung]
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


def measured_next(now: Rung, est: Optional[oom_evidence.Estimate]) -> Remedy:
    """The first OOM of a run (micro-batch > 1): the restart goes to the ladder's next rung at most, and the new
    process, before training, measures one step at micro-batch 1 (the device's peak: an upper bound of an example's
    cost) and goes lower at once when that measure says so (`daemon.trainer.loop.Trainer.probe_micro_batch`).  The
    OOM's own figures are a lower bound of the failed step's need — torch raises at the first allocation that does not
    fit — so they are said, never picked from."""
    to = next_rung(now)
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


def ladder(record: Optional[dict], base: Rung, now: Rung, why: str) -> Remedy:
    """The ladder's next rung after `now` (`why`: why the evidence did not decide), or none left."""
    to = next_rung(now)
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


def current(record: Optional[dict], cfg) -> Rung:
    """The setting attempts run with now: the record's, when it was made for this config; else the config's."""
    base = configured(cfg)
    if not valid_for(record, base):
        return base
    return Rung(int(record["micro_batch_size"]), int(record["grad_accum"]), bool(record["gradient_checkpointing"]))


def valid_for(record: Optional[dict], base: Rung) -> bool:
    """Whether `record` applies to a config whose own setting is `base` (not stale, well formed)."""
    if not isinstance(record, dict) or record.get("version") != FORMAT_VERSION:
        return False
    try:
        if Rung(**record["configured"]) != base:
            return False
        s = Rung(int(record["micro_batch_size"]), int(record["grad_accum"]), bool(record["gradient_checkpointing"]))
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
    force (when it is below the rung), the probe done, one more history entry when the setting changed, and the measure
    itself in `measures`, naming the OOM's incident (a finding of this attempt about it, joined on read:
    `incidents.store.with_findings`)."""
    out = {k: v for k, v in record.items() if k != "probe"}
    measure = {**result, "attempt": attempt, "incident": (record.get("probe") or {}).get("incident")}
    out["measures"] = [*(record.get("measures") or []), measure]
    to = result.get("to")
    if not isinstance(to, dict):
        return out
    try:
        after = Rung(int(to["micro_batch_size"]), int(to["grad_accum"]), bool(to["gradient_checkpointing"]))
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


def record_summary(record: Optional[dict]) -> Optional[dict]:
    """`summary` from the record alone (its own `configured`), for state.json and `status`, which have no config
    at hand: what the next attempt runs with when it is not the config's, else None."""
    if not isinstance(record, dict) or not isinstance(record.get("configured"), dict):
        return None
    try:
        base = Rung(**record["configured"])
    except TypeError:
        return None
    stand_in = _ConfigLike(base)
    return summary(record, stand_in)


class _ConfigLike:
    """Just enough of a config for `configured()`: the setting a record says its config had."""

    def __init__(self, s: Rung):
        from types import SimpleNamespace

        self.train = SimpleNamespace(micro_batch_size=s.micro_batch_size, grad_accum=s.grad_accum)
        self.model = SimpleNamespace(gradient_checkpointing=s.gradient_checkpointing)
