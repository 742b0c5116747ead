"""The same failure twice in a row ends the run (`concerns.repeated_failure`), driven alone: real incidents in a real
store, the decisions the restart policy would hand it, asked once the tree is gone through the decision's one owner
(`concerns.decide`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fixtures.deciding import decided

from hangwatch.supervisor.concerns import RunContext
from hangwatch.supervisor.concerns.repeated_failure import RepeatedFailure, signature
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.rules.policy import Decision

RESTART = Decision("restart", "worker exited with code 1")


def failure(store, kind, classification, step, attempt):
    """An attempt that ended by itself (its worker.log silent: no early end to compare) and its exit's episode."""
    inc = store.create(kind, attempt=attempt, step=step, classification=classification)
    worker = SimpleNamespace(exit_code=1, exit_signal=None, log_path=store.root / "no-such.log", exited=True)
    return Episode(kind, inc, 0.0), SimpleNamespace(number=attempt, worker=worker, output=None)


@pytest.mark.parametrize(
    "kind, classification, same",
    [
        ("crash", "crash with FileNotFoundError: [Errno 2] No such file: 'data/trian.jsonl'", True),
        ("crash", "crash with ValueError: bad lr (from the worker log)", True),
        ("oom", "out of memory: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", True),
        ("crash", "exited with code 3 without last words", False),  # no exception to compare
        ("signal", "killed by SIGSEGV (signal 11)", False),
        ("stall", "busy loop in Python (CPU 100%)", False),
    ],
)
def test_only_an_exception_is_a_failure_that_can_repeat(kind, classification, same):
    assert (signature(kind, {"classification": classification, "step": 3}) is not None) is same


def test_the_second_identical_failure_fails_the_run_once(tmp_path):
    store = IncidentStore(tmp_path)
    concern = RepeatedFailure(RunContext(None, tmp_path, None, store, None, None))
    words = "crash with FileNotFoundError: [Errno 2] No such file or directory: 'data/trian.jsonl'"
    ep1, a1 = failure(store, "crash", words, None, 1)
    assert decided([concern], a1, ep1, RESTART, 0.0, store=store) is RESTART  # the first: the policy's restart stands
    assert "repeated" not in store.get(ep1.incident.id)
    ep2, a2 = failure(store, "crash", words, None, 2)
    got = decided([concern], a2, ep2, RESTART, 1.0, store=store)
    assert got.action == "fail" and "the same failure twice in a row before the first step" in got.reason
    assert "data/trian.jsonl" in got.reason and f"incidents {ep1.incident.id} and {ep2.incident.id}" in got.reason
    assert store.get(ep2.incident.id)["repeated"] == ep1.incident.id  # said in the incident too
    assert ep2.decision is got  # settled on the episode once, by the owner


@pytest.mark.parametrize(
    "second, decision, repeats",
    [
        (("crash", "crash with ValueError: x", 7), RESTART, False),  # another step: it got further
        (("crash", "crash with ValueError: y", 5), RESTART, False),  # another error
        (("crash", "crash with ValueError: x", 5), Decision("fail", "crash loop", crash_loop=True), False),
        (("oom", "out of memory: CUDA", 5), Decision("restart", "oom; micro-batch 2", rollback=True), False),
        (("crash", "crash with ValueError: x", 5), RESTART, True),
    ],
)
def test_what_is_not_a_repetition(tmp_path, second, decision, repeats):
    store = IncidentStore(tmp_path)
    concern = RepeatedFailure(RunContext(None, tmp_path, None, store, None, None))
    first_kind = second[0] if second[0] == "oom" else "crash"
    first_words = "out of memory: CUDA" if first_kind == "oom" else "crash with ValueError: x"
    ep1, a1 = failure(store, first_kind, first_words, 5, 1)
    decided([concern], a1, ep1, RESTART, 0.0, store=store)
    ep2, a2 = failure(store, *second, 2)
    got = decided([concern], a2, ep2, decision, 1.0, store=store)
    assert (got is not None and got.action == "fail" and "the same failure twice" in got.reason) is repeats
    assert ("repeated" in store.get(ep2.incident.id)) is repeats
    if not repeats:
        assert got is decision  # the decision proposed stands


def test_two_ooms_of_one_allocation_are_the_same_whatever_was_free_and_the_words_say_what_to_lower(tmp_path):
    from hangwatch.daemon.faults import oom_message

    def words(free_mb):
        message = oom_message(
            tried_mb=2048,
            total_mb=81920,
            free_mb=free_mb,
            in_use_mb=3500,
            allocated_mb=1600,
            reserved_mb=1700,
            allowed_mb=3700,
        )
        return f"out of memory: torch.OutOfMemoryError: {message}"

    assert signature("oom", {"classification": words(1024), "step": 0}) == signature(
        "oom", {"classification": words(1000), "step": 0}
    )
    store = IncidentStore(tmp_path)
    concern = RepeatedFailure(RunContext(None, tmp_path, None, store, None, None))
    ep1, a1 = failure(store, "oom", words(1024), 0, 1)
    assert decided([concern], a1, ep1, RESTART, 0.0) is RESTART
    ep2, a2 = failure(store, "oom", words(1000), 0, 2)
    got = decided([concern], a2, ep2, RESTART, 1.0)
    assert got.action == "fail" and "before the first step" in got.reason
    assert "(Tried to allocate 2.0 GiB; 3.6 GiB allowed): lower the batch size of your training loop" in got.reason
