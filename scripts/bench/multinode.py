"""Section `multinode`: the time from a hang to every rank stepping again, two nodes beside one.

The same job of world size 2 (the demo model, gloo), the same hang (block_c on global rank 1 at step HANG_AT):
* one node: one `hangwatch run` with `worker.nproc_per_node: 2` (torchrun --standalone);
* two nodes: two `hangwatch run` on this machine as two nodes on loopback (`worker.nnodes: 2`, one rank each,
  torchrun's c10d rendezvous at 127.0.0.1, a shared `checkpoint.dir`) — the culprit's node detects, dumps,
  bumps the generation; the other restarts on its notice (or on its own tied deadline) and both rendezvous anew.

Per run: the hang (the fault's own record, written the instant before it fires), the first detection (the
earliest incident), and "every rank stepping again" — the latest, over every rank of every node, of its first
step line in the attempt after the incident; and, with two nodes, how long after the culprit's node the other
node's incident was opened (how fast the peer learnt).  Alternating runs, so a busier stretch falls on both.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from pathlib import Path
from typing import Optional

from .harness import (
    attempts_of,
    demo_worker_config,
    first,
    hangwatch_run,
    incidents_of,
    read_beats,
    summary,
    wait_exit,
    write_yaml,
)

HANG_AT = 12
STEP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 420.0
MODES = ("one_node", "two_nodes")
FIGURES = (
    "hang_to_detection_s",
    "detection_to_all_stepping_s",
    "hang_to_all_stepping_s",
    "peer_learnt_after_s",
    "steps_lost",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_config(run_dir: Path, shared: Path, **worker) -> dict:
    return demo_worker_config(
        run_dir,
        worker={"env": {"OMP_NUM_THREADS": "1"}, **worker},
        train={"max_steps": 20, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 5, "confirm_steps": 2, "dir": str(shared)},
        watchdog={"step_timeout_s": STEP_TIMEOUT_S},
        restart={"backoff_initial_s": 0},
        faults=[{"kind": "block_c", "at_step": HANG_AT, "rank": 1}],
    )


def hang_time(shared: Path, run_dirs: list[Path]) -> Optional[float]:
    """When the fault fired: its record (beside the shared checkpoints for several nodes, else in the run dir)."""
    for where in [shared, *run_dirs]:
        try:
            fired = json.loads((where / "faults-fired.json").read_text())["fired"]
        except (OSError, ValueError, KeyError):
            continue
        if fired:
            return fired[0]["t"]
    return None


def first_steps_after(run_dir: Path, attempt: int) -> list[Optional[float]]:
    """Every rank's first step line (wall time) in `attempt` of this node."""
    adir = run_dir / "attempts" / f"{attempt:04d}"
    ranks = sorted(int(p.stem.split("rank")[1]) for p in adir.glob("heartbeat-rank*.jsonl"))
    out = []
    for r in ranks:
        s = first(read_beats(run_dir, attempt, r), "step")
        out.append(None if s is None else s["t"])
    return out or [None]


def digest(shared: Path, run_dirs: list[Path]) -> Optional[str]:
    for base in [shared, *run_dirs]:
        files = sorted((base / "final").glob("*.safetensors"))
        if files:
            h = hashlib.sha256()
            for f in files:
                h.update(f.read_bytes())
            return h.hexdigest()[:16]
    return None


def trial(tmp: Path, mode: str) -> dict:
    shared = tmp / "shared-checkpoints"
    names = ["a"] if mode == "one_node" else ["a", "b"]
    port = free_port()
    procs, run_dirs = {}, {}
    for n in names:
        run_dirs[n] = tmp / n / "run"
        worker = (
            {"nproc_per_node": 2}
            if mode == "one_node"
            else {"nnodes": 2, "rdzv_endpoint": f"127.0.0.1:{port}", "rdzv_id": "bench", "node_name": n}
        )
        cfg = write_yaml(tmp / n / "cfg.yaml", node_config(run_dirs[n], shared, **worker))
        procs[n] = hangwatch_run(cfg, tmp / f"{n}.out")
        time.sleep(0.5)
    limit = time.monotonic() + RUN_LIMIT_S
    codes = {n: wait_exit(p, max(1.0, limit - time.monotonic())) for n, p in procs.items()}
    row: dict = {"mode": mode, "exit_codes": codes, "dir": str(tmp)}
    incs = {
        n: [i for i in incidents_of(d) if i.get("kind") in ("stall", "peer_restart", "crash")]
        for n, d in run_dirs.items()
    }
    firsts = [(i["time_unix"], n, i) for n, v in incs.items() for i in v[:1]]
    hang = hang_time(shared, list(run_dirs.values()))
    if not firsts or hang is None:
        row["error"] = f"{mode}: no incident or no fault record (exit codes {codes})"
        return row
    firsts.sort(key=lambda x: x[0])
    detected, _, culprit_inc = firsts[0]
    stepping = []
    for n, d in run_dirs.items():
        a = incs[n][0]["attempt"] if incs[n] else max(attempts_of(d), default=1) - 1
        stepping += first_steps_after(d, a + 1)
    if None in stepping:
        row["error"] = f"{mode}: a rank never stepped after the restart"
        return row
    all_stepping = max(stepping)
    resumed = [
        first(read_beats(d, (incs[n][0]["attempt"] if incs[n] else 1) + 1, r), "start")
        for n, d in run_dirs.items()
        for r in (0, 1)
    ]
    resumed_step = next((s["step"] for s in resumed if s and s.get("step") is not None), None)
    row.update(
        hang_to_detection_s=detected - hang,
        detection_to_all_stepping_s=all_stepping - detected,
        hang_to_all_stepping_s=all_stepping - hang,
        peer_learnt_after_s=(firsts[1][0] - firsts[0][0]) if len(firsts) > 1 else None,
        kinds={n: [i["kind"] for i in v] for n, v in incs.items()},
        culprit_rank=culprit_inc.get("culprit_rank"),
        steps_lost=None if resumed_step is None else HANG_AT - 1 - resumed_step,
        final_weights=digest(shared, list(run_dirs.values())),
        finished=all(c == 0 for c in codes.values()),
    )
    return row


def section(work: Path, quick: bool) -> dict:
    trials = 1 if quick else 2
    rows: dict[str, list] = {m: [] for m in MODES}
    for i in range(trials):
        for m in MODES:
            rows[m].append(trial(work / f"{m}-{i}", m))
    modes = {}
    for m, rs in rows.items():
        ok = [r for r in rs if "error" not in r]
        modes[m] = {
            "raw": rs,
            "trials": len(rs),
            "errors": [r["error"] for r in rs if "error" in r],
            **{k: summary([r.get(k) for r in ok]) for k in FIGURES},
            "finished": sum(1 for r in ok if r.get("finished")),
        }
    pairs = [(a.get("final_weights"), b.get("final_weights")) for a, b in zip(rows["one_node"], rows["two_nodes"])]
    return {
        "method": f"{trials} runs per mode, alternating, of the demo model (world size 2, gloo, 0.05 s sleep per step, "
        f"step_timeout_s {STEP_TIMEOUT_S:g}, checkpoint every 5 steps confirmed after 2, backoff 0) with a "
        f"block_c fault (a mutex locked twice) on global rank 1 at step {HANG_AT}: one node "
        "(`worker.nproc_per_node: 2`, torchrun --standalone) vs two `hangwatch run` on this machine as two "
        "nodes (`worker.nnodes: 2`, one rank each, c10d rendezvous on 127.0.0.1, a shared checkpoint.dir). "
        "Hang: the fault's record (written the instant before it fires); detection: the earliest incident; "
        "every rank stepping: the latest first step line of the next attempt over all ranks of all nodes; "
        "peer learnt: the second node's incident time − the first's. Both nodes share 2 cores here, so the "
        "two-node restart pays two torchrun and two rank start-ups on the same CPUs",
        "modes": modes,
        "same_final_weights": f"{sum(1 for a, b in pairs if a and a == b)} of {len(pairs)}",
    }


def render(p: dict) -> tuple:
    modes = p["modes"]

    def cell(s: Optional[dict], digits: int = 2) -> str:
        if not s or not s.get("n"):
            return "–"
        return f"{s['median']:.{digits}f} s (n={s['n']}; min {s['min']:.{digits}f}, max {s['max']:.{digits}f})"

    def row(label: str, key: str) -> list[str]:
        return [label] + [cell(modes[m].get(key)) for m in MODES]

    return (
        "8. Recovery across nodes: a hang on global rank 1 → every rank stepping again, one node vs two",
        ["figure", "one node, 2 ranks (torchrun --standalone)", "two nodes, 1 rank each (c10d, loopback)"],
        [
            row("hang → first detection", "hang_to_detection_s"),
            row("detection → every rank of every node stepping again", "detection_to_all_stepping_s"),
            row("**hang → every rank stepping again**", "hang_to_all_stepping_s"),
            row("the other node's incident after the culprit node's", "peer_learnt_after_s"),
            ["runs finished"] + [f"{modes[m]['finished']} of {modes[m]['trials']}" for m in MODES],
            ["same final weights, one node vs two (bitwise, same round)", p["same_final_weights"], "–"],
            ["runs that could not be measured"] + ["; ".join(modes[m]["errors"]) or "none" for m in MODES],
        ],
        p["method"],
    )
