"""Inbox watching with real watchdog events: down-time arrivals, live arrivals, partial files."""

from __future__ import annotations

import os
import threading

from fixtures.fakes.inbox_support import jsonl, queued_names, validator, write  # noqa: E402

from hangwatch.common.inbox_layout import Stage, data_files
from hangwatch.daemon.inbox.intake import Inbox
from hangwatch.daemon.inbox.publish import publish


def test_files_dropped_while_the_worker_was_down_are_taken_in_arrival_order(tmp_path):
    run = tmp_path / "run"
    # Written "hours ago", newest first on disk order: intake follows their mtimes.
    write(run / "inbox" / "b.jsonl", jsonl(2, "b"), mtime_age=3600)
    write(run / "inbox" / "a.jsonl", jsonl(2, "a"), mtime_age=1800)
    with Inbox(run, validator) as inbox:
        assert inbox.wait_for_work(10.0)
        results = inbox.poll()
    assert results == []  # the first wait already took both
    assert queued_names(run) == ["b.jsonl", "a.jsonl"]
    assert [d.number for d in data_files(run, Stage.QUEUED)] == [1, 2]


def test_a_file_published_while_running_wakes_the_idle_wait(tmp_path):
    run = tmp_path / "run"
    src = write(tmp_path / "new.jsonl", jsonl(3, "n"))
    with Inbox(run, validator, settle_s=0.5, rescan_s=30.0) as inbox:
        assert inbox.wait_for_work(0.3) is False  # nothing there: times out
        timer = threading.Timer(0.3, publish, args=(src, run))
        timer.start()
        # rescan_s is 30 s, longer than this wait: only the watchdog event can wake it in time.
        woke = inbox.wait_for_work(10.0)
        timer.join()
    assert woke and queued_names(run) == ["new.jsonl"]


def test_partial_and_dot_files_are_ignored_until_renamed(tmp_path):
    run = tmp_path / "run"
    with Inbox(run, validator, settle_s=0.2, rescan_s=0.2) as inbox:
        write(run / "inbox" / ".tmp-upload-1234", jsonl(2, "t"), mtime_age=60)
        write(run / "inbox" / "upload.jsonl.part", jsonl(2, "p"), mtime_age=60)
        write(run / "inbox" / "editor.jsonl~", jsonl(2, "e"), mtime_age=60)
        assert inbox.wait_for_work(1.0) is False  # several rescans, several settle periods
        assert sorted(os.listdir(run / "inbox")) == [".tmp-upload-1234", "editor.jsonl~", "upload.jsonl.part"]
        os.rename(run / "inbox" / "upload.jsonl.part", run / "inbox" / "upload.jsonl")
        assert inbox.wait_for_work(10.0)
    assert queued_names(run) == ["upload.jsonl"]


def test_a_file_written_in_place_is_taken_only_once_complete(tmp_path):
    run = tmp_path / "run"
    with Inbox(run, validator, settle_s=2.0, rescan_s=0.1) as inbox:
        path = run / "inbox" / "slow.jsonl"
        with open(path, "w") as f:  # a writer that does not publish by rename
            for i in range(4):
                f.write(jsonl(1, f"s{i}"))
                f.flush()
                # Still open: neither the close event nor an old mtime says it is done.
                assert inbox.wait_for_work(0.1) is False
        assert inbox.wait_for_work(10.0)
    [queued] = data_files(run, Stage.QUEUED)
    assert (run / "queue" / queued.filename).read_text() == "".join(jsonl(1, f"s{i}") for i in range(4))
