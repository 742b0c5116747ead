"""Reading faulthandler dumps: the threads, the main thread's stack and its stuck (innermost) frame.

Blocks start with "Current thread 0x… (most recent call first):" or "Thread 0x… (most recent call
first):" and list `  File "x.py", line N in func`, innermost first.  The main thread is the one whose
outermost frame (below runpy's, for `python -m`) is a `<module>`; its innermost frame is the stuck
frame.  A dump file may hold several dumps (one per SIGUSR1): the last one wins.  faulthandler prints
at most 100 frames of a thread and then "  ...": such a thread is `truncated` (its innermost frames are
the ones kept).  What the whole stack says — the call it is in — is `landmarks.read_stack`'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

TRUNCATED = re.compile(r"^\s+\.\.\.\s*$")
THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)(?: \[[^\]]*\])? \(most recent call first\):\s*$")
STACK_HEADER = re.compile(r"^Stack \(most recent call first\):\s*$")
FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?\?\?) in (?P<function>.+?)\s*$')
FATAL = re.compile(r"^Fatal Python error: (.*)$")


@dataclass
class ThreadStack:
    thread: str
    current: bool
    frames: list[dict] = field(default_factory=list)  # innermost first
    truncated: bool = False  # faulthandler stopped at its frame limit: the outer frames are missing

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
            cur.frames.append(
                {"file": m.group("file"), "line": int(ln) if ln.isdigit() else None, "function": m.group("function")}
            )
        elif cur is not None and TRUNCATED.match(line):
            cur.truncated = True
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
    user = next((f for f in t.frames if not is_library(f["file"])), None)
    return t.frames[0], t.frames, user


def main_stack(text: str) -> tuple[list[dict], bool]:
    """(the main thread's frames, innermost first; whether faulthandler truncated them) — ([], False) without one."""
    t = main_thread(parse_faulthandler(text))
    return (t.frames, t.truncated) if t is not None else ([], False)


def is_library(path: str) -> bool:
    """Not the user's frame: the standard library, an installed package, `<…>` code, or hangwatch's own hooks in the
    user's process (the bootstrap's wrappers, the callbacks, the heartbeat) from a source checkout."""
    return (
        path.startswith("<")
        or "/lib/python3" in path
        or "site-packages" in path
        or any(part in path for part in HANGWATCH_HOOKS)
    )


HANGWATCH_HOOKS = ("/daemon/autoinstrument/", "/daemon/integrations/", "/daemon/heartbeat.py")


def fatal_error(text: str) -> Optional[str]:
    """The message of a "Fatal Python error: …" line (a segfault's dump), if there is one."""
    for line in text.splitlines():
        m = FATAL.match(line)
        if m:
            return m.group(1).strip()
    return None


def frame_str(f: Optional[dict]) -> str:
    return f"{f['function']} ({f['file']}:{f['line']})" if f else "unknown"
