"""The control socket's wire format: one JSON object per line each way, and what a handler returns.

    → {"cmd": "status", ...}
    ← {"ok": true, "result": {...}}   or   {"ok": false, "error": "..."}

Requests are JSON only: nothing a client sends is ever unpickled or evaluated.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable


@runtime_checkable
class Pending(Protocol):
    """A reply that is not ready yet (a `dump` waits for the stack files to stop growing).

    The server keeps the client waiting, asks `ready(now)` on every `poll()`, and sends `reply()` once
    it is ready; the loop never sleeps for it.  `now` is the server's clock (monotonic seconds).
    """

    def ready(self, now: float) -> bool: ...

    def reply(self) -> dict: ...


Handler = Callable[[dict], Union[dict, Pending]]


def parse_request(line: bytes) -> tuple[Optional[dict], Optional[str]]:
    """(request, None) or (None, why it is not one)."""
    try:
        req = json.loads(line)
    except UnicodeDecodeError:
        return None, "request is not UTF-8"
    except ValueError as exc:
        return None, f"request is not valid JSON: {exc}"
    if not isinstance(req, dict):
        return None, f"request must be a JSON object, got {type(req).__name__}"
    cmd = req.get("cmd")
    if cmd is None:
        return None, 'request has no "cmd"'
    if not isinstance(cmd, str):
        return None, '"cmd" must be a string'
    return req, None


def encode_reply(reply: Any) -> bytes:
    """One JSON line; non-finite floats (a NaN loss) become the strings "NaN"/"Infinity" so strict parsers cope."""
    return (json.dumps(_finite(reply), separators=(",", ":"), default=str, allow_nan=False) + "\n").encode()


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def error_reply(message: str) -> dict:
    return {"ok": False, "error": message}
