"""The fault matrix on the built-in worker (`python -m hangwatch.daemon`, a real tiny model).

One uninterrupted reference run is shared by the rows.  The rows that must end in the reference's
weights run as one chain: every fault fires once per run (the worker records it before firing),
so a run with all of them lists one incident per fault, each attempt resuming from the last good
checkpoint and going on to the next fault — the same detection, escalation and resume as one run
per fault, at a third of the cost (the worker's import of torch dominates).  `nan` runs on its
own, since skipped non-finite steps change the weights by design.

The reference and the `nan` run start together in the background (neither depends on a tight
deadline); the chain, whose hang rows do, runs on its own afterwards.

For each row: the deadline or exit classification, the incident kind and classification, the
stuck function for Python-level hangs, every process of the tree gone (fault children included),
the resume from the last good checkpoint, and a finished run; then equal final weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import yaml
from fixtures.fakes.demo_runs import finish, start
from fixtures.fakes.sup_harness import ROOT, incidents, run_supervisor, state
from fixtures.fakes.workers import safetensors_raw

pytestmark = pytest.mark.slow

DEMO = ROOT / "configs" / "demo.yaml"
MAX_STEPS = 22

# (fault, incident kind, deadline name or None, classification contains, stuck function or None)
CHAIN = [
    (
        {"kind": "busy_loop", "at_step": 3, "spawn_child": True},
        "stall",
        "step",
        "busy loop in Python",
        "_select_ranges",
    ),
    ({"kind": "block_c", "at_step": 5, "spawn_child": True}, "stall", "step", "blocked in C", "_wait_for_batch"),
    ({"kind": "livelock", "at_step": 7}, "livelock", "step", "livelock", "_retry_forever"),
    ({"kind": "hang_generate", "at_step": 8}, "stall", "phase", "a loop sleeping in time.sleep()", "__call__"),
    ({"kind": "crash", "at_step": 11}, "crash", None, "RuntimeError: injected fault: crash at step 11", None),
    ({"kind": "segfault", "at_step": 13}, "signal", None, "killed by SIGSEGV", None),
    ({"kind": "oom", "at_step": 15}, "oom", None, "out of memory", None),
    ({"kind": "exit", "at_step": 17, "code": 3, "spawn_child": True}, "crash", None, "exited with code 3", None),
]
NAN = ({"kind": "nan", "at_step": 5, "steps": 4}, "nan", None, "non-finite loss", None)


def config(tmp_path: Path, name: str, faults: list, step_timeout_s: float = 60) -> tuple[Path, Path]:
    """The demo's tiny model, small and fast.  Only the chain's hang rows need a tight step deadline;
    the other runs get a loose one, so that a slow step on a busy machine cannot look like a hang."""
    cfg = yaml.safe_load(DEMO.read_text())
    run_dir = tmp_path / name
    cfg.update(
        run_dir=str(run_dir),
        data={
            "train": str(ROOT / "configs/data/train.jsonl"),
            "eval": str(ROOT / "configs/data/eval.jsonl"),
            "max_length": 64,
        },
        faults=faults,
        # generous for a tiny model (a step takes ~0.2 s, but many seconds on two shared, busy cores);
        # no row relies on silence: it only has to stay out of the way of slow, healthy stretches
        watchdog={
            "startup_timeout_s": 300,
            "silence_timeout_s": max(30, step_timeout_s),
            "step_timeout_s": step_timeout_s,
            "dump_grace_s": 2,
            "term_grace_s": 3,
            "poll_interval_s": 0.1,
            "py_spy": False,
            "phase_budgets_s": {"eval": 120, "generate": 12, "checkpoint": 120, "load": 300},
        },
        # bitwise against the reference; the restart path (tests/faults/test_in_process_recovery.py has the other)
        restart={"backoff_initial_s": 0, "max_restarts": 20, "oom_remediation": False, "in_process": False},
    )
    cfg["train"].update(max_steps=MAX_STEPS, sleep_per_step_s=0.0, max_nonfinite_streak=3)
    cfg["eval"].update(every_steps=4, max_new_tokens=8)
    cfg["checkpoint"].update(every_steps=2, confirm_steps=1, keep_last=3)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def run_to_end(cfg_path: Path, run_dir: Path, timeout: float) -> str:
    rc, out = run_supervisor(cfg_path, timeout=timeout)
    assert rc == 0, out[-6000:]
    assert state(run_dir)["state"] == "finished"
    return out


def final_weights(run_dir: Path) -> dict:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {run_dir / 'final'}"
    return {f.name: safetensors_raw(f) for f in files}


def beats(run_dir: Path) -> list[dict]:
    out = []
    for f in sorted((run_dir / "attempts").glob("*/heartbeat-rank*.jsonl")):
        out += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return out


def tree_pids(run_dir: Path) -> list[int]:
    """Every worker pid and every fault child the attempts announced."""
    pids = []
    for b in beats(run_dir):
        if b["event"] == "start":
            pids.append(b["pid"])
        if b["event"] == "warn" and b.get("children"):
            pids += b["children"]
    return pids


def survivors(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def check_rows(run_dir: Path, rows: list) -> None:
    incs = incidents(run_dir)
    assert [i["kind"] for i in incs] == [r[1] for r in rows], [(i["kind"], i.get("summary")) for i in incs]
    starts = [b for b in beats(run_dir) if b["event"] == "start"]
    assert len(starts) == len(rows) + 1
    for n, (inc, (fault, kind, deadline, classification, function)) in enumerate(zip(incs, rows)):
        row = f"row {fault['kind']}: {inc.get('summary')}"
        assert inc["attempt"] == n + 1, row
        if deadline is None:
            assert inc["deadline"] is None, row
        else:
            assert inc["deadline"]["name"] == deadline and inc["deadline"]["overdue_s"] >= 0, row
        assert classification in inc["classification"], row
        if function is not None:
            assert inc["stuck_frame"]["function"] == function, row
            assert inc["main_stack"] and inc["user_frame"], row
        # the next attempt resumed from the newest good checkpoint the supervisor had seen
        resumed = starts[n + 1].get("resumed_from")
        assert resumed == inc["last_good_checkpoint"], (row, resumed)
        assert inc["decision"]["action"] == "restart", row
    assert not survivors(tree_pids(run_dir))


class Background:
    """Supervisors started together; each is awaited when a test needs its result."""

    def __init__(self, tmp: Path, runs: dict):
        self.procs = {}
        for name, faults in runs.items():
            cfg_path, run_dir = config(tmp, name, faults)
            out = tmp / f"{name}.out"
            self.procs[name] = (start(cfg_path, out), run_dir, out)

    def finish(self, name: str, timeout: float) -> Path:
        p, run_dir, out = self.procs[name]
        finish(p, run_dir, out, timeout)
        return run_dir

    def close(self) -> None:
        for p, _, _ in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def background(tmp_path_factory):
    runs = Background(tmp_path_factory.mktemp("matrix"), {"reference": [], "nan": [NAN[0]]})
    yield runs
    runs.close()


@pytest.fixture(scope="module")
def reference(background):
    run_dir = background.finish("reference", timeout=500)
    assert [i["summary"] for i in incidents(run_dir)] == []
    return final_weights(run_dir)


def test_nan_streak_restarts_with_rollback_and_finishes(background):
    run_dir = background.finish("nan", timeout=500)
    check_rows(run_dir, [NAN])
    (inc,) = incidents(run_dir)
    assert inc["decision"]["rollback"] is True and inc["rollback_to"] == inc["last_good_checkpoint"]
    assert inc["exit"]["code"] == 75 and inc["exit"]["last_words"]["kind"] == "nan"


@pytest.mark.timeout(900)  # nine worker starts: minutes when the two cores are shared with other work
def test_fault_chain_detects_each_fault_resumes_and_ends_in_the_reference_weights(tmp_path, reference):
    cfg_path, run_dir = config(tmp_path, "chain", [r[0] for r in CHAIN], step_timeout_s=20)
    run_to_end(cfg_path, run_dir, timeout=560)
    check_rows(run_dir, CHAIN)
    children = [pid for b in beats(run_dir) if b["event"] == "warn" for pid in b.get("children") or []]
    assert len(children) == 6  # two per spawn_child fault, one of each pair having left the group
    assert final_weights(run_dir) == reference
