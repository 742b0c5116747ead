"""How the doctor's findings are shown: a rich table (a terminal), JSON (`--json`, for scripts and CI), or
plain lines (`--plain`: what `hangwatch run` echoes before its first attempt — only what needs attention,
then one summary line)."""

from __future__ import annotations

import json

from hangwatch.daemon.doctor.findings import FAIL, OK, SKIP, WARN, Finding, exit_code

STYLE = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}


def summary_line(findings: list[Finding], seconds: float) -> str:
    n = {s: sum(1 for f in findings if f.status == s) for s in (OK, WARN, FAIL, SKIP)}
    return (
        f"doctor: {len(findings)} checks in {seconds:.1f}s: {n[OK]} OK, {n[WARN]} warning(s), {n[FAIL]} failure(s)"
        + (f", {n[SKIP]} skipped" if n[SKIP] else "")
    )


def as_json(config: str, mode: str, findings: list[Finding], seconds: float) -> str:
    return json.dumps(
        {
            "config": config,
            "mode": mode,
            "exit_code": exit_code(findings),
            "seconds": round(seconds, 3),
            "findings": [f.to_dict() for f in findings],
        },
        indent=2,
        ensure_ascii=False,
    )


def as_plain(findings: list[Finding], seconds: float) -> list[str]:
    lines = []
    for f in findings:
        if f.status in (WARN, FAIL):
            lines.append(f"doctor: {f.status} {f.check}: {f.summary}" + (f" — fix: {f.fix}" if f.fix else ""))
    lines.append(summary_line(findings, seconds))
    return lines


def print_table(config: str, mode: str, findings: list[Finding], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"hangwatch doctor {config} ({mode})", show_lines=True, expand=True)
    table.add_column("check", no_wrap=True)
    table.add_column("", no_wrap=True)
    table.add_column("finding", ratio=3, overflow="fold")
    table.add_column("fix", ratio=2)
    for f in findings:
        body = Text(f.summary)
        for d in f.details:
            body.append("\n" + d, style="dim")
        table.add_row(f.check, Text(f.status, style=STYLE[f.status]), body, f.fix)
    console = Console()
    console.print(table)
    console.print(summary_line(findings, seconds))
