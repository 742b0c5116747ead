"""A DataLoader worker that blocks for ever, under `hangwatch run`: the incident says the main process waits in its
DataLoader and names the stuck worker process and its frame — whether the workers are forked, spawned or forked by a
forkserver, through py-spy, and through the faulthandler the heartbeat registers in every worker the rank forks or
spawns (watchdog.py_spy: false), with or without the automatic instrumentation's bootstrap in the workers.

The fixture (tests/fixtures/workers/dataloader_stuck.py, a plain PyTorch loop with `DataLoader(num_workers=2)`) writes
the pid of the worker that blocks to a file: the truth the incident is compared with.  One attempt per row:
`max_restarts: 0` ends the run at the first incident instead of paying for a second torch import."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fixtures.fakes.sup_harness import PY, ROOT, alive, incidents, run_supervisor, wait_no_strays
from fixtures.fakes.watchdog_settings import FAST_WATCHDOG

FIXTURE = ROOT / "tests" / "fixtures" / "workers" / "dataloader_stuck.py"

pytestmark = pytest.mark.slow


def config(tmp_path: Path, py_spy: bool, context: str = "fork", instrument: str = "auto") -> tuple[Path, Path, Path]:
    run_dir, pid_file = tmp_path / "run", tmp_path / "stuck-worker.pid"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {
            "command": [
                PY,
                str(FIXTURE),
                "--pid-file",
                str(pid_file),
                "--stuck-index",
                "5",
                "--context",
                context,
                "--tag",
                str(run_dir),
            ],
            "env": {"OMP_NUM_THREADS": "1"},
            "instrument": instrument,
        },
        # importing torch on a shared machine: a generous start; the step deadline is what fires
        "watchdog": {
            **FAST_WATCHDOG,
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "step_timeout_s": 2,
            "dump_grace_s": 3,
            "py_spy": py_spy,
            "py_spy_timeout_s": 20,
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 0},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir, pid_file


ROWS = [  # context, py-spy, instrument
    ("fork", True, "auto"),
    ("fork", False, "auto"),
    ("spawn", True, "auto"),
    ("spawn", False, "auto"),
    # an edited script whose workers never see the bootstrap: the dump handler travels with multiprocessing's data
    ("spawn", False, "off"),
    ("forkserver", False, "auto"),
    ("forkserver", False, "off"),
]


@pytest.mark.parametrize(
    "context, py_spy, instrument", ROWS, ids=[f"{c}-{'py-spy' if s else 'faulthandler'}-{i}" for c, s, i in ROWS]
)
def test_the_incident_names_the_stuck_dataloader_worker_and_its_frame(tmp_path, context, py_spy, instrument):
    source = "py-spy" if py_spy else "faulthandler"
    cfg, run_dir, pid_file = config(tmp_path, py_spy, context, instrument)
    rc, out = run_supervisor(cfg, timeout=180)
    assert pid_file.exists(), out[-4000:]
    truth = int(pid_file.read_text())
    stalls = [i for i in incidents(run_dir) if i["kind"] == "stall"]
    assert len(stalls) == 1, [(i["kind"], i.get("summary")) for i in incidents(run_dir)]
    inc = stalls[0]
    where = (
        f"incident {inc['id']}: {inc['summary']} / {inc.get('dataloader_verdict')} / "
        f"{inc.get('dataloader_workers_dumped')}"
    )
    assert inc["landmark"]["kind"] == "dataloader" and inc["caller_frame"]["function"] == "main", where
    assert inc["summary"].startswith("in DataLoader.__next__(), called from main (dataloader_stuck.py:"), where
    assert inc["stuck_worker_pid"] == truth, where
    workers = {w["pid"]: w for w in inc["dataloader_workers"]}
    assert len(workers) == 2 and truth in workers, where
    stuck = workers.pop(truth)
    assert stuck["stuck_frame"]["function"].rsplit(".", 1)[-1] == "__getitem__", where  # py-spy: Rows.__getitem__
    assert stuck["stuck_frame"]["file"].endswith("dataloader_stuck.py") and stuck["stack_source"] == source, where
    (other,) = workers.values()
    assert other["idle"] and other["doing"] == "waiting on its index queue", where
    assert inc["summary"].endswith(
        f"; stuck DataLoader worker pid {truth} at {stuck['stuck_frame']['function']} "
        f"(dataloader_stuck.py:{stuck['stuck_frame']['line']})"
    ), where
    assert stuck["dump"] in inc["files"], where
    assert wait_no_strays(str(run_dir)) == [], "the worker tree outlived the run"
    # spawned workers do not carry the run dir on their command line: each one the incident names is gone
    assert not [pid for pid in (truth, other["pid"]) if alive(pid)], "a DataLoader worker outlived the run"
