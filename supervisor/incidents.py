"""Incidents: one directory per failure, the evidence in it, and what the evidence says.

`incidents/NNNN-<kind>/` holds `incident.json`, the stack dumps, the last heartbeat lines of
every rank and the tail of the worker log.  Kinds: stall, livelock, startup_timeout, manual,
crash, oom, nan, signal, config_error, data_error, crash_loop.

The stuck frame is read from the faulthandler dump: blocks start with
"Current thread 0x… (most recent call first):" or "Thread 0x… (most recent call first):" and list
`  File "x.py", line N in func`, innermost first.  The main thread is the one whose outermost
frame (below runpy's, for `python -m`) is a `<module>`; its innermost frame is the stuck frame.
"""
from __future__ import annotations

import json
import os
import re
import signal as _signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_TEMPFAIL

KINDS = ("stall", "livelock", "startup_timeout", "manual", "crash", "oom", "nan", "signal", "config_error",
         "data_error", "crash_loop")
THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):\s*$")
STACK_HEADER = re.compile(r"^Stack \(most recent call first\):\s*$")
FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.+?)\s*$')
FATAL = re.compile(r"^Fatal Python error: (.*)$")
OOM_PATTERNS = ("OutOfMemoryError", "out of memory", "MemoryError", "CUBLAS_STATUS_ALLOC_FAILED", "std::bad_alloc")
BUSY_CPU = 40.0  # % of one core: a hot loop (generous, CPUs are shared)
IDLE_CPU = 10.0


# --------------------------------------------------------------------------------------------
# faulthandler dumps


@dataclass
class ThreadStack:
    thread: str
    current: bool
    frames: list[dict] = field(default_factory=list)  # innermost first

    def is_main(self) -> bool:
        outer = [f for f in self.frames if not _is_runpy(f["file"])]
        return bool(outer) and outer[-1]["function"] == "<module>"


def _is_runpy(path: str) -> bool:
    return path in ("<frozen runpy>",) or path.endswith("/runpy.py")


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """Every thread block of a faulthandler dump (several dumps in one text are all parsed)."""
    threads: list[ThreadStack] = []
    cur: Optional[ThreadStack] = None
    for line in text.splitlines():
        m = THREAD_HEADER.match(line)
        if m:
            cur = ThreadStack(thread=m.group(2), current=m.group(1) == "Current thread")
            threads.append(cur)
            continue
        if STACK_HEADER.match(line):
            cur = ThreadStack(thread="?", current=True)
            threads.append(cur)
            continue
        m = FRAME.match(line)
        if m and cur is not None:
            ln = m.group("line")
            cur.frames.append({"file": m.group("file"), "line": int(ln) if ln.isdigit() else None,
                               "function": m.group("function")})
        elif not line.strip():
            cur = None
    return [t for t in threads if t.frames]


def main_thread(threads: list[ThreadStack]) -> Optional[ThreadStack]:
    """The last dumped main thread; else the thread that took the signal; else the first."""
    mains = [t for t in threads if t.is_main()]
    if mains:
        return mains[-1]
    current = [t for t in threads if t.current]
    if current:
        return current[-1]
    return threads[0] if threads else None


def stuck_frame(text: str) -> tuple[Optional[dict], list[dict], Optional[dict]]:
    """(innermost frame of the main thread, its whole stack, innermost frame outside the stdlib)."""
    t = main_thread(parse_faulthandler(text))
    if t is None:
        return None, [], None
    user = next((f for f in t.frames if not _is_library(f["file"])), None)
    return t.frames[0], t.frames, user


def _is_library(path: str) -> bool:
    return path.startswith("<") or "/lib/python3" in path or "site-packages" in path


def fatal_error(text: str) -> Optional[str]:
    for line in text.splitlines():
        m = FATAL.match(line)
        if m:
            return m.group(1).strip()
    return None


def frame_str(f: Optional[dict]) -> str:
    return f"{f['function']} ({f['file']}:{f['line']})" if f else "unknown"


def call_chain(stack: list[dict], depth: int = 8) -> str:
    """The functions a stuck frame was called from, innermost first ("__call__ ← generate ← …"):
    the innermost frame alone is often a library's (a logits processor, a lock), the chain names
    the user-level call that never returned."""
    names: list[str] = []
    for f in stack[1 : depth + 1]:
        fn = f.get("function")
        if fn and (not names or names[-1] != fn) and not fn.startswith("<"):
            names.append(fn)
    return " ← ".join(f"{n}()" for n in names)


# --------------------------------------------------------------------------------------------
# Classification


def classify_stall(kind: str, deadline: Optional[dict], procs: list[dict], frame: Optional[dict]) -> str:
    """What the evidence shows about a stalled worker: CPU and state of its announced processes."""
    if not procs:
        return "no worker process left to inspect"
    states = {p.get("state") for p in procs}
    cpu = max(p.get("cpu_percent", 0.0) for p in procs)
    where = f" at {frame_str(frame)}" if frame else ""
    if "D" in states:
        text = f"uninterruptible I/O (state D, CPU {cpu:.0f}%){where}"
    elif cpu >= BUSY_CPU or ("R" in states and cpu > IDLE_CPU):
        # a spinning loop never sleeps: always runnable (R), though it gets less than a core when CPUs are contended
        text = f"busy loop in Python (CPU {cpu:.0f}%){where}"
    elif cpu <= IDLE_CPU:
        state = "/".join(sorted(s for s in states if s)) or "?"
        text = f"blocked in C (CPU {cpu:.0f}%, state {state}){where}"
    elif states == {"T"}:
        text = f"stopped (state T){where}"
    else:
        text = f"partly busy (CPU {cpu:.0f}%){where}"
    if kind == "livelock" and deadline:
        text = (f"livelock: {deadline.get('progress_lines', 0)} progress beat(s) but no "
                f"{'step' if deadline.get('name') == 'step' else 'end of phase ' + repr(deadline.get('phase'))} "
                f"in {deadline.get('elapsed_s', 0):.1f}s; " + text)
    elif kind == "startup_timeout":
        text = "never sent its start beat; " + text
    return text


def signal_name(sig: Optional[int]) -> Optional[str]:
    if sig is None:
        return None
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def classify_exit(code: Optional[int], sig: Optional[int], last_words: Optional[dict], log_tail: str,
                  *, killed_by_us: bool = False) -> tuple[str, str]:
    """(kind, classification) of a worker that ended by itself.

    Last words (exit.json) first, then the exit code or signal, then the log tail.
    """
    lw = last_words or {}
    lw_kind = str(lw.get("kind") or "")
    lw_msg = str(lw.get("message") or "")
    lw_tb = str(lw.get("traceback") or "")
    lw_text = " ".join((lw_kind, lw_msg, lw_tb))
    exc_line = _last_exception_line(lw_tb) or (f"{lw_kind}: {lw_msg}" if lw_kind or lw_msg else "")
    if code == EXIT_CONFIG or lw_kind in ("config", "config_error"):
        return "config_error", f"configuration error: {lw_msg or exc_line or 'exit 78 (EX_CONFIG)'}"
    if code == EXIT_DATAERR or lw_kind in ("data", "data_error"):
        return "data_error", f"unusable data: {lw_msg or exc_line or 'exit 65 (EX_DATAERR)'}"
    if code == EXIT_TEMPFAIL or lw_kind in ("nan", "nonfinite", "non_finite"):
        return "nan", f"non-finite loss: {lw_msg or 'exit 75 (EX_TEMPFAIL)'}"
    if any(p in lw_text for p in OOM_PATTERNS) or lw_kind == "oom":
        return "oom", f"out of memory: {exc_line or lw_msg}"
    if last_words:
        return "crash", f"crash with {exc_line or lw_kind or 'an exception'}"
    if sig is not None:
        name = signal_name(sig)
        hint = ""
        if sig == _signal.SIGKILL and not killed_by_us:
            hint = " — not sent by the supervisor; the kernel's OOM killer does this"
        return "signal", f"killed by {name} (signal {sig}){hint}"
    tail_exc = _last_exception_line(log_tail)
    if tail_exc and any(p in tail_exc for p in OOM_PATTERNS):
        return "oom", f"out of memory: {tail_exc}"
    if tail_exc:
        return "crash", f"crash with {tail_exc} (from the worker log)"
    if any(p in log_tail for p in OOM_PATTERNS):
        return "oom", "out of memory (from the worker log)"
    return "crash", f"exited with code {code} without last words"


def _last_exception_line(text: str) -> Optional[str]:
    """The `Type: message` line closing the last traceback in `text`."""
    lines = text.splitlines()
    idx = max((i for i, l in enumerate(lines) if l.startswith("Traceback (most recent call last):")), default=None)
    if idx is None:
        return None
    for line in lines[idx + 1:]:
        if line and not line.startswith((" ", "\t", "Traceback")):
            if line.startswith(("During handling", "The above exception")):
                continue
            return line.strip()
    return None


# --------------------------------------------------------------------------------------------
# Files


def tail_text(path: os.PathLike | str, max_lines: int = 200, max_bytes: int = 64 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return ""
    lines = data.decode("utf-8", "replace").splitlines()
    if size > max_bytes and lines:
        lines = lines[1:]  # the first is probably cut
    return "\n".join(lines[-max_lines:]) + ("\n" if lines else "")


def read_json(path: os.PathLike | str) -> Optional[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Incident:
    def __init__(self, directory: Path, ident: str, kind: str, data: dict):
        self.dir = directory
        self.id = ident
        self.kind = kind
        self.data = data

    def add_file(self, name: str, content: str | bytes) -> Path:
        p = self.dir / name
        if isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content)
        self.data.setdefault("files", [])
        if name not in self.data["files"]:
            self.data["files"].append(name)
        return p

    def write(self) -> None:
        write_json_atomic(self.dir / "incident.json", self.data)

    def summary(self) -> dict:
        return summary_of(self.data)


def summary_of(d: dict) -> dict:
    return {k: d.get(k) for k in ("id", "kind", "time", "attempt", "step", "classification", "summary")}


class IncidentStore:
    def __init__(self, run_dir: os.PathLike | str):
        self.root = Path(run_dir) / "incidents"

    def dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.is_dir() and re.match(r"^\d{4,}-", p.name))

    def count(self) -> int:
        return len(self.dirs())

    def create(self, kind: str, **fields) -> Incident:
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
        out = []
        for d in self.dirs():
            data = read_json(d / "incident.json")
            if data is None:
                ident, _, kind = d.name.partition("-")
                data = {"id": ident, "kind": kind, "summary": "incident.json missing or unreadable"}
            out.append(summary_of(data))
        return out

    def get(self, ident: str) -> Optional[dict]:
        ident = str(ident)
        for d in self.dirs():
            if d.name.split("-", 1)[0] == ident.zfill(4):
                return read_json(d / "incident.json") or {"id": ident, "error": "incident.json missing or unreadable"}
        return None
