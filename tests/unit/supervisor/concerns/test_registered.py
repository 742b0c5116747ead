"""`concerns.registered`: which concerns a run has for its config, in the order the loop asks them — a concern
switched off is absent, not an `if` in the pass; the unkillable wait is always last (its failure overrides any
other concern's decision); every concern shares the one RunContext."""

from __future__ import annotations

from pathlib import Path

import pytest
from fixtures.fakes.fake_supervisor import FakeProcessTable
from fixtures.fakes.standby import FakeStandbySpawn

from hangwatch.common.config import Config
from hangwatch.common.durable import FsOps
from hangwatch.supervisor.concerns import Concern, RunContext, registered
from hangwatch.supervisor.concerns.generate_overrun import GenerateOverrun
from hangwatch.supervisor.concerns.goodput_accounting import GoodputAccounting
from hangwatch.supervisor.concerns.in_process_recovery import InProcessRecovery
from hangwatch.supervisor.concerns.oom_recovery import OomRecovery
from hangwatch.supervisor.concerns.output_settle import OutputSettle
from hangwatch.supervisor.concerns.prewarmed_standby import PrewarmedStandby
from hangwatch.supervisor.concerns.repeated_failure import RepeatedFailure
from hangwatch.supervisor.concerns.resume_audit import ResumeAudit
from hangwatch.supervisor.concerns.straggler_report import StragglerReport
from hangwatch.supervisor.concerns.unkillable_wait import UnkillableWait
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.records.run_state import RunRecord
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

COMMAND = {"command": ["python", "train.py"]}


def concerns_for(tmp_path: Path, **sections) -> list[Concern]:
    cfg = Config.model_validate({"run_dir": str(tmp_path / "run"), "data": {"train": "train.jsonl"}, **sections})
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = RunContext(
        cfg, run_dir, FsOps(), IncidentStore(run_dir), Deadlines(cfg.watchdog, Calibration(cfg.watchdog)), RunRecord()
    )
    table = FakeProcessTable()
    got = registered(run, table=table, config_path=run_dir / "config.yaml", spawn_standby=FakeStandbySpawn(table))
    assert all(c.run is run for c in got)  # one context, shared
    return got


def names(tmp_path: Path, **sections) -> list[str]:
    return [c.name for c in concerns_for(tmp_path, **sections)]


def test_the_defaults_for_the_built_in_worker(tmp_path):
    got = concerns_for(tmp_path)
    assert [type(c) for c in got] == [
        OutputSettle,
        GoodputAccounting,
        StragglerReport,
        GenerateOverrun,
        ResumeAudit,
        OomRecovery,
        InProcessRecovery,
        RepeatedFailure,
        UnkillableWait,
    ]
    assert [c.name for c in got] == [
        "output_settle",
        "goodput",
        "straggler_report",
        "generate_overrun",
        "resume_audit",
        "oom_recovery",
        "in_process_recovery",
        "repeated_failure",
        "unkillable_wait",
    ]


@pytest.mark.parametrize(
    "sections, present, absent",
    [
        ({"watchdog": {"generate_overrun": "truncate"}}, {"generate_overrun"}, set()),
        ({"watchdog": {"generate_overrun": "restart"}}, set(), {"generate_overrun"}),
        ({"watchdog": {"resume_audit": {"enabled": True}}}, {"resume_audit"}, set()),
        ({"watchdog": {"resume_audit": {"enabled": False}}}, set(), {"resume_audit"}),
        ({"restart": {"oom_remediation": True}}, {"oom_recovery"}, set()),
        ({"restart": {"oom_remediation": False}}, set(), {"oom_recovery"}),
        (
            {"worker": COMMAND, "restart": {"oom_remediation": True}},
            {"resume_check", "framework_oom"},
            {"oom_recovery", "in_process_recovery"},
        ),
        ({"restart": {"in_process": True}}, {"in_process_recovery"}, set()),
        ({"restart": {"in_process": False}}, set(), {"in_process_recovery"}),
        (
            {"worker": COMMAND, "restart": {"in_process": True}},
            {"resume_check", "framework_oom"},
            {"in_process_recovery", "oom_recovery"},
        ),
        (
            {"worker": {**COMMAND, "instrument": "off"}},
            {"resume_check"},
            {"oom_recovery", "framework_oom", "in_process_recovery"},
        ),
        (
            {"worker": COMMAND, "restart": {"oom_remediation": False}},
            {"resume_check"},
            {"oom_recovery", "framework_oom", "in_process_recovery"},
        ),
        ({"restart": {"prewarm": False}}, set(), {"prewarmed_standby"}),
        ({"restart": {"prewarm": True}}, {"prewarmed_standby"}, set()),
        ({"restart": {"prewarm": "always"}}, {"prewarmed_standby"}, set()),
    ],
)
def test_each_switch_adds_or_leaves_out_its_concern_only(tmp_path, sections, present, absent):
    got = names(tmp_path, **sections)
    assert present <= set(got) and not (absent & set(got))
    # the rest is as by default
    default = set(names(tmp_path / "default"))
    assert set(got) - present == default - absent - present
    assert got[:3] == ["output_settle", "goodput", "straggler_report"] and got[-1] == "unkillable_wait"


def test_everything_off_leaves_the_ones_that_every_run_has(tmp_path):
    got = names(
        tmp_path,
        watchdog={"generate_overrun": "restart", "resume_audit": {"enabled": False}},
        restart={"oom_remediation": False},
        worker=COMMAND,
    )
    # resume_check: a command of your own
    assert got == [
        "output_settle",
        "goodput",
        "straggler_report",
        "resume_check",
        "repeated_failure",
        "unkillable_wait",
    ]


def test_everything_on_in_the_loops_order_with_the_standby_before_the_unkillable_wait(tmp_path):
    got = concerns_for(tmp_path, restart={"prewarm": "always"})
    assert [c.name for c in got] == [
        "output_settle",
        "goodput",
        "straggler_report",
        "generate_overrun",
        "resume_audit",
        "oom_recovery",
        "in_process_recovery",
        "repeated_failure",
        "prewarmed_standby",
        "unkillable_wait",
    ]
    standby = got[-2]
    assert isinstance(standby, PrewarmedStandby) and standby.keeper.why_not is None and standby.keeper.always


def test_a_prewarm_the_run_cannot_have_is_registered_and_says_why_it_keeps_none(tmp_path):
    got = concerns_for(tmp_path, restart={"prewarm": True}, worker=COMMAND)
    (standby,) = [c for c in got if isinstance(c, PrewarmedStandby)]
    assert "worker.command is set" in standby.keeper.why_not
    assert [c.name for c in got][-2:] == ["prewarmed_standby", "unkillable_wait"]


def test_each_run_gets_its_own_instances(tmp_path):
    a, b = concerns_for(tmp_path / "a"), concerns_for(tmp_path / "b")
    assert all(x is not y for x, y in zip(a, b))


@pytest.mark.parametrize("sections", [{}, {"worker": COMMAND}])
def test_the_deciders_priorities_follow_the_registered_order_and_the_unkillable_wait_is_highest(tmp_path, sections):
    """`decision` is asked in ascending priority: the order of `registered`, the unkillable wait's failure last."""
    concerns = concerns_for(tmp_path, **sections)
    deciders = [c for c in concerns if type(c).decision is not Concern.decision]
    assert [c.priority for c in deciders] == sorted(c.priority for c in deciders)
    assert len({c.priority for c in deciders}) == len(deciders)
    assert deciders[-1].name == "unkillable_wait" and deciders[-1].priority == max(c.priority for c in concerns)


def test_the_decision_follows_priority_not_the_list_order(tmp_path):
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.concerns import Answer, decide
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.rules.policy import Decision

    run = concerns_for(tmp_path)[0].run
    heard: list[str] = []

    class Replaces(Concern):
        def decision(self, attempt, episode, decision, now):
            heard.append(f"{self.name} saw {decision.reason}")
            return Answer(Decision("fail", self.name), {self.name: True})

    low, high = Replaces(run), Replaces(run)
    low.name, high.name, low.priority, high.priority = "low", "high", 1, 2
    inc = run.incidents.create("crash", attempt=1)
    ep = Episode("crash", inc, 0.0, proposed=Decision("restart", "policy"))
    assert decide([high, low], None, ep, 0.0, fs=FsOps(), write_failed=lambda exc, path: None).reason == "high"
    assert ep.decision.reason == "high"  # written on the episode, in one place
    assert heard == ["low saw policy", "high saw low"]
    assert inc.data["low"] is True and inc.data["high"] is True  # each answer's fields, in the record to be saved


def test_the_decision_is_asked_once_when_the_tree_is_gone_and_its_answer_reaches_the_incident(tmp_path):
    """Through the loop (the fake supervisor): a worker's exit proposes the policy's restart; each concern's
    `decision` is asked once, after the tree's teardown, and what it answers is in the incident as saved."""
    from fixtures.fakes.fake_supervisor import Harness

    from hangwatch.supervisor.concerns import Answer

    h = Harness(tmp_path)
    asked: list[tuple] = []

    class Counting(Concern):
        def decision(self, attempt, episode, decision, now):
            asked.append((attempt.number, episode.killer is not None and episode.killer.gone_at is not None,
                          decision.action))  # fmt: skip
            return Answer(None, {"asked": len(asked)})

    h.sup.concerns.append(Counting(h.sup.context))
    h.running().exit(1)
    h.until(lambda: h.sup.attempt == 2)
    assert asked == [(1, True, "restart")]  # once, with the tree gone, the policy's restart proposed
    inc = h.incident()
    assert inc["asked"] == 1 and inc["decision"]["action"] == "restart"


def test_no_concern_keeps_an_observer_hook_of_its_own(tmp_path):
    """What only observes comes as events to `observe`; the old observer hooks are gone from every concern."""
    gone = ("prepare", "attempt_started", "beat", "output_progress", "attempt_ended", "stop_requested", "outcome",
            "pass_begins", "settled", "close")  # fmt: skip
    everything = concerns_for(tmp_path, restart={"prewarm": "always"}) + concerns_for(tmp_path / "b", worker=COMMAND)
    assert {"resume_check", "framework_oom", "prewarmed_standby"} <= {c.name for c in everything}
    for c in everything:
        assert not [h for h in gone if hasattr(c, h)], type(c).__name__
