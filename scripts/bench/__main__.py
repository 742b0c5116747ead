"""hangwatch benchmark: how fast a hang is caught, what watching costs, how much a failure loses.

    .venv/bin/python scripts/bench [--quick] [--out DIR] [--only SECTION[,SECTION…]] [--jobs N] [--large]
                                   [--allowance-s S] [--workdir DIR] [--keep]
    hangwatch bench …              (the same command)

Sections (all but soak by default, in this order; `--only` picks some), one module each:

  heartbeat     (heartbeat_cost.py) median step time of the demo model with real heartbeats vs none, same
                process, interleaved rounds; one beat alone; checkpoint save; cold start of
                `python -m hangwatch.daemon` to its first step.
  detection     (detection.py) for each deadline (startup, silence, step, phase): a real supervisor
                (`hangwatch run`) and a light stdlib worker (scripts/baselines/stall_worker.py) that breaks
                that deadline; the latency beyond the budget, read from the incident (the supervisor's own
                clock), and from the worker's last line (wall clock); `--jobs` trials at once.
  recovery      (recovery.py) the built-in worker on the demo model hangs in C (block_c), as one process
                and as 2 ranks under torchrun (`worker.nproc_per_node: 2`, the hang on rank 1), side by
                side: the step deadline's latency beyond its budget, whether the verdict names the hung
                rank, detection → process tree gone, detection → first step of the next attempt, steps
                lost; then a graceful `restart` over the control socket and the steps that loses.
  footprint     (footprint.py) supervisor RSS and CPU% while watching 8 synthetic ranks beating at 20 Hz
                (scripts/baselines/synthetic_ranks.py), run alone; supervisor start time.
  side_by_side  (side_by_side.py) the same hung worker (busy_loop, hang_generate) under hangwatch, plain
                `torchrun --max-restarts=3`, and a cron-style watchdog (scripts/baselines/cron_watchdog.py),
                each with the same wall-clock allowance.
  cli           (cli_latency.py) `hangwatch status` round trip against a real supervisor (p50/p95), and
                `hangwatch submit` of a 1,000-line file (tiny tokenizer; a local tokenizer directory, first
                use and later), against their goals; the heavy packages each command imported.
  prewarm       (prewarm.py) the restart with restart.prewarm off and on, side by side: a standby loading
                while the stuck tree is torn down vs a cold spawn (demo model, block_c).
  in_process    (in_process.py) recovery inside the worker's process (restart.in_process) beside a prewarmed and a
                cold restart: a Python spin's detection → next step and the weights each ends with; an OOM on a
                capped (fake) device adapted in the process vs the restart path (measured micro-batch); the goodput
                of a demo run with a failure every 60 s (--quick: 30 s of a 2-minute run); with --large the ~1B
                Llama too.
  multinode     (multinode.py) a hang on global rank 1 → every rank stepping again: one node with 2 ranks
                vs two `hangwatch run` as two nodes on loopback (c10d rendezvous, 1 rank each).
  instrument    (instrument_cost.py) what automatic instrumentation costs an unedited script per optimizer
                step: the same plain loop (tiny Llama) with the bootstrap environment and without, alternating
                runs, median step times and the cost in % (target ≤ 0.5 %); the hooks' own work per step timed
                in process; the interpreter start-up each way.
  own_command   (own_command.py) launch → first optimizer step of the same unedited script bare, under
                `hangwatch run -- python train.py` (instrument auto) and with instrument off.
  overrun       (overrun.py) a runaway eval generate() on the demo model: the run's wall time with no fault,
                with the generation truncated in process (generate_overrun: truncate) and restarted instead.
  early_stalls  (early_stalls.py) the learned step and token budgets, simulated: hours of runs whose step, eval,
                generate and checkpoint times vary ×3 (seeded) through the supervisor's own deadline code on a fake
                clock (no sleeping) — the false stalls (must be 0) — then a spin in step 5, one after 50 min, and a
                generate whose tokens stop at its first call: the deadline that caught each and how soon.
  trackers      (tracker_hooks.py) what the tracker hooks cost a script per logging call, real W&B (offline) and
                TensorBoard: bare, hooked (attempt 1), and an attempt 2 whose first half replays logged steps.
  soak          (soak.py) the supervisor for --soak-minutes (default 60; --quick: 1) watching 8 synthetic ranks
                at 20 Hz, asked `status` over the control socket every second, its log rotated (rename + SIGHUP)
                every minute: RSS, open descriptors and CPU at the start (after a warm-up) and at the end, and
                whether every request was answered.  Run only when named (`--only soak`): it takes the hour.
  weight        (weight.py) the supervisor's weight, each figure the median of 3 rounds, with hangwatch's bytecode
                cached and compiled at each start: its RSS and CPU at 8 ranks × 20 Hz and the heavy packages it
                imported; `hangwatch status` and `status --json` round trips; and `hangwatch run` → the worker spawned
                (a foreign command, instrument auto and off; the built-in worker with its doctor preflight and with
                --no-doctor).

Writes bench-results.json (every raw sample, the summaries, the machine) and bench-results.md (the
tables, each figure with how it was measured; report.py) into --out (default: the repository root) and
prints the markdown.  The figures are for reading: no threshold on them passes or fails the run.  The
exit status says whether every section could be measured: 0; 1 when a section raised (the others still
run, and its error is in both files); 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

if not __package__:  # `python scripts/bench`: sys.path[0] is this folder; import it as the package `bench`
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from bench import (
    cli_latency,
    detection,
    early_stalls,
    footprint,
    heartbeat_cost,
    in_process,
    instrument_cost,
    multinode,
    overrun,
    own_command,  # noqa: E402
    prewarm,
    recovery,
    side_by_side,
    soak,
    tracker_hooks,
    weight,
)
from bench.harness import ROOT  # noqa: E402
from bench.report import machine_info, to_markdown  # noqa: E402

SECTIONS = (
    "heartbeat",
    "detection",
    "recovery",
    "footprint",
    "side_by_side",
    "cli",
    "prewarm",
    "in_process",
    "multinode",
    "instrument",
    "own_command",
    "overrun",
    "early_stalls",
    "trackers",
    "soak",
    "weight",
)
ON_REQUEST = ("soak",)  # an hour long: run when named in --only, never as part of the whole benchmark
DEFAULT_SECTIONS = tuple(s for s in SECTIONS if s not in ON_REQUEST)


def parse_only(text: Optional[str]) -> list[str]:
    if not text:
        return list(DEFAULT_SECTIONS)
    picked = [s.strip().replace("-", "_") for s in text.split(",") if s.strip()]
    unknown = [s for s in picked if s not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown section(s) {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    return [s for s in SECTIONS if s in picked]


def run_section(name: str, work: Path, args: argparse.Namespace, res: dict) -> dict:
    if name == "heartbeat":
        return heartbeat_cost.section(work, args.quick)
    if name == "detection":
        return detection.section(work, args.quick, args.jobs)
    if name == "recovery":  # beside recovery, the cold start the heartbeat section measured (when it ran)
        return recovery.section(
            work, args.quick, (res["sections"].get("heartbeat") or {}).get("cold_start_to_first_step")
        )
    if name == "footprint":
        return footprint.section(work, args.quick)
    if name == "cli":
        return cli_latency.section(work, args.quick)
    if name == "prewarm":
        return prewarm.section(work, args.quick)
    if name == "in_process":
        return in_process.section(work, args.quick, full=args.large)
    if name == "multinode":
        return multinode.section(work, args.quick)
    if name == "instrument":
        return instrument_cost.section(work, args.quick)
    if name == "own_command":
        return own_command.section(work, args.quick)
    if name == "overrun":
        return overrun.section(work, args.quick)
    if name == "early_stalls":
        return early_stalls.section(work, args.quick)
    if name == "soak":
        return soak.section(work, args.quick, args.soak_minutes)
    if name == "weight":
        return weight.section(work, args.quick)
    if name == "trackers":
        return tracker_hooks.section(work, args.quick)
    return side_by_side.section(work, args.allowance_s)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--quick", action="store_true", help="tiny trial counts and durations (plumbing check)")
    ap.add_argument("--out", type=Path, default=ROOT, help="where bench-results.json and bench-results.md go")
    ap.add_argument(
        "--only",
        type=parse_only,
        default=list(DEFAULT_SECTIONS),
        metavar="SECTION[,SECTION…]",
        help=f"run only these sections: {', '.join(SECTIONS)} (soak only when named here)",
    )
    ap.add_argument("--jobs", type=int, default=4, help="detection trials run at once (default 4)")
    ap.add_argument(
        "--large",
        action="store_true",
        help="in_process: the ~1B Llama too (minutes of CPU per run; the prewarm section has it in its full run)",
    )
    ap.add_argument(
        "--allowance-s",
        type=float,
        default=None,
        help="wall clock each side-by-side contender gets (default 120; 20 with --quick)",
    )
    ap.add_argument(
        "--soak-minutes", type=float, default=None, help="how long the soak section runs (default 60; 1 with --quick)"
    )
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (with --workdir)")
    return ap


def run_sections(args: argparse.Namespace, base: Path, res: dict) -> list[str]:
    """Every picked section into res["sections"], timed; the names of those that raised."""
    failed = []
    for name in args.only:
        work = base / name
        work.mkdir(parents=True)
        s0 = time.monotonic()
        res["section_load_average_1min_at_start"][name] = os.getloadavg()[0]
        print(f"bench: {name} …", file=sys.stderr, flush=True)
        try:
            out = run_section(name, work, args, res)
        except Exception as exc:  # one broken section must not cost the others their figures
            failed.append(name)
            out = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(out["traceback"], file=sys.stderr, flush=True)
        res["sections"][name] = out
        res["section_wall_s"][name] = time.monotonic() - s0
        print(f"bench: {name} done in {res['section_wall_s'][name]:.0f} s", file=sys.stderr, flush=True)
    return failed


def main(argv: Optional[list[str]] = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error("--jobs must be at least 1")
    if args.soak_minutes is not None and args.soak_minutes <= 0:
        ap.error("--soak-minutes must be more than 0")
    if args.allowance_s is None:
        args.allowance_s = 20.0 if args.quick else 120.0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    t0 = time.monotonic()
    given = argv if argv is not None else sys.argv[1:]
    res: dict = {
        "command": " ".join(["python scripts/bench", *given]),
        "quick": args.quick,
        "machine": machine_info(),
        "sections": {},
        "section_wall_s": {},
        "section_load_average_1min_at_start": {},
    }
    base = Path(tempfile.mkdtemp(prefix="hangwatch-bench-", dir=args.workdir))
    try:
        failed = run_sections(args, base, res)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    res["workdir"] = str(base) if args.keep else None
    res["wall_s"] = time.monotonic() - t0
    res["machine"]["load_average_end"] = os.getloadavg()
    md = to_markdown(res)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench-results.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    (args.out / "bench-results.md").write_text(md + "\n")
    print(md)
    if failed:
        print(
            f"bench: section(s) failed: {', '.join(failed)} (see their error in the table and the JSON)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
