"""The doctor's checks of the run's plan and of this machine: learning rate and schedule (the worker's own
`WarmupCosine`), device placement against `worker.nproc_per_node`, free disk for the checkpoints retention
keeps, and py-spy with the ptrace permission it needs.

No torch: pure functions of the config and of numbers the runner measures (free bytes, device count),
so that tests call them with plain values.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from hangwatch.daemon.doctor.findings import Finding, fail, ok, skip, warn
from hangwatch.daemon.trainer.schedule import WarmupCosine

LR_FAIL = 0.1  # AdamW moves every weight by ~lr per step: at 0.1 and above the loss diverges within steps
LR_WARN_PRETRAINED = 1e-3  # LoRA on a pretrained model: 1e-4..3e-4 is usual
LR_WARN_TINY = 5e-2  # the tiny model starts from random weights and tolerates more
GIB = 1 << 30


def check_lr_schedule(
    lr: float, warmup: int, max_steps: int, *, pretrained: bool, effective_batch: int, n_examples: Optional[int] = None
) -> Finding:
    """Peak LR, warm-up against the total optimizer steps, and the schedule the worker will follow."""
    name = "learning rate"
    sched = WarmupCosine(warmup, max_steps)
    lrs = [lr * sched(s) for s in range(max_steps)]
    peak_at = max(range(max_steps), key=lrs.__getitem__)
    low = sum(1 for x in lrs if x < 0.1 * lr)
    details = [
        f"{max_steps} optimizer steps × {effective_batch} examples; warm-up {warmup} steps; lr at step 1 "
        f"{lrs[0]:.3g}, peak {lrs[peak_at]:.3g} at step {peak_at + 1}, last {lrs[-1]:.3g} (cosine to a floor of 0); "
        f"{low} steps below 10% of the peak"
    ]
    if n_examples:
        details.append(f"{max_steps * effective_batch / n_examples:.1f} epochs over {n_examples} usable examples")
    fix_lr = "set train.lr to 1e-4..3e-4 for LoRA (1e-5 for a full fine-tune)"
    if lr >= LR_FAIL:
        return fail(
            name,
            f"train.lr {lr:g}: AdamW moves every trainable weight by about lr per step — the loss diverges "
            "(NaN) within a few steps",
            fix_lr,
            details,
        )
    if warmup >= max_steps:  # a valid run (config rules warn too), but one that never reaches its peak lr
        return warn(
            name,
            f"train.warmup_steps {warmup} >= train.max_steps {max_steps}: the whole run is warm-up, "
            f"the peak lr {lr:g} is never reached and never decays",
            "set train.warmup_steps to ~3-10% of max_steps",
            details,
        )
    limit = LR_WARN_PRETRAINED if pretrained else LR_WARN_TINY
    if lr > limit:
        return warn(
            name,
            f"train.lr {lr:g} is high for {'a pretrained' if pretrained else 'the tiny'} model (above {limit:g})",
            fix_lr,
            details,
        )
    if warmup * 2 > max_steps:
        return warn(
            name,
            f"warm-up {warmup} of {max_steps} steps: more than half the run at a rising lr",
            "set train.warmup_steps to ~3-10% of max_steps",
            details,
        )
    return ok(name, f"peak {lr:g} after {warmup} warm-up steps, cosine to 0 at step {max_steps}", details)


# ---- devices --------------------------------------------------------------------------------------


def visible_count(value: Optional[str]) -> Optional[int]:
    """GPUs a CUDA_VISIBLE_DEVICES value leaves visible (None: not set, unknown here)."""
    if value is None:
        return None
    ids = [v.strip() for v in value.split(",") if v.strip()]
    if ids and ids[0] == "-1":
        return 0
    return len(ids)


def check_placement(device: str, nproc: int, cuda_count: Optional[int], visible: Optional[str]) -> Finding:
    """model.device and worker.nproc_per_node against the GPUs this worker will see."""
    name = "device placement"
    env = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if device == "cpu":
        return ok(name, f"cpu, {nproc} rank(s){' (gloo)' if nproc > 1 else ''}")
    if cuda_count is None:
        return skip(
            name,
            f"model.device {device}, {nproc} rank(s), {env}: GPUs not counted (no NVML on this "
            "machine, and the cheap checks load no torch)",
        )
    if cuda_count == 0:
        if device == "cuda":
            return fail(
                name,
                f"model.device cuda but no CUDA device is visible ({env})",
                "fix CUDA_VISIBLE_DEVICES (worker.env) or set model.device: cpu",
            )
        return ok(name, f"cpu (no CUDA device visible, {env}), {nproc} rank(s)")
    if nproc > cuda_count:
        return fail(
            name,
            f"worker.nproc_per_node {nproc} but {cuda_count} GPU(s) visible ({env}): ranks would share "
            "a GPU (NCCL refuses it; memory halves)",
            f"set worker.nproc_per_node: {cuda_count} or make more GPUs visible",
        )
    if nproc < cuda_count:
        return ok(name, f"{nproc} rank(s) on {cuda_count} visible GPUs ({env}): {cuda_count - nproc} GPU(s) left idle")
    return ok(name, f"{nproc} rank(s), one per visible GPU ({env})")


# ---- disk -----------------------------------------------------------------------------------------


def existing_dir(path: Path) -> Path:
    """The nearest existing directory at or above `path` (where the run dir will be created)."""
    path = path.resolve()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def newest_checkpoint_bytes(root: Path) -> Optional[int]:
    """The size of the newest checkpoint already under `root` (the checkpoints' directory: an exact figure for a
    resumed run)."""
    steps = sorted(root.glob("step-*")) if root.is_dir() else []
    if not steps:
        return None
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file())


def check_disk(keep_last: int, checkpoint_bytes: Optional[int], free_bytes: int, where: str, *, basis: str) -> Finding:
    """Room for keep_last checkpoints plus the one being written (the oldest is deleted only after it)
    plus the final export (about a third of a checkpoint: the adapter without the optimizer state)."""
    name = "disk"
    if checkpoint_bytes is None:
        return ok(name, f"{free_bytes / GIB:.1f} GiB free at {where} (checkpoint size unknown until the first one)")
    need = int((keep_last + 1 + 0.34) * checkpoint_bytes)
    text = (
        f"{free_bytes / GIB:.2f} GiB free at {where}; retention needs ~{need / GIB:.3f} GiB "
        f"(checkpoint.keep_last {keep_last} + 1 being written + export, {checkpoint_bytes / (1 << 20):.1f} MiB each, "
        f"{basis})"
    )
    if need > free_bytes:
        return fail(name, text, "free disk space, move run_dir, or lower checkpoint.keep_last")
    if need * 2 > free_bytes:
        return warn(name, text + ": more than half the free space", "free disk space or lower checkpoint.keep_last")
    return ok(name, text)


# ---- py-spy and ptrace ----------------------------------------------------------------------------

CAP_SYS_PTRACE = 19


def find_py_spy(configured: Optional[str]) -> Optional[str]:
    """As the supervisor looks for it (supervisor/escalation.find_py_spy): the configured path, then beside
    this interpreter (a venv's bin/), then PATH."""
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def ptrace_scope(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> Optional[int]:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return None  # no Yama: classic ptrace rules (same user may attach)


def has_cap_sys_ptrace(status_path: str = "/proc/self/status") -> bool:
    try:
        for line in Path(status_path).read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def check_py_spy(
    enabled: bool, exe: Optional[str], scope: Optional[int], cap: bool, probe: Optional[tuple[bool, str]] = None
) -> Finding:
    """py-spy found, and allowed to attach to the worker (a sibling of py-spy under the supervisor).
    `probe`: (attached, message) of a real `py-spy dump` of a child, when the runner tried one."""
    name = "py-spy"
    if not enabled:
        return skip(name, "watchdog.py_spy is false: stall dumps are faulthandler stacks only")
    if exe is None:
        return warn(
            name,
            "py-spy not found (watchdog.py_spy_path, beside this Python, PATH): stall incidents get "
            "Python stacks only, no native frames of a hang in C (a rank inside backward() only probably "
            "waits in DDP's all-reduce)",
            "pip install py-spy into hangwatch's venv (a dependency of hangwatch: an install without it is incomplete)",
        )
    scope_text = "no Yama" if scope is None else f"ptrace_scope {scope}"
    fix = (
        "sudo sysctl kernel.yama.ptrace_scope=0, or give py-spy CAP_SYS_PTRACE "
        "(setcap cap_sys_ptrace+ep, or AmbientCapabilities=CAP_SYS_PTRACE in the unit)"
    )
    if probe is not None:
        attached, msg = probe
        if not attached:
            return warn(name, f"{exe}: could not dump a test process ({scope_text}): {msg}", fix)
        return ok(name, f"{exe}: attached to a test process ({scope_text}{', CAP_SYS_PTRACE' if cap else ''})")
    if scope == 3:
        return warn(
            name,
            f"{exe}: ptrace_scope 3 forbids every attach: stall dumps will fail",
            "kernel.yama.ptrace_scope=3 cannot be lowered without a reboot; stall dumps fall back to faulthandler",
        )
    if scope in (1, 2) and not cap:
        return warn(
            name,
            f"{exe}: {scope_text} and no CAP_SYS_PTRACE: py-spy may not attach to the worker (not its descendant)",
            fix,
        )
    return ok(name, f"{exe} ({scope_text}{', CAP_SYS_PTRACE' if cap else ''})")


def probe_py_spy(exe: str, timeout_s: float = 15) -> tuple[bool, str]:
    """Dump a sleeping child of this process, as the supervisor dumps its worker: (attached, message)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # let it reach its sleep
        done = subprocess.run([exe, "dump", "--pid", str(child.pid)], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode == 0:
            return True, "ok"
        return False, (done.stderr or done.stdout).strip().splitlines()[-1:][0] if (
            done.stderr or done.stdout
        ).strip() else f"exit {done.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    finally:
        child.kill()
        child.wait()


def check_rendezvous(
    endpoint: str, checkpoint_dir: Optional[str], nnodes: int, connect_timeout_s: float = 1.0
) -> Finding:
    """Several nodes: the store's endpoint — this machine's (its hangwatch will host the store: the port must be free
    or already held by a store) or another's (reachable?) — and a checkpoint directory every node sees."""
    import socket

    from hangwatch.daemon.peerlink import is_local, parse_endpoint
    from hangwatch.daemon.peerlink.connect import local_addresses, resolve

    name = "rendezvous"
    if not checkpoint_dir:
        return warn(
            name,
            f"{nnodes} nodes, but checkpoint.dir is not set: each node keeps its checkpoints in its own run dir",
            "set checkpoint.dir to a directory every node sees (NFS, Lustre, …): rank 0 may run on another node "
            "after a restart, and every rank must resume from the checkpoint it wrote",
        )
    host, port = parse_endpoint(endpoint)
    addrs = resolve(host)
    local = is_local(host, socket.gethostname(), local_addresses(), addrs)
    try:
        socket.create_connection((host, port), timeout=connect_timeout_s).close()
        up = True
    except OSError:
        up = False
    if local:
        where = "this machine: its hangwatch hosts the store"
        return ok(name, f"{endpoint} is {where}" + (" (a store already answers there)" if up else " (port free)"))
    if not addrs:
        return fail(name, f"{endpoint}: {host!r} does not resolve", "use a host name or address every node can reach")
    if up:
        return ok(name, f"{endpoint} answers (the store the node owning that address hosts)")
    return warn(
        name,
        f"{endpoint} does not answer yet",
        f"start hangwatch on the node that owns {host} (it hosts the "
        "store); this node waits for it, and reports a lost peer after worker.rdzv_timeout_s",
    )
