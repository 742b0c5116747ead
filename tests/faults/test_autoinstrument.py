"""Automatic instrumentation with real processes: unedited scripts — written here, importing nothing from
hangwatch — run with the environment the supervisor gives a `worker.command` (`instrument_env` plus where the
attempt writes), and what their heartbeat files say.

    a plain torch loop      one start (dump signal, phase load), step beats 1..N with the script's own loss and
                            lr, `eval` around model.eval(), `checkpoint` + a checkpoint beat for torch.save(path)
                            and neither for torch.save(BytesIO); its DataLoader's forked workers and a Python
                            child write no start (the child a dump file of its own)
    HF Trainer              the script's own HangwatchCallback: hangwatch adds none, the callback's start follows
                            the bootstrap's, every step once; an unedited one gets the callback and resumes from
                            HANGWATCH_RESUME_FROM, the callback's start saying so
    Lightning               the callback added before the ModelCheckpoints; fit() resumes from HANGWATCH_RESUME_FROM
    accelerate, Fabric      save_state's directory and Fabric.save's file: one checkpoint each
    CUDA (with a GPU)       the loss read at the step without a device sync
    torchrun, 2 ranks       a start from ranks 0 and 1, none from the agent
    SIGUSR1                 the unedited script's stack in the rank's dump file
    the environment         a user's sitecustomize still runs; another interpreter without hangwatch gets the
                            standard-library pieces from the source tree and none of hangwatch's dependencies;
                            one too old says so in one line; outside hangwatch nothing happens at all
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Optional

import pytest

from hangwatch.common.instrumentation import MIN_PYTHON, SOURCE_ROOT, instrument_env
from hangwatch.common.rundir import read_jsonl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv" / "bin"
PY = str(VENV / "python") if (VENV / "python").exists() else sys.executable
TORCHRUN = str(VENV / "torchrun")
EXAMPLES = ROOT / "examples"
HEAVY = ("pydantic", "yaml", "structlog", "click", "psutil", "torch", "numpy", "rich", "watchdog")


# ---- harness -------------------------------------------------------------------------------------------


def attempt_dir(tmp_path: Path, attempt: int = 1) -> Path:
    return tmp_path / "run" / "attempts" / f"{attempt:04d}"


def auto_env(
    tmp_path: Path,
    attempt: int = 1,
    resume_from: str = "",
    resume_step: Optional[int] = None,
    pythonpath: Optional[str] = None,
    supervised: bool = True,
) -> dict:
    """What the supervisor gives a `worker.command` attempt (supervisor/processes/attempt.py::worker_env)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_") and k != "PYTHONPATH"}
    if pythonpath:
        base["PYTHONPATH"] = pythonpath
    env = {**base, **instrument_env(base, resume_step)}
    if supervised:
        env.update(
            HANGWATCH_RUN_DIR=str(tmp_path / "run"),
            HANGWATCH_ATTEMPT=str(attempt),
            HANGWATCH_HEARTBEAT_DIR=str(attempt_dir(tmp_path, attempt)),
            HANGWATCH_RESUME_FROM=resume_from,
        )
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def run(argv: list, env: dict, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], env=env, cwd=str(cwd), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}"
    return p


def beats(tmp_path: Path, rank: int = 0, attempt: int = 1) -> list[dict]:
    return read_jsonl(attempt_dir(tmp_path, attempt) / f"heartbeat-rank{rank}.jsonl")


def of(lines: list[dict], event: str) -> list[dict]:
    return [b for b in lines if b["event"] == event]


def last_json(stdout: str) -> dict:
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def python_where(want, probe: str) -> Optional[str]:
    """The first interpreter on this machine, other than hangwatch's environment, for which `probe` (a -c
    program run without PYTHONPATH) prints `True` and `want(version)` holds."""

    def minor(path: str) -> int:
        digits = path.split("python3.")[-1] if "python3." in path else path.split("/versions/3.")[-1].split(".")[0]
        return int(digits) if digits.isdigit() else 99

    found = (
        glob.glob("/root/.pyenv/versions/3.*/bin/python3")
        + [f"/usr/bin/python3.{m}" for m in range(6, 15)]
        + [f"/usr/local/bin/python3.{m}" for m in range(6, 15)]
    )
    candidates = sorted(found, key=minor)  # the oldest first: the minimum version is the one to prove
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME") and not k.startswith("HANGWATCH_")
    }
    for exe in candidates:
        if not os.path.exists(exe) or os.path.realpath(exe) == os.path.realpath(PY):
            continue
        try:
            p = subprocess.run(
                [exe, "-c", "import sys; print(sys.version_info[0], sys.version_info[1]); " + probe],
                capture_output=True,
                text=True,
                timeout=30,
                env=env,
            )
            major, minor, verdict = p.stdout.split()
        except (OSError, subprocess.SubprocessError, ValueError):
            continue
        if want((int(major), int(minor))) and verdict == "True":
            return exe
    return None


# ---- a plain torch loop ------------------------------------------------------------------------------------

PLAIN_LOOP = """
    import io, json, subprocess, sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(48, 4), torch.randn(48, 1)), batch_size=8, num_workers=2,
                      multiprocessing_context="fork")
    losses = []
    model.train()
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        model.train()  # as many scripts do every step
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 4))
    model.train()
    torch.save(model.state_dict(), "ckpt.pt")
    torch.save(model.state_dict(), io.BytesIO())
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True)
    print(json.dumps({"losses": losses, "child": int(child.stdout)}))
"""


def test_a_plain_torch_loop_beats_steps_phases_and_its_checkpoint(tmp_path):
    path = script(tmp_path, "train.py", PLAIN_LOOP)
    p = subprocess.Popen(
        [PY, str(path)],
        env=auto_env(tmp_path),
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-5000:]
    result = last_json(out)
    lines = beats(tmp_path)

    [start] = of(lines, "start")
    assert (start["pid"], start["dump_signal"], start["instrumented"], start["phase"], start["step"]) == (
        p.pid,
        "SIGUSR1",
        "auto",
        "load",
        0,
    )
    assert Path(start["dump_path"]) == attempt_dir(tmp_path) / "stack-rank0.txt"
    steps = of(lines, "step")
    assert [b["step"] for b in steps] == list(range(1, 7))
    assert [b["loss"] for b in steps] == pytest.approx(result["losses"], rel=0, abs=0)
    assert all(b["lr"] == 0.01 and b["phase"] == "train" and b["pid"] == p.pid for b in steps)
    assert [b["phase"] for b in of(lines, "phase")] == ["train", "eval", "train", "checkpoint", "train"]
    [ckpt] = of(lines, "checkpoint")  # the BytesIO save: neither phase nor announcement
    assert (ckpt["path"], ckpt["step"], ckpt["good"]) == (str(tmp_path / "ckpt.pt"), 6, False)
    assert not of(lines, "warn") and [(b["reason"], b["code"]) for b in of(lines, "stop")] == [("exit", 0)]
    assert lines[-1]["event"] == "stop"  # the interpreter's exit, said last
    # nobody else wrote a heartbeat: the forked DataLoader workers and the Python child are no ranks ...
    assert sorted(f.name for f in attempt_dir(tmp_path).glob("heartbeat-*")) == ["heartbeat-rank0.jsonl"]
    # ... but each has a dump file of its own: the workers through the at-fork hook, the child from its bootstrap
    dumps = {f.name for f in attempt_dir(tmp_path).glob("stack-rank0-pid*.txt")}
    assert f"stack-rank0-pid{result['child']}.txt" in dumps and len(dumps) >= 3
    assert "hangwatch" not in err


WRAPPER = """
    import subprocess, sys
    # a wrapper that runs the training script (a launch script, a CLI running the trainer in a child)
    sys.exit(subprocess.call([sys.executable, "train.py"]))
"""
TRAINS_THEN_EVALS = """
    import json, subprocess, sys, torch
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    # after training: a separate evaluation script in a child; it works for this rank, it is not the rank
    evals = subprocess.run([sys.executable, "evaluate.py"], capture_output=True, text=True, check=True)
    print(json.dumps({"pid": __import__("os").getpid(), "eval_pid": int(evals.stdout)}))
"""


def test_a_wrappers_training_child_takes_the_rank_over_and_a_child_started_after_training_does_not(tmp_path):
    script(tmp_path, "wrapper.py", WRAPPER)
    script(tmp_path, "train.py", TRAINS_THEN_EVALS)
    script(tmp_path, "evaluate.py", "import os\nprint(os.getpid())\n")
    p = subprocess.Popen(
        [PY, "wrapper.py"],
        env=auto_env(tmp_path),
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-5000:]
    result = last_json(out)
    lines = beats(tmp_path)
    assert [(b["pid"], b["phase"]) for b in of(lines, "start")] == [(p.pid, "load"), (result["pid"], "load")]
    assert [(b["pid"], b["step"]) for b in of(lines, "step")] == [(result["pid"], n) for n in (1, 2, 3)]
    assert result["eval_pid"] not in {b["pid"] for b in lines}  # the evaluation child wrote nothing


@pytest.mark.parametrize("loads", [True, False], ids=["reads-the-checkpoint", "reads-nothing"])
def test_the_step_count_goes_on_from_the_checkpoint_resumed_only_when_the_script_read_it(tmp_path, loads):
    import torch

    ck = tmp_path / "ck" / "step-00000040"
    ck.mkdir(parents=True)
    torch.save({"step": 40}, ck / "state.pt")
    body = """
        import os, torch
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if {loads}:
            torch.load(os.path.join(os.environ["HANGWATCH_RESUME_FROM"], "state.pt"))
        for _ in range(3):
            opt.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            opt.step()
    """.format(loads=loads)
    run(
        [PY, script(tmp_path, "t.py", body)],
        auto_env(tmp_path, attempt=2, resume_from=str(ck), resume_step=40),
        tmp_path,
    )
    lines = beats(tmp_path, attempt=2)
    assert of(lines, "start")[0]["step"] == 40
    if loads:
        assert [b["step"] for b in of(lines, "step")] == [41, 42, 43]
        assert not [b for b in of(lines, "warn") if "resume_ignored" in b]
    else:  # handed step 40 but read none of it: its own steps 1, 2, 3, and one warning that says so
        assert [b["step"] for b in of(lines, "step")] == [1, 2, 3]
        assert len([b for b in of(lines, "warn") if "resume_ignored" in b]) == 1


# ---- HF Trainer ----------------------------------------------------------------------------------------------

HF_TRAINER = """
    import json, sys
    sys.path.insert(0, {examples!r})
    import tiny_model  # examples/tiny_model.py: a tiny Llama built locally
    from transformers import Trainer, TrainingArguments

    tok = tiny_model.tokenizer()
    model = tiny_model.model(tok)
    data = tiny_model.TextDataset(tok, tiny_model.TEXTS[:16], length=24)
    args = TrainingArguments(output_dir="out", max_steps=4, per_device_train_batch_size=4, save_steps=2,
                             logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="steps")
    callbacks = []
    if "--own-callback" in sys.argv:  # the three-line integration, done by the script itself
        from hangwatch.daemon.integrations.transformers import HangwatchCallback
        callbacks.append(HangwatchCallback())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    out = trainer.train()
    print(json.dumps({{"callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
                      "global_step": out.global_step}}))
"""


def test_hf_trainer_one_start_no_duplicate_steps_and_resume_without_an_edit(tmp_path):
    path = script(tmp_path, "hf.py", HF_TRAINER.format(examples=str(EXAMPLES)))
    # 1. the script adds HangwatchCallback itself: hangwatch adds none; the bootstrap's start, then the callback's
    #    (through the same heartbeat), and each step once
    p = run([PY, path, "--own-callback"], auto_env(tmp_path), tmp_path)
    assert last_json(p.stdout)["callbacks"].count("HangwatchCallback") == 1
    lines = beats(tmp_path)
    assert [(b.get("instrumented"), b.get("integration")) for b in of(lines, "start")] == [
        ("auto", None),
        (None, "transformers"),
    ]
    assert len({b["pid"] for b in lines}) == 1
    steps = of(lines, "step")
    assert [b["step"] for b in steps] == [1, 2, 3, 4]
    assert all("grad_norm" in b and "loss" in b for b in steps)  # the callback's steps, not the hook's
    assert [b["path"] for b in of(lines, "checkpoint")] == [str(tmp_path / "out" / f"checkpoint-{s}") for s in (2, 4)]
    assert [b["reason"] for b in of(lines, "stop")] == ["finished"]  # the script's own callback says stop
    assert of(lines, "phase")[0]["phase"] == "train"

    # 2. unedited: hangwatch adds the callback (no stop line) and hands train() the last good checkpoint
    good = tmp_path / "out" / "checkpoint-2"
    p = run([PY, path], auto_env(tmp_path, attempt=2, resume_from=str(good), resume_step=2), tmp_path)
    assert last_json(p.stdout) == {"callbacks": last_json(p.stdout)["callbacks"], "global_step": 4}
    assert last_json(p.stdout)["callbacks"].count("HangwatchCallback") == 1
    assert f"resume_from_checkpoint='{good}'" in p.stderr
    lines = beats(tmp_path, attempt=2)
    auto, own = of(lines, "start")
    assert (auto["instrumented"], auto["step"], auto["resumed_from"]) == ("auto", 2, None)
    assert (own["integration"], own["step"], own["resumed_from"]) == ("transformers", 2, str(good))
    assert [b["step"] for b in of(lines, "step")] == [3, 4]  # resumed at step 2: steps 3 and 4 only
    assert [(b["reason"], b["code"]) for b in of(lines, "stop")] == [("exit", 0)] and not of(lines, "warn")


# ---- Lightning, accelerate, Fabric -----------------------------------------------------------------------------

LIGHTNING = """
    import json, torch
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 1)), batch_size=8)
    keep = L.callbacks.ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1)
    trainer = L.Trainer(max_steps=4, callbacks=[keep], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(Module(), data)
    print(json.dumps({"callbacks": [type(c).__name__ for c in trainer.callbacks], "ckpt_path": trainer.ckpt_path}))
"""


def test_lightning_gets_the_callback_and_resumes_without_an_edit(tmp_path):
    path = script(tmp_path, "pl.py", LIGHTNING)
    p = run([PY, path], auto_env(tmp_path), tmp_path)
    assert last_json(p.stdout)["callbacks"][-2:] == ["HangwatchCallback", "ModelCheckpoint"]  # checkpoints run last
    lines = beats(tmp_path)
    assert [b.get("integration") for b in of(lines, "start")] == [None, "lightning"]  # the bootstrap's, the callback's
    assert [b["step"] for b in of(lines, "step")] == [1, 2, 3, 4]
    saved = [b["path"] for b in of(lines, "checkpoint")]
    assert saved == [str(tmp_path / "ckpts" / f"epoch=0-step={s}.ckpt") for s in (2, 4)]
    assert [(b["reason"], b["code"]) for b in of(lines, "stop")] == [("exit", 0)] and not of(lines, "warn")

    p = run([PY, path], auto_env(tmp_path, attempt=2, resume_from=saved[0], resume_step=2), tmp_path)
    assert last_json(p.stdout)["ckpt_path"] == saved[0]
    lines = beats(tmp_path, attempt=2)
    assert of(lines, "start")[-1]["resumed_from"] == saved[0]
    assert [b["step"] for b in of(lines, "step")] == [3, 4]


ACCELERATE_FABRIC = """
    import torch
    from accelerate import Accelerator
    import lightning as L

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(2):
        accelerator.backward(model(torch.randn(8, 4)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    accelerator.save_state("state")   # model, optimizer, RNG: several files, one checkpoint
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.save("fabric.ckpt", {"model": model})  # written through a BytesIO: announced by Fabric.save
"""


def test_accelerate_save_state_and_fabric_save_are_one_checkpoint_each(tmp_path):
    run([PY, script(tmp_path, "acc.py", ACCELERATE_FABRIC)], auto_env(tmp_path), tmp_path)
    lines = beats(tmp_path)
    assert [(b["path"], b["step"]) for b in of(lines, "checkpoint")] == [
        (str(tmp_path / "state"), 2),
        (str(tmp_path / "fabric.ckpt"), 2),
    ]
    assert [b["phase"] for b in of(lines, "phase")] == ["train", "checkpoint", "train", "checkpoint", "train"]
    assert len(list((tmp_path / "state").iterdir())) >= 2


# ---- torchrun ------------------------------------------------------------------------------------------------

DDP = """
    import os
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()
"""


def test_torchrun_ranks_start_and_the_agent_does_not(tmp_path):
    path = script(tmp_path, "ddp.py", DDP)
    p = subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(path)],
        env=auto_env(tmp_path),
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    pids = set()
    for rank in (0, 1):
        lines = beats(tmp_path, rank)
        [start] = of(lines, "start")
        assert start["rank"] == rank and start["pid"] != p.pid and start["torchrun"]["local_rank"] == rank
        assert [b["step"] for b in of(lines, "step")] == [1, 2, 3]
        assert lines[-1]["event"] == "stop" and lines[-1]["reason"] == "exit" and lines[-1]["code"] == 0, lines[-1]
        pids.add(start["pid"])
    # torch's gloo backend aborts a rank now and then after a run that completed, in its native teardown (after
    # the rank's exit line above): torchrun then fails the job.  Any other failure is one.
    assert p.returncode == 0 or "terminate called without an active exception" in out, out[-5000:]
    assert len(pids) == 2
    assert sorted(f.name for f in attempt_dir(tmp_path).glob("heartbeat-*")) == [
        "heartbeat-rank0.jsonl",
        "heartbeat-rank1.jsonl",
    ]
    assert (attempt_dir(tmp_path) / f"stack-rank0-pid{p.pid}.txt").exists()  # the agent: a dump handler only


# ---- SIGUSR1 -------------------------------------------------------------------------------------------------


def test_sigusr1_dumps_the_stack_of_the_unedited_script(tmp_path):
    body = """
        import os, time

        def spin_here(marker):
            open(marker, "w").close()
            while True:
                time.sleep(0.02)

        spin_here("ready")
    """
    path = script(tmp_path, "spin.py", body)
    p = subprocess.Popen(
        [PY, str(path)], env=auto_env(tmp_path), cwd=str(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.02)
        [start] = of(beats(tmp_path), "start")
        os.kill(p.pid, signal.SIGUSR1)
        dump = Path(start["dump_path"])
        while "spin_here" not in (dump.read_text() if dump.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.02)
        text = dump.read_text()
        assert "spin_here" in text and "spin.py" in text
        assert p.poll() is None  # the dump does not end the process
    finally:
        p.kill()
        p.wait()


# ---- CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_cuda_loss_is_read_without_a_device_sync(tmp_path):
    """With torch's sync debug mode at "error", any synchronising call in the loop raises — in the script (it
    has none) or in hangwatch's hook (it would be reported as an instrumentation error).  The loss is copied at
    backward time behind an event; a step whose event is done reports it, exactly."""
    body = """
        import json, torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x, y = torch.randn(64, 64, device="cuda"), torch.randn(64, 1, device="cuda")
        torch.cuda.synchronize()
        losses = []
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(20):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.cuda.set_sync_debug_mode(0)
        print(json.dumps({"losses": torch.stack(losses).cpu().tolist()}))
    """
    p = run([PY, script(tmp_path, "cuda_loop.py", body)], auto_env(tmp_path), tmp_path)
    losses = last_json(p.stdout)["losses"]
    lines = beats(tmp_path)
    steps = of(lines, "step")
    assert [b["step"] for b in steps] == list(range(1, 21)) and not of(lines, "warn")
    reported = [b for b in steps if "loss" in b]
    assert reported and all(b["loss"] == losses[b["step"] - 1] for b in reported)


# ---- the environment ----------------------------------------------------------------------------------------

PROBE = """
    import json, sys
    mod = sys.modules.get("hangwatch.daemon.heartbeat")
    print(json.dumps({"heartbeat": getattr(mod, "__file__", None),
                      "autoinstrument": "hangwatch.daemon.autoinstrument" in sys.modules,
                      "heavy": sorted(m for m in %r if m in sys.modules),
                      "user_site": getattr(sys.modules.get("sitecustomize"), "USER_MARK", None)}))
""" % (HEAVY,)


def test_a_users_sitecustomize_still_runs(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("import os\nUSER_MARK = 'ran'\nos.environ['USER_SITE_RAN'] = '1'\n")
    path = script(tmp_path, "probe.py", PROBE)
    p = run([PY, path], auto_env(tmp_path, pythonpath=str(mine)), tmp_path)
    got = last_json(p.stdout)
    assert got["user_site"] == "ran" and got["autoinstrument"]
    assert len(of(beats(tmp_path), "start")) == 1

    # its error is printed as Python prints it, and instruments on
    (mine / "sitecustomize.py").write_text("raise RuntimeError('broken user site')\n")
    p = run([PY, path], auto_env(tmp_path, attempt=2, pythonpath=str(mine)), tmp_path)
    assert "Error in sitecustomize; set PYTHONVERBOSE for traceback:\nRuntimeError: broken user site" in p.stderr
    assert last_json(p.stdout)["autoinstrument"] and len(of(beats(tmp_path, attempt=2), "start")) == 1


def test_an_interpreter_without_site_packages_gets_hangwatch_from_its_source_only(tmp_path):
    """`python -S`: no site-packages, so no editable install of hangwatch and none of its dependencies; the
    bootstrap's finder maps hangwatch.common/daemon onto the source tree.  (-S also skips sitecustomize, so
    the program imports it itself, as site would.)"""
    path = script(tmp_path, "probe.py", PROBE)
    p = run([PY, "-S", "-c", f"import sitecustomize; exec(open({str(path)!r}).read())"], auto_env(tmp_path), tmp_path)
    got = last_json(p.stdout)
    assert got["heartbeat"] == str(SOURCE_ROOT / "daemon" / "heartbeat.py") and got["autoinstrument"]
    assert got["heavy"] == []
    assert of(beats(tmp_path), "start")[0]["instrumented"] == "auto"


def test_another_environments_interpreter_gets_the_stdlib_pieces_only(tmp_path):
    other = python_where(
        lambda v: v >= MIN_PYTHON, "import importlib.util as u; print(u.find_spec('hangwatch') is None)"
    )
    if other is None:
        pytest.skip("no second Python >= 3.9 without hangwatch on this machine")
    path = script(tmp_path, "probe.py", PROBE)
    p = run([other, path], auto_env(tmp_path), tmp_path)
    got = last_json(p.stdout)
    assert got["heartbeat"] == str(SOURCE_ROOT / "daemon" / "heartbeat.py"), (other, got)
    assert got["heavy"] == [] and got["autoinstrument"]
    [start] = of(beats(tmp_path), "start")
    assert start["instrumented"] == "auto" and start["dump_signal"] == "SIGUSR1"
    assert "hangwatch" not in p.stderr


def test_a_too_old_interpreter_says_so_in_one_line(tmp_path):
    old = python_where(lambda v: (3, 0) <= v < MIN_PYTHON, "print(True)")
    if old is None:
        pytest.skip("no Python older than 3.9 on this machine")
    path = script(tmp_path, "old.py", "import sys\nprint('ran', sys.version_info[:2])\n")
    p = run([old, path], auto_env(tmp_path), tmp_path)
    assert p.stdout.startswith("ran")
    version = subprocess.run(
        [old, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
    ).stdout.strip()
    assert p.stderr == (
        f"hangwatch: Python {version} is too old for instrumentation (needs 3.9+): this process is "
        "watched by its output, py-spy and NVML only\n"
    )
    assert not attempt_dir(tmp_path).exists()


def test_outside_hangwatch_the_bootstrap_does_nothing(tmp_path):
    path = script(tmp_path, "probe.py", PROBE)
    env = auto_env(tmp_path, supervised=False)  # PYTHONPATH has the bootstrap, no HANGWATCH_RUN_DIR
    p = run([PY, path], env, tmp_path)
    got = last_json(p.stdout)
    assert got["heartbeat"] is None and not got["autoinstrument"] and p.stderr == ""
    assert not (tmp_path / "run").exists()
    env.update(HANGWATCH_RUN_DIR=str(tmp_path / "run"), HANGWATCH_INSTRUMENT="off")  # `worker.instrument: off`
    p = run([PY, path], env, tmp_path)
    assert not last_json(p.stdout)["autoinstrument"] and not (tmp_path / "run").exists()
