"""Section `instrument`: what automatic instrumentation (`worker.instrument: auto`) costs an unedited training
script per optimizer step.

End to end: the same plain loop on the examples' tiny Llama (examples/tiny_model.py; AdamW, `model.train()`
every step as scripts do, one fixed batch so data loading adds no noise, one CPU thread) runs as a subprocess
with the bootstrap environment the supervisor gives a `worker.command` (`common.instrumentation.instrument_env`
plus where the attempt writes) and without it, alternating, several runs each way; each step is timed by the
script itself.  Figures: the median step time each way, their ratio, and the cost in % (target ≤ 0.5 %).  The
difference is smaller than the run-to-run spread on a shared machine, so the per-run medians are kept too.

In process: the instrumentation's own work per step, timed on its own with the same model — the optimizer
hook (lr, the loss read with `.item()`, one `step` beat written), the backward wrapper's bookkeeping and the
`Module.train` wrapper on the per-step `model.train()` — as a share of the median uninstrumented step: the
figure noise cannot hide.  Plus the interpreter start-up each way (`python -c pass`): the bootstrap's price per
Python process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import textwrap
import time
from pathlib import Path

from hangwatch.common.instrumentation import instrument_env

from .harness import PY, ROOT, env, summary

TARGET_PERCENT = 0.5
ROUNDS = 10  # in-process measurements are split into this many alternating rounds
EXAMPLES = ROOT / "examples"

LOOP = """
    import json, sys, time
    sys.path.insert(0, {examples!r})
    import torch
    import tiny_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok)
    rows = tiny_model.TextDataset(tok, tiny_model.TEXTS[:{batch}], length=48).rows
    batch = {{k: torch.stack([r[k] for r in rows]) for k in rows[0]}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for i in range({warmup} + {steps}):
        t0 = time.perf_counter()
        model.train()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({{"step_s": times[{warmup}:], "instrumented": "hangwatch.daemon.autoinstrument" in sys.modules}}))
"""


def loop_script(work: Path, steps: int, warmup: int, batch: int = 8) -> Path:
    path = work / "loop.py"
    path.write_text(textwrap.dedent(LOOP.format(examples=str(EXAMPLES), steps=steps, warmup=warmup, batch=batch)))
    return path


def child_env(work: Path, instrumented: bool, attempt: int) -> dict:
    e = env()
    e["OMP_NUM_THREADS"] = "1"
    if instrumented:
        run_dir = work / "run"
        e.update(instrument_env(e))
        e.update(
            HANGWATCH_RUN_DIR=str(run_dir),
            HANGWATCH_ATTEMPT=str(attempt),
            HANGWATCH_HEARTBEAT_DIR=str(run_dir / "attempts" / f"{attempt:04d}"),
            HANGWATCH_RESUME_FROM="",
        )
    return e


def one_run(script: Path, work: Path, instrumented: bool, attempt: int, timeout: float = 600) -> dict:
    p = subprocess.run(
        [PY, str(script)],
        cwd=str(work),
        env=child_env(work, instrumented, attempt),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise RuntimeError(f"the bench loop exited {p.returncode}: {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if out["instrumented"] != instrumented:
        raise RuntimeError(
            f"the loop ran {'with' if out['instrumented'] else 'without'} instrumentation, "
            f"asked {'with' if instrumented else 'without'}: {p.stderr[-2000:]}"
        )
    return out


def startup_s(work: Path, instrumented: bool, n: int) -> list[float]:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        subprocess.run([PY, "-c", "pass"], env=child_env(work / "startup", instrumented, i + 1), check=True, timeout=60)
        times.append(time.perf_counter() - t0)
    return times


def in_process(work: Path, calls: int) -> dict:
    """µs per step of the instrumentation's own work on the tiny Llama (see the module docstring)."""
    import sys

    import torch

    from hangwatch.daemon.autoinstrument.context import Context
    from hangwatch.daemon.autoinstrument.phases import EvalPhase
    from hangwatch.daemon.autoinstrument.steps import StepCounter
    from hangwatch.daemon.heartbeat import WRITERS, Heartbeat

    sys.path.insert(0, str(EXAMPLES))
    import tiny_model

    torch.set_num_threads(1)
    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok)
    rows = tiny_model.TextDataset(tok, tiny_model.TEXTS[:8], length=48).rows
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = model(**batch).loss
    loss.backward()
    opt.step()

    WRITERS.reset()  # a section before this one beat steps in this process: the hook would stay quiet
    hb = Heartbeat(work / "in-process" / "heartbeat-rank0.jsonl")
    ctx = Context(hb, 0, 0, {})
    hb._start(install_dump=False, instrumented="auto")
    counter = StepCounter(ctx)
    evals = EvalPhase(ctx, counter)

    def per_call(fn, n: int) -> float:
        for _ in range(max(1, n // 10)):  # warm
            fn()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    def hook_step():
        counter.probe.seen(loss)
        counter.after_step(opt, (), {})

    hook_us = statistics.median(per_call(hook_step, calls // ROUNDS) for _ in range(ROUNDS))
    # model.train() with and without the wrapper, in alternating rounds: the difference (tens of ns a module)
    # is far below the drift of a shared machine between two back-to-back measurements.
    original = torch.nn.Module.train
    evals.patch(torch.nn.modules.module)
    wrapped = torch.nn.Module.train
    plain, wrapped_times = [], []
    try:
        for r in range(ROUNDS):
            for fn, bucket in ((original, plain), (wrapped, wrapped_times))[:: 1 if r % 2 == 0 else -1]:
                torch.nn.Module.train = fn
                bucket.append(per_call(model.train, calls // ROUNDS))
    finally:
        torch.nn.Module.train = original
    plain_us, wrapped_us = statistics.median(plain), statistics.median(wrapped_times)
    hb.close()
    lines = hb.path.read_bytes().count(b"\n")
    modules = sum(1 for _ in model.modules())
    return {
        "calls": calls,
        "step_hook_us": hook_us,
        "train_plain_us": plain_us,
        "train_wrapped_us": wrapped_us,
        "train_wrapper_us": max(0.0, wrapped_us - plain_us),
        "modules": modules,
        "lines_written": lines,
        "total_us": hook_us + max(0.0, wrapped_us - plain_us),
    }


def section(work: Path, quick: bool) -> dict:
    rounds, steps, warmup, starts, calls = (1, 40, 10, 3, 300) if quick else (3, 150, 20, 10, 3000)
    script = loop_script(work, steps, warmup)
    per_run: list[dict] = []
    with_s: list[float] = []
    without_s: list[float] = []
    attempt = 0
    for r in range(rounds):
        order = (True, False) if r % 2 == 0 else (False, True)  # alternate: drift falls on both alike
        for instrumented in order:
            attempt += 1
            out = one_run(script, work, instrumented, attempt)
            (with_s if instrumented else without_s).extend(out["step_s"])
            per_run.append(
                {
                    "instrumented": instrumented,
                    "median_s": statistics.median(out["step_s"]),
                    "steps": len(out["step_s"]),
                }
            )
    beats_written = sum(
        Path(p).read_bytes().count(b'"event":"step"') for p in (work / "run").rglob("heartbeat-rank0.jsonl")
    )
    s_with, s_without = summary(with_s), summary(without_s)
    ratio = s_with["median"] / s_without["median"]
    own = in_process(work, calls)
    up_with, up_without = startup_s(work, True, starts), startup_s(work, False, starts)
    return {
        "method": f"{rounds} run(s) each way, alternating, of {steps} timed optimizer steps after {warmup} warm-up "
        "steps (examples/tiny_model.py's Llama, AdamW, batch 8 × 48 tokens, model.train() every step, one "
        "CPU thread); the same unedited script with the bootstrap environment and without; in process: "
        f"{calls} calls of each hook on the same model, in {ROUNDS} alternating rounds",
        "steps_per_run": steps,
        "rounds": rounds,
        "step_s_with": with_s,
        "step_s_without": without_s,
        "summary_with": s_with,
        "summary_without": s_without,
        "ratio_of_medians": ratio,
        "cost_percent": (ratio - 1.0) * 100.0,
        "target_percent": TARGET_PERCENT,
        "per_run": per_run,
        "step_beats_written": beats_written,
        "in_process": own,
        "own_work_percent": own["total_us"] / (s_without["median"] * 1e6) * 100.0,
        "startup_s_with": up_with,
        "startup_s_without": up_without,
        "startup_with": summary(up_with),
        "startup_without": summary(up_without),
    }


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    from .report import stats_cell

    own = s["in_process"]
    spread = [r["median_s"] * 1000 for r in s["per_run"]]

    def runs(instrumented: bool) -> str:
        return ", ".join(f"{r['median_s'] * 1000:.3f}" for r in s["per_run"] if r["instrumented"] == instrumented)

    verdict = "within" if s["own_work_percent"] <= s["target_percent"] else "over"
    return (
        "9. Automatic instrumentation cost per optimizer step (unedited plain loop, tiny Llama, CPU)",
        ["figure", "value"],
        [
            ["step time, instrumented (bootstrap env)", stats_cell(s["summary_with"], "ms", 1000, 3)],
            ["step time, not instrumented", stats_cell(s["summary_without"], "ms", 1000, 3)],
            [
                "**cost end to end (ratio of medians − 1)**",
                f"**{s['cost_percent']:+.2f} %** (target ≤ {s['target_percent']:g} %)",
            ],
            [
                "per-run medians, instrumented / not (ms)",
                f"{runs(True)} / {runs(False)} (spread {max(spread) - min(spread):.3f} ms)",
            ],
            ["`step` beats written by the hook", str(s["step_beats_written"])],
            ["in process: optimizer hook (loss .item(), lr, one beat)", f"{own['step_hook_us']:.1f} µs"],
            [
                f"in process: `Module.train` wrapper on model.train() ({own['modules']} modules)",
                f"{own['train_wrapper_us']:.1f} µs ({own['train_plain_us']:.1f} → {own['train_wrapped_us']:.1f})",
            ],
            ["**own work per step / median step**", f"**{s['own_work_percent']:.3f} %** ({verdict} the target)"],
            [
                "interpreter start-up (`python -c pass`), with / without the bootstrap",
                f"{stats_cell(s['startup_with'], 'ms', 1000, 1)} / {stats_cell(s['startup_without'], 'ms', 1000, 1)}",
            ],
        ],
        f"{s['method']} (bench/instrument_cost.py).",
    )


__all__ = ["section", "render", "TARGET_PERCENT"]
