"""Which run a client command means when it is not told (`cli/find_run.py`): the one running under ./runs/, else
the most recent, else it asks."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from hangwatch.supervisor.cli.find_run import NoRunFound, candidates, choose, find_run


def run(base, name, state, updated, alive=False):
    d = base / name
    d.mkdir(parents=True)
    me = psutil.Process()
    sup = {"pid": os.getpid(), "create_time": me.create_time()} if alive else {"pid": 2**22 + 17, "create_time": 1.0}
    (d / "state.json").write_text(json.dumps({"state": state, "updated_wall": updated, "supervisor": sup}))
    return d


def test_the_only_running_one_is_meant(tmp_path):
    run(tmp_path, "a", "finished", 300.0)
    live = run(tmp_path, "b", "running", 100.0, alive=True)
    run(tmp_path, "c", "running", 200.0)  # its supervisor is gone: not running, whatever it recorded
    where, words = find_run(tmp_path)
    assert where == live and "that is running" in words


def test_none_running_the_most_recent_and_it_says_which(tmp_path):
    run(tmp_path, "old", "finished", 100.0)
    new = run(tmp_path, "new", "failed", 200.0)
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "state.json").write_text('{"state": "runn')
    where, words = find_run(tmp_path)
    assert where == new and "most recent" in words and "new (failed)" in words
    assert sorted(c.run_dir.name for c in candidates(tmp_path)) == ["new", "old"]


@pytest.mark.parametrize("setup, says", [("none", "no run under"), ("two", "2 runs under")])
def test_it_asks_when_it_cannot_tell(tmp_path, setup, says):
    if setup == "two":
        run(tmp_path, "a", "running", 1.0, alive=True)
        run(tmp_path, "b", "starting", 2.0, alive=True)
    with pytest.raises(NoRunFound) as info:
        choose(candidates(tmp_path), tmp_path)
    assert says in str(info.value) and "--run-dir" in str(info.value) and info.value.exit_code == 64
