"""restart.prewarm: always on a real run of the built-in worker (the demo's tiny model): the next attempt's standby
is spawned once attempt 1 steps; the test SIGKILLs it, and the supervisor replaces it; the injected hang in C then
restarts the run from the replacement (one pid from `standby_spawned` to the second attempt's `start`), the run
finishes, and its final adapter is bit for bit the one of the same run restarted cold (`prewarm: false`), which
runs alongside.  Meanwhile `status` shows the standby with its RAM."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml
from fixtures.fakes import demo_runs as cold
from fixtures.fakes.sup_harness import incidents, wait_for, wait_no_strays

from hangwatch.supervisor.cli.client import Client, ClientError
from hangwatch.supervisor.control import socket_path_in

pytestmark = pytest.mark.slow

HANG_AT = 40


def config(tmp_path: Path, name: str, prewarm) -> tuple[Path, Path]:
    path, run_dir = cold.config(tmp_path, name, [{"kind": "block_c", "at_step": HANG_AT}])
    cfg = yaml.safe_load(path.read_text())
    cfg["restart"]["prewarm"] = prewarm
    cfg["train"].update(max_steps=HANG_AT + 8, sleep_per_step_s=0.25)  # the standby loads while attempt 1 trains
    path.write_text(yaml.safe_dump(cfg))
    return path, run_dir


def standby_status(run_dir: Path):
    try:
        return Client(socket_path_in(run_dir), timeout=5).call("status").get("standby")
    except ClientError:
        return None


def wait(cond, timeout: float, what: str, out: Path):
    try:
        return wait_for(cond, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{out.read_text()[-4000:]}") from None


@pytest.mark.timeout(600)
def test_a_killed_standby_is_replaced_and_the_restart_ends_in_the_cold_restarts_weights(tmp_path):
    cold_cfg, cold_dir = config(tmp_path, "cold", False)
    warm_cfg, run_dir = config(tmp_path, "always", "always")
    ref, run = cold.start(cold_cfg, tmp_path / "cold.out"), cold.start(warm_cfg, tmp_path / "always.out")
    out = tmp_path / "always.out"

    first = wait(lambda: standby_status(run_dir), 120, "the first standby in status", out)
    assert first["attempt"] == 2 and first["state"] in ("loading", "ready") and first["why"] == "always", first
    os.kill(first["pid"], signal.SIGKILL)
    second = wait(
        lambda: (s := standby_status(run_dir)) and s["pid"] != first["pid"] and s, 60, "the replacement standby", out
    )
    assert second["attempt"] == 2 and "replacing a standby that died" in second["why"]
    ready = wait(
        lambda: (s := standby_status(run_dir)) and s["state"] == "ready" and s, 90, "the replacement ready", out
    )
    # Ready: torch, transformers, peft, the model and the data in its RAM (a bare interpreter is ~10 MiB).
    assert ready["pid"] == second["pid"] and ready["rss_mb"] > 150 and ready["preload_s"] > 0, ready

    cold.finish(run, run_dir, out)
    cold.finish(ref, cold_dir, tmp_path / "cold.out")

    (inc,) = incidents(run_dir)
    assert inc["kind"] == "stall" and inc["attempt"] == 1 and inc["step"] >= HANG_AT - 1
    log = cold.events(run_dir)
    names = [e["event"] for e in log]
    spawned = [e for e in log if e["event"] == "standby_spawned"]
    assert [e["pid"] for e in spawned[:2]] == [first["pid"], second["pid"]] and spawned[0]["why"] == "always"
    died = next(e for e in log if e["event"] == "standby_died")
    assert died["pid"] == first["pid"] and died["signal"] == signal.SIGKILL
    released = next(e for e in log if e["event"] == "standby_released")
    worker_2 = next(e for e in log if e["event"] == "worker_spawned" and e["attempt"] == 2)
    assert released["pid"] == worker_2["pid"] == second["pid"] and worker_2["prewarmed"] is True
    assert names.index("standby_spawned") < names.index("stall_detected")  # loaded before anything failed
    # Attempt 2 got its own standby (for attempt 3) once it stepped, discarded when the run finished.
    assert spawned[-1]["attempt"] == 3 and names[-1] != "standby_spawned"
    assert any(e["event"] == "standby_discarded" and e["attempt"] == 3 for e in log)
    assert not (run_dir / "standby.log").exists() and not (run_dir / "standby.json").exists()
    beats2 = cold.beats(run_dir, 2)
    assert beats2[0]["event"] == "start" and beats2[0]["prewarmed"] is True

    assert not wait_no_strays(str(run_dir)) and not wait_no_strays(str(cold_dir))
    assert [e["event"] for e in cold.events(cold_dir)].count("standby_spawned") == 0
    assert cold.final_weights(run_dir) == cold.final_weights(cold_dir)  # bit for bit the cold restart's
