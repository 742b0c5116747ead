"""The GPU paths of `hangwatch run -- CMD` on a real CUDA device (skipped without one): an unedited bf16 training
script on the GPU, instrumented automatically, whose forward then spins in Python.

What only a GPU shows: the step beats carry the loss read without a device synchronisation (a pinned copy and a
CUDA event, `worker.instrument: auto`), the stall's incident holds NVML's view of the worker process (its GPU memory,
`gpu_processes`) and says it used it (`evidence.gpu`), and the run resumes from the announced checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hangwatch.common.protocol import decode_line

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.slow, pytest.mark.gpu]  # skipped where torch sees no CUDA device (tests/conftest.py)

SCRIPT = """\
import os, sys, time
import torch
torch.manual_seed(0)
dev = "cuda"
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
start = 0
if "--resume" in sys.argv:
    state = torch.load(sys.argv[sys.argv.index("--resume") + 1], map_location=dev)
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
marker = sys.argv[1]

def nsa_select_blocks(x):
    total = 0
    for i in range(10 ** 12):  # the spin: pure Python, the GPU idle
        total += i
    return x

for step in range(start + 1, 31):
    x = torch.randn(64, 512, device=dev)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if step == 12 and not os.path.exists(marker):
            open(marker, "w").close()
            x = nsa_select_blocks(x)
        loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}", flush=True)
    if step % 5 == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, f"ckpt-{step}.pt")
    time.sleep(0.05)
"""


def hangwatch_argv() -> list[str]:
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]


def test_an_unedited_cuda_script_is_instrumented_caught_with_nvml_evidence_and_resumed(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    cfg = {
        "worker": {"resume_args": ["--resume", "{checkpoint}"]},
        "watchdog": {"step_timeout_s": 8, "dump_grace_s": 2, "stuck_term_grace_s": 0.5},
        "restart": {"backoff_initial_s": 0},
        "checkpoint": {"confirm_steps": 1},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    r = subprocess.run(
        [*hangwatch_argv(), "run", "cfg.yaml", "--run-dir", "run", "--", "python", "train.py", str(tmp_path / "spun")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    run = tmp_path / "run"
    assert r.returncode == 0, r.stderr[-4000:]
    beats = [
        b
        for b in map(decode_line, (run / "attempts" / "0001" / "heartbeat-rank0.jsonl").read_bytes().splitlines())
        if b
    ]
    steps = [b for b in beats if b["event"] == "step"]
    assert [b["step"] for b in steps][:11] == list(range(1, 12))
    losses = [b.get("loss") for b in steps]
    assert sum(isinstance(v, float) for v in losses) >= len(losses) // 2, losses  # read without a sync, most steps
    inc = json.loads(next((run / "incidents").glob("*/incident.json")).read_text())
    assert inc["deadline"]["name"] == "step" and inc["stuck_frame"]["function"] == "nsa_select_blocks"
    assert inc["evidence"]["gpu"] == "NVML, per process"
    worker_pids = {p["pid"] for p in inc["gpu_processes"]}
    assert worker_pids and all(p["used_memory_bytes"] for p in inc["gpu_processes"])
    a2 = [
        b
        for b in map(decode_line, (run / "attempts" / "0002" / "heartbeat-rank0.jsonl").read_bytes().splitlines())
        if b
    ]
    assert [b["step"] for b in a2 if b["event"] == "step"][0] == 11  # resumed from ckpt-10.pt, counting on from it
