"""What a doctor check returns: a `Finding` (OK / WARN / FAIL, one line saying what was seen, one line
saying how to fix it, a few detail lines), and the exit code a list of them means.

Pure data and the standard library, so that checks stay small functions that tests can call with fakes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
SEVERITY = {OK: 0, SKIP: 0, WARN: 1, FAIL: 2}


@dataclass
class Finding:
    """One check's verdict.  `fix` is the one line a user acts on (empty when there is nothing to do)."""

    check: str
    status: str
    summary: str
    fix: str = ""
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seconds"] = round(self.seconds, 3)
        return d


def ok(check: str, summary: str, details: list[str] | None = None) -> Finding:
    return Finding(check, OK, summary, "", details or [])


def warn(check: str, summary: str, fix: str, details: list[str] | None = None) -> Finding:
    return Finding(check, WARN, summary, fix, details or [])


def fail(check: str, summary: str, fix: str, details: list[str] | None = None) -> Finding:
    return Finding(check, FAIL, summary, fix, details or [])


def skip(check: str, summary: str) -> Finding:
    return Finding(check, SKIP, summary)


def worst(findings: list[Finding]) -> str:
    return max((f.status for f in findings), key=SEVERITY.__getitem__, default=OK)


def exit_code(findings: list[Finding]) -> int:
    """0 when nothing FAILs (warnings included), 1 otherwise."""
    return 1 if any(f.status == FAIL for f in findings) else 0
