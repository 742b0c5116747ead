"""The shape of one training example, the JSON object on a line of `data.train` / `data.eval`.

Either `{"prompt": ..., "completion": ...}` or `{"messages": [{"role", "content"}, ...]}` ending with
the assistant's turn.  Standard library only, so that `hangwatch validate-config` (the supervisor side,
which must not import the worker) checks the first lines of a data file by the same rule the worker
trains by; tokenizing and lengths stay with the worker (`hangwatch.daemon.data`).
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant")
EXPECTED = 'each line must be {"prompt", "completion"} or {"messages": [...]}'  # what a rejection expected
# Why a file whose first line is not an example is refused outright, where a bad line further on is only skipped:
# it is the wrong format (CSV, a JSON array, pretty-printed JSON), a header, or a byte-order mark.
FIRST_LINE_WHY = "the first line of a data file must be an example (a header, a byte-order mark or another format?)"


class ExampleRejected(ValueError):
    """An example that cannot train; the message says why."""


def _check_text(obj: dict, key: str) -> str:
    value = obj.get(key)
    if value is None:
        raise ExampleRejected(f"missing key '{key}'")
    if not isinstance(value, str):
        raise ExampleRejected(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def messages_of(obj: Any) -> list[dict]:
    """The conversation a JSONL object describes (prompt/completion becomes user/assistant)."""
    if not isinstance(obj, dict):
        raise ExampleRejected(f"expected a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        extra = set(obj) & {"prompt", "completion"}
        if extra:
            raise ExampleRejected(f"has both 'messages' and {sorted(extra)}: use one format per line")
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ExampleRejected("'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict):
                raise ExampleRejected(f"messages[{i}] must be an object with 'role' and 'content'")
            role = m.get("role")
            if role not in ROLES:
                raise ExampleRejected(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
            _check_text(m, "content")
        if msgs[-1]["role"] != "assistant":
            raise ExampleRejected("the last message must be the assistant's (it is what is learned)")
        if len(msgs) < 2:
            raise ExampleRejected("'messages' needs at least one turn before the assistant's")
        return [{"role": m["role"], "content": m["content"]} for m in msgs]
    if "prompt" in obj or "completion" in obj:
        prompt = _check_text(obj, "prompt")
        completion = _check_text(obj, "completion")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    raise ExampleRejected("expected keys 'prompt' and 'completion', or 'messages'")


def parse_line(line: bytes) -> Any:
    """The JSON value on one line of a data file (bytes as read); ExampleRejected when it is not UTF-8 text
    or not JSON.  The one reading of a line: the worker (`data.validate_file`), `validate-config`
    (`config.deep`) and the doctor all go through it, so that none of them stumbles on a line another
    one skips."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ExampleRejected(f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ExampleRejected(f"not valid JSON: {exc}") from None


def first_line_problem(lines) -> Any:
    """(line number, why) when the first non-blank line of `lines` (bytes, in file order) is not an example; None
    when it is, or when there is no such line.  The rule validate-config and the doctor refuse a file by."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            example_of_line(line)
        except ExampleRejected as exc:
            return lineno, str(exc)
        return None
    return None


def example_of_line(line: bytes) -> Any:
    """The example object on one line, checked by the rule the worker trains by (`messages_of`)."""
    obj = parse_line(line)
    messages_of(obj)
    return obj
