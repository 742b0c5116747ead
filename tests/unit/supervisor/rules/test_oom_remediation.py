"""OOM remediation's decision table (`supervisor/rules/oom_remediation.py`): pure, no processes, no files.  The ladder
itself is tests/unit/common/test_oom_ladder.py; remediation.json is tests/unit/supervisor/records/test_healing.py;
the supervisor's handle is tests/unit/supervisor/concerns/test_oom_recovery.py."""

from fixtures.fakes.oom_config import oom_cfg as cfg

from hangwatch.common.oom_ladder import Rung as Setting
from hangwatch.supervisor.rules import oom_remediation as rem


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


def test_the_records_own_summary_needs_no_config():
    record = rem.applied(None, cfg(4, 2), rem.decide(None, cfg(4, 2)), attempt=1, step=1, incident=None, now=0.0)
    assert rem.record_summary(record) == rem.summary(record, cfg(4, 2))
    assert rem.record_summary(record)["words"] == (
        "micro_batch_size 4 × grad_accum 2 → micro_batch_size 2 × grad_accum 4 (OOM)"
    )
    assert rem.record_summary(None) is None and rem.record_summary({"configured": "x"}) is None
    assert rem.record_summary({**record, "configured": {"micro_batch_size": 4, "odd": 1}}) is None
