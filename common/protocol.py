"""Heartbeat protocol, version 1: the wire format both sides agree on (standard library only).

One JSON object per line, written with a single `os.write` on an O_APPEND descriptor and shorter
than PIPE_BUF, so lines from several writers never interleave or tear.  Readers skip (and count) a
torn or invalid line.  See docs/run-directory.md, "Heartbeats".
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Optional

VERSION = 1
PIPE_BUF = 4096
MAX_LINE = PIPE_BUF - 96  # margin for the newline and a future field or two
DUMP_SIGNAL = "SIGUSR1"

EVENTS = ("start", "phase", "step", "progress", "checkpoint", "warn", "stop")
REQUIRED = ("v", "t", "pid", "rank", "attempt", "event", "step", "phase")

# Where the supervisor tells a worker to write, and what to resume from.
ENV_RUN_DIR = "HANGWATCH_RUN_DIR"
ENV_ATTEMPT = "HANGWATCH_ATTEMPT"
ENV_HEARTBEAT_DIR = "HANGWATCH_HEARTBEAT_DIR"
ENV_RESUME_FROM = "HANGWATCH_RESUME_FROM"

# The supervisor's order to end a runaway generate() (watchdog.generate_overrun: truncate), in the attempt's
# directory beside the heartbeat files, replaced atomically:
#   {"order": N, "tokens": LIMIT, "issued_unix": T, "budget_s": B}
# A rank's generate that was running when the order appeared stops once it has produced LIMIT new tokens
# (at once, if it already has), then says so in a `progress` line carrying `generate_truncated`
# ({"order", "limit", "tokens", ...}) before it leaves the phase.  Orders written before a generate began
# are not its orders.
GENERATE_STOP_NAME = "generate-stop.json"
TRUNCATED_FIELD = "generate_truncated"

# The supervisor's order to abandon a stuck step (`restart.in_process`, the built-in worker on one process), in the
# attempt's directory, written once the stall's stack dumps are in:
#   {"order": N, "issued_unix": T, "step": S}
# The worker raises an exception in its training thread at that thread's next bytecode, puts back the last good
# checkpoint's state (held in memory) and goes on; it answers with a `warn` line carrying RECOVERED_FIELD
# ({"kind": "stall", "order": N, ...}), or ABANDON_REFUSED_FIELD ({"order": N, "why": ...}) when it cannot (not in
# its training loop).  A thread blocked in C, in a CUDA kernel or a collective never runs that bytecode: no answer,
# and the supervisor kills the tree after `watchdog.abandon_grace_s`.
ABANDON_NAME = "abandon-step.json"
RECOVERED_FIELD = "recovered"
ABANDON_REFUSED_FIELD = "abandon_refused"

# The `stop` reason an automatically instrumented rank gives as its interpreter exits (its last Python act):
#   {"event": "stop", "reason": "exit", "code": N[, "exception": "TypeName"]}
# A rank that said it with code 0 had finished its work: a signal that ends the process after it (a crash in
# native teardown) does not make the run a failure (supervisor.rules.teardown).
EXIT_STOP_REASON = "exit"


def rank_from_env(environ: Optional[Mapping[str, str]] = None) -> int:
    env = os.environ if environ is None else environ
    try:
        return int(env.get("RANK", "0"))
    except ValueError:
        return 0


def decode_line(raw: bytes | str) -> Optional[dict]:
    """Parse one heartbeat line; None when it is torn, not JSON, or lacks a required field."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(obj, dict) or any(k not in obj for k in REQUIRED):
        return None
    if obj.get("v") != VERSION or obj.get("event") not in EVENTS:
        return None
    if not isinstance(obj.get("step"), int) or not isinstance(obj.get("pid"), int):
        return None
    return obj


def encode(rec: dict) -> bytes:
    """One line, newline included, shorter than PIPE_BUF: over-long optional fields are shortened."""
    data = (json.dumps(rec, separators=(",", ":"), default=str, allow_nan=True) + "\n").encode()
    if len(data) <= MAX_LINE:
        return data
    # Too long to stay atomic: shorten the largest optional fields rather than tear the line.
    slim = dict(rec)
    for key in sorted((k for k in rec if k not in REQUIRED), key=lambda k: -len(json.dumps(rec[k], default=str))):
        slim[key] = "<truncated>"
        slim["truncated"] = True
        data = (json.dumps(slim, separators=(",", ":"), default=str) + "\n").encode()
        if len(data) <= MAX_LINE:
            return data
    raise ValueError("heartbeat line cannot be made shorter than PIPE_BUF")
