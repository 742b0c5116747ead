"""The fault table on 2 ranks: the built-in worker under torchrun (`worker.nproc_per_node: 2`, gloo on CPU)
under `hangwatch run`, one fault per row, each on the rank the row names (`faults[].rank`).

The rows run as one chain, as in test_sup_matrix: every fault fires once per run (the worker records it
before firing), so one run lists one incident per row, each attempt resuming from the last good checkpoint
and going on to the next row's fault — the same detection, verdict, escalation and resume as one run per
fault, at a fraction of the cost (torchrun and two ranks importing torch dominate on a 2-core machine).
The culprits alternate between rank 0 and rank 1, so that a verdict that always names rank 0 (the tie-break
of equal deadlines) fails half the rows.

While the run goes on, a watcher checks that once attempt n+1 is spawned, torchrun and every rank of the
attempts before it are gone.  Then one test per row reads that row's incident: the kind, `culprit_rank`,
the summary naming the culprit first with its own classification and frame (the frame it is really stuck
in, from its own stack), the other rank's role, both ranks' dumps for stalls, and a restart; and the run
finished.

py-spy stays on (the default): a rank waiting in DDP's reducer at the end of `backward()` shows only
`_engine_run_backward` in its faulthandler dump; py-spy's native frames are what say it waits for its peer.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import yaml
from fixtures.fakes.sup_harness import PY, ROOT, alive, env, incidents, spawned_pids, state, wait_no_strays
from fixtures.fakes.workers import make_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the shared run is awaited by the first test

RUN_LIMIT_S = 600  # seven torchrun start-ups and six detections on two shared cores


@dataclass(frozen=True)
class Row:
    fault: dict
    kind: str  # the incident's kind
    culprit: int
    classification: str  # how the summary classifies the culprit (for a stall, right after "rank R: ")
    function: str  # the culprit's own frame the summary names ("at FUNCTION (")
    deadline: Optional[str]  # the deadline that fired, None for an exit

    @property
    def name(self) -> str:
        return f"{self.fault['kind']}-rank{self.culprit}"


ROWS = [
    Row({"kind": "busy_loop", "at_step": 3, "rank": 1}, "stall", 1, "busy loop in Python", "_select_ranges", "step"),
    Row({"kind": "block_c", "at_step": 5, "rank": 0}, "stall", 0, "blocked in C", "_wait_for_batch", "step"),
    Row({"kind": "livelock", "at_step": 7, "rank": 1}, "livelock", 1, "livelock", "_retry_forever", "step"),
    # generate() runs on rank 0 only (the others wait at a barrier in phase `wait`); evals every 4 steps
    Row({"kind": "hang_generate", "at_step": 8}, "stall", 0, "blocked in C", "__call__", "phase"),
    # exits: the culprit's own error (its last words; the fatal error faulthandler wrote into its dump), not the
    # broken connection its peer then reports; the frame that raised, the innermost frame of the fatal signal
    Row(
        {"kind": "crash", "at_step": 11, "rank": 1},
        "crash",
        1,
        "RuntimeError: injected fault: crash at step 11",
        "_fire",
        None,
    ),
    Row({"kind": "segfault", "at_step": 13, "rank": 0}, "signal", 0, "killed by SIGSEGV", "string_at", None),
]
STALLS = [r for r in ROWS if r.deadline is not None]


def config(tmp_path: Path) -> tuple[Path, Path]:
    path = make_config(
        tmp_path,
        worker={"nproc_per_node": 2, "env": {"OMP_NUM_THREADS": "1"}},
        train={"max_steps": 16},
        eval={"every_steps": 4},
        checkpoint={"every_steps": 2, "confirm_steps": 1, "keep_last": 3},
        # A tiny step takes well under a second; the step deadline only has to stay clear of a slow step on
        # two busy cores.  Start-up (torchrun, two ranks importing torch) and silence are generous: no row
        # relies on them.
        watchdog={
            "startup_timeout_s": 240,
            "silence_timeout_s": 120,
            "step_timeout_s": 8,
            "dump_grace_s": 3,
            "term_grace_s": 3,
            "poll_interval_s": 0.1,
            "py_spy": True,
            "py_spy_timeout_s": 20,
            "phase_budgets_s": {"eval": 120, "generate": 10, "checkpoint": 120, "load": 240},
        },
        restart={"backoff_initial_s": 0, "max_restarts": len(ROWS) + 2},
        faults=[r.fault for r in ROWS],
    )
    return path, Path(yaml.safe_load(path.read_text())["run_dir"])


# ---------------------------------------------------------------- what the run directory says about processes


def rank_pids(run_dir: Path, attempt: int) -> set[int]:
    """The pids the ranks of `attempt` announced (their heartbeat `start` lines)."""
    pids = set()
    for f in (run_dir / "attempts" / f"{attempt:04d}").glob("heartbeat-rank*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # a line being written
                continue
            if rec.get("event") == "start":
                pids.add(rec["pid"])
    return pids


class LeftoverWatch(threading.Thread):
    """Polls the run: as soon as attempt n+1 is spawned, records any process of attempts ≤ n still alive."""

    def __init__(self, run_dir: Path):
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.left_over: list[str] = []
        self.checked = 1  # attempts ≤ checked were found gone
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            self.check()
            time.sleep(0.05)
        self.check()

    def check(self) -> None:
        spawned = spawned_pids(self.run_dir)
        while self.checked + 1 in spawned:
            for n in range(1, self.checked + 1):
                for pid in {spawned[n]} | rank_pids(self.run_dir, n):
                    if alive(pid):
                        self.left_over.append(f"attempt {n}: pid {pid} alive when attempt {self.checked + 1} started")
            self.checked += 1


# ---------------------------------------------------------------- the run, once for every row


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp-faults")
    cfg_path, run_dir = config(tmp)
    out_path = tmp / "supervisor.out"
    with open(out_path, "w") as out:
        sup = subprocess.Popen(
            [PY, "-m", "hangwatch.supervisor", "run", str(cfg_path)],
            cwd=ROOT,
            env=env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    watch = LeftoverWatch(run_dir)
    watch.start()
    try:
        sup.wait(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
        watch.stopping.set()
        watch.join()
    return {
        "run_dir": run_dir,
        "rc": sup.returncode,
        "out": out_path.read_text(errors="replace"),
        "left_over": watch.left_over,
        "attempts_checked": watch.checked,
        "strays": wait_no_strays(str(run_dir)),
    }


def incident_of(chain: dict, row: Row) -> dict:
    """The incident of the attempt this row's fault ended (row k ends attempt k)."""
    n = ROWS.index(row) + 1
    found = [i for i in incidents(chain["run_dir"]) if i["attempt"] == n]
    assert len(found) == 1, [(i["attempt"], i["kind"], i.get("summary")) for i in incidents(chain["run_dir"])]
    return found[0]


def culprit_part(summary: str, row: Row) -> str:
    """What the summary says before it turns to the other rank (a classification may hold a `;` itself)."""
    return summary.split(f"; rank {1 - row.culprit} ")[0]


def test_the_run_finished_with_one_incident_per_row_and_nothing_left_over(chain):
    run_dir = chain["run_dir"]
    assert chain["rc"] == 0, chain["out"][-6000:]
    assert state(run_dir)["state"] == "finished"
    assert list((run_dir / "final").glob("*.safetensors")), "no final adapter"
    fired = json.loads((run_dir / "faults-fired.json").read_text())["fired"]
    assert sorted((f["kind"], f["rank"]) for f in fired) == sorted((r.fault["kind"], r.culprit) for r in ROWS)
    # every attempt but the last was checked against the one after it, and torchrun and both ranks were gone
    assert chain["attempts_checked"] == len(ROWS) + 1
    assert chain["left_over"] == []
    assert chain["strays"] == []
    incs = incidents(run_dir)
    assert [i["attempt"] for i in incs] == list(range(1, len(ROWS) + 1)), [
        (i["attempt"], i.get("summary")) for i in incs
    ]
    for inc in incs:  # the next attempt resumed from the newest good checkpoint the supervisor had seen
        start = next(b for b in beats(run_dir, inc["attempt"] + 1) if b["event"] == "start")
        assert start.get("resumed_from") == inc["last_good_checkpoint"], (inc["id"], start)


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_row_names_the_culprit_rank_with_its_own_classification_and_frame(chain, row):
    inc = incident_of(chain, row)
    where = f"row {row.name}: incident {inc['id']} [{inc['kind']}]: {inc.get('summary')}"
    assert inc["culprit_rank"] == row.culprit, where
    head = culprit_part(inc["summary"], row)
    assert head.startswith(f"rank {row.culprit}"), where
    assert row.classification in head and f" at {row.function} (" in head, where
    assert inc["kind"] == row.kind, where
    if row.deadline is None:
        assert inc["deadline"] is None, where
    else:
        assert inc["deadline"]["name"] == row.deadline, where
    assert inc["decision"]["action"] == "restart", where
    assert inc["worker_pid"] == spawned_pids(chain["run_dir"])[inc["attempt"]], where


@pytest.mark.parametrize("row", STALLS, ids=lambda r: r.name)
def test_stall_row_classifies_each_rank_from_its_own_stack_and_keeps_both_dumps(chain, row):
    inc = incident_of(chain, row)
    where = f"row {row.name}: incident {inc['id']}: {inc.get('summary')}"
    other = 1 - row.culprit
    assert culprit_part(inc["summary"], row).startswith(f"rank {row.culprit}: {row.classification}"), where
    assert f"; rank {other} waiting in " in inc["summary"], where
    ranks = {r["rank"]: r for r in inc["ranks"]}
    assert sorted(ranks) == [0, 1], where
    assert ranks[row.culprit]["role"] == "culprit", where
    assert ranks[row.culprit]["classification"].startswith(row.classification), where
    assert ranks[row.culprit]["stuck_frame"]["function"] == row.function, where
    assert ranks[other]["role"] == "victim", where
    assert ranks[0]["pid"] != ranks[1]["pid"] and inc["worker_pid"] not in (ranks[0]["pid"], ranks[1]["pid"]), where
    # both ranks' dumps, each its own process's stack; SIGUSR1 went to the ranks, never to torchrun
    d = incident_dir(chain, inc)
    assert inc["dumps"] == {"0": "stack-rank0.txt", "1": "stack-rank1.txt"}, where
    culprit_dump, other_dump = ((d / f"stack-rank{r}.txt").read_text() for r in (row.culprit, other))
    assert "most recent call first" in other_dump, where
    assert f"in {row.function}\n" in culprit_dump and culprit_dump != other_dump, where
    assert inc["dump_signalled"] == {"0": True, "1": True}, where
    assert inc["timings"]["survivors"] == [], where


@pytest.mark.parametrize("row", [r for r in ROWS if r.deadline is None], ids=lambda r: r.name)
def test_exit_row_keeps_the_culprit_evidence(chain, row):
    inc = incident_of(chain, row)
    where = f"row {row.name}: incident {inc['id']}: {inc.get('summary')}"
    assert row.classification in inc["classification"], where
    kept = {f.name: f.read_text(errors="replace") for f in incident_dir(chain, inc).iterdir()}
    if row.fault["kind"] == "segfault":  # faulthandler wrote the fatal error into the culprit's own dump
        assert "Fatal Python error: Segmentation fault" in kept.get(f"stack-rank{row.culprit}.txt", ""), (
            where,
            list(kept),
        )
        assert inc["stuck_frame"]["function"] == row.function, where
    else:  # the culprit's own last words, a Python exception; not its peer's broken connection
        attempt = chain["run_dir"] / "attempts" / f"{inc['attempt']:04d}"
        words = json.loads(
            (attempt / ("exit.json" if row.culprit == 0 else f"exit-rank{row.culprit}.json")).read_text()
        )
        assert words["message"] == row.classification and not words.get("collective_error"), (where, words)
        assert any(row.classification in text for text in kept.values()), (where, list(kept))


def incident_dir(chain: dict, inc: dict) -> Path:
    return chain["run_dir"] / "incidents" / f"{inc['id']}-{inc['kind']}"


def beats(run_dir: Path, attempt: int) -> list[dict]:
    """Rank 0's heartbeat lines of `attempt`."""
    f = run_dir / "attempts" / f"{attempt:04d}" / "heartbeat-rank0.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
