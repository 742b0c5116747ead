"""What the supervisor puts in a worker's environment so that its Python processes instrument themselves.

`worker.instrument: auto` (the default for `worker.command`): every Python process of the worker tree —
the script, torchrun's ranks, accelerate's, a shell script's inner `python` — starts with hangwatch's
bootstrap directory first on `PYTHONPATH`.  Python imports `sitecustomize` from it at start-up
(`daemon/autoinstrument/boot/sitecustomize.py`): it chains to any `sitecustomize` the environment already
had, then installs the hooks (`hangwatch.daemon.autoinstrument`) — heartbeats, stack dumps, step beats,
phases, checkpoint announcements — without an edit of the user's files.

The bootstrap must also work in a Python environment that is not hangwatch's (a user's conda env with its
own torch): it brings onto that interpreter's path only hangwatch's own standard-library pieces — the
source tree of `hangwatch.common` and `hangwatch.daemon`, found through `HANGWATCH_SOURCE_ROOT` — never
hangwatch's dependencies.  An interpreter older than MIN_PYTHON is left uninstrumented and says so on its
stderr.

Standard library only: the supervisor and the bootstrap both read it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Optional

ENV_INSTRUMENT = "HANGWATCH_INSTRUMENT"  # "auto" when the bootstrap should instrument this process
ENV_SOURCE_ROOT = "HANGWATCH_SOURCE_ROOT"  # the folder holding common/ and daemon/ (hangwatch's own source)
ENV_RESUME_STEP = "HANGWATCH_RESUME_STEP"  # the optimizer step of HANGWATCH_RESUME_FROM ("" when none)
ENV_BOOT_DIR = "HANGWATCH_BOOT_DIR"  # the bootstrap directory, so the bootstrap can find its own entry on PYTHONPATH
# Set by the worker's own processes, inherited by their children (a supervisor starting a worker may drop them):
# "<rank>:<pid>:<heartbeat dir>": that rank is taken (daemon/autoinstrument/process_roles.py)
ENV_RANK_CLAIM = "HANGWATCH_RANK_CLAIM"
ENV_TOO_OLD_NOTED = "HANGWATCH_TOO_OLD_NOTED"  # a too-old interpreter said so once: its Python children stay quiet

SOURCE_ROOT = Path(__file__).resolve().parents[1]  # editable checkout: the repo; a wheel: site-packages/hangwatch
BOOT_DIR = SOURCE_ROOT / "daemon" / "autoinstrument" / "boot"
MIN_PYTHON = (3, 9)
MODES = ("auto", "off")


def instrument_env(environ: Mapping[str, str], resume_step: Optional[int] = None) -> dict[str, str]:
    """The variables to add to (or replace in) a worker's environment `environ` for automatic instrumentation:
    the bootstrap directory first on PYTHONPATH (once), where hangwatch's source is, and the step of the
    checkpoint the attempt resumes from (the step hooks count on from it)."""
    existing = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(BOOT_DIR)]
    return {
        "PYTHONPATH": os.pathsep.join([str(BOOT_DIR), *existing]),
        ENV_INSTRUMENT: "auto",
        ENV_SOURCE_ROOT: str(SOURCE_ROOT),
        ENV_BOOT_DIR: str(BOOT_DIR),
        ENV_RESUME_STEP: "" if resume_step is None else str(int(resume_step)),
    }
