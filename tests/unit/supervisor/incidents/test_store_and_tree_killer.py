"""Reading the evidence: faulthandler dumps, exit classification, incident files, the tree killer."""

from __future__ import annotations

import json
import signal

import pytest
from fixtures.fakes.fake_supervisor import FakeProcessTable

from hangwatch.common.rundir import tail_text
from hangwatch.supervisor.escalation.dump_collector import DumpCollector
from hangwatch.supervisor.escalation.tree_killer import TreeKiller
from hangwatch.supervisor.incidents import (
    IncidentStore,
    classify_exit,
    classify_stall,
    fatal_error,
    frame_str,
    main_stack,
    parse_faulthandler,
    stuck_frame,
)
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes.attempt import DumpTarget

DUMP_M = """\
Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/srv/app/model.py", line 88 in _select_ranges
  File "/srv/app/model.py", line 120 in forward
  File "/srv/app/train.py", line 40 in main
  File "/srv/app/daemon/__main__.py", line 7 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def test_main_thread_is_the_one_ending_in_module_below_runpy():
    threads = parse_faulthandler(DUMP_M)
    assert [t.thread for t in threads] == ["0x00007f0000000001", "0x00007f0000000002"]
    frame, stack, user = stuck_frame(DUMP_M)
    assert frame == {"file": "/srv/app/model.py", "line": 88, "function": "_select_ranges"}
    assert [f["function"] for f in stack][-3:] == ["<module>", "_run_code", "_run_module_as_main"]
    assert user == frame


def test_main_thread_found_even_when_another_thread_took_the_signal():
    dump = """\
Current thread 0x0000000000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x0000000000000001 (most recent call first):
  File "/usr/lib/python3.11/socket.py", line 700 in recv_into
  File "/srv/job.py", line 12 in wait_for_peer
  File "/srv/job.py", line 30 in <module>
"""
    frame, stack, user = stuck_frame(dump)
    assert frame["function"] == "recv_into"  # innermost, as the dump says
    assert user["function"] == "wait_for_peer"  # innermost outside the standard library
    assert len(stack) == 3


def test_the_last_of_several_appended_dumps_wins():
    second = DUMP_M.replace("_select_ranges", "later_function")
    assert stuck_frame(DUMP_M + "\n" + second)[0]["function"] == "later_function"


def test_a_dump_without_frames_gives_no_frame():
    assert stuck_frame("") == (None, [], None)
    assert stuck_frame("garbage\nmore garbage\n") == (None, [], None)


def test_a_thread_cut_at_faulthandlers_frame_limit_is_marked_truncated():
    frames = "".join(f'  File "/srv/app/deep.py", line {i} in f\n' for i in range(100))
    dump = f"Current thread 0x1 (most recent call first):\n{frames}  ...\n"
    stack, truncated = main_stack(dump)
    assert len(stack) == 100 and truncated
    assert main_stack(DUMP_M) == (stuck_frame(DUMP_M)[1], False) and main_stack("") == ([], False)


def test_fatal_error_and_frame_str():
    segv = (
        "Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
        '  File "m.py", line 3 in f\n'
    )
    assert fatal_error(segv) == "Segmentation fault" and fatal_error(DUMP_M) is None
    assert frame_str(stuck_frame(segv)[0]) == "f (m.py:3)" and frame_str(None) == "unknown"


@pytest.mark.parametrize(
    "procs, needle",
    [
        ([{"state": "R", "cpu_percent": 99.0}], "busy loop in Python (CPU 99%)"),
        ([{"state": "S", "cpu_percent": 0.4}], "blocked in C (CPU 0%, state S)"),
        ([{"state": "D", "cpu_percent": 2.0}], "uninterruptible I/O (state D"),
        ([{"state": "R", "cpu_percent": 30.0}], "busy loop in Python (CPU 30%)"),  # spinning on a contended CPU
        ([{"state": "S", "cpu_percent": 20.0}], "partly busy (CPU 20%)"),
        ([{"state": "T", "cpu_percent": 0.0}], "stopped (SIGSTOP or a debugger; state T)"),  # not "blocked in C"
        ([{"state": "t", "cpu_percent": 0.0}], "stopped by a debugger (state t)"),
        ([{"state": "T", "cpu_percent": 0.0}, {"state": "R", "cpu_percent": 95.0}], "busy loop in Python"),
        ([], "no worker process left"),
    ],
)
def test_stall_classification_from_cpu_and_state(procs, needle):
    assert needle in classify_stall("stall", None, procs, None)


@pytest.mark.parametrize(
    "line, native, procs, expect",
    [
        ("        time.sleep(0.5)", [], [{"state": "S", "cpu_percent": 0.2}], "waiting in Python: a loop sleeping"),
        ("    sleep(poll_s)  # wait for the file", [], [{"state": "S", "cpu_percent": 0.0}], "waiting in Python"),
        ("x = q.get()", ["clock_nanosleep (libc.so.6)", "pysleep (time.c)"], [{"state": "S"}], "waiting in Python"),
        ("x = q.get()", ["futex_wait (libc.so.6)"], [{"state": "S", "cpu_percent": 0.0}], "blocked in C"),
        ("        time.sleep(0.5)", [], [{"state": "R", "cpu_percent": 99.0}], "busy loop in Python"),  # CPU wins
        ("        time.sleep(0.5)", [], [{"state": "D", "cpu_percent": 0.0}], "uninterruptible I/O"),
    ],
)
def test_a_loop_polling_with_time_sleep_is_a_python_wait_not_a_call_blocked_in_c(line, native, procs, expect):
    from hangwatch.supervisor.incidents import sleeping

    procs = [{"cpu_percent": 0.0, **p} for p in procs]
    assert classify_stall("stall", None, procs, None, sleeping(line, native)).startswith(expect)


@pytest.mark.parametrize(
    "code, sig, last_words, log, kind, needle",
    [
        (
            1,
            None,
            {
                "kind": "crash",
                "message": "boom",
                "traceback": 'Traceback (most recent call last):\n  File "x", line 1\nValueError: boom\n',
            },
            "",
            "crash",
            "ValueError: boom",
        ),
        (1, None, {"kind": "oom", "message": "CUDA out of memory"}, "", "oom", "out of memory"),
        (75, None, {"kind": "nan", "message": "5 non-finite losses in a row"}, "", "nan", "5 non-finite"),
        (78, None, None, "", "config_error", "EX_CONFIG"),
        (65, None, {"kind": "data_error", "message": "no usable example"}, "", "data_error", "no usable example"),
        (None, signal.SIGSEGV, None, "", "signal", "killed by SIGSEGV (signal 11)"),
        (
            74,
            None,
            {
                "kind": "checkpoint_failed",
                "message": "checkpoint of step 30 could not be written under /r: [Errno 28] No space left on device",
            },
            "",
            "checkpoint_failed",
            "checkpoint save failed: checkpoint of step 30",
        ),
        (74, None, None, "", "disk", "exit 74 (EX_IOERR), no last words"),
        (
            None,
            signal.SIGKILL,
            None,
            "",
            "signal",
            "killed by SIGKILL (signal 9): not sent by hangwatch; what sent it is unknown",
        ),
        (
            1,
            None,
            None,
            'step 3\nTraceback (most recent call last):\n  File "t.py", line 3\n'
            "torch.OutOfMemoryError: CUDA out of memory\n",
            "oom",
            "torch.OutOfMemoryError",
        ),
        (
            1,
            None,
            None,
            "Traceback (most recent call last):\n  File \"t.py\", line 3\nKeyError: 'x'\n",
            "crash",
            "KeyError: 'x' (from the worker log)",
        ),
        (
            1,
            None,
            None,
            # a traceback whose start is above the tail (HF Trainer's are long): its closing line still names it
            '    ^^^^^\n  File "t.py", line 3\n'
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
            "  0%|          | 0/6 [00:00<?, ?it/s]\n",
            "oom",
            "out of memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
            "(from the worker log)",
        ),
        (1, None, None, "warning: running out of memory soon\n", "oom", "out of memory (from the worker log)"),
        (3, None, None, "", "crash", "exited with code 3 without last words"),
    ],
)
def test_exit_classification(code, sig, last_words, log, kind, needle):
    got_kind, text = classify_exit(code, sig, last_words, log)
    assert got_kind == kind and needle in text, text


@pytest.mark.parametrize(
    "cause, kind",
    [
        ("the kernel's OOM killer (kernel log: killed process 41)", "oom"),
        ("not sent by hangwatch, and not the OOM killer (the kernel recorded no OOM kill)", "signal"),
        (
            "not sent by hangwatch; the kernel's OOM records cannot be read here, so whether it was the OOM killer is "
            "unknown",
            "signal",
        ),
    ],
)
def test_a_sigkill_names_the_oom_killer_only_when_the_evidence_does(cause, kind):
    got_kind, text = classify_exit(None, signal.SIGKILL, None, "", sigkill_cause=cause)
    assert (got_kind, text) == (kind, f"killed by SIGKILL (signal 9): {cause}")
    assert classify_exit(None, signal.SIGKILL, None, "", killed_by_us=True) == (
        "signal",
        "killed by SIGKILL (signal 9)",
    )


def test_a_torchrun_jobs_failed_rank_is_named_not_childfailederror():
    root = {"rank": 1, "exitcode": 1, "pid": 9406, "signal": None, "exception": "ValueError: shard 7 is empty"}
    tail = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    assert classify_exit(1, None, None, tail, launcher=root) == (
        "crash",
        "rank 1 failed first (exit code 1, pid 9406, per torchrun): ValueError: shard 7 is empty",
    )
    oom = dict(root, exception="torch.OutOfMemoryError: CUDA out of memory")
    assert classify_exit(1, None, None, tail, launcher=oom)[0] == "oom"
    assert "no exception in the log" in classify_exit(1, None, None, tail, launcher=dict(root, exception=None))[1]


def test_incident_store_numbers_lists_and_fetches(tmp_path):
    store = IncidentStore(tmp_path)
    a = store.create("stall", attempt=1, step=4, classification="c", summary="s")
    b = store.create("crash", attempt=2, step=5, classification="c2", summary="s2")
    assert (a.id, b.id) == ("0001", "0002") and (tmp_path / "incidents" / "0002-crash" / "incident.json").exists()
    assert [i["id"] for i in store.list()] == ["0001", "0002"] and store.count() == 2
    assert store.get("2")["kind"] == "crash" and store.get("0009") is None
    with pytest.raises(ValueError, match="unknown incident kind"):
        store.create("meltdown")
    (tmp_path / "incidents" / "0003-stall").mkdir()  # a directory whose incident.json never got written
    assert store.list()[-1]["summary"] == "incident.json missing or unreadable"
    assert store.create("oom").id == "0004"  # the next number, past the directory without a record


def test_evidence_files_are_listed_in_the_record(tmp_path):
    store = IncidentStore(tmp_path)
    inc = store.create("stall", attempt=1)
    inc.add_file("stack-rank0.txt", "Thread 0x1 ...\n")
    inc.add_file("raw.bin", b"\x00\x01")
    inc.add_file("stack-rank0.txt", "Thread 0x1 again\n")
    store.save(inc)
    record = json.loads((inc.dir / "incident.json").read_text())
    assert record["files"] == ["stack-rank0.txt", "raw.bin"]
    assert (inc.dir / "stack-rank0.txt").read_text() == "Thread 0x1 again\n" and (
        inc.dir / "raw.bin"
    ).read_bytes() == b"\x00\x01"
    assert [p.name for p in inc.dir.iterdir() if p.name.startswith(".tmp-")] == []


def test_tail_text_keeps_the_end(tmp_path):
    p = tmp_path / "log"
    p.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail_text(p, max_lines=3) == "line 997\nline 998\nline 999\n"
    assert tail_text(tmp_path / "missing") == ""


# ------------------------------------------------------------------------ escalation, on a fake process table


def _killer(table, worker, **kw):
    kw = {"term_grace_s": 1, "gpu_release_timeout_s": 30, "kill_wait_s": 5, **kw}
    return TreeKiller(worker, [], table=table, **kw)


def _fake_worker(table, **proc):
    p = table.add(**proc)
    return p, process.Worker(pid=p.pid, create_time=p.create_time, argv=[], log_path=None, started_at=0.0)


def _drive(table, killer, worker, limit=20.0, step=0.1):
    """What the loop does each pass: reap (the one place exits are observed), then advance the killer."""
    t = 0.0
    killer.begin(t)
    while True:
        status = table.reap(worker.pid)
        if status is not None:
            worker.record_exit(status, t)
        if killer.advance(t):
            return t
        t = round(t + step, 3)
        assert t < limit


def test_tree_killer_waits_for_the_gpu_memory_of_the_dead_to_be_freed():
    table = FakeProcessTable()
    p, worker = _fake_worker(table, term="die")
    holding = [{p.pid}, {p.pid}, set()]  # NVML still lists the dead pid twice, then not
    killer = _killer(table, worker, gpu_pids=lambda: holding.pop(0) if len(holding) > 1 else holding[0])
    _drive(table, killer, worker)
    assert table.signals() == ["-SIGTERM"] and worker.exit_signal == signal.SIGTERM
    assert killer.gpu_release["checked"] and killer.gpu_release["released"] and killer.gpu_release["waited_s"] > 0
    assert killer.kill_at is None  # SIGTERM was enough


def test_tree_killer_gives_up_waiting_for_gpu_memory_after_its_bound():
    table = FakeProcessTable()
    p, worker = _fake_worker(table, term="ignore")
    killer = _killer(table, worker, gpu_release_timeout_s=2, gpu_pids=lambda: {p.pid})
    _drive(table, killer, worker, limit=30)
    assert worker.exit_signal == signal.SIGKILL and killer.kill_at == pytest.approx(
        1.0
    )  # SIGTERM ignored → SIGKILL after grace
    assert table.signals() == ["-SIGTERM", "-SIGKILL"]
    assert killer.gpu_release == {
        "checked": True,
        "released": False,
        "waited_s": pytest.approx(2.0, abs=0.15),
        "pids_still_holding": [p.pid],
    }
    assert json.dumps(killer.timings())


def test_tree_killer_never_calls_an_exit_gone_before_the_loop_reaped_it():
    table = FakeProcessTable()
    p, worker = _fake_worker(table, term="die")
    killer = _killer(table, worker)
    killer.begin(0.0)
    assert not p.alive
    for t in (0.1, 0.2, 5.0):  # dead, but not reaped by the loop yet: the killer waits for that fact
        assert not killer.advance(t)
    worker.record_exit(table.reap(p.pid), 5.0)
    assert killer.advance(5.1) and killer.gone_at == 5.1


def test_a_child_that_left_the_group_gets_its_own_sigkill_and_survivors_are_recorded():
    table = FakeProcessTable()
    p, worker = _fake_worker(table, term="die")
    escaped = table.add(ppid=p.pid, term="ignore", survives_kill=True)  # setsid, then stuck in state D
    killer = _killer(table, worker, kill_wait_s=3)
    t = _drive(table, killer, worker)
    assert table.signals() == ["-SIGTERM", "-SIGKILL", "SIGKILL"] and table.sent[-1][0] == escaped.pid
    assert killer.killed == [escaped.pid] and [s["pid"] for s in killer.survivors] == [escaped.pid]
    assert t == pytest.approx(1.0 + 3.0, abs=0.11)  # term grace, then kill_wait_s: recorded, not waited on for ever


def test_dump_collector_signals_announced_targets_and_keeps_only_what_was_appended(tmp_path):
    table = FakeProcessTable()
    a, b = table.add(), table.add()
    a.dump_path, b.dump_path = tmp_path / "stack-rank0.txt", tmp_path / "stack-rank1.txt"
    a.dump_path.write_text("an old dump\n")
    targets = [
        DumpTarget(0, process.ProcRef(a.pid, a.create_time), a.dump_path),
        DumpTarget(1, process.ProcRef(b.pid, b.create_time), b.dump_path),
    ]
    dc = DumpCollector(targets, grace_s=5, table=table, py_spy=False)
    dc.begin(0.0)
    assert table.sent == [(a.pid, signal.SIGUSR1), (b.pid, signal.SIGUSR1)] and dc.signalled == {0: True, 1: True}
    t = 0.0
    while not dc.advance(t):
        t = round(t + 0.1, 3)
    assert t == 0.0  # both dumps are whole (each ends with its main thread's block): in at once, no settle wait
    texts = dc.texts()
    assert "an old dump" not in texts[0] and "block_in_c" in texts[0] and "block_in_c" in texts[1]


def test_dump_collector_is_bounded_when_a_rank_never_writes(tmp_path):
    table = FakeProcessTable()
    mute = table.add()  # announced a dump file, but its handler writes elsewhere (or never)
    dc = DumpCollector(
        [DumpTarget(0, process.ProcRef(mute.pid, mute.create_time), tmp_path / "none.txt")],
        grace_s=2,
        table=table,
        py_spy=False,
    )
    mute.dump_path = tmp_path / "elsewhere.txt"
    dc.begin(0.0)
    assert not dc.advance(1.9) and dc.advance(2.0)
    assert dc.texts() == {0: ""} and dc.py_spy_note == "disabled (watchdog.py_spy: false)"


def test_an_incident_can_change_kind_once_the_evidence_is_in(tmp_path):
    from hangwatch.supervisor.incidents import IncidentStore

    store = IncidentStore(tmp_path)
    inc = store.create("stall", summary="x")
    inc.add_file("stack-rank0.txt", "stack")
    inc.rekind("livelock")
    store.save(inc)
    assert [d.name for d in store.dirs()] == [f"{inc.id}-livelock"]
    assert store.get(inc.id)["kind"] == "livelock" and (inc.dir / "stack-rank0.txt").read_text() == "stack"
    with pytest.raises(ValueError):
        inc.rekind("bogus")


def test_a_stall_without_a_landmark_says_so_and_names_the_users_frame(tmp_path):
    from fixtures.fakes.fake_supervisor import Harness

    h = Harness(tmp_path, proc={"term": "die", "stuck_in": "_poll_shard_ready"})
    h.running()
    h.until(lambda: h.sup.attempt == 2)
    inc = h.incident()
    assert inc["summary"].startswith("step deadline 2.0s exceeded by ")
    assert inc["summary"].endswith(
        "; blocked in C (CPU 0%, state S); no landmark call on the stack; "
        "innermost _poll_shard_ready (worker.py:12), your own code"
    ), inc["summary"]
    assert inc["landmark"] is None and inc["caller_frame"]["function"] == "_poll_shard_ready"
    assert inc["user_outermost_frame"]["function"] == "<module>" and inc["stack_truncated"] is False
    assert "call_chain" not in inc  # the old 8-frame chain is gone: the landmark reading replaces it


def test_a_fatal_signals_dump_names_the_call_it_died_in(tmp_path):
    from fixtures.fakes.fake_supervisor import Harness

    h = Harness(tmp_path, proc={"term": "die"})
    w = h.running()
    torch = "/venv/lib/python3.11/site-packages/torch"
    w.proc.dump_path.write_text(f"""Fatal Python error: Segmentation fault

Current thread 0x1 (most recent call first):
  File "{torch}/autograd/graph.py", line 829 in _engine_run_backward
  File "{torch}/_tensor.py", line 625 in backward
  File "/srv/job/train.py", line 40 in train_step
  File "/srv/job/train.py", line 61 in <module>
""")
    w.exit(sig=signal.SIGSEGV)
    h.until(lambda: h.sup.attempt == 2)
    inc = h.incident()
    assert inc["kind"] == "signal" and inc["landmark"]["name"] == "backward"
    assert inc["summary"] == (
        "killed by SIGSEGV (signal 11); in backward(), called from train_step (train.py:40); "
        "innermost _engine_run_backward"
    )
    assert inc["caller_frame"]["line"] == 40 and inc["stuck_frame"]["function"] == "_engine_run_backward"


@pytest.mark.parametrize(
    "log, expect",
    [
        (  # accelerate launch: the child's traceback, then the launcher's CalledProcessError about it
            'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
            "ValueError: lr must be positive, got -0.1\nTraceback (most recent call last):\n"
            '  File "/venv/bin/accelerate", line 8, in <module>\nsubprocess.CalledProcessError: Command '
            "'['python', 'train.py']' returned non-zero exit status 1.\n",
            "ValueError: lr must be positive, got -0.1",
        ),
        (  # torchrun's ChildFailedError after the rank's own
            "Traceback (most recent call last):\nKeyError: 'labels'\nTraceback (most recent call last):\n"
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n",
            "KeyError: 'labels'",
        ),
        (  # only the wrapper's: it is all there is
            "Traceback (most recent call last):\nsubprocess.CalledProcessError: Command 'x' returned 2.\n",
            "subprocess.CalledProcessError: Command 'x' returned 2.",
        ),
        (
            "Traceback (most recent call last):\nRuntimeError: a\nTraceback (most recent call last):\nOSError: b\n",
            "OSError: b",
        ),
    ],
)
def test_the_childs_own_exception_is_the_cause_not_the_launchers_wrapper(log, expect):
    from hangwatch.supervisor.incidents import last_exception_line

    assert last_exception_line(log.splitlines()) == expect
