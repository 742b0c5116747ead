"""A configuration, data or disk error on any rank ends the run with that rank's code, though torchrun exits 1:
the decision (`rules.no_retry`), the restart policy and the final outcome that follow from it, and what the
supervisor reads for it from an attempt's directory and log."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.fakes.torchrun_report import root_cause

from hangwatch.common.config import RestartCfg
from hangwatch.common.rundir import rank_exit_name
from hangwatch.supervisor.escalation.episode import classify, no_retry, rank_last_words
from hangwatch.supervisor.rules.no_retry import NoRetry, no_retry_code, words_code
from hangwatch.supervisor.rules.outcome import Intent, next_outcome
from hangwatch.supervisor.rules.policy import Decision, RestartPolicy
from hangwatch.supervisor.rules.states import State

CONFIG = {"kind": "config_error", "message": "ConfigError: model.device: no GPU", "exit_code": 78}
DATA = {"kind": "data_error", "message": "DataError: train.jsonl: no usable example", "exit_code": 65}
DISK = {"kind": "disk", "message": "OSError: [Errno 28] No space left on device", "exit_code": 74}
CRASH = {"kind": "crash", "message": "RuntimeError: boom", "exit_code": 1}
VICTIM = {
    "kind": "crash",
    "message": "RuntimeError: Connection closed by peer",
    "exit_code": 1,
    "collective_error": True,
}


def root(rank, exitcode, signal=None, exception=None) -> dict:
    """torchrun's root-cause report as `kernel_evidence.torchrun_root_cause` reads it."""
    return {
        "rank": rank,
        "local_rank": rank,
        "exitcode": exitcode,
        "pid": 4242,
        "signal": signal,
        "exception": exception,
        "host": "localhost",
        "error_file": None,
    }


@pytest.mark.parametrize(
    "code, words, report, expected",
    [
        # torchrun exits 1 for a rank's error: the rank's last words say which, and with what
        (1, {1: CONFIG}, root(1, 78), NoRetry(78, 1, CONFIG["message"])),
        (1, {1: DATA}, root(1, 65), NoRetry(65, 1, DATA["message"])),
        (1, {0: DISK}, root(0, 74), NoRetry(74, 0, DISK["message"])),
        # ... also without torchrun's report (the log's tail lost it), or when torchrun died by a signal
        (1, {1: CONFIG}, None, NoRetry(78, 1, CONFIG["message"])),
        (None, {1: CONFIG}, None, NoRetry(78, 1, CONFIG["message"])),
        # the kind alone says it (a script of one's own may write no exit_code)
        (1, {1: {"kind": "config_error", "message": "bad --lr"}}, None, NoRetry(78, 1, "bad --lr")),
        (1, {1: {"kind": "disk"}}, None, NoRetry(74, 1, "disk")),
        # any rank: the victim's broken collective and the other rank's crash do not hide it
        (1, {0: VICTIM, 1: CONFIG}, root(0, -15, "SIGTERM"), NoRetry(78, 1, CONFIG["message"])),
        (1, {0: CRASH, 1: DATA}, root(0, 1), NoRetry(65, 1, DATA["message"])),
        # several ranks say it: the one torchrun saw fail first, else the lowest
        (1, {0: CONFIG, 1: DATA}, root(1, 65), NoRetry(65, 1, DATA["message"])),
        (1, {0: CONFIG, 1: DATA}, root(2, -9, "SIGKILL"), NoRetry(78, 0, CONFIG["message"])),
        (1, {2: CONFIG, 1: CONFIG}, None, NoRetry(78, 1, CONFIG["message"])),
        # no last words: torchrun's root cause, when it exited with such a code by itself
        (1, {}, root(1, 78), NoRetry(78, 1, "exit 78 (EX_CONFIG) per torchrun's root-cause report, no last words")),
        (
            1,
            {},
            root(0, 74, exception="OSError: [Errno 28] No space left on device"),
            NoRetry(
                74,
                0,
                "exit 74 (EX_IOERR) per torchrun's root-cause report, no last words; the log's last exception: "
                "OSError: [Errno 28] No space left on device",
            ),
        ),
        (
            1,
            {0: VICTIM},
            root(1, 65),
            NoRetry(65, 1, "exit 65 (EX_DATAERR) per torchrun's root-cause report, no last words"),
        ),
        # the worker's own code (a single process) stays what it is, with its words when they say the same
        (78, {0: CONFIG}, None, NoRetry(78, 0, CONFIG["message"])),
        (65, {}, None, NoRetry(65, None, "exit 65 (EX_DATAERR)")),
        (74, {0: CRASH}, None, NoRetry(74, None, "exit 74 (EX_IOERR)")),
        # nothing that forbids a restart
        (1, {}, None, None),
        (1, {1: CRASH}, root(1, 1), None),
        (1, {0: VICTIM, 1: CRASH}, root(1, 1), None),
        (1, {}, root(1, 1), None),
        (None, {}, root(1, 78, "SIGKILL"), None),  # a signal's exit code is not the rank's word
        (1, {1: CRASH}, root(1, 78), None),  # the rank's own last words outrank the launcher's account
        (1, {}, {"rank": None, "exitcode": 78, "signal": None}, None),
        (75, {}, None, None),  # the non-finite streak restarts (with rollback)
        # exit 0 is a completed worker, whatever was written
        (0, {1: CONFIG}, root(1, 78), None),
    ],
)
def test_no_retry_code(code, words, report, expected):
    assert no_retry_code(code, words, report) == expected


@pytest.mark.parametrize(
    "words, expected",
    [
        (CONFIG, 78),
        (DATA, 65),
        (DISK, 74),
        (CRASH, None),
        (VICTIM, None),
        ({"kind": "config"}, 78),
        ({"kind": "data"}, 65),
        ({"kind": "checkpoint_failed", "exit_code": 74}, 74),  # a checkpoint the full disk refused
        ({"kind": "checkpoint_failed", "exit_code": 1}, None),
        ({"kind": "crash", "exit_code": True}, None),  # a bool is not an exit code
        ({"kind": "config_error", "collective_error": True}, None),
        ({}, None),
    ],
)
def test_words_code(words, expected):
    assert words_code(words) == expected


# ---- the restart policy and the outcome -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stop, worker_code, reason",
    [
        (
            NoRetry(78, 1, "ConfigError: model.device: no GPU\nsecond line"),
            1,
            "rank 1 exited 78: configuration error (EX_CONFIG): ConfigError: model.device: no GPU; not restarting "
            "(the worker exited with code 1)",
        ),
        (
            NoRetry(65, 0, "DataError: no usable example"),
            1,
            "rank 0 exited 65: unusable data (EX_DATAERR): DataError: no usable example; not restarting "
            "(the worker exited with code 1)",
        ),
        (
            NoRetry(74, 1, "OSError: [Errno 28] No space left on device"),
            None,
            "rank 1 exited 74: the disk refused a write (EX_IOERR): OSError: [Errno 28] No space left on device; not "
            "restarting (the worker ended by a signal); make room, then `hangwatch run` resumes from the last good "
            "checkpoint",
        ),
    ],
)
def test_a_ranks_error_fails_the_run_with_its_code(stop, worker_code, reason):
    policy = RestartPolicy(RestartCfg())
    d = policy.on_exit(0.0, worker_code, None, no_retry=stop)
    assert (d.action, d.exit_code, d.reason) == ("fail", stop.code, reason)
    assert d.as_dict()["exit_code"] == stop.code
    assert policy.total_restarts == 0
    out = next_outcome(Intent.NONE, d, worker_code)
    assert (out.state, out.exit_code, out.why) == (State.FAILED, stop.code, reason)


def test_the_workers_own_code_keeps_its_words_and_a_clean_end_stays_clean():
    policy = RestartPolicy(RestartCfg())
    own = policy.on_exit(0.0, 78, None, no_retry=NoRetry(78, 0, "ConfigError: x"))
    assert (own.reason, own.exit_code) == ("worker exited 78: configuration error (EX_CONFIG); not restarting", None)
    assert next_outcome(Intent.NONE, own, 78).exit_code == 78
    assert policy.on_exit(0.0, 0, "finished", no_retry=None).action == "finish"
    assert policy.on_exit(0.0, 1, None, no_retry=None).action == "restart"
    assert "exit_code" not in Decision("restart", "x").as_dict()


def test_an_operators_request_still_wins():
    d = Decision("fail", "rank 1 exited 78: …", exit_code=78)
    assert next_outcome(Intent.EXIT, d, 1).exit_code == 0
    assert next_outcome(Intent.FAIL, d, 1).exit_code == 74


# ---- what the supervisor reads: the attempt's last words (announced or not) and torchrun's report ----------------


TORCHRUN_78 = """\
W1123 02:43:09.095000 9336 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9405 \
closing signal SIGTERM
Traceback (most recent call last):
  File "/x/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
""" + root_cause(exitcode=78)


def attempt(tmp_path: Path, words: dict, log: str = "", code=1, announced=()) -> SimpleNamespace:
    d = tmp_path / "attempts" / "0001"
    d.mkdir(parents=True)
    for rank, w in words.items():
        (d / rank_exit_name(rank)).write_text(json.dumps({**w, **({"rank": rank} if rank else {})}))
    (d / "worker.log").write_text(log)
    (d / "exit-rank1.json.tmp").write_text("{")  # a write cut short is nobody's last words
    worker = SimpleNamespace(exit_code=code, exit_signal=None, log_path=d / "worker.log")
    return SimpleNamespace(dir=d, worker=worker, announced={r: None for r in announced})


def test_the_last_words_of_a_rank_that_never_announced_itself_are_read(tmp_path):
    a = attempt(tmp_path, {1: CONFIG, 3: DATA})
    assert sorted(rank_last_words(a)) == [1, 3]
    assert no_retry(a) == NoRetry(78, 1, CONFIG["message"])
    kind, text, rank = classify(None, a)
    assert (kind, rank) == ("config_error", 1)
    assert text == f"rank 1: configuration error: {CONFIG['message']}"


def test_no_last_words_torchruns_report_decides(tmp_path):
    a = attempt(tmp_path, {}, log=TORCHRUN_78)
    assert no_retry(a) == NoRetry(78, 1, "exit 78 (EX_CONFIG) per torchrun's root-cause report, no last words")
    kind, text, rank = classify(None, a)
    assert (kind, rank) == ("config_error", 1) and text.startswith("rank 1: configuration error: exit 78"), text


def test_with_several_announced_ranks_the_incident_names_the_rank_itself(tmp_path):
    a = attempt(tmp_path, {0: VICTIM, 1: DISK}, announced=(0, 1))
    kind, text, rank = classify(None, a)
    assert (kind, text, rank) == ("disk", f"the disk refused a write: {DISK['message']}", 1)


def test_an_attempt_that_wrote_nothing_is_left_to_the_policy(tmp_path):
    a = attempt(tmp_path, {1: CRASH})
    assert no_retry(a) is None
    gone = SimpleNamespace(
        dir=tmp_path / "nowhere",
        worker=SimpleNamespace(exit_code=1, exit_signal=None, log_path=tmp_path / "nowhere" / "w.log"),
        announced={},
    )
    assert rank_last_words(gone) == {} and no_retry(gone) is None
