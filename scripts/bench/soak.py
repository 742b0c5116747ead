"""Section 12, soak: what an hour of watching leaves behind.  `hangwatch run` watches 8 synthetic ranks
beating at 20 Hz (scripts/baselines/synthetic_ranks.py) for N minutes (--soak-minutes, default 60; --quick:
1) while a client asks `status` over the control socket once a second and the supervisor's log is rotated
(renamed, then SIGHUP: logrotate without copytruncate) once a minute.  Its RSS, open descriptors
(/proc/PID/fd) and CPU are compared between the start (after a warm-up) and the end: growth that a
one-minute footprint cannot show — a leaked connection, a log file never closed, a list that only grows."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Optional

import psutil

from hangwatch.common import rundir

from .footprint import start_synthetic
from .harness import control, summary, wait_exit

RANKS, HZ = 8, 20.0
STATUS_EVERY_S = 1.0
ROTATE_EVERY_S = 60.0
SAMPLE_EVERY_S = 5.0  # RSS, descriptors and CPU time of the supervisor
WARMUP_S = 60.0  # imports settled, every rank's file open, the first rotations done: then "start" is taken
QUICK_WARMUP_S = 15.0
STATUS_TIMEOUT_S = 10.0
ERRORS_KEPT = 5


def descriptors(pid: int) -> dict[str, str]:
    """fd number → what it points at (a path, socket:[inode], pipe:[inode], anon_inode:inotify)."""
    out = {}
    base = f"/proc/{pid}/fd"
    for fd in os.listdir(base):
        try:
            out[fd] = os.readlink(f"{base}/{fd}")
        except OSError:  # closed between the listing and the readlink
            continue
    return out


def kinds(fds: dict[str, str]) -> dict[str, int]:
    """How many descriptors of each kind: socket, pipe, anon_inode:…, or the file's name (heartbeat files
    folded into one kind)."""
    out: dict[str, int] = {}
    for target in fds.values():
        if target.startswith(("socket:", "pipe:")):
            kind = target.split(":")[0]
        elif target.startswith("anon_inode:"):
            kind = target
        else:
            name = Path(target).name
            kind = "heartbeat-rank*.jsonl" if name.startswith("heartbeat-rank") else name
        out[kind] = out.get(kind, 0) + 1
    return dict(sorted(out.items()))


def cpu_s(proc: psutil.Process) -> float:
    c = proc.cpu_times()
    return c.user + c.system


def rotate(run_dir: Path, sup: psutil.Process, n: int) -> None:
    """What logrotate does without copytruncate: move the log aside, then tell the supervisor (SIGHUP)."""
    log = run_dir / rundir.SUPERVISOR_LOG_NAME
    if log.exists():
        log.rename(run_dir / f"{rundir.SUPERVISOR_LOG_NAME}.{n}")
    sup.send_signal(signal.SIGHUP)


def reopened(run_dir: Path) -> int:
    """`log_reopened` records in the supervisor's log and every rotated one."""
    return sum(
        1
        for f in run_dir.glob(f"{rundir.SUPERVISOR_LOG_NAME}*")
        for line in f.read_bytes().splitlines()
        if b"log_reopened" in line
    )


def window(samples: list[dict], lo: float, hi: float) -> list[dict]:
    return [s for s in samples if lo <= s["t"] <= hi]


def cpu_percent(samples: list[dict]) -> Optional[float]:
    """CPU time over wall time between the first and last sample of `samples` (100 = one core)."""
    if len(samples) < 2 or samples[-1]["t"] <= samples[0]["t"]:
        return None
    return 100.0 * (samples[-1]["cpu_s"] - samples[0]["cpu_s"]) / (samples[-1]["t"] - samples[0]["t"])


def slope_per_hour(samples: list[dict], key: str) -> Optional[float]:
    """Least-squares slope of `key` against time, per hour (a steady growth shows here whatever the noise)."""
    if len(samples) < 3:
        return None
    ts = [s["t"] for s in samples]
    vs = [s[key] for s in samples]
    mt, mv = sum(ts) / len(ts), sum(vs) / len(vs)
    den = sum((t - mt) ** 2 for t in ts)
    return None if den == 0 else 3600.0 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs)) / den


def soak(work: Path, seconds: float, warmup: float, rotate_every: float) -> dict:
    proc, run_dir, hb_files = start_synthetic(work, RANKS, HZ, seconds + 120)
    sup = psutil.Process(proc.pid)

    samples: list[dict] = []
    asked = answered = 0
    errors: list[str] = []
    latency: list[float] = []
    rotations = 0
    fds_start: Optional[dict] = None
    t0 = time.monotonic()
    next_status = next_sample = t0
    next_rotate = t0 + rotate_every
    while True:
        now = time.monotonic()
        el = now - t0
        if el >= seconds or proc.poll() is not None:
            break
        if now >= next_sample:  # before the request: the last connection had a second to close
            next_sample += SAMPLE_EVERY_S
            fds = descriptors(sup.pid)
            samples.append(
                {
                    "t": el,
                    "rss": sup.memory_info().rss,
                    "fds": len(fds),
                    "cpu_s": cpu_s(sup),
                    "threads": sup.num_threads(),
                }
            )
            if fds_start is None and el >= warmup:
                fds_start = fds
        if now >= next_rotate:
            next_rotate += rotate_every
            rotations += 1
            rotate(run_dir, sup, rotations)
        if now >= next_status:
            next_status += STATUS_EVERY_S
            asked += 1
            a = time.monotonic()
            result, why = control(run_dir, "status", STATUS_TIMEOUT_S)
            if why is None and isinstance(result, dict) and result.get("state"):
                answered += 1
                latency.append(time.monotonic() - a)
            elif len(errors) < ERRORS_KEPT:
                errors.append(f"at {el:.0f} s: {why or f'an answer without a state: {result!r}'}")
        time.sleep(max(0.0, min(next_status, next_sample, next_rotate) - time.monotonic()))
    ended_early = proc.poll() is not None
    time.sleep(STATUS_EVERY_S)  # as for every sample: the last connection has had a second to close
    fds_end = descriptors(sup.pid) if not ended_early else {}
    lines = sum(f.read_bytes().count(b"\n") for f in hb_files if f.exists())
    proc.send_signal(signal.SIGTERM)
    code = wait_exit(proc, 60)
    state = rundir.read_json(run_dir / rundir.STATE_NAME) or {}

    wall = samples[-1]["t"] if samples else 0.0
    span = min(60.0, max(SAMPLE_EVERY_S, (wall - warmup) / 2))  # the start and end windows, each up to a minute
    first, last = window(samples, warmup, warmup + span), window(samples, wall - span, wall)
    after = window(samples, warmup, wall)
    start_fds = min((s["fds"] for s in first), default=None)  # the floor: a connection being closed is no leak
    end_fds = min((s["fds"] for s in last), default=None)
    start_rss = summary([s["rss"] / 2**20 for s in first]).get("median")
    end_rss = summary([s["rss"] / 2**20 for s in last]).get("median")
    added = sorted(set(fds_end.values()) - set((fds_start or {}).values()))
    gone = sorted(set((fds_start or {}).values()) - set(fds_end.values()))
    return {
        "seconds": seconds,
        "warmup_s": warmup,
        "rotate_every_s": rotate_every,
        "wall_s": wall,
        "window_s": span,
        "ranks": RANKS,
        "hz": HZ,
        "ended_early": ended_early,
        "supervisor_exit": code,
        "samples": samples,
        "rss_mib_first": samples[0]["rss"] / 2**20 if samples else None,
        "fds_first": samples[0]["fds"] if samples else None,
        "rss_mib_start": start_rss,
        "rss_mib_end": end_rss,
        "rss_mib_growth": None if start_rss is None or end_rss is None else end_rss - start_rss,
        "rss_mib_max_after_warmup": max((s["rss"] / 2**20 for s in after), default=None),
        "rss_mib_per_hour": (lambda v: None if v is None else v / 2**20)(slope_per_hour(after, "rss")),
        "fds_start": start_fds,
        "fds_end": end_fds,
        "fds_growth": None if start_fds is None or end_fds is None else end_fds - start_fds,
        "fds_max_after_warmup": max((s["fds"] for s in after), default=None),
        "fd_kinds_start": kinds(fds_start or {}),
        "fd_kinds_end": kinds(fds_end),
        "fd_targets_added": added[:20],
        "fd_targets_gone": gone[:20],
        "cpu_percent_start": cpu_percent(first),
        "cpu_percent_end": cpu_percent(last),
        "cpu_percent_after_warmup": cpu_percent(after),
        "threads_start": first[0]["threads"] if first else None,
        "threads_end": last[-1]["threads"] if last else None,
        "status_asked": asked,
        "status_answered": answered,
        "status_errors": errors,
        "status_latency_s": summary(latency),
        "rotations": rotations,
        "log_reopened": reopened(run_dir),
        "heartbeat_lines": lines,
        "torn_lines": state.get("torn_lines"),
    }


def section(work: Path, quick: bool, minutes: Optional[float] = None) -> dict:
    minutes = (1.0 if quick else 60.0) if minutes is None else minutes
    seconds = 60.0 * minutes
    warmup = min(QUICK_WARMUP_S if quick else WARMUP_S, seconds / 4)
    rotate_every = min(ROTATE_EVERY_S, seconds / 6)  # a short soak still rotates, before and after its warm-up
    s = soak(work, seconds, warmup, rotate_every)
    s["minutes"] = minutes
    s["method"] = (
        f"`hangwatch run` watching {RANKS} synthetic ranks beating a step line at {HZ:g} Hz each "
        f"(scripts/baselines/synthetic_ranks.py) for {minutes:g} min; meanwhile one `status` request over the control "
        f"socket every {STATUS_EVERY_S:g} s (a new connection each, {STATUS_TIMEOUT_S:g} s timeout), and every "
        f"{rotate_every:g} s the log rotated as logrotate does without copytruncate (supervisor.log renamed, then "
        f"SIGHUP). The supervisor process sampled every {SAMPLE_EVERY_S:g} s: RSS, open descriptors "
        f"(/proc/PID/fd), CPU time (psutil). Start = the first {s['window_s']:g} s after a {warmup:g} s warm-up, "
        f"end = the last {s['window_s']:g} s: RSS is the median of the samples "
        "in each, descriptors the lowest count in each (a connection still being closed is not a leak), CPU the CPU "
        "time over the wall time across each (100 % = one core); RSS per hour = least-squares slope of every sample "
        "after the warm-up"
    )
    return s


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""

    def mib(x: Optional[float], sign: bool = False) -> str:
        return "–" if x is None else f"{x:+.2f} MiB" if sign else f"{x:.2f} MiB"

    def pct(x: Optional[float]) -> str:
        return "–" if x is None else f"{x:.2f} %"

    errors = "; ".join(s["status_errors"]) or "none"
    fds_growth = s["fds_growth"]
    every = s["rotate_every_s"]
    return (
        f"12. Soak: {s['minutes']:g} min at {s['ranks']} ranks × {s['hz']:g} Hz, `status` every second, "
        f"log rotation every {'minute' if every == 60 else f'{every:g} s'}",
        ["figure", "start", "end", "growth"],
        [
            ["RSS", mib(s["rss_mib_start"]), mib(s["rss_mib_end"]), f"**{mib(s['rss_mib_growth'], True)}**"],
            [
                "RSS / descriptors at the first sample, before the warm-up",
                f"{mib(s['rss_mib_first'])} / {s['fds_first']}",
                "",
                "",
            ],
            ["RSS, least-squares slope after the warm-up", "", "", mib(s["rss_mib_per_hour"], True) + " per hour"],
            ["RSS, highest after the warm-up", "", mib(s["rss_mib_max_after_warmup"]), ""],
            [
                "open descriptors",
                str(s["fds_start"]),
                str(s["fds_end"]),
                f"**{'–' if fds_growth is None else f'{fds_growth:+d}'}** (highest {s['fds_max_after_warmup']})",
            ],
            [
                "descriptors by kind",
                ", ".join(f"{k} {v}" for k, v in s["fd_kinds_start"].items()),
                ", ".join(f"{k} {v}" for k, v in s["fd_kinds_end"].items()),
                "",
            ],
            [
                "CPU (% of one core)",
                pct(s["cpu_percent_start"]),
                pct(s["cpu_percent_end"]),
                f"{pct(s['cpu_percent_after_warmup'])} over the whole run after the warm-up",
            ],
            ["threads", str(s["threads_start"]), str(s["threads_end"]), ""],
            [
                "`status` requests answered",
                "",
                f"{s['status_answered']} of {s['status_asked']}",
                f"latency {s['status_latency_s'].get('median', 0) * 1000:.1f} ms median, "
                f"{s['status_latency_s'].get('p95', 0) * 1000:.1f} ms p95; failures: {errors}",
            ],
            ["log rotations (SIGHUP) / `log_reopened` records", "", f"{s['rotations']} / {s['log_reopened']}", ""],
            ["heartbeat lines written / torn", "", f"{s['heartbeat_lines']} / {s['torn_lines']}", ""],
        ],
        f"{s['method']} (bench/soak.py).",
    )


__all__ = ["section", "render"]
