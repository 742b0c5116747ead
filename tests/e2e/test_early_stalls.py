"""An early stall is caught as fast as a late one: `hangwatch run CONFIG --run-dir run -- python train.py`, with
the watchdog's defaults for every budget (nothing fixed, nothing learned before the run).

  * a plain loop with a torch optimizer that spins in step 5 → the step budget learned from steps 2-4 (seconds),
    not the silence deadline's 120 s;
  * the same loop known only by its output (`step N loss …` lines, no optimizer) → its first step line ended
    `load`, and the step budget learned from its lines catches the spin; before, it stayed in `load` for 300 s;
  * `model.generate()` on a tiny Llama built from a config whose tokens stop at its first call (a logits processor
    that waits for ever after 12 tokens) → the token budget: seconds after its last beat;
  * a slow first generate whose tokens keep coming (0.2–1.5 s each) → never a stall.

Each fault fires once (a marker file): attempt 2 finishes.  The scripts import nothing from hangwatch; what the
supervisor knows comes from the automatic instrumentation and the output.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import incidents, run_hangwatch, worker_logs

from hangwatch.common.protocol import decode_line

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SILENCE_S = 120  # the default silence deadline: what caught these before

CONFIG = {
    "watchdog": {"dump_grace_s": 2, "term_grace_s": 2, "py_spy": False},
    "restart": {"backoff_initial_s": 0, "max_restarts": 2},
}

PLAIN_LOOP = """\
import os, sys, time
import torch

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 11):
    if step == 5 and not os.path.exists("spun"):
        open("spun", "w").close()
        n = 0
        while True:  # a pure-Python spin: the GIL held, no step, no beat
            n += 1
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.2)
print("done", flush=True)
"""

OUTPUT_ONLY = """\
import os, time

print("loading", flush=True)
time.sleep(1.0)
for step in range(1, 11):
    if step == 5 and not os.path.exists("spun"):
        open("spun", "w").close()
        while True:  # spins in step 5: no more lines
            pass
    time.sleep(0.2)
    print(f"step {step} loss {1.0 / step:.3f}", flush=True)
print("done", flush=True)
"""

GENERATE = """\
import os, random, sys, threading, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

class StopsAfter(LogitsProcessor):
    '''Waits for ever before token `n + 1`: the tokens stop, as in a generate stuck on a lock.'''
    def __init__(self, n):
        self.n, self.calls = n, 0
    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls > self.n:
            threading.Event().wait()
        return scores

class Slow(LogitsProcessor):
    '''Every token takes 0.2-1.5 s: slow, but the tokens keep coming.'''
    def __init__(self):
        self.rnd = random.Random(0)
    def __call__(self, input_ids, scores):
        time.sleep(self.rnd.uniform(0.2, 1.5))
        return scores

mode = sys.argv[1]
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
ids = torch.tensor([[1, 5, 9, 13]])
processors = []
if mode == "stop" and not os.path.exists("stopped"):
    open("stopped", "w").close()
    processors.append(StopsAfter(12))
if mode == "slow":
    processors.append(Slow())
tokens = 40 if mode == "stop" else 24
with torch.no_grad():  # the script's first and only generate
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                         do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList(processors))
print("generated", out.shape[1] - ids.shape[1], "tokens", flush=True)
"""


def run(tmp_path: Path, script: str, *args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / "train.py").write_text(script)
    return run_hangwatch(tmp_path, CONFIG, ["python", "train.py", *args], timeout=timeout)


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    return f"hangwatch run exited {r.returncode}\n{r.stderr[-3000:]}\n{worker_logs(run_dir)}"


def finished(r: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert r.returncode == 0, explain(r, run_dir)
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished", explain(r, run_dir)


def the_stall(run_dir: Path) -> dict:
    found = [inc for _, inc in incidents(run_dir)]
    assert len(found) == 1, [(i["kind"], i.get("summary")) for i in found]
    inc = found[0]
    assert inc["kind"] == "stall" and inc["attempt"] == 1, inc.get("summary")
    return inc


def beats(run_dir: Path, attempt: int) -> list[dict]:
    path = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [b for b in map(decode_line, path.read_bytes().splitlines()) if b is not None]


def test_a_plain_loop_that_spins_in_step_5_is_caught_by_the_step_budget_its_first_steps_taught(tmp_path):
    r, run_dir = run(tmp_path, PLAIN_LOOP)
    finished(r, run_dir)
    inc = the_stall(run_dir)
    deadline = inc["deadline"]
    assert (deadline["name"], deadline["phase"]) == ("step", "train"), inc["summary"]
    assert deadline["source"].startswith("learned: 5 × p99"), deadline  # from steps 2 → 3 → 4, not first_steps
    assert deadline["budget_s"] < 30 and deadline["elapsed_s"] < 60 < SILENCE_S, deadline
    assert inc["step"] == 4, inc["summary"]


def test_a_loop_known_only_by_its_output_that_spins_in_step_5_is_caught_by_the_step_budget(tmp_path):
    r, run_dir = run(tmp_path, OUTPUT_ONLY)
    finished(r, run_dir)
    inc = the_stall(run_dir)
    deadline = inc["deadline"]
    # Its first `step N` line ended `load` (whose budget was the startup timeout, 300 s): a step of `train`.
    assert (deadline["name"], deadline["phase"]) == ("step", "train"), inc["summary"]
    assert deadline["source"].startswith("learned: 5 × p99"), deadline
    assert deadline["budget_s"] < 30 and deadline["elapsed_s"] < 60 < SILENCE_S, deadline
    assert not any(b["event"] == "step" for b in beats(run_dir, 1))  # no optimizer: the output alone said so


def test_a_generate_whose_tokens_stop_at_its_first_call_is_caught_within_seconds(tmp_path):
    r, run_dir = run(tmp_path, GENERATE, "stop")
    finished(r, run_dir)
    inc = the_stall(run_dir)
    deadline = inc["deadline"]
    assert (deadline["name"], deadline["phase"]) == ("token", "generate"), inc["summary"]
    assert deadline["budget_s"] == 10 and deadline["source"].startswith("learned: 5 × 8 tokens"), deadline
    assert deadline["elapsed_s"] < 60 < SILENCE_S, deadline
    assert "in generate()" in inc["summary"], inc["summary"]
    gen = [b for b in beats(run_dir, 1) if b["event"] == "progress" and b["phase"] == "generate"]
    assert [b["tokens"] for b in gen] == [8] and gen[0]["token_s"] >= 0, gen  # one beat, then the tokens stopped


def test_a_slow_first_generate_whose_tokens_keep_coming_is_never_a_stall(tmp_path):
    r, run_dir = run(tmp_path, GENERATE, "slow")
    finished(r, run_dir)
    assert incidents(run_dir) == [], [(i["kind"], i.get("summary")) for _, i in incidents(run_dir)]
    gen = [b for b in beats(run_dir, 1) if b["event"] == "progress" and b["phase"] == "generate"]
    assert [b["tokens"] for b in gen] == [8, 16, 24], gen
    assert all(0.2 <= b["token_s"] <= 3.0 for b in gen), gen  # the token deadline was armed throughout
    assert "generated 24 tokens" in (run_dir / "attempts" / "0001" / "worker.log").read_text()
