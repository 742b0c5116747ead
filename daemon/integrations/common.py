"""What every integration shares: whether the script runs under hangwatch, and the heartbeat it then writes.

Outside hangwatch (no HANGWATCH_RUN_DIR in the environment) a callback is a no-op: it writes nothing,
installs no signal handler and patches nothing, so the same script runs unchanged on a laptop.
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional

from hangwatch.common.protocol import ENV_RUN_DIR
from hangwatch.daemon.heartbeat import Heartbeat


def supervised(environ: Optional[Mapping[str, str]] = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get(ENV_RUN_DIR))


def heartbeat_or_none(environ: Optional[Mapping[str, str]] = None) -> Optional[Heartbeat]:
    """The heartbeat of this rank of this attempt when hangwatch runs the script, else None: the process's
    shared one (`Heartbeat.shared`), so a callback and the automatic instrumentation write one view."""
    if not supervised(environ):
        return None
    return Heartbeat.shared(dict(os.environ if environ is None else environ))


def as_float(value: Any) -> Optional[float]:
    """A metric as a plain float (tensors included), None when it is not a number."""
    if value is None:
        return None
    try:
        if hasattr(value, "detach"):
            value = value.detach().float().mean().item()
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def nonfinite(value: Optional[float]) -> bool:
    return value is not None and not math.isfinite(value)
