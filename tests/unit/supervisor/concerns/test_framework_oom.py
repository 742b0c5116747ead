"""A script's OOM batch, the supervisor's side (`concerns.framework_oom`): the pure ladder and verdict, the record it
keeps, what `status` shows, and the concern driven alone with real incidents in a real store and the decisions the
restart policy would hand it — then `repeated_failure` after it, as registered — the decision asked once the tree is
gone through its one owner (`concerns.decide`, which writes the record the answer wants written)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures.deciding import RecordingFs, decided

from hangwatch.common.rundir import FRAMEWORK_REMEDIATION_NAME, framework_setting_name
from hangwatch.daemon.faults import oom_message
from hangwatch.supervisor.concerns import RunContext
from hangwatch.supervisor.concerns.events import OutcomeReached, Prepared
from hangwatch.supervisor.concerns.framework_oom import (
    FrameworkOom,
    decide,
    next_setting,
    oom_text,
    oom_words,
    recorded,
    summary,
)
from hangwatch.supervisor.concerns.repeated_failure import RepeatedFailure
from hangwatch.supervisor.escalation.episode import Episode
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.rules.oom_evidence import parse_oom_message
from hangwatch.supervisor.rules.outcome import Outcome, State
from hangwatch.supervisor.rules.policy import Decision

RESTART = Decision("restart", "worker exited with code 1")
MESSAGE = oom_message(
    tried_mb=2048, total_mb=81920, free_mb=1024, in_use_mb=3500, allocated_mb=1600, reserved_mb=1700, allowed_mb=3700
)
FIGURES = parse_oom_message(MESSAGE)
HF_ARGS = {"batch": "per_device_train_batch_size", "accumulation": "gradient_accumulation_steps"}


def found(batch=4, accumulation=1, asked=None, applied=None, changeable=True, why_fixed=None, framework="hf", **kw):
    return {
        "framework": framework,
        "trainer": kw.get("trainer", "Trainer"),
        "arguments": kw.get("arguments", HF_ARGS),
        "asked": asked or {"batch": batch, "accumulation": accumulation},
        "now": {"batch": batch, "accumulation": accumulation},
        "changeable": changeable,
        "why_fixed": why_fixed,
        "applied": applied,
        "why_not_applied": kw.get("why_not_applied"),
    }


@pytest.mark.parametrize(
    "batch, accumulation, expect",
    [
        (8, 1, (4, 2)),
        (4, 2, (2, 4)),
        (2, 4, (1, 8)),
        (1, 8, None),  # nothing smaller
        (6, 1, (3, 2)),
        (3, 1, (1, 3)),  # odd: its largest divisor at most half, the product exact
        (9, 2, (3, 6)),
        (7, 1, (1, 7)),
    ],
)
def test_the_ladder_halves_the_batch_and_keeps_the_product(batch, accumulation, expect):
    got = next_setting(batch, accumulation)
    assert got == expect
    if got:
        assert got[0] * got[1] == batch * accumulation


def test_the_ooms_figures_in_words():
    assert oom_words(FIGURES) == (
        "Tried to allocate 2.0 GiB; 3.6 GiB allowed; 1.6 GiB already allocated by PyTorch; GPU 0: 1.0 GiB free of "
        "80.0 GiB"
    )
    assert oom_words(None) is None


RECORD = {"version": 1, "framework": "hf", "configured": {"batch": 4, "accumulation": 1}, "batch": 2, "accumulation": 2}


@pytest.mark.parametrize(
    "record, seen, phase, action, words",
    [
        (None, found(), "train", "restart_with", "the next attempt trains with per_device_train_batch_size 2 × "),
        (RECORD, found(2, 2, asked={"batch": 4, "accumulation": 1}, applied=True), "train", "restart_with", "1 × "),
        (None, found(1, 8), "train", "failed", "per_device_train_batch_size is 1 already: nothing smaller to try"),
        (None, None, "load", "none", "no HF, TRL or Lightning Trainer started training"),
        (None, found(), "eval", "none", "in phase 'eval', not in a training step"),
        (None, found(changeable=False, why_fixed="DeepSpeed: x"), "train", "none", "cannot be changed: DeepSpeed: x"),
        (RECORD, found(4, 1, applied=False, why_not_applied="made for 8"), "train", "none", "did not apply the last"),
        (RECORD, found(4, 1, applied=None), "train", "none", "did not read the remedy recorded"),
        (None, found(), None, "restart_with", "per_device_train_batch_size 2 × gradient_accumulation_steps 2"),
    ],
)
def test_the_verdict(record, seen, phase, action, words):
    v = decide(record, seen, phase, FIGURES)
    assert v.action == action and words in v.message, v.message
    assert "Tried to allocate 2.0 GiB; 3.6 GiB allowed" in v.message  # the figures, whatever the verdict
    assert v.fields["oom"] == FIGURES
    if action == "restart_with":
        assert v.to["batch"] * v.to["accumulation"] == 4 and v.fields["from"] == seen["now"]
    if seen is not None:
        assert v.fields["argument"] == "per_device_train_batch_size (HF Trainer)"


def test_the_labels_name_the_trainer_and_the_lightning_argument():
    trl = decide(None, found(trainer="SFTTrainer"), "train", None)
    assert "out of memory in the SFTTrainer (an HF Trainer): the next attempt" in trl.message
    lightning = found(
        framework="lightning",
        trainer="Regressor",
        arguments={"batch": "model.batch_size", "accumulation": "trainer.accumulate_grad_batches"},
    )
    v = decide(None, lightning, "train", None)
    assert (
        "in the Lightning Trainer (module Regressor): the next attempt trains with model.batch_size 2 × " in v.message
    )
    assert v.fields["argument"] == "model.batch_size (Lightning Trainer)"
    fixed = decide(None, {**lightning, "changeable": False, "why_fixed": "no `batch_size`"}, "train", None)
    assert fixed.fields["argument"] == "the batch_size of the DataLoader your script builds (Lightning Trainer)"


def test_the_record_keeps_what_the_script_asked_for_and_each_step():
    v1 = decide(None, found(), "train", FIGURES)
    r1 = recorded(None, found(), v1, attempt=1, step=0, incident="0001", t=1.0)
    assert r1["configured"] == {"batch": 4, "accumulation": 1} and (r1["batch"], r1["accumulation"]) == (2, 2)
    seen = found(2, 2, asked={"batch": 4, "accumulation": 1}, applied=True)
    v2 = decide(r1, seen, "train", None)
    r2 = recorded(r1, seen, v2, attempt=2, step=3, incident="0002", t=2.0)
    assert r2["configured"] == {"batch": 4, "accumulation": 1} and (r2["batch"], r2["accumulation"]) == (1, 4)
    assert [(h["attempt"], h["from"]["batch"], h["to"]["batch"]) for h in r2["history"]] == [(1, 4, 2), (2, 2, 1)]
    assert r2["history"][0]["oom"] == FIGURES
    assert summary(r2) == {
        "framework": "hf",
        "configured": {"batch": 4, "accumulation": 1},
        "now": {"batch": 1, "accumulation": 4},
        "oom_restarts": 2,
        "words": "HF Trainer: per_device_train_batch_size 4 × gradient_accumulation_steps 1 → 1 × 4 after 2 "
        "out-of-memory restart(s)",
    }
    assert summary(None) is None and summary({"framework": "hf"}) is None


def test_the_oom_message_from_the_log_when_the_classification_has_none(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("step 1\nTraceback ...\n" + "  frame\n" * 200 + f"torch.OutOfMemoryError: {MESSAGE}\n  0%| |\n")
    assert oom_text("out of memory (from the worker log)", log) == f"torch.OutOfMemoryError: {MESSAGE}"
    assert oom_text(f"out of memory: {MESSAGE}", None) == f"out of memory: {MESSAGE}"
    assert oom_text("out of memory: killed by SIGKILL", tmp_path / "none.log") is None


# ---- the concern, alone and before repeated_failure ----------------------------------------------------------


class Run:
    def __init__(self, tmp_path: Path):
        self.run_dir = tmp_path / "run"
        (self.run_dir / "attempts").mkdir(parents=True)
        self.store = IncidentStore(self.run_dir)
        self.fs = RecordingFs()  # the loop's: the decision's writes are made through it
        ctx = RunContext(None, self.run_dir, None, self.store, None, None)
        self.concern, self.repeated = FrameworkOom(ctx), RepeatedFailure(ctx)
        self.concern.observe(Prepared(0.0))

    def attempt(self, number: int, seen: dict | None, kind="oom", phase="train", step=0, classification=None):
        adir = self.run_dir / "attempts" / f"{number:04d}"
        adir.mkdir()
        (adir / "worker.log").write_text("")
        if seen is not None:
            (adir / framework_setting_name(0)).write_text(json.dumps(seen))
        inc = self.store.create(
            kind, attempt=number, phase=phase, step=step, classification=classification or f"out of memory: {MESSAGE}"
        )
        episode = Episode(kind, inc, 0.0)
        worker = SimpleNamespace(exit_code=1, exit_signal=None, log_path=adir / "worker.log", exited=True)
        attempt = SimpleNamespace(number=number, dir=adir, worker=worker, output=None)
        return attempt, episode

    def decide(self, attempt, episode, decision=RESTART):
        """As the loop asks once the tree is gone: each concern in turn, a later one's replacement winning, the writes
        made, the incident saved; then the outcome told."""
        got = decided([self.concern, self.repeated], attempt, episode, decision, 0.0, fs=self.fs, store=self.store)
        for c in (self.concern, self.repeated):
            c.observe(OutcomeReached(Outcome(State.BACKOFF if got.action == "restart" else State.FAILED, ""), 0.0))
        return got

    def record(self) -> dict:
        return json.loads((self.run_dir / FRAMEWORK_REMEDIATION_NAME).read_text())


def test_each_oom_is_one_restart_with_half_the_batch_then_batch_1_ends_the_run(tmp_path):
    run = Run(tmp_path)
    a1, e1 = run.attempt(1, found(4, 1))
    d1 = run.decide(a1, e1)
    assert d1.action == "restart" and d1.rollback and "per_device_train_batch_size 2 × " in d1.reason
    assert (run.record()["batch"], run.record()["accumulation"]) == (2, 2)
    inc = run.store.get(e1.incident.id)["framework_remediation"]
    assert inc["action"] == "restart_with" and inc["to"] == {"batch": 2, "accumulation": 2} and inc["oom"] == FIGURES
    assert run.concern.readers(0.0)["framework_remediation"]()["now"] == {"batch": 2, "accumulation": 2}
    # asked once, when the tree is gone: settled on the episode, the record written once, one step in its history
    assert e1.decision is d1 and run.fs.written == [run.run_dir / FRAMEWORK_REMEDIATION_NAME]
    assert len(run.record()["history"]) == 1

    # the same message at the same step: no repetition, it ran with another batch (rollback)
    a2, e2 = run.attempt(2, found(2, 2, asked={"batch": 4, "accumulation": 1}, applied=True))
    d2 = run.decide(a2, e2)
    assert d2.action == "restart" and d2.rollback and (run.record()["batch"], run.record()["accumulation"]) == (1, 4)

    a3, e3 = run.attempt(3, found(1, 4, asked={"batch": 4, "accumulation": 1}, applied=True))
    d3 = run.decide(a3, e3)
    assert d3.action == "fail" and "per_device_train_batch_size is 1 already: nothing smaller to try" in d3.reason
    assert "Tried to allocate 2.0 GiB; 3.6 GiB allowed" in d3.reason
    assert run.store.get(e3.incident.id)["framework_remediation"]["action"] == "failed"
    assert len(run.record()["history"]) == 2


def test_a_batch_that_cannot_change_is_stopped_by_the_repetition_naming_the_argument(tmp_path):
    run = Run(tmp_path)
    why = "the train DataLoader was passed to fit() directly: its batch size is fixed inside it"
    seen = found(framework="lightning", changeable=False, why_fixed=why, trainer="Regressor")
    a1, e1 = run.attempt(1, seen)
    assert run.decide(a1, e1) is RESTART  # the policy's restart stands
    assert not (run.run_dir / FRAMEWORK_REMEDIATION_NAME).exists()
    a2, e2 = run.attempt(2, seen)
    d2 = run.decide(a2, e2)
    assert d2.action == "fail" and "the same failure twice in a row before the first step" in d2.reason
    assert "lower the batch_size of the DataLoader your script builds (Lightning Trainer)" in d2.reason
    assert "(Tried to allocate 2.0 GiB; 3.6 GiB allowed; 1.6 GiB already allocated by PyTorch" in d2.reason
    assert why in d2.reason


def test_a_plain_loop_is_stopped_at_the_second_identical_oom(tmp_path):
    run = Run(tmp_path)
    a1, e1 = run.attempt(1, None, phase="load")
    assert run.decide(a1, e1) is RESTART
    a2, e2 = run.attempt(2, None, phase="load")
    d2 = run.decide(a2, e2)
    assert d2.action == "fail"
    assert "lower the batch size of your training loop (its DataLoader's batch_size)" in d2.reason
    assert "hangwatch did not change the batch: no HF, TRL or Lightning Trainer started training" in d2.reason


def test_a_remedy_the_attempt_did_not_apply_does_not_loop(tmp_path):
    run = Run(tmp_path)
    a1, e1 = run.attempt(1, found(4, 1))
    assert run.decide(a1, e1).rollback
    not_applied = found(4, 1, applied=False, why_not_applied="it was made for … 4 × 1; the script now asks for 8 × 1")
    a2, e2 = run.attempt(2, not_applied)
    d2 = run.decide(a2, e2)
    assert d2.action == "fail" and "the same failure twice in a row" in d2.reason
    assert "did not apply the last remedy" in d2.reason


def test_not_an_oom_or_not_a_restart_is_left_alone(tmp_path):
    run = Run(tmp_path)
    a1, e1 = run.attempt(1, found(), kind="crash", classification="crash with ValueError: x")
    assert run.concern.decision(a1, e1, RESTART, 0.0) is None
    assert decided([run.concern], a1, e1, RESTART, 0.0, fs=run.fs, store=run.store) is RESTART
    assert "framework_remediation" not in run.store.get(e1.incident.id)
    a2, e2 = run.attempt(2, found())
    crash_loop = Decision("fail", "crash loop", crash_loop=True)
    assert decided([run.concern], a2, e2, crash_loop, 0.0, fs=run.fs, store=run.store) is crash_loop  # it stands
    # the verdict is said in the incident (as it always was), the batch left as it is
    assert "framework_remediation" in run.store.get(e2.incident.id)
    assert not (run.run_dir / FRAMEWORK_REMEDIATION_NAME).exists() and run.fs.written == []


def test_a_supervisor_started_again_reads_the_record(tmp_path):
    run = Run(tmp_path)
    a1, e1 = run.attempt(1, found(8, 1))
    run.decide(a1, e1)
    again = FrameworkOom(RunContext(None, run.run_dir, None, run.store, None, None))
    again.observe(Prepared(0.0))
    assert again.readers(0.0)["framework_remediation"]()["now"] == {"batch": 4, "accumulation": 2}


def test_the_record_goes_through_the_runs_fsops_and_a_refused_write_ends_the_run(tmp_path):
    from hangwatch.common.durable import write_json_atomic

    run = Run(tmp_path)
    refused, failed = RecordingFs(refuse=True), []
    a1, e1 = run.attempt(1, found(4, 1))
    d1 = decided(
        [run.concern],
        a1,
        e1,
        RESTART,
        0.0,
        fs=refused,
        write_failed=lambda exc, path: failed.append(path),
        store=run.store,
    )
    path = run.run_dir / FRAMEWORK_REMEDIATION_NAME
    assert d1.action == "fail" and "the smaller batch could not be recorded" in d1.reason and e1.decision is d1
    assert refused.written == [path] and failed == [path]
    assert not path.exists()
    said = run.store.get(e1.incident.id)["framework_remediation"]  # the incident says why, not the smaller batch
    assert said["action"] == "none" and "the smaller batch could not be recorded" in said["message"]

    fs = RecordingFs(refuse=False)
    a2, e2 = run.attempt(2, found(4, 1))
    assert decided([run.concern], a2, e2, RESTART, 0.0, fs=fs).action == "restart" and fs.written == [path]
    # byte for byte what the file always held (indented by 2)
    before = write_json_atomic(tmp_path / "before.json", run.record(), indent=2)
    assert (run.run_dir / FRAMEWORK_REMEDIATION_NAME).read_bytes() == before.read_bytes()
