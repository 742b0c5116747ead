"""restart.prewarm on a real run: the built-in worker (the demo's tiny model) hangs in C; the supervisor spawns
the next attempt's standby at detection, releases it once the stuck tree is gone, and the run finishes from
the last good checkpoint — in exactly the weights of an uninterrupted run of the same config (which runs
alongside).  What shows that the second attempt came from the standby: the supervisor's log
(`standby_spawned` → `tree_gone` → `standby_released` → `worker_spawned prewarmed`, one pid throughout), the
attempt's `start` beat (`prewarmed: true`, first line of its heartbeat file) and `load` progress (what the
standby preloaded), and its worker.log, which
begins with the standby's own lines."""

from __future__ import annotations

import pytest
from fixtures.fakes.demo_runs import beats, config, events, final_weights, finish, start
from fixtures.fakes.sup_harness import incidents, wait_no_strays

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_a_hang_restarts_from_the_standby_and_ends_in_the_uninterrupted_weights(tmp_path):
    ref_cfg, ref_dir = config(tmp_path, "reference", [])
    hang_cfg, run_dir = config(tmp_path, "hang", [{"kind": "block_c", "at_step": 7}])
    ref, hang = start(ref_cfg, tmp_path / "reference.out"), start(hang_cfg, tmp_path / "hang.out")
    finish(hang, run_dir, tmp_path / "hang.out")
    finish(ref, ref_dir, tmp_path / "reference.out")

    (inc,) = incidents(run_dir)
    assert inc["kind"] == "stall" and inc["deadline"]["name"] == "step" and inc["attempt"] == 1
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001", "0002"]

    # The supervisor's account: spawned at detection, released after the stuck tree was gone, as attempt 2.
    log = events(run_dir)
    names = [e["event"] for e in log]
    spawned = next(e for e in log if e["event"] == "standby_spawned")
    released = next(e for e in log if e["event"] == "standby_released")
    worker_2 = next(e for e in log if e["event"] == "worker_spawned" and e["attempt"] == 2)
    assert (
        names.index("stall_detected")
        < names.index("standby_spawned")
        < names.index("tree_gone")
        < names.index("standby_released")
        < names.index("worker_spawned", names.index("tree_gone"))
    )
    assert spawned["attempt"] == released["attempt"] == 2 and spawned["why"] == "stall"
    assert spawned["pid"] == released["pid"] == worker_2["pid"] and worker_2["prewarmed"] is True
    assert "standby_discarded" not in names and "standby_died" not in names
    assert released["resume_from"] == inc["last_good_checkpoint"]  # decided at the release: the last good one

    # The worker's account: its first line is its `start`, after the release, and it resumed where it was told.
    second = beats(run_dir, 2)
    first = second[0]
    assert first["event"] == "start" and first["pid"] == released["pid"] and first["prewarmed"] is True
    assert first["resumed_from"] == released["resume_from"]
    loaded = next(b for b in second if b["event"] == "progress" and b["phase"] == "load")  # its preload, waited for
    assert loaded["prewarmed"] is True and loaded["standby_preload_error"] is None
    assert (run_dir / "attempts" / "0002" / "worker.log").read_text().startswith("standby for attempt 2")
    assert not (run_dir / "standby.log").exists()
    assert beats(run_dir, 1)[0].get("prewarmed") is None  # the first attempt was a cold spawn

    left = wait_no_strays(str(run_dir))
    assert not left, f"survivors: {[(p.pid, p.cmdline()) for p in left]}"
    assert final_weights(run_dir) == final_weights(ref_dir)  # bit for bit: the standby consumed nothing early
