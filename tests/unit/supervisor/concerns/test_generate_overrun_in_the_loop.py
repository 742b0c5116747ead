"""A runaway generate on the fake supervisor: ordered to end in-process while tokens arrive (no signal, no restart,
a `generate_truncated` incident), escalated when it does not obey or produces no tokens, restarted in `restart`
mode; the resume audit and the goodput ledger seen through the loop."""

from __future__ import annotations

import json
import signal

import pytest
from fixtures.fakes.fake_supervisor import Harness

from hangwatch.common.protocol import GENERATE_STOP_NAME, TRUNCATED_FIELD
from hangwatch.supervisor.read_model import view as views

WD = {"phase_budgets_s": {"generate": 5}, "silence_timeout_s": 30}


def _generate(h: Harness, *, tokens_every_s: float = 0.5, obey: bool = True, tokens: bool = True, until_s: float = 30):
    """The worker enters `generate` and produces 8 tokens every `tokens_every_s`; once an order appears it stops at
    the order's limit (obey) or goes on.  Returns the order (None if none came)."""
    w = h.worker
    w.phase("generate", budget_s=5)
    state = {"n": 0, "next": h.clock() + tokens_every_s, "order": None}
    order_path = w.dir / GENERATE_STOP_NAME

    def each():
        if state["order"] is None and order_path.exists():
            state["order"] = json.loads(order_path.read_text())
            if obey:
                limit = state["order"]["tokens"]
                w.beat(
                    "progress",
                    **{
                        TRUNCATED_FIELD: {
                            "order": state["order"]["order"],
                            "limit": limit,
                            "tokens": limit,
                            "prompt": "Once upon a time",
                            "output_tail": "and and and",
                        }
                    },
                )
                w.phase("train")
                return
        if tokens and (state["order"] is None or not obey) and h.clock() >= state["next"]:
            state["n"] += 8
            state["next"] = h.clock() + tokens_every_s
            w.beat("progress", tokens=state["n"])

    h.until(lambda: (state["order"] is not None and obey) or h.state != "running", within_s=until_s, each=each)
    return state["order"], state["n"]


def test_a_generate_past_its_budget_with_tokens_flowing_is_truncated_without_a_restart(tmp_path):
    h = Harness(tmp_path, watchdog=WD)
    w = h.running(steps=3)
    t0 = h.clock()
    order, produced = _generate(h)
    assert order is not None and h.clock() - t0 >= 5.0
    assert order["tokens"] > produced  # ahead of the fastest rank: it reads the order before reaching it
    w.step(2)
    h.until(lambda: h.incident_kinds() == ["generate_truncated"], within_s=5)
    inc = h.incident()
    assert inc["tokens"] == {"0": order["tokens"]} and inc["limit"] == order["tokens"]
    assert inc["prompt"] == "Once upon a time" and inc["output_tail"] == "and and and"
    assert "nothing restarted" in inc["summary"] and inc["budget_s"] == 5
    assert h.state == "running" and h.sup.attempt == 1 and len(h.spawn.workers) == 1
    assert not [s for _, s in h.table.sent if s in (signal.SIGTERM, signal.SIGKILL, signal.SIGUSR1)]
    # training goes on under its usual deadlines
    w.step(1)
    h.tick(0.5)
    assert h.state == "running"


def test_a_generate_that_ignores_the_order_is_escalated_after_the_grace_and_the_incident_says_so(tmp_path):
    h = Harness(tmp_path, watchdog=WD)
    h.running(steps=2)
    _generate(h, obey=False, until_s=40)
    h.until(lambda: h.sup.incidents.list(), within_s=5)
    inc = h.incident(0)
    assert inc["kind"] == "livelock"
    assert inc["truncation_ordered"]["limit"] > 0 and "did not within" in inc["truncation_ordered"]["note"]
    h.until(lambda: len(h.spawn.workers) == 2, within_s=30)


def test_a_generate_that_produces_no_tokens_is_a_stall_as_before(tmp_path):
    h = Harness(tmp_path, watchdog=WD)
    h.running(steps=2)
    _generate(h, tokens=False)
    assert not (h.worker.dir / GENERATE_STOP_NAME).exists()
    h.until(lambda: h.sup.incidents.list(), within_s=10)
    assert h.incident(0)["kind"] == "stall"


def test_restart_mode_restarts_a_runaway_generate(tmp_path):
    h = Harness(tmp_path, watchdog={**WD, "generate_overrun": "restart"})
    h.running(steps=2)
    _generate(h)
    assert not (h.spawn.workers[0].dir / GENERATE_STOP_NAME).exists()
    h.until(lambda: h.sup.incidents.list(), within_s=10)
    assert h.incident(0)["kind"] == "livelock"


def _resumed(h: Harness, losses_before: dict, losses_after: dict, lrs_after: dict | None = None):
    """Attempt 1 steps 1..8 with a good checkpoint at 4, dies at step 8; attempt 2 replays 5..8 and goes on."""
    h.until(lambda: h.spawn.workers)
    w = h.worker
    w.start()
    for s in range(1, 9):
        w.step(1, loss=losses_before[s], lr=1e-3 * s)
        if s == 4:
            ckpt = h.tmp_path / "ckpt-4"
            ckpt.mkdir()
            w.beat("checkpoint", path=str(ckpt), good=True)
        h.tick(0.2)
    w.exit(sig=signal.SIGKILL)
    h.until(lambda: len(h.spawn.workers) == 2, within_s=30)
    w2 = h.worker
    w2.step_no = 4
    w2.start()
    for s in range(5, 11):
        w2.step(1, loss=losses_after[s], lr=(lrs_after or {}).get(s, 1e-3 * s))
        h.tick(0.2)
    return w2


def test_the_resume_audit_through_the_loop_verified(tmp_path):
    h = Harness(tmp_path, watchdog={"silence_timeout_s": 30}, restart={"backoff_initial_s": 0.1})
    h.sup.ledger.ledger.confirm_steps = 1
    losses = {s: 1.0 / s for s in range(1, 11)}
    _resumed(h, losses, losses)
    audits = json.loads((h.sup.run_dir / "resume-audit.json").read_text())["audits"]
    assert len(audits) == 1 and audits[0]["verdict"] == "verified"
    assert audits[0]["replayed"] == [5, 8] and "within rtol 0.01" in audits[0]["text"]  # a worker.command: 0.01
    crash = h.incident(0)
    assert crash["resume_audit"]["verdict"] == "verified"
    assert "resume_diverged" not in h.incident_kinds()


@pytest.mark.parametrize("mode, final", [("warn", "running"), ("stop", "failed")])
def test_the_resume_audit_through_the_loop_diverged(tmp_path, mode, final):
    h = Harness(
        tmp_path,
        watchdog={"silence_timeout_s": 30, "resume_audit": {"on_divergence": mode}},
        restart={"backoff_initial_s": 0.1},
    )
    h.sup.ledger.ledger.confirm_steps = 1
    whys = []
    h.sup.lifecycle._on_change = lambda src, dst, why: whys.append((dst.value, why))
    losses = {s: 1.0 / s for s in range(1, 11)}
    _resumed(h, losses, losses, lrs_after={5: 1e-3})
    h.tick(0.2)
    h.tick(0.2)
    assert "resume_diverged" in h.incident_kinds()
    inc = next(i for i in h.sup.incidents.list() if i["kind"] == "resume_diverged")
    full = h.sup.incidents.get(inc["id"])
    assert full["resume_audit"]["difference"]["figure"] == "lr" and full["resume_audit"]["difference"]["step"] == 5
    assert full["summary"].startswith("step 5: lr 0.001 vs 0.005 before the restart")
    if final == "failed":
        h.until(lambda: h.state == "failed", within_s=10)
        assert (
            h.sup.exit_code == 1 and whys[-1][0] == "failed" and whys[-1][1].startswith("resume diverged — step 5: lr")
        )
        assert signal.SIGKILL in [s for _, s in h.table.sent] and len(h.spawn.workers) == 2
    else:
        assert h.state == "running"


def test_goodput_in_status_adds_up_to_the_supervisors_time(tmp_path):
    h = Harness(tmp_path, watchdog=WD)
    w = h.running(steps=3)
    for _ in range(5):
        w.step(1)
        h.tick(1.0)
    st = views.status_reply(h.sup.view(h.clock()))
    g = st["goodput"]
    assert g["wall_s"] == pytest.approx(h.clock() - h.sup.started_at, abs=1e-6)
    assert sum(g["categories"].values()) == pytest.approx(g["wall_s"])
    assert g["categories"]["training"] > 0 and g["line"].startswith("goodput ")
