"""How long a stall's recovery waits, and for what — on a fake clock and a fake process table.

The dump step ends as soon as the evidence is in: a whole faulthandler dump at once, a partial one once it
stopped growing, py-spy only while it runs; the process snapshot is taken beside the dumps.  A worker a
deadline found stuck gets `stuck_term_grace_s` between SIGTERM and SIGKILL; a stop the operator asked for,
`restart now`, and the leftovers of a worker that exited keep the full `term_grace_s`.  The first restart
after a healthy stretch is immediate; only repeated failure backs off, and the crash-loop guard holds with
or without delays.  Figures in seconds here are fake-clock seconds: the behaviour, not a timing.
"""

from __future__ import annotations

import signal

import pytest
from fixtures.fakes.fake_supervisor import DUMP, FakeProcessTable, Harness

from hangwatch.common.config import RestartCfg
from hangwatch.supervisor.escalation.dump_collector import (
    PARTIAL_SETTLE_S,
    SETTLE_S,
    DumpCollector,
    dump_complete,
    settle_s,
)
from hangwatch.supervisor.loop.supervisor import FAST_PASS_S
from hangwatch.supervisor.processes import process
from hangwatch.supervisor.processes.attempt import DumpTarget
from hangwatch.supervisor.rules.policy import RestartPolicy

LIB = "/usr/lib/python3.11"
WORKER_THREAD = f"""Thread 0x00007f0000000002 (most recent call first):
  File "{LIB}/threading.py", line 324 in wait
  File "{LIB}/threading.py", line 1002 in _bootstrap
"""
MAIN = """Current thread 0x00007f0000000001 (most recent call first):
  File "/srv/train.py", line 12 in block_in_c
  File "/srv/train.py", line 40 in main
  File "/srv/train.py", line 50 in <module>
"""
MAIN_UNDER_RUNPY = (
    MAIN
    + """  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
)
MAIN_CUT = """Thread 0x00007f0000000001 (most recent call first):
  File "/srv/train.py", line 12 in recurse
  ...
"""


@pytest.mark.parametrize(
    "text, whole",
    [
        (WORKER_THREAD + "\n" + MAIN, True),  # CPython's order: newer threads first, the main thread last
        (MAIN_UNDER_RUNPY, True),  # `python -m`: runpy's frames below <module>
        (DUMP.format(fn="block_in_c"), True),  # with a blank line after it
        (WORKER_THREAD, False),  # caught between threads: the main thread is still to come
        (WORKER_THREAD + "\n" + MAIN[: MAIN.index("  File")], False),  # the main thread's header only
        (MAIN.rsplit("\n", 2)[0] + "\n", False),  # its outermost frame not written yet
        ((WORKER_THREAD + "\n" + MAIN)[:-1], False),  # the last line not finished
        (MAIN_CUT, False),  # faulthandler's 100-frame cut: nothing says it is the main thread
        ("", False),
    ],
)
def test_a_dump_is_whole_when_it_ends_with_the_main_threads_block(text, whole):
    assert dump_complete(text) is whole


@pytest.mark.parametrize(
    "text, settle",
    [
        (WORKER_THREAD, SETTLE_S),  # ends at a thread's bootstrap: a main thread that is gone, or one still to come
        (MAIN_CUT, SETTLE_S),  # faulthandler's frame limit
        (WORKER_THREAD + "\n" + MAIN, SETTLE_S),
        (
            WORKER_THREAD + "\n" + MAIN.rsplit("\n", 2)[0] + "\n",
            PARTIAL_SETTLE_S,
        ),  # stopped inside the main thread's stack
        (MAIN.split("\n", 2)[0] + "\n" + MAIN.split("\n", 2)[1] + "\n", PARTIAL_SETTLE_S),  # its innermost frame only
        (WORKER_THREAD[:-1], PARTIAL_SETTLE_S),  # the last line not finished
        ("", PARTIAL_SETTLE_S),
    ],
)
def test_a_dump_cut_inside_a_stack_is_given_longer_to_settle(text, settle):
    assert settle_s(text) == settle


class FakeSpy:
    """A py-spy process the test ends (`finish`), or that runs past its time box (then it is killed)."""

    def __init__(self):
        self.code = None
        self.killed = False

    def poll(self):
        return self.code

    def finish(self):
        self.code = 0

    def kill(self):
        self.killed, self.code = True, -9

    def wait(self, timeout=None):
        return self.code


def _collector(tmp_path, writes: list[str], **kw):
    """A collector over one process that writes each of `writes` (in turn) into its dump file on SIGUSR1."""
    table = FakeProcessTable()
    p = table.add()
    p.dump_path = tmp_path / "stack-rank0.txt"
    dc = DumpCollector(
        [DumpTarget(0, process.ProcRef(p.pid, p.create_time), p.dump_path)], grace_s=5, table=table, py_spy=False, **kw
    )

    def deliver(proc, sig):
        if sig == signal.SIGUSR1 and writes:
            with open(proc.dump_path, "a") as f:
                f.write(writes.pop(0))

    table._deliver = deliver
    return dc, p


def _first_done(dc, start: float = 0.0, step: float = 0.1, each=None) -> float:
    t = start
    while not dc.advance(t):
        if each is not None:
            each(t)
        t = round(t + step, 3)
        assert t < 30
    return t


def test_a_whole_dump_is_in_at_once_and_a_partial_one_once_it_stops_growing(tmp_path):
    dc, _ = _collector(tmp_path, [WORKER_THREAD + "\n" + MAIN])
    dc.begin(0.0)
    assert dc.advance(0.0) and dc.timings()["dump_files_s"] == 0.0

    (tmp_path / "partial").mkdir()
    dc, _ = _collector(tmp_path / "partial", [WORKER_THREAD])  # the main thread never comes (cut off, say)
    dc.begin(0.0)
    assert _first_done(dc) == pytest.approx(SETTLE_S)
    assert dc.texts() == {0: WORKER_THREAD}


def test_a_writer_preempted_inside_the_main_threads_stack_is_waited_for_then_its_dump_is_whole(tmp_path):
    innermost = MAIN.rsplit("\n", 2)[0] + "\n"  # the main thread down to `main`, its `<module>` frame not yet written
    dc, p = _collector(tmp_path, [WORKER_THREAD + "\n" + innermost])
    dc.begin(0.0)

    def rest(t):  # the writer runs again 1.5 s later: longer than SETTLE_S, within PARTIAL_SETTLE_S
        if t == 1.5:
            with open(p.dump_path, "a") as f:
                f.write(MAIN[len(innermost) :])

    assert _first_done(dc, each=rest) == pytest.approx(1.6)  # whole at the next pass: at once
    assert dc.texts() == {0: WORKER_THREAD + "\n" + MAIN}

    (tmp_path / "never").mkdir()
    dc, _ = _collector(tmp_path / "never", [WORKER_THREAD + "\n" + innermost])  # the rest never comes
    dc.begin(0.0)
    assert _first_done(dc) == pytest.approx(PARTIAL_SETTLE_S)


def test_a_dump_still_growing_is_waited_for(tmp_path):
    dc, p = _collector(tmp_path, [WORKER_THREAD])
    dc.begin(0.0)

    def grow(t):  # more arrives in pieces, 0.2 s apart: each piece restarts the wait
        piece = {
            0.2: "Thread 0x00007f0000000003 (most recent call first):\n",
            0.4: f'  File "{LIB}/threading.py", line 1002 in _bootstrap\n',
        }.get(t)
        if piece:
            with open(p.dump_path, "a") as f:
                f.write(piece)

    assert _first_done(dc, each=grow) == pytest.approx(0.4 + 0.1 + SETTLE_S)


def test_py_spy_holds_the_step_only_while_it_runs(tmp_path):
    dc, _ = _collector(tmp_path, [MAIN])
    dc.begin(0.0)
    spy = FakeSpy()
    dc.py_spy_procs[0] = (spy, tmp_path / "py-spy-rank0.txt")
    assert not dc.advance(0.0) and dc.files_at == 0.0  # the faulthandler dump is in, py-spy still runs
    assert not dc.advance(0.7)
    spy.finish()
    assert dc.advance(0.8) and dc.timings() == {"dump_files_s": 0.0, "py_spy_s": 0.8, "stacks_s": 0.8}


def test_py_spy_past_its_time_box_is_killed_and_the_step_goes_on(tmp_path):
    dc, _ = _collector(tmp_path, [MAIN], py_spy_timeout_s=2.0)
    dc.begin(0.0)
    spy = FakeSpy()
    dc.py_spy_procs[0] = (spy, tmp_path / "py-spy-rank0.txt")
    assert _first_done(dc) == pytest.approx(2.0) and spy.killed
    assert "killed after 2s time box" in (tmp_path / "py-spy-rank0.txt").read_text()


def test_the_gate_waits_for_py_spy_to_let_go_not_for_the_files(tmp_path):
    """The snapshot (the gate) must not see a process py-spy holds stopped; it need not wait for the dump files."""
    asked = []
    dc, _ = _collector(tmp_path, [WORKER_THREAD], gate=lambda t: asked.append(t) or t >= 0.5)
    dc.begin(0.0)
    spy = FakeSpy()
    dc.py_spy_procs[0] = (spy, tmp_path / "py-spy-rank0.txt")
    for t in (0.0, 0.1, 0.2):
        assert not dc.advance(t)
    assert asked == []  # py-spy still attached
    with open(dc.targets[0].dump_path, "a") as f:  # the dump goes on growing (not whole yet)
        f.write("Thread 0x00007f0000000003 (most recent call first):\n")
    spy.finish()
    assert not dc.advance(0.3) and asked == [0.3]  # asked at once, though the dump file is not in
    assert not dc.advance(0.5) and dc.gate_at == 0.5 and dc.files_at is None  # passed; the file still settling
    assert dc.advance(0.6) and asked == [0.3, 0.5]  # in SETTLE_S after its last growth; the gate never asked again
    assert dc.timings() == {"dump_files_s": 0.6, "py_spy_s": 0.3, "stacks_s": 0.6}


# ------------------------------------------------------------------------------------------- the whole episode


def _kill_after_term(h) -> float:
    """Seconds between the SIGTERM to the group and the SIGKILL to it, from the incident's timings."""
    t = h.incident()["timings"]
    return t["sigkill_after_s"]


def test_a_stalled_worker_gets_the_stuck_grace_and_its_evidence_is_gathered_at_once(tmp_path):
    h = Harness(tmp_path, proc={"term": "ignore"})  # blocked in C: SIGTERM changes nothing
    h.running()
    h.until(lambda: h.state == "stalled")
    assert h.table.signals() == ["SIGUSR1"]  # signalled at detection, while the CPU sample runs
    h.until(lambda: h.sup.attempt == 2)
    assert h.table.signals() == ["SIGUSR1", "-SIGTERM", "-SIGKILL"]
    t = h.incident()["timings"]
    grace = h.sup.watchdog_cfg.stuck_term_grace_s
    assert grace < h.sup.watchdog_cfg.term_grace_s
    assert t["term_grace_s"] == grace and _kill_after_term(h) == pytest.approx(grace, abs=0.11)
    assert t["dump_started_at_s"] == 0 and t["dump_files_s"] == 0  # the whole dump was in at once
    assert t["sigterm_at_s"] == pytest.approx(0.5, abs=0.11)  # the snapshot's interval, the dumps within it
    # gone: at the pass after SIGKILL (the fake's reap), within one fast pass of the grace's end
    assert t["dump_s"] + grace <= t["detection_to_gone_s"] <= t["dump_s"] + grace + FAST_PASS_S + 0.06


def test_a_stuck_worker_whose_children_obey_sigterm_still_gets_its_sigkill_after_the_stuck_grace(tmp_path):
    h = Harness(tmp_path, proc={"term": "ignore"})
    w = h.running()
    child = h.table.add(ppid=w.pid, pgid=w.pid, term="die")  # a DataLoader worker: it can clean up and go
    h.until(lambda: h.sup.attempt == 2)
    assert child.status.signal == signal.SIGTERM  # SIGTERM first, to the whole group
    grace = h.sup.watchdog_cfg.stuck_term_grace_s
    assert h.table.signals() == ["SIGUSR1", "-SIGTERM", "-SIGKILL"] and _kill_after_term(h) == pytest.approx(
        grace, abs=0.11
    )


@pytest.mark.parametrize("how", ["restart now", "crash, a child left behind"])
def test_a_worker_not_known_to_be_stuck_keeps_the_full_grace(tmp_path, how):
    """term_grace_s is 1 s in the harness, the stuck grace 0.5 s."""
    h = Harness(tmp_path, proc={"term": "ignore"} if how == "restart now" else {})
    w = h.running()
    if how == "restart now":  # the operator's word, not a deadline: the worker may well be healthy
        h.request(cmd="restart", mode="now")
    else:
        h.table.add(ppid=w.pid, pgid=w.pid, term="ignore")  # stays behind in the worker's group
        w.exit(1)
    h.until(lambda: h.sup.attempt == 2)
    t = h.incident()["timings"]
    assert (
        h.table.signals()[-1] == "-SIGKILL"
        and t["term_grace_s"] == 1
        and _kill_after_term(h) == pytest.approx(1.0, abs=0.11)
    )


def test_an_operators_graceful_restart_waits_the_full_grace_for_the_leftovers(tmp_path):
    from structlog.testing import capture_logs

    h = Harness(tmp_path)
    w = h.running()
    h.table.add(ppid=w.pid, pgid=w.pid, term="ignore")
    h.request(cmd="restart")  # the worker checkpoints and exits 0; its child ignores SIGTERM
    with capture_logs() as logs:
        h.until(lambda: h.sup.attempt == 2)
    assert [r["grace_s"] for r in logs if r["event"] == "sigkill"] == [1] and h.sup.incidents.list() == []


# ------------------------------------------------------------------------------------------- restarts


def _cfg(**kw):
    return RestartCfg(
        **{"max_restarts": 3, "window_s": 100, "backoff_initial_s": 1, "backoff_max_s": 8, "healthy_after_s": 50, **kw}
    )


def test_the_first_failure_restarts_at_once_and_repeated_failure_doubles():
    p = RestartPolicy(_cfg(max_restarts=100))
    delays = []
    for i in range(6):
        p.attempt_started(float(i))
        delays.append(p.on_failure(i + 0.5, "stall").delay_s)
    assert delays == [0, 1, 2, 4, 8, 8]
    p.attempt_started(10.0)
    p.observed_step(7, 11.0)
    assert p.on_failure(61.0, "stall").delay_s == 0  # after a healthy stretch: at once again
    p.attempt_started(62.0)
    assert p.on_failure(63.0, "stall").delay_s == 1


def test_immediate_restarts_do_not_weaken_the_crash_loop_guard():
    p = RestartPolicy(_cfg(max_restarts=2, backoff_initial_s=0))
    decisions = []
    for i in range(3):
        p.attempt_started(float(i))
        decisions.append(p.on_failure(i + 0.5, "crash"))
    assert [d.action for d in decisions] == ["restart", "restart", "fail"] and decisions[-1].crash_loop
    assert [d.delay_s for d in decisions[:2]] == [0, 0]


def test_a_stall_restarts_in_the_pass_the_tree_is_gone_and_a_second_one_backs_off(tmp_path):
    h = Harness(tmp_path, proc={"term": "die"})
    h.running()
    h.until(lambda: h.state == "killing")
    h.until(lambda: h.state != "killing")
    assert h.state == "starting" and h.sup.attempt == 2  # no pass spent in backoff
    assert h.incident()["decision"]["delay_s"] == 0
    h.worker.start()
    h.worker.step(2)
    h.until(lambda: h.state == "running")
    took = h.until(lambda: h.sup.attempt == 3)  # stalls again at once: the second failure in a row
    assert h.incident()["decision"]["delay_s"] == 1
    backoff_entered = h.visited.count("backoff")
    assert backoff_entered == 2 and took >= 2 + 0.5 + 1  # step deadline, snapshot, then the 1 s backoff


# ------------------------------------------------------------------------------------------- the loop's wait


def test_the_episode_says_when_it_next_has_something_to_do(tmp_path):
    """For the loop's wait: the snapshot's interval, then SIGKILL at the end of the grace, then the kill wait —
    each from the episode's own clock, so a pass can land on it instead of the next fixed-period one."""
    h = Harness(tmp_path, proc={"term": "ignore"})
    h.running()
    h.until(lambda: h.state == "stalled")
    ep, now = h.sup.episode, h.clock()
    assert ep.next_due_s(now, 0.5) == pytest.approx(0.5 - (now - ep.sampled_at))  # the CPU sample's end
    h.until(lambda: h.state == "killing")
    term_at = ep.killer.term_at
    assert ep.next_due_s(term_at, 0.5) == pytest.approx(
        h.sup.watchdog_cfg.stuck_term_grace_s
    )  # the stuck grace, then SIGKILL
    assert ep.next_due_s(term_at + 0.7, 0.5) == 0  # overdue: at once, never negative
    h.until(lambda: ep.killer.kill_at is not None)
    assert ep.next_due_s(ep.killer.kill_at, 0.5) == pytest.approx(h.sup.watchdog_cfg.kill_wait_s)


def test_a_dump_not_yet_whole_is_due_when_its_quiet_period_ends(tmp_path):
    dc, p = _collector(tmp_path, [WORKER_THREAD], py_spy_timeout_s=3.0)
    dc.begin(1.0)
    assert dc.next_due() == 1.0 + 5  # nothing written yet: the grace
    dc.py_spy_procs[0] = (FakeSpy(), tmp_path / "py-spy-rank0.txt")
    assert not dc.advance(1.2)
    assert dc.next_due() == pytest.approx(1.2 + SETTLE_S)  # it grew at 1.2 and is not whole
    assert not dc.advance(1.6) and dc.files_at == 1.6 and dc.next_due() == 1.0 + 3.0  # only py-spy's time box left
    (tmp_path / "whole").mkdir()
    whole, _ = _collector(tmp_path / "whole", [MAIN])
    whole.begin(0.0)
    assert whole.advance(0.0) and whole.next_due() is None
