"""Integrations for training scripts people already have: one callback each, a no-op outside hangwatch.

    transformers.py  HangwatchCallback for `transformers.Trainer`
    lightning.py     HangwatchCallback for Lightning (`lightning.pytorch` or `pytorch_lightning`)
    generation.py    the `generate` phase: progress beats every N new tokens wherever `model.generate` runs

Resuming: `resume_from()` is the last good checkpoint the supervisor hands each attempt (or None).
"""

from hangwatch.daemon.heartbeat import Heartbeat

resume_from = Heartbeat.resume_from

__all__ = ["resume_from"]

# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("heartbeat", "lastwords")
