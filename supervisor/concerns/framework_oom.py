"""An unedited HF Trainer / TRL / Lightning script that runs out of memory in training: one restart with the
framework's own per-device batch halved and its gradient accumulation doubled (the examples per optimizer step kept),
again on each further OOM, down to per-device batch 1; an OOM there ends the run.

What the script trains with is only known from the script's own process: at each `train()` / `fit()` the automatic
instrumentation writes `attempts/NNNN/framework-rank<R>.json` (`daemon.autoinstrument.oom_batch`): the framework,
the batch and accumulation the script asks for, what it runs with, whether hangwatch can change them and why not.
After an attempt that ended in an OOM (incident kind `oom`, a training step's: phase `train`) this concern reads the
main rank's file and decides (`decide`, pure):

  * a batch hangwatch can change, above 1: the next setting (`next_setting`: the OOM ladder's rule,
    `common.oom_ladder`, without its gradient-checkpointing rung — half, or the largest divisor at most half when the
    batch is odd, so that batch × accumulation stays exactly what it was), recorded durably (through the run's
    `FsOps`) in `<run_dir>/framework-remediation.json` before the restart (the next attempt's instrumentation reads
    it), the policy's restart kept with `rollback` set (a restart with another setting is no repetition for
    `repeated_failure`), the incident amended (`framework_remediation`: what was changed, the OOM's figures);
  * per-device batch 1 already: the run fails, with the figures and what is left to change;
  * no framework Trainer reached training, a batch it cannot change (a plain loop, a Lightning module without a
    `batch_size` attribute, a DataLoader passed to `fit()`), a remedy the attempt did not apply, an OOM outside a
    training step: nothing is decided here — the incident says why — and a second identical failure ends the run
    (`repeated_failure`, registered after this concern, whose words name the argument recorded here).

Registered for a script (`worker.command`) with `worker.instrument: auto` and `restart.oom_remediation` on.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import structlog

from hangwatch.common.durable import FsOps
from hangwatch.common.oom_ladder import Rung, next_rung
from hangwatch.common.rundir import FRAMEWORK_REMEDIATION_NAME, framework_setting_name, read_json, tail_text
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import OutcomeReached, Prepared
from hangwatch.supervisor.rules.answer import Answer, Write
from hangwatch.supervisor.rules.oom_evidence import gib, parse_oom_message
from hangwatch.supervisor.rules.policy import Decision

log = structlog.get_logger("hangwatch")

FORMAT_VERSION = 1  # keep in step with daemon.autoinstrument.oom_batch.FORMAT_VERSION (a test checks)
OOM_KIND = "oom"
TRAIN_PHASE = "train"
LABELS = {"hf": "HF Trainer", "lightning": "Lightning Trainer"}
LOG_TAIL_BYTES = 256 * 1024
OOM_LINE = re.compile(r"(OutOfMemoryError|out of memory)", re.I)


# ---- the pure part ---------------------------------------------------------------------------------------


def next_setting(batch: int, accumulation: int) -> Optional[tuple[int, int]]:
    """The setting after an OOM at `batch` × `accumulation`: the batch halved (an odd one: its largest divisor at
    most half, so that the product stays exact) and the accumulation multiplied to match; None at batch 1 (the
    script's model is not hangwatch's to checkpoint: no gradient-checkpointing rung)."""
    to = next_rung(Rung(batch, accumulation), checkpointing=False)
    return None if to is None else (to.micro_batch_size, to.grad_accum)


def oom_words(figures: Optional[dict]) -> Optional[str]:
    """The OOM message's figures in a line: "Tried to allocate 2.0 GiB; 3.6 GiB allowed; 1.5 GiB already allocated
    by PyTorch; GPU 0: 1.0 GiB free of 80 GiB"."""
    if not figures:
        return None
    parts = [f"Tried to allocate {gib(figures['tried_mb'])}"]
    if figures.get("allowed_mb") is not None:
        parts.append(f"{gib(figures['allowed_mb'])} allowed")
    if figures.get("allocated_mb") is not None:
        parts.append(f"{gib(figures['allocated_mb'])} already allocated by PyTorch")
    if figures.get("free_mb") is not None and figures.get("total_mb") is not None:
        parts.append(f"GPU {figures.get('gpu', 0)}: {gib(figures['free_mb'])} free of {gib(figures['total_mb'])}")
    return "; ".join(parts)


def argument_words(found: Optional[dict]) -> Optional[str]:
    """The framework argument that holds the batch, for words: "per_device_train_batch_size (HF Trainer)",
    "the batch_size of the DataLoader your script builds (Lightning Trainer)"; None without a framework."""
    if not isinstance(found, dict) or found.get("framework") not in LABELS:
        return None
    label = LABELS[found["framework"]]
    if found.get("changeable") or found["framework"] == "hf":
        return f"{(found.get('arguments') or {}).get('batch') or 'the batch size'} ({label})"
    return f"the batch_size of the DataLoader your script builds ({label})"


def trainer_label(found: dict) -> str:
    """ "HF Trainer", "SFTTrainer (an HF Trainer)", "Lightning Trainer (module Regressor)"."""
    name = found.get("trainer")
    if found.get("framework") == "hf":
        return "HF Trainer" if name in (None, "Trainer") else f"{name} (an HF Trainer)"
    return "Lightning Trainer" + (f" (module {name})" if name else "")


def setting_words(found: dict, s: dict) -> str:
    args = found.get("arguments") or {}
    return f"{args.get('batch', 'batch')} {s['batch']} × {args.get('accumulation', 'accumulation')} {s['accumulation']}"


@dataclass(frozen=True)
class Verdict:
    """What an OOM of a script leads to: `action` "restart_with" (`to`), "failed" (batch 1 already) or "none"
    (nothing this concern can do: `why`), and the words."""

    action: str
    message: str
    to: Optional[dict] = None
    why: Optional[str] = None
    fields: dict = field(default_factory=dict)

    def incident_fields(self) -> dict:
        return {
            "action": self.action,
            "message": self.message,
            **({"why": self.why} if self.why else {}),
            **self.fields,
        }


def _valid_setting(s: Any) -> Optional[dict]:
    if not isinstance(s, dict):
        return None
    b, a = s.get("batch"), s.get("accumulation")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (b, a)):
        return None
    return {"batch": b, "accumulation": a}


def decide(record: Optional[dict], found: Optional[dict], phase: Optional[str], figures: Optional[dict]) -> Verdict:
    """The verdict on an OOM in an attempt whose main rank wrote `found` (None: no framework Trainer reached
    training), with the run's remediation record `record` (None: none yet), in `phase`, with the OOM message's
    `figures` (None: no torch message)."""
    said = oom_words(figures)
    base_fields: dict[str, Any] = {"oom": figures, "oom_words": said} if figures else {}
    argument = argument_words(found)
    if argument:
        base_fields["argument"] = argument
    tail = f" ({said})" if said else ""

    def none(why: str) -> Verdict:
        return Verdict("none", f"out of memory{tail}; the batch is not changed: {why}", why=why, fields=base_fields)

    if not isinstance(found, dict) or found.get("framework") not in LABELS:
        return none(
            "no HF, TRL or Lightning Trainer started training in this attempt, so hangwatch cannot change its batch"
        )
    label = trainer_label(found)
    if phase not in (None, TRAIN_PHASE):
        return none(
            f"it ran out of memory in phase '{phase}', not in a training step: the training batch is not what ran out"
        )
    if not found.get("changeable"):
        return none(f"the {label}'s batch cannot be changed: {found.get('why_fixed') or 'no reason given'}")
    if found.get("applied") is False:
        return none(f"the {label} did not apply the last remedy: {found.get('why_not_applied') or 'no reason given'}")
    now, asked = _valid_setting(found.get("now")), _valid_setting(found.get("asked"))
    if now is None or asked is None:
        return none(f"the {label} reported no per-device batch and accumulation")
    fields = {**base_fields, "framework": found["framework"], "from": now}
    if record is not None and found.get("applied") is not True:
        return none(f"the {label} did not read the remedy recorded in {FRAMEWORK_REMEDIATION_NAME}")
    to = next_setting(now["batch"], now["accumulation"])
    if to is None:
        batch_arg = (found.get("arguments") or {}).get("batch", "batch")
        why = f"{batch_arg} is 1 already: nothing smaller to try"
        return Verdict(
            "failed",
            f"out of memory at {setting_words(found, now)} in the {label}{tail}: {why}; shorten the sequences "
            "(max_length), turn on gradient checkpointing, use a smaller model or a device with more memory",
            why=why,
            fields=fields,
        )
    new = {"batch": to[0], "accumulation": to[1]}
    return Verdict(
        "restart_with",
        f"out of memory in the {label}{tail}: the next attempt trains with "
        f"{setting_words(found, new)} (was {setting_words(found, now)}; {new['batch'] * new['accumulation']} examples "
        "per optimizer step, as before)",
        to=new,
        fields={**fields, "to": new},
    )


def recorded(
    record: Optional[dict], found: dict, verdict: Verdict, *, attempt: int, step: Optional[int], incident: str, t: float
) -> dict:
    """The record after `verdict` (a restart with a new setting) is applied: the new setting, one more history entry;
    `configured` is the first remedy's `asked` (what the script itself asks for)."""
    configured = (record or {}).get("configured") or _valid_setting(found.get("asked"))
    history = list((record or {}).get("history") or [])
    history.append(
        {
            "attempt": attempt,
            "step": step,
            "incident": incident,
            "from": verdict.fields.get("from"),
            "to": verdict.to,
            "oom": verdict.fields.get("oom"),
            "t": t,
        }
    )
    return {
        "version": FORMAT_VERSION,
        "framework": found["framework"],
        "arguments": found.get("arguments"),
        "configured": configured,
        **verdict.to,
        "history": history,
    }


def summary(record: Optional[dict]) -> Optional[dict]:
    """For `status` and state.json: the setting a script runs with after its OOMs, None when there is none."""
    if not isinstance(record, dict) or record.get("framework") not in LABELS:
        return None
    base, now = _valid_setting(record.get("configured")), _valid_setting(record)
    if base is None or now is None:
        return None
    found = {"arguments": record.get("arguments") or {}}
    restarts = len(record.get("history") or [])
    return {
        "framework": record["framework"],
        "configured": base,
        "now": now,
        "oom_restarts": restarts,
        "words": f"{LABELS[record['framework']]}: {setting_words(found, base)} → {now['batch']} × "
        f"{now['accumulation']} after {restarts} out-of-memory restart(s)",
    }


# ---- the files -----------------------------------------------------------------------------------------------


def path_for(run_dir: os.PathLike | str) -> Path:
    return Path(run_dir) / FRAMEWORK_REMEDIATION_NAME


def load(run_dir: os.PathLike | str) -> Optional[dict]:
    """The run's record, or None (none yet, or unreadable)."""
    record = read_json(path_for(run_dir))
    return record if isinstance(record, dict) and record.get("version") == FORMAT_VERSION else None


def save(run_dir: os.PathLike | str, record: dict, fs: Optional[FsOps] = None) -> Path:
    """Durably, through `fs` (the run's write seam): the next attempt, possibly under another supervisor, must find
    it.  Indented by 2, as it always was."""
    w = Write.json(path_for(run_dir), record)
    (fs or FsOps()).write_file(w.path, w.data)
    return w.path


def found_in(attempt_dir: os.PathLike | str, rank: int = 0) -> Optional[dict]:
    """What rank `rank`'s framework Trainer wrote in the attempt (None: none reached training, or unreadable)."""
    found = read_json(Path(attempt_dir) / framework_setting_name(rank))
    return found if isinstance(found, dict) else None


def oom_text(classification: str, log_path: Optional[os.PathLike | str]) -> Optional[str]:
    """torch's OOM message of the attempt: the classification's, else the last OOM line of the worker log."""
    if parse_oom_message(classification) is not None:
        return classification
    if log_path is None:
        return None
    lines = tail_text(log_path, max_lines=5000, max_bytes=LOG_TAIL_BYTES).splitlines()
    return next((line for line in reversed(lines) if OOM_LINE.search(line) and parse_oom_message(line)), None)


# ---- the concern ---------------------------------------------------------------------------------------------


class FrameworkOom(Concern):
    priority = 20  # `decision`: after the built-in worker's OOM remedy (never both registered): a script's batch

    def __post_init__(self) -> None:
        self.name = "framework_oom"
        self.record: Optional[dict] = None

    def on_prepared(self, ev: Prepared) -> None:
        self.record = load(self.run.run_dir)

    def decision(self, attempt, episode, decision, now: float) -> Optional[Answer]:
        inc = episode.incident
        if inc is None or decision is None or episode.kind != OOM_KIND:
            return None
        data = inc.data
        rank = data.get("culprit_rank") if isinstance(data.get("culprit_rank"), int) else 0
        found = found_in(attempt.dir, rank)
        text = oom_text(str(data.get("classification") or ""), getattr(attempt.worker, "log_path", None))
        record = load(self.run.run_dir)
        verdict = decide(record, found, data.get("phase"), parse_oom_message(text))
        log.warning("framework_oom", incident=inc.id, action=verdict.action, message=verdict.message)
        fields = {"framework_remediation": verdict.incident_fields()}
        if verdict.action == "failed" and decision.action == "restart":
            return Answer(Decision("fail", verdict.message), fields)
        if verdict.action == "restart_with" and decision.action != "restart":  # a crash loop, a stop: no restart
            fields["framework_remediation"].update(applied=False, why_not=f"no restart follows: {decision.reason}")
        if verdict.action != "restart_with" or decision.action != "restart":
            return Answer(None, fields)
        new = recorded(
            record, found, verdict, attempt=attempt.number, step=data.get("step"), incident=inc.id, t=time.time()
        )

        def refused(exc: OSError) -> Answer:  # the smaller batch must reach the next attempt through the file
            why = f"out of memory; the smaller batch could not be recorded: {exc}"
            return Answer(
                Decision("fail", why), {"framework_remediation": Verdict("none", why, why=str(exc)).incident_fields()}
            )

        return Answer(
            Decision("restart", f"{decision.reason}; {verdict.message}", delay_s=decision.delay_s, rollback=True),
            fields,
            writes=(Write.json(path_for(self.run.run_dir), new),),
            refused=refused,
        )

    def on_outcome(self, ev: OutcomeReached) -> None:
        self.record = load(self.run.run_dir)  # what the decision wrote, for `status` until the next one

    def readers(self, now: float) -> dict[str, Callable[[], Any]]:
        record = self.record
        return {"framework_remediation": lambda: summary(record)}
