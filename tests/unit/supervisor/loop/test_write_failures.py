"""Every write the supervisor makes in the run dir can fail (a full disk, a read-only remount, EIO):
it survives each one, removes its own temporary files, and ends the run in a clear state.

Table-driven over the write sites with a failing `FsOps` (the seam every write goes through), on the
fake-driven supervisor. The real small filesystem is tests/faults/test_full_disk.py.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from fixtures.fakes.failing_fs import FailingFs
from fixtures.fakes.fake_supervisor import Harness

from hangwatch.common.durable import TMP_PREFIX
from hangwatch.common.exitcodes import EXIT_IOERR


def start(h):  # the first transition writes state.json
    pass


def stall(h):  # a worker that stops stepping: the step deadline fires, an incident is written
    h.running()


def restart_after_crash(h):  # the next attempt needs attempts/0002/
    h.running()
    h.worker.exit(3)


SITES = [
    ("state.json", lambda p: p.name == "state.json", start),
    ("incident directory", lambda p: p.parent.name == "incidents", stall),
    ("incident.json", lambda p: p.name == "incident.json", stall),
    ("incident evidence file", lambda p: p.name.startswith("heartbeat-tail"), stall),
    ("the next attempt's directory", lambda p: p.name == "0002", restart_after_crash),
]


def no_temporaries(run_dir: Path) -> list[str]:
    return [str(p) for p in run_dir.rglob(f"{TMP_PREFIX}*")]


@pytest.mark.parametrize("site,match,script", SITES, ids=[s[0] for s in SITES])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EIO, errno.EDQUOT])
def test_a_refused_write_ends_the_run_failed_naming_the_path(tmp_path, capsys, site, match, script, err):
    fs = FailingFs(match, err)
    h = Harness(tmp_path, fs=fs)
    script(h)
    h.until(lambda: h.sup.lifecycle.state.final, within_s=60)  # no exception escapes: the supervisor survives
    assert fs.refused, f"the {site} was never written"
    assert h.state == "failed" and h.sup.exit_code == EXIT_IOERR
    what = {
        errno.ENOSPC: "no space left on device",
        errno.EROFS: "read-only file system",
        errno.EIO: "I/O error",
        errno.EDQUOT: "disk quota exceeded",
    }[err]
    assert h.sup.intents.fail_reason == f"{what} at {fs.refused[0]}"
    assert f"cannot write {fs.refused[0]}" in capsys.readouterr().err  # said where a person sees it
    assert not any(p.alive for p in h.table.procs.values())  # the worker was stopped, not stranded
    assert no_temporaries(tmp_path / "run") == []
    if site != "state.json":
        import json

        st = json.loads((tmp_path / "run" / "state.json").read_text())
        assert st["state"] == "failed" and st["exit_code"] == EXIT_IOERR


def test_a_refused_calibration_write_is_not_a_reason_to_stop(tmp_path):
    fs = FailingFs(lambda p: p.name == "calibration.json")
    h = Harness(tmp_path, fs=fs)
    h.running(steps=40)  # enough samples to persist
    h.sup.calibration.persist(False, None, 30.0)
    assert fs.refused and h.state == "running" and h.sup.intents.fail_reason is None


def test_a_permission_error_on_an_incident_is_logged_not_fatal(tmp_path):
    """Not the disk's fault (EACCES): the incident stays in memory and the run carries on."""
    fs = FailingFs(lambda p: p.name == "incident.json", errno.EACCES)
    h = Harness(tmp_path, fs=fs)
    h.running()
    h.until(lambda: h.sup.attempt == 2, within_s=60)
    assert fs.refused and h.sup.intents.fail_reason is None and h.sup.incidents.count() >= 1


def test_an_unwritable_config_copy_refuses_to_start_with_exit_74(tmp_path):
    fs = FailingFs(lambda p: p.name == "config.yaml")
    with pytest.raises(AssertionError):  # Harness asserts prepare() succeeds
        Harness(tmp_path, fs=fs)
    assert fs.refused
