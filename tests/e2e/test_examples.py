"""The examples as a user meets them: each `configs/examples/*.yaml` run with `hangwatch run` (tiny model, CPU),
and the example scripts run without hangwatch, where they must write no heartbeat at all.

Table-driven: a config names its script in `worker.command`, so a new example is covered as soon as its
config lands.  Each run uses the shipped config verbatim, copied to the same depth of a scratch tree whose
examples/ links to the repo's: the command's relative paths reach the repo's scripts, while the run dir
(`../../runs/examples/...`) and whatever else the config puts beside it land in the scratch tree.  A test
run leaves nothing in the repo, and checks that no example writes there.

The lines an example adds for hangwatch end with `# hangwatch`; an HF Trainer or Lightning script may have at
most 3, and examples/README.md states each example's count.  Those checks read files
only.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CONFIGS = REPO / "configs" / "examples"

E2E = [pytest.mark.e2e, pytest.mark.slow]

# The examples there must be: a plain loop, an HF Trainer, Lightning and accelerate, each with a config.
REQUIRED = {"plain_loop.py", "hf_trainer.py", "lightning_train.py", "accelerate_loop.py"}
# "Lines a user adds to an existing Trainer or Lightning script: at most 3."
AT_MOST_3 = ("hf_trainer.py", "lightning_train.py")
# Run once without hangwatch: the plain loop (the Heartbeat used directly) and the two callbacks, which
# must be no-ops outside hangwatch.  The accelerate example uses the Heartbeat as the plain loop does.
WITHOUT_HANGWATCH = (
    "plain_loop.py",
)  # the callbacks' no-op is tested in-process (tests/faults/test_{hf,lightning}_callback.py)

HANGWATCH_LINE = re.compile(r"^\s*[^#\s].*#\s*hangwatch\s*$")
README_ROW = re.compile(r"^\|\s*\[?`(?P<script>[\w.]+\.py)`\]?(?:\([^)]*\))?\s*\|.*\|\s*(?P<count>\d+)\s*\|\s*$")


# ---- what is there ---------------------------------------------------------------------------------


def example_scripts() -> list[Path]:
    """Runnable examples (a `__main__` block); examples/tiny_model.py and the like are helpers."""
    return sorted(p for p in EXAMPLES.glob("*.py") if '__name__ == "__main__"' in p.read_text())


def example_configs() -> list[Path]:
    return sorted(CONFIGS.glob("*.yaml"))


def worker_cwd(cfg: dict) -> Path:
    cwd = (cfg.get("worker") or {}).get("cwd")
    return (CONFIGS / cwd).resolve() if cwd else CONFIGS


def script_of(config: Path) -> Path:
    """The example script a config runs: the first `.py` argument of its worker.command."""
    cfg = yaml.safe_load(config.read_text())
    command = (cfg.get("worker") or {}).get("command") or []
    scripts = [a for a in command if str(a).endswith(".py")]
    assert scripts, f"{config}: worker.command {command} names no .py script"
    return (worker_cwd(cfg) / scripts[0]).resolve()


def hangwatch_lines(script: Path) -> list[str]:
    return [line for line in script.read_text().splitlines() if HANGWATCH_LINE.match(line)]


def clean_env(**extra: str) -> dict:
    """The caller's environment without anything that would tell a script it runs under hangwatch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_") and k != "NOTIFY_SOCKET"}
    env.update(extra)
    return env


def hangwatch_argv() -> list[str]:
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor"]


# ---- the examples' source (no subprocess) ------------------------------------------------------------


def test_every_required_example_exists_and_every_example_has_a_config():
    scripts = {p.name for p in example_scripts()}
    assert REQUIRED <= scripts, f"missing examples: {sorted(REQUIRED - scripts)}"
    configured = {script_of(c) for c in example_configs()}
    assert all(s.exists() for s in configured), (
        f"configs name scripts that do not exist: {sorted(map(str, configured))}"
    )
    unconfigured = sorted(p.name for p in example_scripts() if p.resolve() not in configured)
    assert not unconfigured, f"examples without a configs/examples/*.yaml: {unconfigured}"


@pytest.mark.parametrize("script", example_scripts(), ids=lambda p: p.stem)
def test_hangwatch_lines_are_marked_and_few_enough(script):
    lines = hangwatch_lines(script)
    assert lines, f"{script.name}: no line ends with `# hangwatch` (mark every line hangwatch adds)"
    if script.name in AT_MOST_3:
        assert len(lines) <= 3, f"{script.name}: {len(lines)} hangwatch lines, at most 3 are allowed:\n" + "\n".join(
            lines
        )


def test_examples_readme_states_each_examples_line_count():
    rows = {
        m["script"]: int(m["count"])
        for m in map(README_ROW.match, (EXAMPLES / "README.md").read_text().splitlines())
        if m
    }
    actual = {p.name: len(hangwatch_lines(p)) for p in example_scripts()}
    assert rows == actual, "examples/README.md's table (script → lines hangwatch adds) is out of date"


# ---- each example under `hangwatch run` -----------------------------------------------------------------


def heartbeats(attempt_dir: Path) -> dict[int, list[dict]]:
    """rank → its heartbeat lines (complete ones, as the supervisor reads them)."""
    out = {}
    for f in sorted(attempt_dir.glob("heartbeat-rank*.jsonl")):
        recs = [r for r in map(decode_line, f.read_bytes().splitlines()) if r is not None]
        out[recs[0]["rank"] if recs else -1] = recs
    return out


def own_start(recs: list[dict]) -> dict:
    """The script's own start line (its callback's or heartbeat's), after the bootstrap's (`instrumented: auto`)."""
    return next(r for r in recs if r["event"] == "start" and r.get("instrumented") != "auto")


def place_config(tmp_path: Path, config: Path, **worker_changes) -> tuple[Path, Path]:
    """A verbatim copy of `config` (`worker_changes` update its `worker`) at the same depth of a scratch
    tree whose examples/ is a link to the repo's: the command's relative paths reach the repo's scripts,
    while the run dir and anything else the config puts beside it (`../../runs/...`) land in the scratch
    tree, not in the repo.  Returns (the copy, its run dir)."""
    home = tmp_path / "tree"
    (home / "configs" / "examples").mkdir(parents=True)
    (home / "examples").symlink_to(EXAMPLES, target_is_directory=True)
    cfg = yaml.safe_load(config.read_text())
    assert not Path(cfg["run_dir"]).is_absolute(), f"{config}: ship a run_dir relative to the config file"
    cfg["worker"] = {**cfg["worker"], **worker_changes}
    copy = home / "configs" / "examples" / config.name
    copy.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = (copy.parent / cfg["run_dir"]).resolve()
    assert run_dir.is_relative_to(home), f"{config}: run_dir {cfg['run_dir']} leaves the tree"
    return copy, run_dir


def run_config(tmp_path: Path, config: Path, **worker_changes) -> tuple[Path, subprocess.CompletedProcess]:
    """`hangwatch run` on a placed copy of `config`, to the end."""
    copy, run_dir = place_config(tmp_path, config, **worker_changes)
    t0 = time.monotonic()
    r = subprocess.run(
        [*hangwatch_argv(), "run", str(copy)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
        cwd=tmp_path,
    )
    print(f"{config.name}: hangwatch run took {time.monotonic() - t0:.1f} s")
    return run_dir, r


def hw(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*hangwatch_argv(), *map(str, args)], capture_output=True, text=True, timeout=60, env=clean_env()
    )


def wait_for(what: str, check, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def log_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    return [rec for rec in map(json.loads, lines) if rec.get("event") == event]


def worker_log(run_dir: Path) -> str:
    logs = sorted(run_dir.glob("attempts/*/worker.log"))
    return "\n".join(f"--- {p}\n{p.read_text()[-4000:]}" for p in logs)


def assert_ran_cleanly(run_dir: Path, r: subprocess.CompletedProcess, script: Path, ranks: int = 1) -> None:
    """Exit 0, finished, no incident, one attempt; on every rank each step beaten once, in order; the
    final checkpoint committed (outside the repo); a `generate` phase when the script generates."""
    assert r.returncode == 0, f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_log(run_dir)}"
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
    incidents = sorted(p.name for p in (run_dir / "incidents").glob("*")) if (run_dir / "incidents").exists() else []
    assert incidents == [], f"incidents: {incidents}\n{worker_log(run_dir)}"
    attempts = sorted((run_dir / "attempts").iterdir())
    assert [a.name for a in attempts] == ["0001"]

    beats = heartbeats(attempts[0])
    assert sorted(beats) == list(range(ranks)), f"heartbeat files for ranks {sorted(beats)}, expected {ranks}"
    last_steps = set()
    for rank, recs in beats.items():
        assert recs[0]["event"] == "start" and own_start(recs)["resumed_from"] is None, recs[0]
        assert recs[-1]["event"] == "stop" and recs[-1]["reason"] == "finished", recs[-1]
        steps = [b["step"] for b in recs if b["event"] == "step"]
        assert steps and steps == list(range(1, len(steps) + 1)), f"rank {rank} beat steps {steps}"
        last_steps.add(steps[-1])
    assert len(last_steps) == 1, f"ranks ended at different steps: {last_steps}"
    final_step = last_steps.pop()

    checkpoints = [b for recs in beats.values() for b in recs if b["event"] == "checkpoint"]
    assert checkpoints, "no checkpoint beat"
    assert {b["rank"] for b in checkpoints} == {0}, "only rank 0 announces checkpoints"
    last = checkpoints[-1]
    assert last["step"] == final_step, f"the last checkpoint is of step {last['step']}, training ended at {final_step}"
    path = Path(last["path"])
    assert path.is_dir() or path.is_file(), f"announced checkpoint {path} is not there"
    assert not path.resolve().is_relative_to(REPO), f"{path}: the example wrote into the repo, not beside its run dir"
    if ".generate(" in script.read_text():
        phases = [b["phase"] for b in beats[0] if b["event"] == "phase"]
        assert "generate" in phases, f"{script.name} generates, but rank 0 never entered the generate phase: {phases}"


@pytest.mark.parametrize("config", example_configs(), ids=lambda p: p.stem)
@pytest.mark.e2e
@pytest.mark.slow
def test_example_runs_under_hangwatch(tmp_path, config):
    run_dir, r = run_config(tmp_path, config)
    assert_ran_cleanly(run_dir, r, script_of(config))


@pytest.mark.e2e
@pytest.mark.slow
def test_accelerate_example_on_two_processes(tmp_path):
    """The accelerate example under torchrun, 2 CPU processes on gloo: a heartbeat file per rank, every
    rank beats every step, rank 0 alone commits and announces the checkpoints."""
    config = CONFIGS / "accelerate.yaml"
    command = yaml.safe_load(config.read_text())["worker"]["command"]
    assert command[0] == "python" and command[1].endswith("accelerate_loop.py"), command
    launch = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *command[1:]]
    run_dir, r = run_config(tmp_path, config, command=launch, env={"ACCELERATE_USE_CPU": "true"})
    assert_ran_cleanly(run_dir, r, script_of(config), ranks=2)
    final = max((run_dir / "checkpoints").glob("step-*"))
    assert sorted(p.name for p in final.glob("random_states_*.pkl")) == ["random_states_0.pkl", "random_states_1.pkl"]


@pytest.mark.e2e
@pytest.mark.slow
def test_plain_loop_killed_mid_run_resumes_from_the_last_good_checkpoint(tmp_path):
    """`hangwatch restart --now` kills the plain loop once a checkpoint is good; the next attempt gets that
    checkpoint through HANGWATCH_RESUME_FROM (not a newer one still unconfirmed), goes on from the step
    after it, rewrites the checkpoints the killed attempt had made past it, and finishes."""
    config = CONFIGS / "plain_loop.yaml"
    command = yaml.safe_load(config.read_text())["worker"]["command"]
    at = command.index("--max-steps")
    # Long enough to be killed mid-run; evals (generate) only at the end, to keep it short.
    longer = [*command[:at], "--max-steps", "60", *command[at + 2 :], "--eval-every", "60"]
    copy, run_dir = place_config(tmp_path, config, command=longer)
    with open(tmp_path / "supervisor.err", "w") as err:
        sup = subprocess.Popen(
            [*hangwatch_argv(), "run", str(copy)], stdout=subprocess.DEVNULL, stderr=err, env=clean_env(), cwd=tmp_path
        )
        try:

            def good_checkpoint():
                r = hw("status", "--json", "--run-dir", run_dir)
                return r.returncode == 0 and json.loads(r.stdout).get("last_good_checkpoint")

            wait_for("a good checkpoint", good_checkpoint)
            r = hw("restart", "--now", "--run-dir", run_dir)
            assert r.returncode == 0, r.stderr
            assert sup.wait(300) == 0, (tmp_path / "supervisor.err").read_text()[-4000:]
        finally:
            if sup.poll() is None:
                sup.kill()
                sup.wait(10)

    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished"
    first, second = (heartbeats(run_dir / "attempts" / n)[0] for n in ("0001", "0002"))
    handed = [e["path"] for e in log_events(run_dir, "resume_from") if e["attempt"] == 2]
    assert len(handed) == 1 and handed[0], log_events(run_dir, "resume_from")
    good = [e for e in log_events(run_dir, "good_checkpoint") if e["attempt"] == 1]
    assert handed[0] == good[-1]["path"]  # the newest GOOD one of attempt 1
    assert second[0]["event"] == "start" and own_start(second)["resumed_from"] == handed[0]

    steps1 = [b["step"] for b in first if b["event"] == "step"]
    steps2 = [b["step"] for b in second if b["event"] == "step"]
    g = good[-1]["step"]
    assert steps1 == list(range(1, len(steps1) + 1)) and steps1[-1] >= g + 2  # confirmed by 2 steps after it
    assert steps2 == list(range(g + 1, 61)), "attempt 2 goes on from the step after the checkpoint it resumed"
    assert second[-1]["event"] == "stop" and second[-1]["reason"] == "finished"
    announced2 = [b for b in second if b["event"] == "checkpoint"]
    assert announced2[-1]["step"] == 60 and Path(announced2[-1]["path"]).is_dir()
    assert not list((run_dir / "checkpoints").glob(".*")), "no temp or stale checkpoint directory is left behind"


# ---- each example without hangwatch -------------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in WITHOUT_HANGWATCH if (EXAMPLES / n).exists()])
@pytest.mark.e2e
@pytest.mark.slow
def test_example_runs_without_hangwatch_and_writes_no_heartbeat(tmp_path, name):
    r = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert written, "the example wrote nothing (its checkpoints and model belong in its working directory)"
    assert not [w for w in written if w.endswith(".jsonl") and "heartbeat" in w], written
    # A Heartbeat made outside hangwatch would have started runs/standalone/attempts/0001/.
    assert not (tmp_path / "runs" / "standalone").exists() and not [
        w for w in written if "attempts" in Path(w).parts
    ], written
