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
