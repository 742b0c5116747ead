"""The out-of-memory ladder: the memory-relevant setting of a training step (`Rung`) and the rung after one that ran
out of memory (`next_rung`, table-tested in tests/unit/common/test_oom_ladder.py).  One rule for every side that
walks it:

  * the supervisor's restarts of the built-in worker (`supervisor.rules.oom_remediation`, the setting kept in
    `remediation.json`);
  * the worker's own process, a step adapted without a restart (`daemon.trainer.recovery.smaller`);
  * an HF / TRL / Lightning script's per-device batch (`supervisor.concerns.framework_oom.next_setting`), whose model
    hangwatch does not build: its ladder has no gradient-checkpointing rung (`checkpointing=False`).

A rung down: the micro-batch halved — an odd one, its largest divisor at most half — and the accumulation multiplied
to match, so that micro-batch × accumulation (the examples of an optimizer step, hence the data order and the LR
schedule) stays exactly what it was; below micro-batch 1, gradient checkpointing; then nothing is left.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Rung:
    """The memory-relevant training setting of a step or an attempt."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool = False

    @property
    def effective(self) -> int:
        """Examples per optimizer step and rank (micro-batch × accumulation)."""
        return self.micro_batch_size * self.grad_accum

    def words(self) -> str:
        gc = ", gradient checkpointing" if self.gradient_checkpointing else ""
        return f"micro_batch_size {self.micro_batch_size} × grad_accum {self.grad_accum}{gc}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def smaller_micro(micro: int) -> Optional[int]:
    """The next micro-batch size down: half of it, or its largest divisor at most half (so that the effective
    batch stays exact); None at 1."""
    if micro <= 1:
        return None
    return max(d for d in range(1, micro // 2 + 1) if micro % d == 0)


def next_rung(r: Rung, *, checkpointing: bool = True) -> Optional[Rung]:
    """The rung after `r`, which ran out of memory; None: nothing is left to try.  `checkpointing`: whether the rung
    after micro-batch 1 turns gradient checkpointing on (False: the ladder ends at micro-batch 1)."""
    m = smaller_micro(r.micro_batch_size)
    if m is not None:
        return Rung(m, r.grad_accum * (r.micro_batch_size // m), r.gradient_checkpointing)
    if checkpointing and not r.gradient_checkpointing:
        return Rung(r.micro_batch_size, r.grad_accum, True)
    return None
