"""Section own_command: what `hangwatch run -- CMD` costs a command you already run before it trains.

The same unedited script (a plain PyTorch loop on the examples' tiny Llama, CPU: it imports torch and
transformers, builds the model, takes one optimizer step and prints `step 1 t=<wall clock>`) started three ways,
in interleaved rounds: bare (`python script.py`), under `hangwatch run -- python script.py` with the default
instrumentation (`worker.instrument: auto`: the bootstrap on PYTHONPATH, heartbeats, step hooks), and under
`hangwatch run CONFIG -- python script.py` with `worker.instrument: off`.  The figure is the wall time from the
moment the command is launched to the step line's time stamp (the script's own clock, the same machine): the
supervisor's start (its imports, the config check, the interpreter probe) plus the worker's own start.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from .cli_latency import hangwatch_argv
from .harness import PY, ROOT, env, summary, write_yaml

SCRIPT = """\
import sys, time
sys.path.insert(0, {examples!r})
import torch
import tiny_model
tok = tiny_model.tokenizer()
model = tiny_model.model(tok)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = torch.utils.data.default_collate([tiny_model.TextDataset(tok)[i] for i in range(4)])
loss = model(**batch).loss
loss.backward()
opt.step()
print(f"step 1 loss {{loss.item():.4f}} t={{time.time():.6f}}", flush=True)
"""
STEP = re.compile(r"step 1 loss \S+ t=([0-9.]+)")


def first_step_s(argv: list[str], log: Path, cwd: Path) -> float:
    """Launch `argv`, wait for it to end, and read the step line's time stamp from `log`: seconds from launch."""
    t0 = time.time()
    done = subprocess.run(argv, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    text = log.read_text() if log.exists() else done.stdout
    m = STEP.search(text)
    if m is None:
        raise RuntimeError(f"no step line from {argv} (exit {done.returncode}): {(done.stderr or done.stdout)[-500:]}")
    return float(m.group(1)) - t0


def section(work: Path, quick: bool) -> dict:
    rounds = 2 if quick else 5
    script = work / "train.py"
    script.write_text(SCRIPT.format(examples=str(ROOT / "examples")))
    off = write_yaml(work / "off.yaml", {"worker": {"instrument": "off"}})
    samples: dict[str, list[float]] = {"bare": [], "hangwatch_auto": [], "hangwatch_off": []}
    for i in range(rounds):
        bare_log = work / f"bare-{i}.log"
        with open(bare_log, "w") as out:
            t0 = time.time()
            subprocess.run([PY, str(script)], cwd=work, env=env(), stdout=out, stderr=subprocess.STDOUT, timeout=300)
        m = STEP.search(bare_log.read_text())
        if m is None:
            raise RuntimeError(f"the bare script printed no step line: {bare_log.read_text()[-500:]}")
        samples["bare"].append(float(m.group(1)) - t0)
        for name, pre in (("hangwatch_auto", []), ("hangwatch_off", [str(off)])):
            run_dir = work / f"{name}-{i}"
            argv = [*hangwatch_argv(), "run", *pre, "--run-dir", str(run_dir), "--", "python", str(script)]
            samples[name].append(first_step_s(argv, run_dir / "attempts" / "0001" / "worker.log", work))
    sums = {k: summary(v) for k, v in samples.items()}
    return {
        "method": f"{rounds} interleaved rounds: the same unedited script (tiny Llama, CPU, one AdamW step) bare, "
        "under `hangwatch run -- python train.py` (instrument auto) and with instrument off; launch → the step "
        "line's own time stamp",
        "samples_s": samples,
        "summary": sums,
        "overhead_auto_s": sums["hangwatch_auto"]["median"] - sums["bare"]["median"],
        "overhead_off_s": sums["hangwatch_off"]["median"] - sums["bare"]["median"],
    }


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    from .report import stats_cell

    sums = s["summary"]
    return (
        "10. `hangwatch run -- CMD`: launch → first optimizer step, beside the bare command",
        ["figure", "value"],
        [
            ["bare `python train.py`", stats_cell(sums["bare"], "s", 1, 2)],
            ["`hangwatch run -- python train.py` (instrument auto)", stats_cell(sums["hangwatch_auto"], "s", 1, 2)],
            [
                "`hangwatch run off.yaml -- python train.py` (instrument off)",
                stats_cell(sums["hangwatch_off"], "s", 1, 2),
            ],
            [
                "**added by hangwatch (medians), auto / off**",
                f"**{s['overhead_auto_s']:+.2f} s / {s['overhead_off_s']:+.2f} s**",
            ],
        ],
        f"{s['method']} (bench/own_command.py).",
    )


__all__ = ["section", "render"]
