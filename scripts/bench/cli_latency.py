"""Section 6, cli: what a person waits for at the prompt.  `hangwatch status` against a running supervisor
(the whole round trip: interpreter start, imports, one request, the answer printed), and `hangwatch submit`
of a 1,000-line file (the CLI, then the worker-side check with the run's tokenizer, then the publish), for
the tiny model's tokenizer and for a local tokenizer directory (saved with save_pretrained) both before and
after its first use.  Also which heavy packages each command imported (PYTHONPROFILEIMPORTTIME, which a
child process inherits), because "imports only what it needs" is what keeps these figures down."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from .harness import PY, ROOT, control, env, hangwatch_run, summary, wait_exit, write_yaml

STATUS_GOAL_S = 0.150
SUBMIT_GOAL_S = 1.0
SUBMIT_LINES = 1000
JITTER_S = 0.3  # a little more than the default loop period (watchdog.poll_interval_s 0.25)
HEAVY = ("pydantic", "yaml", "structlog", "rich", "torch", "transformers", "numpy", "jinja2", "tokenizers")
TINY = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "max_position": 128,
}


def hangwatch_argv() -> list[str]:
    """The installed console script (what a person types), else the same entry point through -m."""
    script = Path(PY).parent / "hangwatch"
    return [str(script)] if script.exists() else [PY, "-m", "hangwatch.supervisor.cli.main"]


def timed(argv: list[str], child_env: dict) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120)
    return time.perf_counter() - t0, done


def heavy_imports(argv: list[str], child_env: dict) -> list[str]:
    """The packages of HEAVY that one run of `argv` (and any Python child it starts) imported."""
    done = subprocess.run(
        argv, cwd=ROOT, env={**child_env, "PYTHONPROFILEIMPORTTIME": "1"}, capture_output=True, text=True, timeout=120
    )
    names = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return sorted(names & set(HEAVY))


def trials(
    argv: list[str], child_env: dict, n: int, ok=lambda d: d.returncode == 0, jitter_s: float = 0.0
) -> tuple[list[float], list[str]]:
    """Wall times of `n` sequential runs of `argv`; the runs that failed, as errors.  A random pause of up to
    `jitter_s` before each keeps the runs from falling into step with the supervisor's loop period (a person
    typing a command is not in step with it either)."""
    times, errors = [], []
    rng = random.Random(0)
    for _ in range(n):
        time.sleep(rng.uniform(0.0, jitter_s))
        s, done = timed(argv, child_env)
        if ok(done):
            times.append(s)
        else:
            errors.append(f"exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}")
    return times, errors


# ---------------------------------------------------------------- status


@contextlib.contextmanager
def instant_daemon(path: Path, reply: dict):
    """A control socket answering every request line at once with `reply` (threads of this process): what
    `hangwatch status` costs by itself, whatever the supervisor's loop takes to answer."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    line = json.dumps(reply).encode() + b"\n"

    def answer(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            if conn.makefile("rb").readline():
                conn.sendall(line)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the figures are taken
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield path
    finally:
        listener.close()


def status_figures(work: Path, n: int, child_env: dict) -> dict:
    """`hangwatch status` (rich view) and `status --json` against a real supervisor watching a sleeping worker."""
    run_dir = work / "run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {"command": [PY, "-c", "import time; time.sleep(600)"]},
        "watchdog": {"py_spy": False, "startup_timeout_s": 600},
    }
    proc = hangwatch_run(write_yaml(work / "cfg.yaml", cfg), work / "supervisor.out")
    try:
        limit = time.monotonic() + 60
        while control(run_dir, "status", 1)[1] is not None:
            if time.monotonic() > limit or proc.poll() is not None:
                raise RuntimeError(f"the supervisor's control socket never answered (see {work / 'supervisor.out'})")
            time.sleep(0.05)
        base = [*hangwatch_argv(), "status", "--run-dir", str(run_dir)]
        floor, _ = trials([PY, "-c", "pass"], child_env, n)
        view, view_err = trials(base, child_env, n, jitter_s=JITTER_S)
        as_json, json_err = trials([*base, "--json"], child_env, n, jitter_s=JITTER_S)
        reply = {"ok": True, "result": control(run_dir, "status", 5)[0]}
        with instant_daemon(work / "instant.sock", reply) as sock:
            alone = [*hangwatch_argv(), "status", "--socket", str(sock)]
            view_alone, e1 = trials(alone, child_env, n)
            json_alone, e2 = trials([*alone, "--json"], child_env, n)
        return {
            "python_startup_s": summary(floor),
            "status_s": summary(view),
            "status_json_s": summary(as_json),
            "status_samples_s": view,
            "status_json_samples_s": as_json,
            "status_instant_s": summary(view_alone),
            "status_json_instant_s": summary(json_alone),
            "errors": view_err + json_err + e1 + e2,
            "status_imports": heavy_imports(base, child_env),
            "status_json_imports": heavy_imports([*base, "--json"], child_env),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        wait_exit(proc, 30)


# ---------------------------------------------------------------- submit


def thousand_lines(path: Path, salt: str) -> Path:
    """SUBMIT_LINES lines cycled from configs/data/train.jsonl (both formats), made unique by `salt`."""
    src = [json.loads(line) for line in (ROOT / "configs/data/train.jsonl").read_text().splitlines() if line.strip()]
    with open(path, "w") as f:
        for i, obj in zip(range(SUBMIT_LINES), itertools.cycle(src)):
            obj = json.loads(json.dumps(obj))
            last = obj["messages"][-1] if "messages" in obj else obj
            key = "content" if "messages" in obj else "completion"
            last[key] = f"{last[key]} {salt}{i}"
            f.write(json.dumps(obj) + "\n")
    return path


def save_local_tokenizer(where: Path) -> Path:
    """A model directory holding only the tiny tokenizer (save_pretrained) and a config.json."""
    code = (
        "import sys; from hangwatch.daemon.model import build_tiny_tokenizer; "
        "from transformers import LlamaConfig; d = sys.argv[1]; "
        "build_tiny_tokenizer(128).save_pretrained(d); LlamaConfig(vocab_size=128).save_pretrained(d)"
    )
    subprocess.run([PY, "-c", code, str(where)], cwd=ROOT, env=env(), check=True, capture_output=True, timeout=300)
    return where


def submit_trial(work: Path, name: str, i: int, model: dict, child_env: dict) -> tuple[Optional[float], Optional[str]]:
    """One `hangwatch submit --config CFG FILE` of a fresh 1,000-line file into a fresh run dir."""
    d = work / f"{name}-{i}"
    cfg = {"run_dir": str(d / "run"), "model": model, "data": {"inbox": True, "max_length": 64}}
    cfg_path = write_yaml(d / "cfg.yaml", cfg)
    data = thousand_lines(d / "batch.jsonl", f"{name}{i}-")
    s, done = timed([*hangwatch_argv(), "submit", "--config", str(cfg_path), str(data)], child_env)
    if done.returncode != 0 or f"({SUBMIT_LINES} examples)" not in done.stdout:
        return None, f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]}"
    return s, None


def submit_figures(work: Path, n: int, child_env: dict) -> dict:
    tiny = {"tiny": TINY, "device": "cpu"}
    out: dict = {"errors": []}
    times = []
    for i in range(n):
        s, err = submit_trial(work, "tiny", i, tiny, child_env)
        times.append(s)
        out["errors"] += [err] if err else []
    out["submit_tiny_s"], out["submit_tiny_samples_s"] = summary(times), times
    cfg = {"run_dir": str(work / "imports" / "run"), "model": tiny, "data": {"inbox": True, "max_length": 64}}
    data = thousand_lines(work / "imports.jsonl", "imports-")
    out["submit_tiny_imports"] = heavy_imports(
        [*hangwatch_argv(), "submit", "--config", str(write_yaml(work / "imports" / "cfg.yaml", cfg)), str(data)],
        child_env,
    )

    local = {"name_or_path": str(save_local_tokenizer(work / "local-model")), "device": "cpu"}
    first, err = submit_trial(work, "local-first", 0, local, child_env)
    out["errors"] += [err] if err else []
    warm = []
    for i in range(n):
        s, err = submit_trial(work, "local", i, local, child_env)
        warm.append(s)
        out["errors"] += [err] if err else []
    out["submit_local_first_s"], out["submit_local_s"], out["submit_local_samples_s"] = first, summary(warm), warm
    return out


def section(work: Path, quick: bool) -> dict:
    n_status, n_submit = (5, 2) if quick else (30, 7)
    child_env = {**env(), "XDG_CACHE_HOME": str(work / "cache")}  # the tokenizer cache starts empty, here
    status = status_figures(work / "status", n_status, child_env)
    submit = submit_figures(work / "submit", n_submit, child_env)
    return {
        "method": f"`{' '.join(Path(a).name for a in hangwatch_argv())} status --run-dir RUN` (and `--json`) spawned "
        f"{n_status} times in a row (a random 0–{JITTER_S:g} s pause before each, so as not to fall into step "
        f"with the loop period) against a real supervisor watching a sleeping worker, wall clock from "
        f"spawn to exit (time.perf_counter), beside `python -c pass` for the interpreter's own start, and "
        f"against a socket that answers at once (threads of the bench, the real supervisor's status reply "
        f"canned): the command's own share; "
        f"`hangwatch submit --config CFG FILE` of a fresh {SUBMIT_LINES}-line file (configs/data/train.jsonl "
        f"cycled, both formats) into a fresh run dir, {n_submit} times: the tiny model's tokenizer, and a "
        f"local model directory holding the tiny tokenizer saved with save_pretrained (its first submit, "
        f"with an empty XDG_CACHE_HOME, then the later ones). Imports: one more run of each with "
        f"PYTHONPROFILEIMPORTTIME=1 (children inherit it), the heavy packages named ({', '.join(HEAVY)}).",
        "goals": {"status_p50_s": STATUS_GOAL_S, "submit_s": SUBMIT_GOAL_S},
        "lines": SUBMIT_LINES,
        **status,
        **{k: v for k, v in submit.items() if k != "errors"},
        "errors": status["errors"] + submit["errors"],
        "python": sys.version.split()[0],
        "cores_usable": len(os.sched_getaffinity(0)),
    }
