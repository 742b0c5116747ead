"""`hangwatch incidents`: the list reads at the width it is printed at — the summary gets the spare columns, and
on a narrow terminal the less important columns give way before the summary is wrapped to a sliver."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console

from hangwatch.supervisor.cli.render import SUMMARY_ROOM, incidents_table

HUNG = (
    "eval generate() made no progress for 62.0 s (phase budget 60 s); rank 0 stuck in "
    "transformers/generation/utils.py:_sample"
)
CRASHED = "crash: RuntimeError: CUDA error: an illegal memory access was encountered"


def incidents(kind2: str = "livelock", day2: str = "2024-05-01") -> list[dict]:
    return [
        {"id": "0001", "kind": "stall", "time": "2024-05-01T03:12:44+0000", "attempt": 1, "step": 40, "summary": HUNG},
        {
            "id": "0002",
            "kind": kind2,
            "time": f"{day2}T04:13:05+0000",
            "attempt": 12,
            "step": 123456,
            "summary": CRASHED,
        },
        {
            "id": "0003",
            "kind": "oom",
            "time": "2024-05-01T05:00:00+0000",
            "attempt": 13,
            "summary": None,
            "classification": "out of memory",
        },
    ]


def render(rows: list, width: int) -> list[str]:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(incidents_table(rows))
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert all(len(line) <= width for line in lines)
    return lines


def rows_of(lines: list[str]) -> dict[str, list[str]]:
    """Each incident's lines (a row starts with its id), after the header."""
    out: dict[str, list[str]] = {}
    for line in lines[1:]:
        if line[:4].isdigit():
            out[line[:4]] = [line]
        else:
            out[list(out)[-1]].append(line)
    return out


def summary_of(lines: list[str], column: int) -> str:
    """The summary column's text, joined again (rich folds a word longer than the column where it must)."""
    return " ".join(line[column:].strip() for line in lines)


def same_text(a: str, b: str) -> bool:
    return "".join(a.split()) == "".join(b.split())


def test_at_200_columns_every_incident_is_one_line_with_every_column_whole():
    lines = render(incidents(), 200)
    assert lines[0].split() == ["id", "kind", "time", "attempt", "step", "summary"]
    rows = rows_of(lines)
    assert [len(r) for r in rows.values()] == [1, 1, 1]
    assert rows["0001"][0].split()[:5] == ["0001", "stall", "2024-05-01T03:12:44+0000", "1", "40"]
    assert rows["0001"][0].endswith(HUNG) and rows["0002"][0].endswith(CRASHED)
    assert rows["0003"][0].split() == ["0003", "oom", "2024-05-01T05:00:00+0000", "13", "-", "out", "of", "memory"]


def test_at_80_columns_the_time_gives_way_to_the_summary():
    lines = render(incidents(), 80)
    column = lines[0].index("summary")
    assert lines[0].split() == ["id", "kind", "time", "attempt", "step", "summary"]  # every header whole
    assert 80 - column >= SUMMARY_ROOM  # the summary has the room, not a sliver
    rows = rows_of(lines)
    # one day: the time of day; the id, kind, attempt and step whole on the row's first line
    assert rows["0001"][0].split()[:5] == ["0001", "stall", "03:12:44", "1", "40"]
    assert rows["0002"][0].split()[:5] == ["0002", "livelock", "04:13:05", "12", "123456"]
    assert len(rows["0001"]) <= math.ceil(len(HUNG) / SUMMARY_ROOM) + 1 and len(rows["0002"]) <= 2
    assert same_text(summary_of(rows["0001"], column), HUNG) and same_text(summary_of(rows["0002"], column), CRASHED)
    assert rows["0001"][0][column:].startswith("eval generate() made no progress")


def test_incidents_of_several_days_show_the_date_and_minute():
    lines = render(incidents(day2="2024-05-02"), 90)
    rows = rows_of(lines)
    assert rows["0001"][0].split()[:4] == ["0001", "stall", "05-01", "03:12"]
    assert rows["0002"][0].split()[:4] == ["0002", "livelock", "05-02", "04:13"]


@pytest.mark.parametrize(
    "width,columns",
    [
        (80, ["id", "kind", "attempt", "step", "summary"]),  # a long kind: the time goes, the rest stays
        (72, ["id", "kind", "attempt", "summary"]),
        (50, ["id", "kind", "summary"]),
    ],
)
def test_a_narrow_terminal_drops_the_less_important_columns_never_the_id_kind_or_summary(width, columns):
    lines = render(incidents(kind2="checkpoint_failed"), width)
    assert lines[0].split() == columns
    rows = rows_of(lines)
    assert rows["0002"][0].split()[:2] == ["0002", "checkpoint_failed"]
    column = lines[0].index("summary")
    assert same_text(summary_of(rows["0002"], column), CRASHED)
    assert rows["0002"][0][column:].startswith("crash: RuntimeError")


def test_a_summary_with_brackets_is_printed_as_written():
    rows = [{"id": "0001", "kind": "crash", "summary": "[bold]KeyError: '[/]'"}]
    assert "[bold]KeyError: '[/]'" in "\n".join(render(rows, 80))
