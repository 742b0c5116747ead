"""The per-device batch of an unedited HF Trainer / TRL / Lightning script after an out-of-memory failure: read from
the run dir, set on the framework's own arguments before training starts, and said.

The supervisor (`supervisor.concerns.framework_oom`) answers an OOM in training with a smaller per-device batch and
a larger gradient accumulation, their product unchanged, and keeps it in `<run_dir>/framework-remediation.json`:

    {"version": 1, "framework": "hf", "configured": {"batch": 8, "accumulation": 1},
     "batch": 4, "accumulation": 2, "history": [...]}

`configured` is what the script itself asks for; `batch` × `accumulation` what the next attempt runs with.  Here, in
the rank, at the entry of `Trainer.train()` (HF, TRL's trainers) or `Trainer.fit()` (Lightning) — before the train
DataLoader is built:

  HF / TRL   `args.per_device_train_batch_size` and `args.gradient_accumulation_steps`, and the Trainer's
             `_train_batch_size` (which `train()` hands to the inner loop and `get_train_dataloader` builds from);
             not with DeepSpeed (its config was filled in from the arguments when they were made).
  Lightning  the `batch_size` attribute Lightning's own batch-size finder uses (`lightning_setattr`: the
             LightningModule, its `hparams`, the datamodule, its `hparams` — every one that has it) and
             `trainer.accumulate_grad_batches`.  Without such an attribute, with a DataLoader passed to `fit()`
             directly (its batch is fixed inside it; Lightning's finder refuses that too), with manual optimization
             or a GradientAccumulationScheduler, the batch is not hangwatch's to change: the script is then treated
             like a plain loop.

A remedy applies only when the script still asks for the record's `configured` setting and is of the record's
framework; otherwise it is left alone and said why.  Each time, the rank writes what it found —
`attempts/NNNN/framework-rank<R>.json`: the framework, the arguments' names, what the script asked for, what it
runs with, whether it could be changed and why not — which the supervisor reads after an OOM.  A remedy applied or
refused is one line on stderr (`hangwatch: …`) and one `warn` beat with a `framework_remediation` field.  A record
that cannot be read or makes no sense is said the same way and ignored: the run goes on with the script's setting.

Standard library only; every error is the hook's (`Context.failed`), never the script's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Optional

from hangwatch.common.rundir import FRAMEWORK_REMEDIATION_NAME, framework_setting_name
from hangwatch.daemon.autoinstrument.context import Context

FORMAT_VERSION = 1
HF, LIGHTNING = "hf", "lightning"
FRAMEWORKS = (HF, LIGHTNING)
LABELS = {HF: "HF Trainer", LIGHTNING: "Lightning Trainer"}
# The arguments each framework keeps its per-device batch and its accumulation in.
ARGUMENTS = {
    HF: ("per_device_train_batch_size", "gradient_accumulation_steps"),
    LIGHTNING: ("batch_size", "accumulate_grad_batches"),
}
BATCH_ATTRIBUTE = "batch_size"  # Lightning's batch-size-finder default (`BatchSizeFinder(batch_arg_name=...)`)
MAX_BYTES = 1 << 20
APPLIED_MARK = "_hangwatch_oom_batch"  # on the Trainer: the setting hangwatch set (a second train() keeps it)


def setting(batch: Any, accumulation: Any) -> Optional[dict]:
    """{"batch", "accumulation"} when both are ints ≥ 1, else None."""
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (batch, accumulation)):
        return None
    return {"batch": batch, "accumulation": accumulation}


def invalid(record: Any) -> Optional[str]:
    """Why `record` is no usable remediation record, or None when it is one."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("version") != FORMAT_VERSION:
        return "version %r, not %d" % (record.get("version"), FORMAT_VERSION)
    if record.get("framework") not in FRAMEWORKS:
        return "framework %r is none of %s" % (record.get("framework"), ", ".join(FRAMEWORKS))
    conf = record.get("configured")
    base = setting(conf.get("batch"), conf.get("accumulation")) if isinstance(conf, dict) else None
    if base is None:
        return "`configured` is not a batch and an accumulation ≥ 1"
    now = setting(record.get("batch"), record.get("accumulation"))
    if now is None:
        return "`batch` and `accumulation` are not ints ≥ 1"
    if now["batch"] * now["accumulation"] != base["batch"] * base["accumulation"]:
        return "batch %d × accumulation %d does not keep the configured effective batch %d × %d" % (
            now["batch"],
            now["accumulation"],
            base["batch"],
            base["accumulation"],
        )
    return None


def read_remedy(run_dir: Optional[str]) -> tuple[Optional[dict], Optional[str]]:
    """(the run's remediation record, None), (None, None) when there is none, or (None, why it is ignored)."""
    if not run_dir:
        return None, None
    path = os.path.join(run_dir, FRAMEWORK_REMEDIATION_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, "%s could not be read (%s); ignored" % (path, exc)
    if len(data) > MAX_BYTES:
        return None, "%s is larger than %d bytes; ignored" % (path, MAX_BYTES)
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        return None, "%s is not JSON (%s); ignored" % (path, exc)
    why = invalid(record)
    if why is not None:
        return None, "%s ignored: %s" % (path, why)
    return record, None


def plan(
    record: Optional[dict], framework: str, asked: Optional[dict], why_fixed: Optional[str]
) -> tuple[Optional[dict], Optional[str]]:
    """What to do with a valid `record` (None: none) for a Trainer of `framework` whose script asks for `asked`
    (None: unknown) and whose batch cannot be changed when `why_fixed` says why: (the setting to run with, None),
    (None, why it is not applied), or (None, None) when there is nothing to apply."""
    if record is None:
        return None, None
    if record["framework"] != framework:
        return None, "it was made for a %s, this is a %s" % (LABELS[record["framework"]], LABELS[framework])
    if why_fixed is not None:
        return None, why_fixed
    base = setting(record["configured"]["batch"], record["configured"]["accumulation"])
    if asked != base:
        return None, "it was made for %s; the script now asks for %s" % (
            words(framework, base),
            words(framework, asked),
        )
    return setting(record["batch"], record["accumulation"]), None


def words(framework: str, s: Optional[dict], names: Optional[tuple] = None) -> str:
    """ "per_device_train_batch_size 8 × gradient_accumulation_steps 1" (`names`: the arguments' names, when not
    the framework's defaults)."""
    if s is None:
        return "an unknown batch"
    batch, accumulation = names or ARGUMENTS[framework]
    return "%s %d × %s %d" % (batch, s["batch"], accumulation, s["accumulation"])


def change_words(framework: str, old: dict, new: dict, names: Optional[tuple] = None) -> str:
    """ "per_device_train_batch_size 8 → 4, gradient_accumulation_steps 1 → 2 (8 examples per optimizer step, as
    before)"."""
    batch, accumulation = names or ARGUMENTS[framework]
    return "%s %d → %d, %s %d → %d (%d examples per optimizer step, as before)" % (
        batch,
        old["batch"],
        new["batch"],
        accumulation,
        old["accumulation"],
        new["accumulation"],
        new["batch"] * new["accumulation"],
    )


# ---- the frameworks' own attributes ------------------------------------------------------------------------


def hf_fixed(args: Any) -> Optional[str]:
    """Why an HF Trainer's batch cannot be changed at train() (None: it can)."""
    if getattr(args, "deepspeed", None):
        return (
            "DeepSpeed: its config was filled in from per_device_train_batch_size and gradient_accumulation_steps "
            "when the TrainingArguments were made"
        )
    return None


def _in_hparams(obj: Any, name: str) -> bool:
    hp = getattr(obj, "hparams", None)
    try:
        return hp is not None and name in hp
    except TypeError:
        return False


def lightning_holders(model: Any, datamodule: Any, name: str = BATCH_ATTRIBUTE) -> list[tuple[str, Any]]:
    """(where, holder) of every place Lightning's batch-size finder would set `name`
    (`lightning.pytorch.utilities.parsing._lightning_get_all_attr_holders`, in its order): the LightningModule, its
    hparams, the datamodule, its hparams.  Its datamodule is the one `fit()` is given (the finder reads it from the
    Trainer, which has it only once fit() runs)."""
    holders: list[tuple[str, Any]] = []
    if hasattr(model, name):
        holders.append(("model." + name, model))
    if _in_hparams(model, name):
        holders.append(("model.hparams." + name, model.hparams))
    if datamodule is not None:
        if hasattr(datamodule, name):
            holders.append(("datamodule." + name, datamodule))
        if _in_hparams(datamodule, name):
            holders.append(("datamodule.hparams." + name, datamodule.hparams))
    return holders


def holder_value(holder: Any, name: str = BATCH_ATTRIBUTE) -> Any:
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def set_holder(holder: Any, value: int, name: str = BATCH_ATTRIBUTE) -> None:
    if isinstance(holder, dict):
        holder[name] = value
    else:
        setattr(holder, name, value)


def _named(obj: Any, name: str) -> bool:
    return any(c.__name__ == name for c in type(obj).__mro__)


def lightning_fixed(trainer: Any, model: Any, train_dataloaders: Any, holders: list) -> Optional[str]:
    """Why a Lightning fit's batch cannot be changed (None: it can)."""
    if train_dataloaders is not None:
        return (
            "the train DataLoader was passed to fit() directly: its batch size is fixed inside it (Lightning's "
            "batch-size finder refuses this too); build it in the LightningModule's or a LightningDataModule's "
            "train_dataloader() from a `batch_size` attribute"
        )
    if not holders:
        return (
            "no `batch_size` attribute on the LightningModule, its hparams or the datamodule (the attribute "
            "Lightning's batch-size finder changes): the batch is the script's own"
        )
    if getattr(model, "automatic_optimization", True) is False:
        return "manual optimization: Trainer.accumulate_grad_batches does not apply to it"
    if any(_named(cb, "GradientAccumulationScheduler") for cb in getattr(trainer, "callbacks", None) or ()):
        return "a GradientAccumulationScheduler sets accumulate_grad_batches itself"
    values = {holder_value(h) for _, h in holders}
    if len(values) != 1 or setting(next(iter(values)), 1) is None:
        return "the `batch_size` attributes (%s) are not one int ≥ 1: %r" % (
            ", ".join(w for w, _ in holders),
            sorted(values, key=repr),
        )
    return None


def all_or_nothing(apply, places: list) -> None:
    """`apply()`, which sets the attributes (or dict keys) `places`; when it fails part way, every one is put back
    as it was and the error raised: a batch halved without its accumulation doubled would change the examples per
    optimizer step."""
    missing = object()
    before = []
    for obj, name in places:
        if isinstance(obj, dict):
            before.append((obj, name, obj.get(name, missing)))
        else:
            before.append((obj, name, getattr(obj, name, missing)))
    try:
        apply()
    except BaseException:
        for obj, name, value in reversed(before):
            if value is missing:
                continue
            try:
                if isinstance(obj, dict):
                    obj[name] = value
                else:
                    setattr(obj, name, value)
            except Exception:
                pass
        raise


# ---- in the rank -------------------------------------------------------------------------------------------


class OomBatch:
    """The rank's side: at each train()/fit(), read the record, apply it or say why not, and write what it found."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.hook = ctx.hook("OOM batch")

    def hf_train(self, trainer: Any) -> None:
        """At the entry of an HF Trainer's train()."""
        args = getattr(trainer, "args", None)
        if args is None:  # no TrainingArguments: nothing of the framework's to read
            return
        batch, accumulation = ARGUMENTS[HF]
        asked = setting(getattr(args, batch, None), getattr(args, accumulation, None))
        mine = getattr(trainer, APPLIED_MARK, None)
        if mine is not None and mine["to"] == asked:  # train() again on a Trainer hangwatch already set
            return
        why_fixed = hf_fixed(args) if asked is not None else "per_device_train_batch_size is not an int ≥ 1"
        to, why = self._decide(HF, asked, why_fixed)
        if to is not None:

            def apply() -> None:
                setattr(args, batch, to["batch"])
                setattr(args, accumulation, to["accumulation"])
                if hasattr(trainer, "_train_batch_size"):
                    trainer._train_batch_size = args.train_batch_size  # what train() builds the DataLoader from

            all_or_nothing(apply, [(args, batch), (args, accumulation), (trainer, "_train_batch_size")])
            setattr(trainer, APPLIED_MARK, {"from": asked, "to": to})
        self._report(HF, type(trainer).__name__, asked, to, why, why_fixed, ARGUMENTS[HF])

    def lightning_fit(self, trainer: Any, model: Any, train_dataloaders: Any, datamodule: Any) -> None:
        """At the entry of a Lightning Trainer's fit(model, train_dataloaders, …, datamodule)."""
        if train_dataloaders is not None and _named(train_dataloaders, "LightningDataModule"):
            datamodule, train_dataloaders = train_dataloaders, None  # as fit() reads its second argument
        holders = lightning_holders(model, datamodule)
        why_fixed = lightning_fixed(trainer, model, train_dataloaders, holders)
        accumulation = getattr(trainer, "accumulate_grad_batches", None)
        asked = setting(holder_value(holders[-1][1]), accumulation) if why_fixed is None else None
        mine = getattr(trainer, APPLIED_MARK, None)
        if mine is not None and mine["to"] == asked:
            return
        to, why = self._decide(LIGHTNING, asked, why_fixed)
        if to is not None:

            def apply() -> None:
                for _, holder in holders:
                    set_holder(holder, to["batch"])
                trainer.accumulate_grad_batches = to["accumulation"]

            all_or_nothing(apply, [(h, BATCH_ATTRIBUTE) for _, h in holders] + [(trainer, "accumulate_grad_batches")])
            setattr(trainer, APPLIED_MARK, {"from": asked, "to": to})
        names = (", ".join(w for w, _ in holders) or BATCH_ATTRIBUTE, "trainer." + ARGUMENTS[LIGHTNING][1])
        self._report(LIGHTNING, type(model).__name__, asked, to, why, why_fixed, names)

    # ----

    def _decide(self, framework: str, asked: Optional[dict], why_fixed: Optional[str]) -> tuple:
        record, bad = read_remedy(self.ctx.run_dir)
        if bad is not None:
            self._say(bad, {"applied": False, "why": bad, "framework": framework})
        return plan(record, framework, asked, why_fixed)

    def _report(
        self,
        framework: str,
        trainer: str,
        asked: Optional[dict],
        to: Optional[dict],
        why: Optional[str],
        why_fixed: Optional[str],
        names: tuple,
    ) -> None:
        now = to or asked
        found = {
            "framework": framework,
            "trainer": trainer,
            "arguments": {"batch": names[0], "accumulation": names[1]},
            "asked": asked,
            "now": now,
            "changeable": why_fixed is None,
            "why_fixed": why_fixed,
            "applied": True if to is not None else (False if why is not None else None),
            "why_not_applied": why,
            "t": time.time(),
        }
        if framework == HF:
            label = LABELS[HF] if trainer == "Trainer" else "%s (an HF Trainer)" % trainer
        else:
            label = "%s (module %s)" % (LABELS[LIGHTNING], trainer)
        if to is not None:
            message = "out-of-memory remedy applied to the %s: %s [%s]" % (
                label,
                change_words(framework, asked, to, names),
                FRAMEWORK_REMEDIATION_NAME,
            )
        elif why is not None:
            message = "out-of-memory remedy not applied to the %s: %s; it trains with %s" % (
                label,
                why,
                words(framework, asked, names) if asked is not None else "the script's own batch",
            )
        else:
            message = None
        if message is not None:  # said before the file is written: a full disk must not keep it unsaid
            self._say(message, {k: found[k] for k in ("framework", "asked", "now", "applied", "why_not_applied")})
        self._write(found)

    def _write(self, found: dict) -> None:
        directory = os.path.dirname(self.ctx.hb.path) if getattr(self.ctx.hb, "path", None) else None
        if not directory:
            return
        path = os.path.join(directory, framework_setting_name(self.ctx.rank))
        tmp = "%s.tmp-%d" % (path, os.getpid())
        with open(tmp, "w") as f:
            json.dump(found, f)
        os.replace(tmp, path)

    def _say(self, message: str, fields: dict) -> None:
        try:
            sys.stderr.write("hangwatch: %s\n" % message)
            sys.stderr.flush()
        except Exception:
            pass
        if not self.ctx.hb.closed:
            self.ctx.hb.warn(message[:1000], framework_remediation=fields)


__all__ = ["OomBatch", "read_remedy", "plan", "invalid", "setting", "lightning_holders", "lightning_fixed"]
