"""What the worker's process tree and the GPUs look like at the moment of a stall.

`TreeSample` records, for every process of the tree: pid, ppid, name, cmdline, state letter
(R running, S sleeping, D uninterruptible I/O, Z zombie, T stopped), CPU% sampled over a short
interval, RSS and thread count, and — asleep — the terminal it is blocked reading, if any
(`terminal_wait`).  `gpu` asks NVML (nvidia-ml-py) per device for utilisation, memory and compute
processes; without a GPU it says so plainly instead of failing.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Iterable, Optional

import psutil

from hangwatch.supervisor.processes.terminal_wait import reading_terminal

STATE_LETTERS = {
    psutil.STATUS_RUNNING: "R",
    psutil.STATUS_SLEEPING: "S",
    psutil.STATUS_DISK_SLEEP: "D",
    psutil.STATUS_ZOMBIE: "Z",
    psutil.STATUS_STOPPED: "T",
    psutil.STATUS_TRACING_STOP: "t",
    psutil.STATUS_DEAD: "X",
    psutil.STATUS_IDLE: "I",
}
CMDLINE_MAX = 20  # arguments kept per process; a launcher's argv can be very long


def _collect(roots: Iterable[int], extra: Iterable[int]) -> dict[int, psutil.Process]:
    procs: dict[int, psutil.Process] = {}
    for pid in list(roots) + list(extra):
        try:
            p = psutil.Process(pid)
        except (psutil.NoSuchProcess, ValueError):
            continue
        procs.setdefault(p.pid, p)
        if pid in roots:
            try:
                for c in p.children(recursive=True):
                    procs.setdefault(c.pid, c)
            except psutil.Error:
                pass
    return procs


class TreeSample:
    """A snapshot of `roots`, their descendants and `extra` pids, taken in two steps so the loop never
    blocks on the CPU interval: construction primes the CPU counters, `take()` (called by the loop
    once the interval has passed) measures CPU% over the time in between and records the rest."""

    def __init__(self, roots: Iterable[int], extra: Iterable[int] = ()):
        self.procs = _collect(list(roots), extra)
        for p in self.procs.values():
            try:
                p.cpu_percent(None)  # primes the counter; the next call measures the interval
            except psutil.Error:
                pass

    def take(self) -> list[dict]:
        out = []
        for pid, p in sorted(self.procs.items()):
            try:
                with p.oneshot():
                    status = p.status()
                    rec = {
                        "pid": pid,
                        "ppid": p.ppid(),
                        "pgid": _pgid(pid),
                        "name": p.name(),
                        "cmdline": p.cmdline()[:CMDLINE_MAX],
                        "state": STATE_LETTERS.get(status, status[:1].upper()),
                        "status": status,
                        "cpu_percent": round(p.cpu_percent(None), 1),
                        "rss_bytes": p.memory_info().rss,
                        "threads": p.num_threads(),
                        "create_time": p.create_time(),
                    }
                if rec["state"] == "S":  # asleep: on a prompt? (the kernel says what it waits for)
                    rec["reading_terminal"] = reading_terminal(pid)
            except psutil.ZombieProcess:
                rec = {"pid": pid, "state": "Z", "status": "zombie", "cpu_percent": 0.0}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out.append(rec)
        return out


def _pgid(pid: int) -> Optional[int]:
    try:
        return os.getpgid(pid)
    except (ProcessLookupError, PermissionError):
        return None


# --------------------------------------------------------------------------------------------
# NVML

_nvml_lock = threading.Lock()
_nvml_state: dict = {}


def _nvml():
    """The initialised pynvml module, or raises RuntimeError with the reason there is none."""
    with _nvml_lock:
        if "module" in _nvml_state:
            return _nvml_state["module"]
        if "error" in _nvml_state:
            raise RuntimeError(_nvml_state["error"])
        try:
            import pynvml
        except ImportError as exc:
            _nvml_state["error"] = f"no GPU: nvidia-ml-py is not installed ({exc})"
            raise RuntimeError(_nvml_state["error"]) from None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as exc:  # pynvml raises NVMLError subclasses, one per NVML return code
            _nvml_state["error"] = f"no GPU: NVML unavailable ({exc})"
            raise RuntimeError(_nvml_state["error"]) from None
        if count == 0:
            _nvml_state["error"] = "no GPU: NVML found no devices"
            raise RuntimeError(_nvml_state["error"])
        _nvml_state["module"] = pynvml
        return pynvml


def _str(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def gpu() -> dict:
    """Per-device utilisation, memory and compute processes; {"available": false, "reason": …} without a GPU."""
    try:
        nv = _nvml()
    except RuntimeError as exc:
        return {"available": False, "reason": str(exc)}
    devices = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            dev = {
                "index": i,
                "name": _str(nv.nvmlDeviceGetName(h)),
                "memory_used_bytes": mem.used,
                "memory_total_bytes": mem.total,
            }
            try:
                util = nv.nvmlDeviceGetUtilizationRates(h)
                dev["utilization_percent"] = util.gpu
            except Exception as exc:
                dev["utilization_percent"] = None
                dev["utilization_error"] = str(exc)
            dev["processes"] = _compute_processes(nv, h)
            devices.append(dev)
    except Exception as exc:
        return {"available": False, "reason": f"NVML query failed: {exc}"}
    return {"available": True, "driver": _driver(nv), "devices": devices}


def _driver(nv) -> Optional[str]:
    try:
        return _str(nv.nvmlSystemGetDriverVersion())
    except Exception:
        return None


def _compute_processes(nv, handle) -> list[dict]:
    """The device's compute processes: pid, memory, and SM utilisation (%) where the driver samples it per process
    (`nvmlDeviceGetProcessUtilization`, the newest sample of each pid; None where it has none)."""
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
    except Exception:
        return []
    util: dict[int, tuple[int, int]] = {}
    try:
        for sample in nv.nvmlDeviceGetProcessUtilization(handle, 0):
            if sample.pid not in util or sample.timeStamp > util[sample.pid][0]:
                util[sample.pid] = (sample.timeStamp, sample.smUtil)
    except Exception:  # NVML_ERROR_NOT_FOUND (no samples yet), NOT_SUPPORTED (older boards, MIG)
        pass
    return [
        {
            "pid": p.pid,
            "used_memory_bytes": getattr(p, "usedGpuMemory", None),
            "sm_util_percent": util[p.pid][1] if p.pid in util else None,
        }
        for p in procs
    ]


def gpu_pids() -> Optional[set[int]]:
    """Pids holding GPU memory on any device; None without NVML."""
    snap = gpu()
    if not snap.get("available"):
        return None
    return {p["pid"] for d in snap["devices"] for p in d["processes"]}


def gpu_summary(snap: dict) -> dict:
    """The short form `status` reports."""
    if not snap.get("available"):
        return snap
    return {
        "available": True,
        "devices": [
            {k: d.get(k) for k in ("index", "name", "utilization_percent", "memory_used_bytes", "memory_total_bytes")}
            for d in snap["devices"]
        ],
    }


class GpuCache:
    """The last GPU snapshot: `status` is asked often and NVML need not be, `fresh` for an incident."""

    MAX_AGE_S = 5.0

    def __init__(self, query: Callable[[], dict] = gpu):
        self.query = query
        self._at = float("-inf")
        self._snap: dict = {}

    def fresh(self, now: float) -> dict:
        self._at, self._snap = now, self.query()
        return self._snap

    def summary(self, now: float) -> dict:
        return gpu_summary(self._snap if now - self._at <= self.MAX_AGE_S else self.fresh(now))
