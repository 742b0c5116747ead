"""Reading the evidence: faulthandler dumps, exit classification, incident files, the tree killer."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hangwatch.supervisor import process
from hangwatch.supervisor.escalation import TreeKiller
from hangwatch.supervisor.incidents import (IncidentStore, classify_exit, classify_stall, parse_faulthandler, stuck_frame,
                                  tail_text)

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


@pytest.mark.parametrize(
    "procs, needle",
    [
        ([{"state": "R", "cpu_percent": 99.0}], "busy loop in Python (CPU 99%)"),
        ([{"state": "S", "cpu_percent": 0.4}], "blocked in C (CPU 0%, state S)"),
        ([{"state": "D", "cpu_percent": 2.0}], "uninterruptible I/O (state D"),
        ([{"state": "R", "cpu_percent": 30.0}], "busy loop in Python (CPU 30%)"),  # spinning on a contended CPU
        ([{"state": "S", "cpu_percent": 20.0}], "partly busy (CPU 20%)"),
        ([], "no worker process left"),
    ],
)
def test_stall_classification_from_cpu_and_state(procs, needle):
    assert needle in classify_stall("stall", None, procs, None)


@pytest.mark.parametrize(
    "code, sig, last_words, log, kind, needle",
    [
        (1, None, {"kind": "crash", "message": "boom", "traceback": "Traceback (most recent call last):\n  File \"x\", line 1\nValueError: boom\n"},
         "", "crash", "ValueError: boom"),
        (1, None, {"kind": "oom", "message": "CUDA out of memory"}, "", "oom", "out of memory"),
        (75, None, {"kind": "nan", "message": "5 non-finite losses in a row"}, "", "nan", "5 non-finite"),
        (78, None, None, "", "config_error", "EX_CONFIG"),
        (65, None, {"kind": "data_error", "message": "no usable example"}, "", "data_error", "no usable example"),
        (None, signal.SIGSEGV, None, "", "signal", "killed by SIGSEGV (signal 11)"),
        (None, signal.SIGKILL, None, "", "signal", "OOM killer"),
        (1, None, None, "step 3\nTraceback (most recent call last):\n  File \"t.py\", line 3\ntorch.OutOfMemoryError: CUDA out of memory\n",
         "oom", "torch.OutOfMemoryError"),
        (1, None, None, "Traceback (most recent call last):\n  File \"t.py\", line 3\nKeyError: 'x'\n", "crash", "KeyError: 'x' (from the worker log)"),
        (3, None, None, "", "crash", "exited with code 3 without last words"),
    ],
)
def test_exit_classification(code, sig, last_words, log, kind, needle):
    got_kind, text = classify_exit(code, sig, last_words, log)
    assert got_kind == kind and needle in text, text


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


def test_tail_text_keeps_the_end(tmp_path):
    p = tmp_path / "log"
    p.write_text("".join(f"line {i}\n" for i in range(1000)))
    assert tail_text(p, max_lines=3) == "line 997\nline 998\nline 999\n"
    assert tail_text(tmp_path / "missing") == ""


def test_tree_killer_waits_for_the_gpu_memory_of_the_dead_to_be_freed():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    worker = process.Worker(pid=child.pid, create_time=psutil.Process(child.pid).create_time(), argv=[], log_path=None,
                            started_at=0.0)
    holding = [{child.pid}, {child.pid}, set()]  # NVML still lists the dead pid twice, then not

    def reap():
        status = process.reap(child.pid)
        if status is not None:
            worker.exit_code, worker.exit_signal = process.decode_status(status)
            worker.exited_at = time.monotonic()
            child.returncode = -1

    killer = TreeKiller(worker, [], term_grace_s=5, gpu_release_timeout_s=30, reap=reap,
                        gpu_pids=lambda: holding.pop(0) if len(holding) > 1 else holding[0])
    t = 0.0
    killer.begin(t)
    while not killer.advance(t):
        t += 0.1
        time.sleep(0.02)
        assert t < 20
    assert worker.exit_signal == signal.SIGTERM
    assert killer.gpu_release["checked"] and killer.gpu_release["released"] and killer.gpu_release["waited_s"] > 0
    assert killer.kill_at is None  # SIGTERM was enough


def test_tree_killer_gives_up_waiting_for_gpu_memory_after_its_bound():
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(60)"], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"  # SIG_IGN is in place: only SIGKILL can end it
    worker = process.Worker(pid=child.pid, create_time=psutil.Process(child.pid).create_time(), argv=[], log_path=None,
                            started_at=0.0)

    def reap():
        status = process.reap(child.pid)
        if status is not None:
            worker.exit_code, worker.exit_signal = process.decode_status(status)
            worker.exited_at = 0.0
            child.returncode = -1

    killer = TreeKiller(worker, [], term_grace_s=1, gpu_release_timeout_s=2, reap=reap, gpu_pids=lambda: {child.pid})
    t = 0.0
    killer.begin(t)
    while not killer.advance(t):
        t += 0.1
        time.sleep(0.01)
        assert t < 30
    assert worker.exit_signal == signal.SIGKILL and killer.kill_at is not None  # SIGTERM ignored → SIGKILL after grace
    assert killer.gpu_release == {"checked": True, "released": False, "waited_s": pytest.approx(2.0, abs=0.15),
                                  "pids_still_holding": [child.pid]}
    assert json.dumps(killer.timings())
