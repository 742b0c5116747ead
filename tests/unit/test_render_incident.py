"""`hangwatch incidents ID`: multi-line texts print as text, not as escaped JSON strings."""
from __future__ import annotations

import io

from rich.console import Console

from hangwatch.supervisor.render import incident_view


def test_a_traceback_prints_as_text_under_its_key_path():
    tb = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    boom()\nValueError: boom\n'
    inc = {"id": "0001", "kind": "crash", "summary": "crash with ValueError: boom",
           "exit": {"code": 1, "last_words": {"kind": "crash", "traceback": tb}}, "files": ["a\nb"]}
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(incident_view(inc))
    text = out.getvalue()
    assert '"traceback": "<5 lines: below, under exit.last_words.traceback>"' in text
    assert "\\n" not in text  # no escaped newlines anywhere
    assert 'exit.last_words.traceback:\nTraceback (most recent call last):\n  File "t.py", line 3, in <module>' in text
    assert "files[0]:\na\nb" in text
    assert inc["exit"]["last_words"]["traceback"] == tb  # the record itself is untouched


def _shown(inc: dict) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(incident_view(inc))
    return out.getvalue()


def test_the_landmark_line_names_the_call_its_caller_and_the_outermost_own_frame():
    frame = {"file": "/venv/lib/python3.11/site-packages/transformers/generation/utils.py", "line": 3235, "function": "_sample"}
    inc = {"id": "0002", "kind": "stall", "summary": "in generate(), called from on_evaluate (train.py:46); innermost x",
           "landmark": {"name": "generate", "kind": "generate", "frame": frame, "depth": 17, "via": "stack"},
           "caller_frame": {"file": "/srv/train.py", "line": 46, "function": "on_evaluate"},
           "user_outermost_frame": {"file": "/srv/train.py", "line": 80, "function": "<module>"}, "stack_truncated": True}
    text = _shown(inc)
    assert "landmark  generate [generate] at _sample (utils.py:3235)" in text
    assert "called from on_evaluate (train.py:46)" in text and "outermost own frame <module> (train.py:80)" in text
    assert "stack truncated: faulthandler printed only its innermost 100 frames" in text
    bare = _shown({"id": "0003", "kind": "stall", "landmark": None, "caller_frame": None})
    assert "landmark  none: no landmark call on the stack" in bare and "called from: no frame of your own code" in bare
    assert "landmark " not in _shown({"id": "0001", "kind": "stall", "summary": "an incident from before landmarks"})
