"""The same end twice before any progress ends the run (`concerns.repeated_failure`: `early_end`, `same_end`): a
missing script, an argparse typo, a script's own `sys.exit(3)` — an exit code and output a restart would only repeat.
The pure judgement table-tested, then the concern driven alone: real incidents in a real store, worker logs on disk,
the decisions the restart policy would hand it, the decision asked once the tree is gone through its one owner
(`concerns.decide`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fixtures.deciding import decided

from hangwatch.supervisor.concerns import RunContext
from hangwatch.supervisor.concerns.events import AttemptEnded, AttemptStarted, Beat, OutputProgress
from hangwatch.supervisor.concerns.repeated_failure import (
    RepeatedFailure,
    early_end,
    same_end,
)
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.rules.policy import Decision

RESTART = Decision("restart", "worker exited with code 2")
USAGE = "usage: train.py [-h] [--steps STEPS]\ntrain.py: error: unrecognized arguments: --stpes 3\n"
NOSUCH = "/usr/bin/python: can't open file '/x/nosuch.py': [Errno 2] No such file or directory\n"
TORCHRUN = """\
[rank0]: usage: train.py [-h] [--steps STEPS]
[rank0]: train.py: error: unrecognized arguments: --stpes 3
E1207 12:56:41.123000 4242 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: 2) local_rank: 0 \
(pid: 4243) of binary: /usr/bin/python
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
Root Cause (first observed failure):
  time      : 2026-12-07_12:56:41
"""


BAR = "".join(f"\rtrain: {i * 20:3d}%|{'#' * i}{' ' * (5 - i)}| {i}/5" for i in range(1, 6))


@pytest.mark.parametrize(
    "text, lines",
    [
        (USAGE, ("usage: train.py [-h] [--steps STEPS]", "train.py: error: unrecognized arguments: --stpes 3")),
        ("\n\n" + NOSUCH + "\n  \n", (NOSUCH.strip(),)),  # blank lines show nothing
        ("\x1b[31merror: bad\x1b[0m\n", ("error: bad",)),  # as a terminal shows it
        (BAR + "\nerror: bad\n", ("train: 100%|#####| 5/5", "error: bad")),  # a bar: its last state
        ("".join(f"line {i}\n" for i in range(20)), tuple(f"line {i}" for i in range(14, 20))),  # the last six
        (
            TORCHRUN,
            (
                "[rank0]: usage: train.py [-h] [--steps STEPS]",
                "[rank0]: train.py: error: unrecognized arguments: --stpes 3",
            ),
        ),  # the rank's words, not torchrun's report of them
    ],
    ids=["argparse", "blank", "escapes", "bar", "last-six", "torchrun"],
)
def test_the_lines_quoted_are_what_the_command_showed_last(text, lines):
    assert early_end(1, None, text, False).lines == lines


@pytest.mark.parametrize(
    "code, sig, output, progressed, quoted",
    [
        (2, None, USAGE, False, (2, tuple(USAGE.splitlines()))),
        (None, 9, "loading the model\n", False, (137, ("loading the model",))),  # 128+N for signal N
        (2, None, USAGE, True, None),  # a step or a progress line: it got somewhere, the policy decides
        (3, None, "", False, None),  # nothing said: nothing to compare or quote
        (3, None, "\n \x1b[0m\n", False, None),
        (None, None, USAGE, False, None),
    ],
    ids=["exit", "signal", "progressed", "silent", "shows-nothing", "unknown"],
)
def test_an_early_end(code, sig, output, progressed, quoted):
    end = early_end(code, sig, output, progressed)
    assert (end.code, end.lines) == quoted if quoted is not None else end is None


def same(code_a: int, text_a: str, code_b: int, text_b: str) -> bool:
    return same_end(early_end(code_a, None, text_a, False), early_end(code_b, None, text_b, False))


@pytest.mark.parametrize(
    "a, b, repeats",
    [
        ((2, USAGE), (2, USAGE), True),
        ((1, NOSUCH), (1, NOSUCH), True),
        ((3, "pid 4242: no lr in config\n"), (3, "pid 4243: no lr in config\n"), True),  # a pid moves
        ((3, "at 0x7f3a2c: bad\n"), (3, "at 0x7f99aa: bad\n"), True),  # an address
        ((3, "2026-12-07 12:56:41,123 ERROR no lr\n"), (3, "2026-12-07 12:57:02,904 ERROR no lr\n"), True),  # a time
        ((3, "port 29500 in use\n"), (3, "port 29501 in use\n"), True),
        # stdout and stderr reach the log as they were read: a line of one inside the unfinished line of the other,
        # or two lines the other way round
        ((3, BAR + "green no newline"), (3, BAR + "\ngreen no newline"), True),
        ((3, "OUT line\nERR line\nfailed\n"), (3, "ERR line\nOUT line\nfailed\n"), True),
        ((3, "x\n" + "k" * 300 + "\nerror: y\n"), (3, "z\n" + "k" * 300 + "\nerror: y\n"), True),  # only the end
        ((2, "error: y\n"), (3, "error: y\n"), False),  # another code
        ((2, "error: y\n"), (2, "error: z\n"), False),  # other words
        ((1, "injected crash at step 1 (attempt 2)\n"), (1, "injected crash at step 1 (attempt 3)\n"), False),
        ((2, "usage: x\nerror: y\n"), (2, "error: y\n"), False),  # more said: not the same
    ],
)
def test_the_same_end(a, b, repeats):
    assert same(*a, *b) is repeats


def test_no_end_is_the_same_as_none():
    now = early_end(2, None, USAGE, False)
    assert not same_end(None, now) and not same_end(now, None) and not same_end(None, None)


# ---- the concern, driven alone


class Output:
    def __init__(self, progress_lines: int = 0):
        self.progress_lines = progress_lines


def attempt(tmp_path, number: int, text: str, code=2, sig=None, progress_lines: int = 0):
    log = tmp_path / f"worker-{number}.log"
    log.write_text(text)
    worker = SimpleNamespace(exit_code=code, exit_signal=sig, log_path=log, exited=True)
    return SimpleNamespace(number=number, worker=worker, output=Output(progress_lines))


def exit_episode(store, number, kind="crash", classification="exited with code 2 without last words", expired=None):
    inc = store.create(kind, attempt=number, step=0, classification=classification, summary=classification)
    return Episode(kind, inc, 0.0, expired=expired)


def ended(concern, a, ep, decision=RESTART, beats=(), progressed=False):
    """One attempt as the loop drives it: started, its beats, its end, then — its tree gone — the decision asked
    once, the policy's `decision` proposed (its incident saved, as `Episode.finish` does)."""
    concern.observe(AttemptStarted(a, None, 0.0))
    for rec in beats:
        concern.observe(Beat(a, None, rec, None, 0.0, 0.0))
    if progressed:
        concern.observe(OutputProgress(a, 0.0))
    concern.observe(AttemptEnded(a, ep, 0.0))
    got = decided([concern], a, ep, decision, 0.0, store=concern.run.incidents)
    assert ep.decision is got  # settled on the episode, in one place
    return got


@pytest.fixture
def run(tmp_path):
    store = IncidentStore(tmp_path)
    return store, RepeatedFailure(RunContext(None, tmp_path, None, store, None, None))


def test_the_same_usage_error_twice_ends_the_run_and_the_incident_quotes_it(tmp_path, run):
    store, concern = run
    ep1 = exit_episode(store, 1)
    assert ended(concern, attempt(tmp_path, 1, USAGE), ep1) is RESTART  # the first: the policy's restart stands
    first = store.get(ep1.incident.id)
    assert first["last_output"] == USAGE.splitlines() and "repeated" not in first
    assert first["summary"] == (
        "exited with code 2 without last words; its output ended: train.py: error: unrecognized arguments: --stpes 3"
    )
    ep2 = exit_episode(store, 2)
    got = ended(concern, attempt(tmp_path, 2, USAGE), ep2)
    assert got.action == "fail" and not got.crash_loop
    assert got.reason.startswith(
        f"the same end twice in a row before any progress (exit code 2, incidents {ep1.incident.id} and "
        f"{ep2.incident.id}), its output ending: train.py: error: unrecognized arguments: --stpes 3"
    )
    second = store.get(ep2.incident.id)
    assert second["repeated"] == ep1.incident.id and second["last_output"] == USAGE.splitlines()
    assert "unrecognized arguments: --stpes 3" in second["summary"] and "not restarted" in second["summary"]


@pytest.mark.parametrize(
    "second, repeats",
    [
        (dict(text=USAGE), True),
        (dict(text=USAGE, code=3), False),  # another exit code
        (dict(text="usage: x\nerror: another\n"), False),  # other words
        (dict(text=USAGE, beats=[{"event": "step", "step": 1}]), False),  # a step beat in this attempt
        (dict(text=USAGE, progressed=True), False),  # a progress line seen while it ran
        (dict(text=USAGE, progress_lines=1), False),  # … or in its output's last read
        (dict(text=USAGE, beats=[{"event": "start"}, {"event": "phase", "phase": "load"}]), True),  # no step
        (dict(text=USAGE, decision=Decision("fail", "no progress")), False),  # decided already
        (dict(text=USAGE, decision=Decision("restart", "oom; micro-batch 2", rollback=True)), False),
        (dict(text=USAGE, kind="stall", expired=object()), False),  # a stall is no exit of its own
    ],
)
def test_what_is_not_the_same_early_end(tmp_path, run, second, repeats):
    store, concern = run
    ended(concern, attempt(tmp_path, 1, USAGE), exit_episode(store, 1))
    a2 = attempt(
        tmp_path, 2, second["text"], code=second.get("code", 2), progress_lines=second.get("progress_lines", 0)
    )
    ep2 = exit_episode(store, 2, kind=second.get("kind", "crash"), expired=second.get("expired"))
    got = ended(
        concern,
        a2,
        ep2,
        decision=second.get("decision", RESTART),
        beats=second.get("beats", ()),
        progressed=second.get("progressed", False),
    )
    assert (got is not None and got.action == "fail" and "same end" in got.reason) is repeats
    if not repeats:  # the decision proposed stands, and the incident says no repetition
        assert got is second.get("decision", RESTART) and "repeated" not in store.get(ep2.incident.id)


def test_only_two_in_a_row(tmp_path, run):
    """An attempt in between that got somewhere (or stalled, or ended without an incident) starts the count again."""
    store, concern = run
    ended(concern, attempt(tmp_path, 1, USAGE), exit_episode(store, 1))
    ended(concern, attempt(tmp_path, 2, "step 1 loss 2.0\n" + USAGE, progress_lines=1), exit_episode(store, 2))
    assert ended(concern, attempt(tmp_path, 3, USAGE), exit_episode(store, 3)) is RESTART
    finish = Decision("finish", "done")  # a clean end between: no incident, its decision asked all the same
    assert ended(concern, attempt(tmp_path, 4, "", code=0), Episode(None, None, 0.0), decision=finish) is finish
    assert ended(concern, attempt(tmp_path, 5, USAGE), exit_episode(store, 5)) is RESTART
    assert ended(concern, attempt(tmp_path, 6, USAGE), exit_episode(store, 6)).action == "fail"


def test_a_signal_and_a_traceback(tmp_path, run):
    store, concern = run
    for n in (1, 2):
        ep = exit_episode(store, n, kind="signal", classification="killed by SIGSEGV (signal 11)")
        got = ended(concern, attempt(tmp_path, n, "loading the model\n", code=None, sig=11), ep)
    assert got.action == "fail" and "(killed by SIGSEGV (139), incidents" in got.reason
    # A traceback's exception is the repeated exception's to judge; its lines are quoted all the same, and its
    # summary, which names the exception already, is left as it was
    store, concern = IncidentStore(tmp_path / "b"), None
    concern = RepeatedFailure(RunContext(None, tmp_path / "b", None, store, None, None))
    text = 'Traceback (most recent call last):\n  File "t.py", line 1\nFileNotFoundError: data/trian.jsonl\n'
    words = "crash with FileNotFoundError: data/trian.jsonl"
    for n in (1, 2):
        ep = exit_episode(store, n, classification=words)
        got = ended(concern, attempt(tmp_path, n, text, code=1), ep)
    assert got.action == "fail" and got.reason.startswith("the same failure twice in a row")
    rec = store.get(ep.incident.id)
    assert rec["summary"] == words and rec["last_output"][-1] == "FileNotFoundError: data/trian.jsonl"
    assert rec["repeated"] == store.list()[0]["id"]
