"""Incident directories: `incidents/NNNN-<kind>/` with `incident.json` and the evidence files.

Numbers are taken by `mkdir` (exclusive), so two writers never share one; `incident.json` is
replaced durably, so a reader sees the old record or the new, never half.

The store is the one writer of `incident.json`: `create`, then `save` or `amend` by whoever owns the incident (the
episode for a failure's, the concern that opened any other).  An incident of the run is opened with `open_for_run`:
`create` with the fields the run's record gives (its last good checkpoint, the incident before), then noted in that
record (`facts.note_incident`) — the one way every opener takes.  A later finding about an incident (the resume audit
of the attempt that recovered from it) is recorded by its finder under the new attempt, naming the incident; readers
see both joined (`with_findings`), and the incident's own file is never rewritten for it.

A write the disk refuses (full, read-only, I/O error) never raises out of here: the incident lives
on in memory (status, the run summary), the failure goes to `on_write_error(exc, path)` — the
supervisor decides what a full disk means for the run — and no temporary file is left behind.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Protocol

from hangwatch.common.durable import FsOps
from hangwatch.common.rundir import INCIDENTS, read_json

WriteError = Callable[[OSError, Path], None]

KINDS = (
    "resume_ignored",
    "stall",
    "livelock",
    "startup_timeout",
    "manual",
    "crash",
    "oom",
    "oom_adapted",
    "nan",
    "signal",
    "config_error",
    "data_error",
    "crash_loop",
    "checkpoint_failed",
    "disk",
    "no_progress",
    "peer_restart",
    "lost_peer",
    "resume_diverged",
    "generate_truncated",
    "unkillable",
)
RECORD_NAME = "incident.json"
SUMMARY_KEYS = ("id", "kind", "time", "attempt", "step", "classification", "summary")
UNREADABLE = "incident.json missing or unreadable"


class RunFacts(Protocol):
    """What opening an incident reads from the run's record and tells it: `records.run_state.RunRecord` (named here
    by its shape only: `incidents` imports no sibling package)."""

    @property
    def last_good_checkpoint(self) -> Optional[str]: ...

    @property
    def last_incident(self) -> Optional[dict]: ...

    def note_incident(self, inc: "Incident") -> None: ...


def _report(exc: OSError, path: Path) -> None:
    raise exc  # without a handler a failed write is the caller's problem, as with any write


class Incident:
    def __init__(
        self,
        directory: Path,
        ident: str,
        kind: str,
        data: dict,
        *,
        fs: Optional[FsOps] = None,
        on_write_error: WriteError = _report,
    ):
        self.dir = directory
        self.id = ident
        self.kind = kind
        self.data = data
        self._fs = fs or FsOps()
        self._on_write_error = on_write_error

    def add_file(self, name: str, content: str | bytes) -> Path:
        """Write one evidence file into the incident and list it in the record (the store's `save` saves that)."""
        p = self.dir / name
        try:
            self._fs.write_file(p, content.encode() if isinstance(content, str) else content)
        except OSError as exc:
            self._on_write_error(exc, p)
            return p
        self.data.setdefault("files", [])
        if name not in self.data["files"]:
            self.data["files"].append(name)
        return p

    def rekind(self, kind: str) -> None:
        """What the evidence showed once the dumps were in differs from the kind opened at detection
        (a multi-rank livelock whose victim's deadline fired first): rename `NNNN-<kind>/` to match."""
        if kind not in KINDS:
            raise ValueError(f"unknown incident kind {kind!r}")
        new_dir = self.dir.with_name(f"{self.id}-{kind}")
        if self.dir.is_dir():
            try:
                self._fs.rename(self.dir, new_dir)
            except OSError as exc:
                self._on_write_error(exc, new_dir)
                if self.dir.is_dir():  # the rename was refused: the incident keeps its name
                    return
                # renamed, but the directory's fsync failed (reported): the incident has its new name
        self.dir, self.kind = new_dir, kind
        self.data["kind"] = kind

    def summary(self) -> dict:
        return summary_of(self.data)


def summary_of(d: dict) -> dict:
    return {k: d.get(k) for k in SUMMARY_KEYS}


class IncidentStore:
    def __init__(self, run_dir: os.PathLike | str, *, fs: Optional[FsOps] = None, on_write_error: WriteError = _report):
        self.root = Path(run_dir) / INCIDENTS
        self.fs = fs or FsOps()
        self.on_write_error = on_write_error
        self._unwritten = 0  # incidents whose directory could not be made: numbered on, never reused

    def dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and re.match(r"^\d{4,}-", p.name))

    def count(self) -> int:
        return len(self.dirs()) + self._unwritten

    def create(self, kind: str, **fields) -> Incident:
        """A new numbered incident directory with its first `incident.json` (time stamped now)."""
        if kind not in KINDS:
            raise ValueError(f"unknown incident kind {kind!r}")
        n = max((int(p.name.split("-", 1)[0]) for p in self.dirs()), default=0) + 1 + self._unwritten
        while True:
            ident = f"{n:04d}"
            d = self.root / f"{ident}-{kind}"
            try:
                self.fs.mkdir(d, exist_ok=False)
                break
            except FileExistsError:
                n += 1
            except OSError as exc:  # the disk refused: the incident still exists, in memory
                self._unwritten += 1
                self.on_write_error(exc, d)
                break
        wall = time.time()
        data = {
            "id": ident,
            "kind": kind,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(wall)),
            "time_unix": wall,
            **fields,
        }
        inc = Incident(d, ident, kind, data, fs=self.fs, on_write_error=self.on_write_error)
        if d.is_dir():
            self.save(inc)
        return inc

    def open_for_run(
        self,
        kind: str,
        facts: RunFacts,
        *,
        with_last_incident: bool = False,
        with_checkpoint: bool = True,
        then: Optional[Mapping[str, Any]] = None,
        note: bool = True,
        **fields: Any,
    ) -> Incident:
        """A new incident of the run (`create`), noted in the run's record (`facts.note_incident`) once written.

        Its record holds `fields`, then what the run's record gives — `last_incident` (the incident before, with
        `with_last_incident`) and `last_good_checkpoint` (unless `with_checkpoint=False`: the `config_error` of a worker
        that could not start never named it) — then `then` (fields that follow those, in their order).  `note=False`: an
        episode's incident, which the record notes when the episode finishes it (`Episode.finish`, `recovered`).
        A field given twice is a TypeError, as a repeated keyword is to `create`."""
        record: dict[str, Any] = {}
        if with_last_incident:
            record["last_incident"] = facts.last_incident
        if with_checkpoint:
            record["last_good_checkpoint"] = facts.last_good_checkpoint
        later = dict(then or {})
        twice = (fields.keys() & record.keys()) | ((fields.keys() | record.keys()) & later.keys())
        if twice:
            raise TypeError(f"open_for_run() got multiple values for {', '.join(sorted(twice))}")
        inc = self.create(kind, **fields, **record, **later)
        if note:
            facts.note_incident(inc)
        return inc

    def save(self, inc: Incident) -> bool:
        """Save the record; False when the disk refused (reported through `on_write_error`)."""
        try:
            self.fs.write_json(inc.dir / RECORD_NAME, inc.data)
        except OSError as exc:
            self.on_write_error(exc, inc.dir / RECORD_NAME)
            return False
        return True

    def amend(self, inc: Incident, **fields) -> bool:
        """Add or replace fields of the record and save it."""
        inc.data.update(fields)
        return self.save(inc)

    def list(self) -> list[dict]:
        """The summary of every incident, oldest first; a directory without a readable record still shows."""
        out = []
        for d in self.dirs():
            data = read_json(d / RECORD_NAME)
            if data is None:
                ident, _, kind = d.name.partition("-")
                data = {"id": ident, "kind": kind, "summary": UNREADABLE}
            out.append(summary_of(data))
        return out

    def open(self, ident: str) -> Optional[Incident]:
        """Incident `ident` as written (for a later amendment), or None when there is none or it cannot be read."""
        for d in self.dirs():
            if d.name.split("-", 1)[0] == str(ident).zfill(4):
                data = read_json(d / RECORD_NAME)
                if not data:
                    return None
                return Incident(
                    d,
                    data.get("id", str(ident)),
                    data.get("kind", ""),
                    data,
                    fs=self.fs,
                    on_write_error=self.on_write_error,
                )
        return None

    def get(self, ident: str) -> Optional[dict]:
        """The whole record of incident `ident` ("3" and "0003" alike), or None when there is none."""
        ident = str(ident)
        for d in self.dirs():
            if d.name.split("-", 1)[0] == ident.zfill(4):
                data = read_json(d / RECORD_NAME)
                return with_findings(self.root.parent, data) if data else {"id": ident, "error": UNREADABLE}
        return None


# (file in the run dir, its list, the field it gives)
FINDINGS = (
    ("resume-audit.json", "audits", "resume_audit"),
    ("remediation.json", "measures", "measured"),  # after an OOM, the micro-batch the next attempt's process measured
)


def with_findings(run_dir: os.PathLike | str, record: dict) -> dict:
    """An incident's record with the later findings about it joined in (a copy): the resume audit of the attempt
    that recovered from it, as `resume_audit` — recorded in `resume-audit.json` under that attempt, naming the
    incident; after an OOM, the micro-batch the next attempt's process measured, as `measured` — recorded in
    `remediation.json`'s `measures` by that attempt, naming the incident.  A record without such findings comes back
    as it is."""
    ident = record.get("id")
    out = dict(record)
    for name, key, field in FINDINGS:
        data = read_json(Path(run_dir) / name)
        entries = data.get(key) if isinstance(data, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("incident") == ident and field not in out:
                out[field] = entry
    return out
