"""`hangwatch incidents ID`: multi-line texts print as text, not as escaped JSON strings."""

from __future__ import annotations

import io

from rich.console import Console

from hangwatch.supervisor.cli.render import incident_view


def test_a_traceback_prints_as_text_under_its_key_path():
    tb = 'Traceback (most recent call last):\n  File "t.py", line 3, in <module>\n    boom()\nValueError: boom\n'
    inc = {
        "id": "0001",
        "kind": "crash",
        "summary": "crash with ValueError: boom",
        "exit": {"code": 1, "last_words": {"kind": "crash", "traceback": tb}},
        "files": ["a\nb"],
    }
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
    frame = {
        "file": "/venv/lib/python3.11/site-packages/transformers/generation/utils.py",
        "line": 3235,
        "function": "_sample",
    }
    inc = {
        "id": "0002",
        "kind": "stall",
        "summary": "in generate(), called from on_evaluate (train.py:46); innermost x",
        "landmark": {"name": "generate", "kind": "generate", "frame": frame, "depth": 17, "via": "stack"},
        "caller_frame": {"file": "/srv/train.py", "line": 46, "function": "on_evaluate"},
        "user_outermost_frame": {"file": "/srv/train.py", "line": 80, "function": "<module>"},
        "stack_truncated": True,
    }
    text = _shown(inc)
    assert "landmark  generate [generate] at _sample (utils.py:3235)" in text
    assert "called from on_evaluate (train.py:46)" in text and "outermost own frame <module> (train.py:80)" in text
    assert "stack truncated: faulthandler printed only its innermost 100 frames" in text
    bare = _shown({"id": "0003", "kind": "stall", "landmark": None, "caller_frame": None})
    assert "landmark  none: no landmark call on the stack" in bare and "called from: no frame of your own code" in bare
    assert "landmark " not in _shown({"id": "0001", "kind": "stall", "summary": "an incident from before landmarks"})


def test_status_shows_the_nodes_line():
    from hangwatch.supervisor.cli.render import nodes_text, status_view

    n = {
        "node": "a",
        "nnodes": 2,
        "endpoint": "127.0.0.1:29400",
        "generation": 3,
        "attempt_generation": 3,
        "store": "ok",
        "store_role": "host",
        "rdzv_id": "job-g3",
        "waiting_since": None,
        "torchrun_rounds": {"0": 1},
        "torchrun_round_changes": 1,
        "peers": {"a": {"age_s": 0.0, "state": "running", "gen": 3}, "b": {"age_s": 0.4, "state": "running", "gen": 3}},
    }
    words = nodes_text(n)
    assert words.startswith("node a, 2 nodes, generation 3 (rendezvous job-g3 at 127.0.0.1:29400, store ok, host)")
    assert (
        "peers: b running g3 (0.4 s)" in words
        and "torchrun round 2 (restarted its ranks 1× within this attempt)" in words
    )
    out = io.StringIO()
    Console(file=out, width=300, color_system=None).print(status_view({"state": "running", "attempt": 2, "nodes": n}))
    assert "node a, 2 nodes, generation 3" in out.getvalue()
