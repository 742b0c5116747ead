"""Evidence about how a process died that the process itself cannot give: the kernel's word.

A SIGKILL the supervisor did not send is *not* by itself the OOM killer: a person, a job scheduler or
a script may have sent it.  The OOM killer is named only when the kernel says so — the cgroup's
`memory.events` `oom_kill` counter went up while the attempt ran, or the kernel log names the pid —
and when neither can be read, the incident says it cannot tell.

Also here: a torchrun job's failing rank, read from torchrun's own "Root Cause (first observed
failure)" report and, when the ranks' output carries them (`--tee`), the `[rankN]:` line prefixes — so
an incident names the rank that raised rather than torchrun's ChildFailedError.
All readers take their paths as arguments (tests point them at files of their own).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from hangwatch.supervisor.incidents.classify import last_exception_line

_KILLED = re.compile(r"Killed process (\d+)")
_OOM_KILL_LINE = re.compile(r"oom-kill:.*?[,\s]pid=(\d+)")
_RANK_LINE = re.compile(r"^\[(?:default)?rank(\d+)\]:(?: ?)(.*)$")
_ROOT_CAUSE = re.compile(r"^Root Cause \(first observed failure\):\s*$")
_FIELD = re.compile(r"^\s+(time|host|rank|exitcode|error_file|traceback)\s*:\s*(.*?)\s*$")


def cgroup_oom_kills(
    proc_self_cgroup: os.PathLike | str = "/proc/self/cgroup", cgroup_root: os.PathLike | str = "/sys/fs/cgroup"
) -> Optional[int]:
    """The `oom_kill` count of this process's memory cgroup (v2, else v1); None when unreadable."""
    try:
        lines = Path(proc_self_cgroup).read_text().splitlines()
    except OSError:
        return None
    root = Path(cgroup_root)
    candidates = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        rel = path.lstrip("/")
        if hid == "0" and controllers == "":
            candidates.append(root / rel / "memory.events")  # cgroup v2
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / rel / "memory.oom_control")  # cgroup v1
    for f in candidates:
        try:
            text = f.read_text()
        except OSError:
            continue
        for row in text.splitlines():
            key, _, value = row.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def kernel_log(path: os.PathLike | str = "/dev/kmsg", max_records: int = 20000) -> Optional[list[str]]:
    """The kernel ring buffer's records (non-blocking), or None when it cannot be read (dmesg_restrict)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    records = []
    try:
        while len(records) < max_records:
            try:
                data = os.read(fd, 8192)  # /dev/kmsg returns one record per read
            except OSError as exc:
                if exc.errno == errno.EAGAIN:
                    break  # the end of the buffer
                if exc.errno == errno.EPIPE:
                    continue  # a record was overwritten while we read: skip it
                return records or None
            if not data:
                break
            records.append(data.decode("utf-8", "replace").rstrip("\n"))
    finally:
        os.close(fd)
    return records


def oom_victims(records: Iterable[str]) -> set[int]:
    """Pids the kernel's OOM killer killed, from kernel log records."""
    pids = set()
    for rec in records:
        for pattern in (_KILLED, _OOM_KILL_LINE):
            m = pattern.search(rec)
            if m:
                pids.add(int(m.group(1)))
    return pids


@dataclass(frozen=True)
class KernelEvidence:
    """The kernel's records, read on demand (seams: tests pass readers of their own)."""

    oom_kills: Callable[[], Optional[int]] = cgroup_oom_kills
    log: Callable[[], Optional[list[str]]] = kernel_log


def sigkill_cause(
    pids: Iterable[int],
    oom_kills_before: Optional[int],
    oom_kills_now: Optional[int],
    kernel_records: Optional[list[str]],
) -> str:
    """What killed a process by SIGKILL that hangwatch did not send — only as far as the evidence goes."""
    pids = set(pids)
    victims = oom_victims(kernel_records) if kernel_records is not None else set()
    hit = sorted(pids & victims)
    if hit:
        return f"the kernel's OOM killer (kernel log: killed process {hit[0]})"
    if oom_kills_before is not None and oom_kills_now is not None and oom_kills_now > oom_kills_before:
        n = oom_kills_now - oom_kills_before
        return f"the kernel's OOM killer (the memory cgroup counted {n} OOM kill(s) during this attempt)"
    if kernel_records is None and (oom_kills_before is None or oom_kills_now is None):
        return (
            "not sent by hangwatch; the kernel's OOM records cannot be read here,"
            " so whether it was the OOM killer is unknown"
        )
    return "not sent by hangwatch, and not the OOM killer (the kernel recorded no OOM kill)"


def rank_exceptions(text: str) -> dict[int, str]:
    """{rank: the `Type: message` line closing that rank's last traceback}, from `[rankN]:`-prefixed lines."""
    per_rank: dict[int, list[str]] = {}
    for line in text.splitlines():
        m = _RANK_LINE.match(line)
        if m:
            per_rank.setdefault(int(m.group(1)), []).append(m.group(2))
    out = {}
    for rank, lines in per_rank.items():
        exc = last_exception_line(lines)
        if exc:
            out[rank] = exc
    return out


def torchrun_root_cause(text: str) -> Optional[dict]:
    """torchrun's own verdict on a failed job: {rank, local_rank, exitcode, pid, signal, host, error_file,
    exception}; None when the text holds no such report.  `exception` is the last traceback's closing
    line among the lines before torchrun's report (the ranks' own output), when there is one."""
    lines = text.splitlines()
    start = max((i for i, l in enumerate(lines) if _ROOT_CAUSE.match(l)), default=None)
    if start is None:
        return None
    fields: dict[str, str] = {}
    for line in lines[start + 1 :]:
        if line.startswith("====="):
            break
        m = _FIELD.match(line)
        if m:
            fields[m.group(1)] = m.group(2)
    out: dict = {
        "host": fields.get("host"),
        "error_file": None if fields.get("error_file") in (None, "<N/A>") else fields["error_file"],
    }
    m = re.match(r"(\d+)(?: \(local_rank: (\d+)\))?", fields.get("rank", ""))
    out["rank"] = int(m.group(1)) if m else None
    out["local_rank"] = int(m.group(2)) if m and m.group(2) else None
    m = re.match(r"(-?\d+) \(pid: (\d+)\)(?:\s+\((SIG\w+)\))?", fields.get("exitcode", ""))
    out["exitcode"] = int(m.group(1)) if m else None
    out["pid"] = int(m.group(2)) if m else None
    out["signal"] = m.group(3) if m and m.group(3) else None
    # The ranks' own output comes before torchrun's launcher traceback (which ends in ChildFailedError).
    launcher = max((i for i, l in enumerate(lines[:start]) if "ChildFailedError" in l), default=start)
    body = lines[:launcher]
    own = max(
        (
            i
            for i, l in enumerate(body)
            if l.startswith("Traceback (most recent call last):")
            and any("torch/distributed/run.py" in x for x in body[i : i + 6])
        ),
        default=None,
    )
    # A rank that died by a signal raised nothing: the last traceback in the log is a victim's (its
    # collective broke when the culprit died), so none is attached to it.
    out["exception"] = None if out["signal"] else last_exception_line(body[:own] if own is not None else body)
    return out
