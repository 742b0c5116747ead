"""The resume audit, end to end: an unedited PyTorch script under `hangwatch run CONFIG --run-dir DIR -- CMD…` dies
once by itself (SIGKILL) after step 11, the supervisor restarts it from the last good checkpoint (step-8.pt, handed
over through `worker.resume_args`), and the steps the new attempt replays (9–11) are compared with the beats the
dead attempt sent for them — loss and lr, both from the automatic instrumentation's optimizer hook.

  * everything restored → verified: `resume-audit.json` holds one `verified` audit over steps 9–11, the crash
    incident carries it, and the end summary prints it;
  * the scheduler not restored (`--forget-scheduler`) → `resume_diverged` naming lr at step 9, the first replayed
    step (its loss is the same: computed from the restored weights before the step);
  * the data reshuffled on resume (`--reshuffle-on-resume`) → `resume_diverged` naming loss at step 9, lr equal;
  * the scheduler not restored with `on_divergence: stop` → the run ends failed (exit 1) before the script reaches
    its last step, and says why.

The script is tests/fixtures/user_scripts/resume_audit_loop.py (no hangwatch import; deterministic on CPU).  The
tolerance is the default for a user's command (`rtol: null` → 0.01); the two faults move lr and loss by far more.
The watchdog settings are short test values; `restart.backoff_initial_s: 0`.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import incidents, run_hangwatch, worker_logs

from hangwatch.common.protocol import decode_line
from hangwatch.supervisor.incidents import IncidentStore

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "fixtures" / "user_scripts" / "resume_audit_loop.py"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS, SAVE_EVERY, DIE_AT = 24, 4, 11
RESUMED = DIE_AT // SAVE_EVERY * SAVE_EVERY  # 8: step-8.pt, confirmed by step 9 — the last good checkpoint
REPLAYED = [RESUMED + 1, DIE_AT]  # 9–11: beaten by attempt 1, beaten again by attempt 2
STEP_S = 0.25  # long enough that a stop at step 9 lands well before step 24


# ---- helpers -----------------------------------------------------------------------------------------------------


def config(**resume_audit) -> dict:
    """What a user of `-- CMD` writes: no run_dir, no worker.command; the resume audit as given (else its defaults)."""
    watchdog = {
        "startup_timeout_s": 120,
        "silence_timeout_s": 60,
        "first_steps_timeout_s": 60,
        "step_timeout_s": 30,
        "dump_grace_s": 1,
        "term_grace_s": 1,
        "py_spy": False,
        "poll_interval_s": 0.1,
    }
    if resume_audit:
        watchdog["resume_audit"] = resume_audit
    return {
        "watchdog": watchdog,
        "restart": {"backoff_initial_s": 0, "max_restarts": 2},
        "worker": {"resume_args": ["--resume", "{checkpoint}"]},
        "checkpoint": {"confirm_steps": 1},
    }


def run_script(
    tmp_path: Path, cfg: dict, *flags: str, timeout: float = 180
) -> tuple[subprocess.CompletedProcess, Path]:
    """`hangwatch run cfg.yaml --run-dir run -- python resume_audit_loop.py … FLAGS` from tmp_path."""
    cmd = [
        "python",
        str(SCRIPT),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
        "--ckpt-dir",
        "ckpts",
        "--step-s",
        str(STEP_S),
        "--die-once",
        "died.marker",
        "--die-at",
        str(DIE_AT),
        "--record",
        "starts.json",
        *flags,
    ]
    r, run_dir = run_hangwatch(tmp_path, cfg, cmd, timeout=timeout)
    assert (tmp_path / "died.marker").exists(), explain(r, run_dir)
    return r, run_dir


def output(r: subprocess.CompletedProcess) -> str:
    return f"{r.stdout}\n{r.stderr}"


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    audits = run_dir / "resume-audit.json"
    return (
        f"hangwatch run exited {r.returncode}\n{output(r)[-4000:]}\n{worker_logs(run_dir)}\n"
        f"--- resume-audit.json\n{audits.read_text() if audits.exists() else '(none)'}"
    )


def state(run_dir: Path) -> dict:
    return json.loads((run_dir / "state.json").read_text())


def crash_incident(run_dir: Path) -> tuple[Path, dict]:
    """The incident of attempt 1's death: the failure whose restart the audit is about."""
    found = [(d, inc) for d, inc in incidents(run_dir) if inc["kind"] != "resume_diverged"]
    assert len(found) == 1, [(d.name, inc.get("summary")) for d, inc in incidents(run_dir)]
    d, inc = found[0]
    assert inc["attempt"] == 1, (d.name, inc.get("summary"))
    return found[0]


def diverged_incidents(run_dir: Path) -> list[tuple[Path, dict]]:
    return [(d, inc) for d, inc in incidents(run_dir) if inc["kind"] == "resume_diverged"]


def audits(run_dir: Path) -> list[dict]:
    path = run_dir / "resume-audit.json"
    assert path.exists(), sorted(p.name for p in run_dir.iterdir())
    return json.loads(path.read_text())["audits"]


def the_audit(run_dir: Path) -> dict:
    found = audits(run_dir)
    assert len(found) == 1, found
    return found[0]


def beats(run_dir: Path, attempt: int, rank: int = 0) -> list[dict]:
    """The heartbeat lines of one rank of an attempt, in file order."""
    out = []
    for p in sorted((run_dir / "attempts" / f"{attempt:04d}").glob("heartbeat-rank*.jsonl")):
        out += [b for b in map(decode_line, p.read_bytes().splitlines()) if b is not None]
    return [b for b in out if b["rank"] == rank]


def step_beats(run_dir: Path, attempt: int) -> dict[int, dict]:
    """step → its step beat, for rank 0 of an attempt."""
    return {b["step"]: b for b in beats(run_dir, attempt) if b["event"] == "step"}


def log_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return Path(a).resolve() == Path(b).resolve()


def names_incident(ref, d: Path, inc: dict) -> bool:
    """Does `ref` (an audit's `incident`) point at incident `d`: its id, or its directory's name?"""
    return ref is not None and str(ref) in (inc["id"], d.name)


def assert_resumed_from_the_checkpoint(tmp_path: Path, run_dir: Path) -> None:
    """Attempt 1 beat steps 1–11 and died; attempt 2 was started with `--resume <step-8.pt>` and beat from step 9."""
    assert sorted(step_beats(run_dir, 1)) == list(range(1, DIE_AT + 1)), sorted(step_beats(run_dir, 1))
    starts = json.loads((tmp_path / "starts.json").read_text())
    assert [s["start_step"] for s in starts] == [0, RESUMED], starts
    assert starts[0]["resume"] is None and same_file(starts[1]["resume"], tmp_path / "ckpts" / f"step-{RESUMED}.pt")
    assert min(step_beats(run_dir, 2)) == RESUMED + 1, sorted(step_beats(run_dir, 2))


def assert_diverged_at_the_first_replayed_step(
    tmp_path: Path, r: subprocess.CompletedProcess, run_dir: Path, figure: str
) -> tuple[dict, dict]:
    """One `resume_diverged` incident and one diverged audit naming `figure` at step 9 with the two beats' values;
    the crash incident carries the audit.  Returns (the audit, the divergence incident)."""
    why = explain(r, run_dir)
    assert_resumed_from_the_checkpoint(tmp_path, run_dir)
    first = RESUMED + 1
    before, now = step_beats(run_dir, 1)[first], step_beats(run_dir, 2)[first]

    audit = the_audit(run_dir)
    assert audit["verdict"] == "diverged", audit
    assert audit["attempt"] == 2 and audit["previous_attempt"] == 1 and audit["resumed_step"] == RESUMED, audit
    diff = audit["difference"]
    assert diff["step"] == first and diff["rank"] == 0 and diff["figure"] == figure, audit
    assert diff["now"] == now[figure] and diff["before"] == before[figure], (diff, now, before)

    found = diverged_incidents(run_dir)
    assert len(found) == 1, [(d.name, inc.get("summary")) for d, inc in incidents(run_dir)]
    _, inc = found[0]
    assert inc["attempt"] == 2, inc.get("summary")
    assert inc["resume_audit"]["verdict"] == "diverged" and inc["resume_audit"]["difference"] == diff, inc[
        "resume_audit"
    ]
    summary = inc["summary"]
    assert summary.startswith(f"step {first}") and f"{figure} " in summary and "before the restart" in summary, summary
    assert log_events(run_dir, "resume_diverged"), why

    crash_dir, crash = crash_incident(run_dir)
    assert names_incident(audit["incident"], crash_dir, crash), (audit["incident"], crash_dir.name)
    assert "resume_audit" not in crash  # the audit is linked to the failure's incident, not written into it …
    crash = IncidentStore(run_dir).get(crash["id"])  # … and joined when it is read
    assert crash["resume_audit"]["verdict"] == "diverged", crash.get("resume_audit")
    assert crash["resume_audit"]["difference"] == diff, crash.get("resume_audit")

    # The end summary of `hangwatch run` has the audit's line, naming the step and the figure.
    assert re.search(rf"resume after incident {crash['id']}: step {first}\b.*\b{figure} ", output(r)), why
    return audit, inc


# ---- everything restored: verified ----------------------------------------------------------------------------------


def test_a_resume_that_restores_everything_is_verified_over_the_replayed_steps(tmp_path):
    r, run_dir = run_script(tmp_path, config())
    why = explain(r, run_dir)
    assert r.returncode == 0, why
    assert state(run_dir)["state"] == "finished", why
    assert_resumed_from_the_checkpoint(tmp_path, run_dir)
    assert sorted(step_beats(run_dir, 2)) == list(range(RESUMED + 1, STEPS + 1)), why

    # The replayed steps' beats are the dead attempt's, figure for figure (the script is deterministic).
    for step in range(REPLAYED[0], REPLAYED[1] + 1):
        a, b = step_beats(run_dir, 1)[step], step_beats(run_dir, 2)[step]
        assert (a["loss"], a["lr"]) == (b["loss"], b["lr"]), (step, a, b)

    audit = the_audit(run_dir)
    assert audit["verdict"] == "verified", audit
    assert audit["attempt"] == 2 and audit["previous_attempt"] == 1 and audit["resumed_step"] == RESUMED, audit
    assert audit["replayed"] == REPLAYED and audit["compared"] == REPLAYED, audit
    assert audit["steps_compared"] == REPLAYED[1] - REPLAYED[0] + 1, audit
    assert {"loss", "lr"} <= set(audit["figures"]), audit
    assert audit["rtol"] == 0.01, audit  # rtol: null → 0.01 for a user's command
    assert not audit.get("difference"), audit
    text = audit["text"]
    assert "resume verified" in text, text
    assert re.search(rf"steps {REPLAYED[0]}\s*[–-]\s*{REPLAYED[1]}\b", text), text
    assert "loss" in text and "lr" in text, text

    # No divergence anywhere; the crash incident, read with its findings, has the audit of the restart it caused.
    assert not diverged_incidents(run_dir), [(d.name, inc.get("summary")) for d, inc in incidents(run_dir)]
    assert not log_events(run_dir, "resume_diverged")
    crash_dir, crash = crash_incident(run_dir)
    assert names_incident(audit["incident"], crash_dir, crash), (audit["incident"], crash_dir.name)
    assert "resume_audit" not in crash
    crash = IncidentStore(run_dir).get(crash["id"])
    assert crash["resume_audit"]["verdict"] == "verified", crash.get("resume_audit")
    assert crash["resume_audit"]["replayed"] == REPLAYED, crash.get("resume_audit")

    # The end summary of `hangwatch run` has the audit's line.
    assert re.search(rf"resume after incident {crash['id']}\b.*resume verified", output(r)), why


# ---- the scheduler not restored: lr differs at the first replayed step ----------------------------------------------


def test_a_scheduler_not_restored_is_a_resume_divergence_naming_lr_and_the_run_goes_on(tmp_path):
    r, run_dir = run_script(tmp_path, config(on_divergence="warn"), "--forget-scheduler")
    why = explain(r, run_dir)
    assert r.returncode == 0, why
    assert state(run_dir)["state"] == "finished", why
    assert max(step_beats(run_dir, 2)) == STEPS, why  # warn: training went on to its end

    audit, inc = assert_diverged_at_the_first_replayed_step(tmp_path, r, run_dir, "lr")
    diff = audit["difference"]
    assert abs(diff["now"] - diff["before"]) > 0.1 * diff["before"], diff  # a warmup begun again, far from 1e-6
    # The loss of step 9 was computed from the restored weights before the step: the same, lr alone differs.
    first = RESUMED + 1
    assert step_beats(run_dir, 1)[first]["loss"] == step_beats(run_dir, 2)[first]["loss"]
    assert "schedule" in inc["summary"], inc["summary"]


# ---- the data reshuffled on resume: loss differs, lr equal --------------------------------------------------------


def test_a_data_order_changed_on_resume_is_a_resume_divergence_naming_loss(tmp_path):
    r, run_dir = run_script(tmp_path, config(), "--reshuffle-on-resume")
    why = explain(r, run_dir)
    assert r.returncode == 0, why  # on_divergence defaults to warn
    assert state(run_dir)["state"] == "finished", why

    audit, inc = assert_diverged_at_the_first_replayed_step(tmp_path, r, run_dir, "loss")
    diff = audit["difference"]
    assert abs(diff["now"] - diff["before"]) > 0.1 * abs(diff["before"]), diff  # far beyond rtol 0.01
    first = RESUMED + 1
    assert step_beats(run_dir, 1)[first]["lr"] == step_beats(run_dir, 2)[first]["lr"]  # the schedule was restored
    assert "lr " not in inc["summary"].split("—")[0], inc["summary"]  # only the loss is named as differing


# ---- on_divergence: stop ------------------------------------------------------------------------------------------


def test_on_divergence_stop_ends_the_run_failed_before_the_script_finishes(tmp_path):
    r, run_dir = run_script(tmp_path, config(on_divergence="stop"), "--forget-scheduler")
    why = explain(r, run_dir)
    assert r.returncode == 79, why  # hangwatch ended it: do not retry (a resume that diverged would again)
    st = state(run_dir)
    assert st["state"] == "failed", st
    assert (st.get("last_incident") or {}).get("kind") == "resume_diverged", st.get("last_incident")

    assert_diverged_at_the_first_replayed_step(tmp_path, r, run_dir, "lr")
    assert "diverg" in output(r).lower(), why  # the printed end names why the run failed
    ended = [e for e in log_events(run_dir, "state") if e.get("to") == "failed"]
    assert ended and "diverg" in str(ended[-1].get("why")).lower(), ended  # so does the transition to failed

    # Stopped, not restarted again, and the script never reached its last step.
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001", "0002"], why
    steps = step_beats(run_dir, 2)
    assert len(steps) < STEPS and max(steps) < STEPS, sorted(steps)
    assert "finished at step" not in (run_dir / "attempts" / "0002" / "worker.log").read_text(errors="replace")
