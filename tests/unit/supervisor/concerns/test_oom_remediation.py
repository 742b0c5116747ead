"""OOM remediation's decision table and its file (supervisor/records/remediation.py): pure, no processes."""

from types import SimpleNamespace

import pytest

from hangwatch.supervisor.concerns import oom_remediation as rem
from hangwatch.supervisor.concerns.oom_remediation import OomRemediation, Setting


def cfg(micro=4, accum=2, gc=False, command=None, on=True):
    return SimpleNamespace(
        train=SimpleNamespace(micro_batch_size=micro, grad_accum=accum),
        model=SimpleNamespace(gradient_checkpointing=gc),
        worker=SimpleNamespace(command=command),
        restart=SimpleNamespace(oom_remediation=on),
    )


def test_oom_remediation_can_be_turned_off(tmp_path):
    assert OomRemediation(cfg(on=False), tmp_path).on_failure("oom", attempt=1, step=3, incident="0001") is None
    assert not (tmp_path / "remediation.json").exists()


@pytest.mark.parametrize(
    "now, after",
    [
        (Setting(4, 2), Setting(2, 4)),
        (Setting(2, 4), Setting(1, 8)),
        (Setting(1, 8), Setting(1, 8, True)),
        (Setting(1, 8, True), None),
        (Setting(3, 1), Setting(1, 3)),  # no even half: the largest divisor at most half
        (Setting(6, 1), Setting(3, 2)),
        (Setting(12, 5, True), Setting(6, 10, True)),  # configured with checkpointing: it stays on
        (Setting(1, 1), Setting(1, 1, True)),
    ],
)
def test_ladder(now, after):
    assert rem.next_setting(now) == after
    if after is not None:
        assert after.effective == now.effective  # the effective batch never changes


def test_ladder_ends_after_every_rung_and_names_them():
    c = cfg(4, 2)
    record, rungs = None, []
    while True:
        remedy = rem.decide(record, c)
        if remedy.exhausted:
            break
        rungs.append(remedy.to)
        record = rem.applied(record, c, remedy, attempt=len(rungs), step=3, incident=f"i{len(rungs)}", now=0.0)
    assert rungs == [Setting(2, 4), Setting(1, 8), Setting(1, 8, True)]
    assert remedy.fields()["action"] == "failed"
    assert (
        "micro_batch_size 4 × grad_accum 2 → micro_batch_size 2 × grad_accum 4 → micro_batch_size 1 × grad_accum 8 "
        "→ micro_batch_size 1 × grad_accum 8, gradient checkpointing"
    ) in remedy.message
    assert [h["incident"] for h in record["history"]] == ["i1", "i2", "i3"]


def test_record_for_another_config_is_ignored():
    record = rem.applied(None, cfg(4, 2), rem.decide(None, cfg(4, 2)), attempt=1, step=1, incident=None, now=0.0)
    assert rem.current(record, cfg(4, 2)) == Setting(2, 4)
    assert rem.current(record, cfg(8, 1)) == Setting(8, 1)  # the user changed the batch: the config holds again
    assert rem.summary(record, cfg(8, 1)) is None
    assert rem.current({"version": 1, "garbage": True}, cfg(4, 2)) == Setting(4, 2)
    bad_product = {**record, "grad_accum": 3}
    assert rem.current(bad_product, cfg(4, 2)) == Setting(4, 2)


def test_supervisor_handle_persists_across_a_new_supervisor(tmp_path):
    c = cfg(4, 2)
    first = OomRemediation(c, tmp_path)
    assert first.on_failure("crash", attempt=1, step=2, incident="a") is None  # only OOMs are remedied
    remedy = first.on_failure("oom", attempt=1, step=2, incident="inc-1", now=5.0)
    assert remedy.to == Setting(2, 4) and "effective batch 8 unchanged" in remedy.message
    saved = rem.load(tmp_path)
    assert saved["micro_batch_size"] == 2 and saved["grad_accum"] == 4 and saved["configured"]["micro_batch_size"] == 4
    second = OomRemediation(c, tmp_path)  # a restarted supervisor escalates from the file, not the config
    assert second.on_failure("oom", attempt=2, step=2, incident="inc-2").to == Setting(1, 8)
    assert second.summary()["now"] == {"micro_batch_size": 1, "grad_accum": 8, "gradient_checkpointing": False}
    assert second.summary()["oom_restarts"] == 2


def test_own_script_is_never_remedied(tmp_path):
    handle = OomRemediation(cfg(command=["python", "train.py"]), tmp_path)
    assert handle.on_failure("oom", attempt=1, step=1, incident=None) is None
    assert not rem.path_for(tmp_path).exists()


class FakeIncident:
    def __init__(self):
        self.id, self.data = "inc-7", {}


def test_after_exit_turns_the_policy_decision_into_the_remedy(tmp_path):
    from hangwatch.supervisor.rules.policy import Decision

    handle = OomRemediation(cfg(2, 1), tmp_path)
    restart = Decision("restart", "worker exited with code 1", delay_s=2.0)
    assert rem.after_exit(handle, "crash", "0001", restart, attempt=1, step=3) == (restart, {})
    giving_up = Decision("fail", "crash loop", crash_loop=True)
    assert rem.after_exit(handle, "oom", "0001", giving_up, attempt=1, step=3) == (giving_up, {})  # the policy wins
    d, fields = rem.after_exit(handle, "oom", "0001", restart, attempt=1, step=3)
    assert d.action == "restart" and d.rollback and d.delay_s == 2.0
    assert "micro-batch 2 → 1, accumulation 1 → 2 (effective batch 2 unchanged)" in d.reason
    assert fields["remediation"]["to"] == {"micro_batch_size": 1, "grad_accum": 2, "gradient_checkpointing": False}
    d, _ = rem.after_exit(handle, "oom", "0002", restart, attempt=2, step=3)
    assert "gradient checkpointing turned on" in d.reason
    d, fields = rem.after_exit(handle, "oom", "0003", restart, attempt=3, step=3)
    assert d.action == "fail" and "every remedy tried" in d.reason and "gradient checkpointing" in d.reason
    assert fields["remediation"]["action"] == "failed"


def test_quarantine_view(tmp_path):
    assert rem.read_quarantine(tmp_path) == [] and rem.quarantine_summary([]) is None
    assert rem.quarantine_fields(tmp_path, 1) == {}
    lines = [{"id": f"t.jsonl:{i}", "reason": "r", "step": 3, "attempt": 1 if i < 25 else 2, "t": 0} for i in range(30)]
    (tmp_path / rem.QUARANTINE_NAME).write_text("".join(__import__("json").dumps(r) + "\n" for r in lines) + '{"id": ')
    s = rem.quarantine_summary(rem.read_quarantine(tmp_path))
    assert s["count"] == 30 and len(s["ids"]) == 20 and s["more"] == 10
    assert [r["id"] for r in rem.quarantine_fields(tmp_path, 2)["quarantined"]] == [
        f"t.jsonl:{i}" for i in range(25, 30)
    ]


def test_state_fields_from_the_files_alone(tmp_path):
    assert rem.state_fields(tmp_path) == {"remediation": None, "quarantine": None}
    OomRemediation(cfg(4, 2), tmp_path).on_failure("oom", attempt=1, step=2, incident="i")
    (tmp_path / "quarantine.jsonl").write_text('{"id": "t.jsonl:3", "reason": "r", "step": 3, "attempt": 1}\n')
    f = rem.state_fields(tmp_path)
    assert f["remediation"]["words"] == "micro_batch_size 4 × grad_accum 2 → micro_batch_size 2 × grad_accum 4 (OOM)"
    assert f["quarantine"]["ids"] == ["t.jsonl:3"]
