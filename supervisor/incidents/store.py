"""Incident directories: `incidents/NNNN-<kind>/` with `incident.json` and the evidence files.

Numbers are taken by `mkdir` (exclusive), so two writers never share one; `incident.json` is
replaced durably, so a reader sees the old record or the new, never half.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Optional

from hangwatch.common.durable import write_atomic, write_json_atomic
from hangwatch.common.rundir import INCIDENTS, read_json

KINDS = ("stall", "livelock", "startup_timeout", "manual", "crash", "oom", "nan", "signal", "config_error",
         "data_error", "crash_loop")
RECORD_NAME = "incident.json"
SUMMARY_KEYS = ("id", "kind", "time", "attempt", "step", "classification", "summary")
UNREADABLE = "incident.json missing or unreadable"


class Incident:
    def __init__(self, directory: Path, ident: str, kind: str, data: dict):
        self.dir = directory
        self.id = ident
        self.kind = kind
        self.data = data

    def add_file(self, name: str, content: str | bytes) -> Path:
        """Write one evidence file into the incident and list it in the record (write() saves that)."""
        p = write_atomic(self.dir / name, content)
        self.data.setdefault("files", [])
        if name not in self.data["files"]:
            self.data["files"].append(name)
        return p

    def write(self) -> None:
        write_json_atomic(self.dir / RECORD_NAME, self.data)

    def summary(self) -> dict:
        return summary_of(self.data)


def summary_of(d: dict) -> dict:
    return {k: d.get(k) for k in SUMMARY_KEYS}


class IncidentStore:
    def __init__(self, run_dir: os.PathLike | str):
        self.root = Path(run_dir) / INCIDENTS

    def dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and re.match(r"^\d{4,}-", p.name))

    def count(self) -> int:
        return len(self.dirs())

    def create(self, kind: str, **fields) -> Incident:
        """A new numbered incident directory with its first `incident.json` (time stamped now)."""
        if kind not in KINDS:
            raise ValueError(f"unknown incident kind {kind!r}")
        self.root.mkdir(parents=True, exist_ok=True)
        n = max((int(p.name.split("-", 1)[0]) for p in self.dirs()), default=0) + 1
        while True:
            ident = f"{n:04d}"
            d = self.root / f"{ident}-{kind}"
            try:
                d.mkdir()
                break
            except FileExistsError:
                n += 1
        wall = time.time()
        data = {"id": ident, "kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(wall)),
                "time_unix": wall, **fields}
        inc = Incident(d, ident, kind, data)
        inc.write()
        return inc

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

    def get(self, ident: str) -> Optional[dict]:
        """The whole record of incident `ident` ("3" and "0003" alike), or None when there is none."""
        ident = str(ident)
        for d in self.dirs():
            if d.name.split("-", 1)[0] == ident.zfill(4):
                return read_json(d / RECORD_NAME) or {"id": ident, "error": UNREADABLE}
        return None
