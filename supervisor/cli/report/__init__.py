"""`hangwatch report`: a run on one self-contained HTML page that opens without a network.

    run_records.py  what the run dir holds, read into plain records: the step beats of every attempt (main rank),
                the incidents (with steps lost and time to recover), eval generations, the final state
    page.py     the page: loss, lr, step time and tokens/s over steps (plotly, its JavaScript inlined) with attempt
                boundaries and incidents marked; the incidents table; the generations per prompt over steps
    command.py  the click command (`hangwatch report [--run-dir D] [--out FILE.html] [--open]`)

Only the run dir is read: the report works on a finished run, a running one and a copy of either.
"""

from __future__ import annotations

import importlib
from typing import Any

# Loaded on first use: `hangwatch --help` and every other command import the click command only.
_NAMES = {"RunData": "run_records", "read_run": "run_records", "render": "page", "write_report": "page"}

__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    globals()[name] = value
    return value
