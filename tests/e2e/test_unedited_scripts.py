"""Unedited user scripts under `hangwatch run CONFIG --run-dir DIR -- CMD…`, exactly as a user starts them.

The scripts (tests/fixtures/user_scripts/) import nothing from hangwatch — except uses_callback.py, which proves
a hand-added HangwatchCallback is not doubled — and run the same under plain `python`.  Each fault fires once (a
marker file), so attempt 1 is caught and attempt 2 resumes and finishes.  Everything hangwatch knows comes from
`worker.instrument: auto` (the default: a sitecustomize on PYTHONPATH instruments every Python process of the
worker), from `worker.resume_args`, and, where no instrumentation can enter, from the worker's output.

  * HF Trainer / TRL SFTTrainer: a user eval callback's `generate()` never ends → the `generate` phase budget
    fires within budget + 1 s; the summary names generate() and on_evaluate; the Trainer, called with no resume
    argument, is handed the last good checkpoint-N and restarts at global_step N.
  * plain PyTorch loop: a pure-Python spin in `nsa_select_blocks` → the `step` deadline; attempt 2 gets
    `--resume <path>` through `worker.resume_args`; the final weights equal an uninterrupted bare run's.
  * Lightning: `validation_step` waits for ever → the eval/validation phase budget; fit() resumes.
  * torchrun, 2 ranks: rank 1 blocks in `load_shard` while rank 0 waits in all_reduce → culprit rank 1.
  * a shell script running `python -I` (no instrumentation can enter) whose job spins silently → the
    `output_silence` deadline, no heartbeats; py-spy's stack of the never-announced process names the spin.
  * a healthy job running longer than the startup deadline, `instrument: off`, only printing progress → no incident.
  * a script that adds HangwatchCallback itself → one `step` beat per step.

The watchdog settings are short test values; `restart.backoff_initial_s: 0`.  The worker's environment is an
activated venv (its bin first on PATH), so `python` and `torchrun` are the venv's, as for a user.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.fakes.user_shell import VENV_BIN, incidents, run_hangwatch, user_env, worker_logs

from hangwatch.common.protocol import decode_line

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "fixtures" / "user_scripts"

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GENERATE_BUDGET_S = 6
EVAL_BUDGET_S = 5


# ---- helpers -----------------------------------------------------------------------------------------------------


def config(
    *,
    watchdog: dict | None = None,
    worker: dict | None = None,
    checkpoint: dict | None = None,
    restart: dict | None = None,
) -> dict:
    """A config holding only the keys a user of `-- CMD` writes: no run_dir, no worker.command."""
    cfg = {
        "watchdog": {
            "startup_timeout_s": 120,
            "silence_timeout_s": 60,
            "first_steps_timeout_s": 60,
            "dump_grace_s": 2,
            "term_grace_s": 2,
            "py_spy": False,
            "poll_interval_s": 0.1,
            **(watchdog or {}),
        },
        "restart": {"backoff_initial_s": 0, "max_restarts": 2, **(restart or {})},
    }
    if worker:
        cfg["worker"] = worker
    if checkpoint:
        cfg["checkpoint"] = checkpoint
    return cfg


def explain(r: subprocess.CompletedProcess, run_dir: Path) -> str:
    return f"hangwatch run exited {r.returncode}\n{r.stderr[-4000:]}\n{worker_logs(run_dir)}"


def assert_finished(r: subprocess.CompletedProcess, run_dir: Path) -> None:
    assert r.returncode == 0, explain(r, run_dir)
    assert json.loads((run_dir / "state.json").read_text())["state"] == "finished", explain(r, run_dir)


def the_incident(run_dir: Path) -> tuple[Path, dict]:
    found = incidents(run_dir)
    assert len(found) == 1, [(d.name, inc.get("summary")) for d, inc in found]
    return found[0]


def beats(run_dir: Path, attempt: int, rank: int | None = None) -> list[dict]:
    """Every heartbeat line of an attempt (of one rank, or of all), in file order per rank."""
    out = []
    for p in sorted((run_dir / "attempts" / f"{attempt:04d}").glob("heartbeat-rank*.jsonl")):
        out += [b for b in map(decode_line, p.read_bytes().splitlines()) if b is not None]
    return [b for b in out if rank is None or b["rank"] == rank]


def step_beats(run_dir: Path, attempt: int, rank: int = 0) -> list[int]:
    return [b["step"] for b in beats(run_dir, attempt, rank) if b["event"] == "step"]


def log_events(run_dir: Path, event: str) -> list[dict]:
    lines = (run_dir / "supervisor.log").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def resume_choice(run_dir: Path, attempt: int) -> dict:
    """The supervisor's `resume_from` log record for `attempt`: {"path", "step", …}."""
    chosen = [e for e in log_events(run_dir, "resume_from") if e.get("attempt") == attempt]
    assert chosen, f"no resume_from record for attempt {attempt}"
    return chosen[-1]


def records(tmp_path: Path, name: str = "starts.json") -> list[dict]:
    return json.loads((tmp_path / name).read_text())


def function_of(frame: dict | None) -> str:
    """A frame's bare function name (py-spy qualifies methods: `Class.method`)."""
    return (frame or {}).get("function", "").rsplit(".", 1)[-1]


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return Path(a).resolve() == Path(b).resolve()


@functools.lru_cache(maxsize=None)
def py_spy_attach() -> tuple[bool, str]:
    """Can py-spy dump a child process here (ptrace allowed, a supported Python)?  The doctor's own probe."""
    from hangwatch.daemon.doctor.plan_checks import find_py_spy, probe_py_spy

    exe = find_py_spy(None)
    if exe is None:
        return False, "py-spy not installed"
    return probe_py_spy(exe, timeout_s=15)


# ---- HF Trainer and TRL: an eval callback's generate() that never ends --------------------------------------------


@pytest.mark.parametrize(
    "script, needs",
    [("hf_trainer_eval_generate.py", "transformers"), ("trl_sft.py", "trl")],
    ids=["transformers", "trl"],
)
def test_trainer_eval_generate_hang_is_caught_and_the_trainer_resumes_from_the_last_good_checkpoint(
    tmp_path, script, needs
):
    pytest.importorskip(needs)
    # The kill-and-resume path: a generate that still produces tokens is truncated in process by default (the
    # next test), so this one asks for the restart.
    cfg = config(
        watchdog={
            "phase_budgets_s": {"generate": GENERATE_BUDGET_S, "eval": 60, "checkpoint": 30},
            "generate_overrun": "restart",
        },
        checkpoint={"confirm_steps": 1},
    )
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            "python",
            str(SCRIPTS / script),
            "--output-dir",
            "out",
            "--max-steps",
            "12",
            "--save-steps",
            "4",
            "--eval-steps",
            "10",
            "--hang-once",
            "hang.marker",
            "--record",
            "starts.json",
        ],
    )
    assert_finished(r, run_dir)
    assert (tmp_path / "hang.marker").exists()

    # Caught by the generate budget, within a second of it, and read as generate() called from the user's callback.
    _, inc = the_incident(run_dir)
    where = f"{inc.get('summary')}\n{json.dumps(inc.get('deadline'))}"
    assert inc["attempt"] == 1 and inc["kind"] in ("stall", "livelock") and inc["phase"] == "generate", where
    assert inc["deadline"]["name"] == "phase" and inc["deadline"]["budget_s"] == GENERATE_BUDGET_S, where
    assert inc["deadline"]["elapsed_s"] <= GENERATE_BUDGET_S + 1, where
    callbacks = "hf_callbacks.py"  # the user's eval callback, in their module beside the script
    assert inc["summary"].startswith(f"in generate(), called from on_evaluate ({callbacks}:"), where
    # The user's own frame is the user's callback, never hangwatch's generate() wrapper (an editable install puts
    # hangwatch outside site-packages: its frames must not pass for the user's code).
    assert function_of(inc["user_frame"]) == "on_evaluate" and inc["user_frame"]["file"].endswith(callbacks), inc[
        "user_frame"
    ]
    ev = inc["evidence"]
    assert ev["heartbeats"] is True and ev["instrumentation"] == "auto", ev
    assert 0 in ev["stacks"]["faulthandler"], ev

    # Attempt 1 stepped to the eval at 10: checkpoint-8 was confirmed good; the Trainer, called with no resume
    # argument, was handed it on attempt 2 and restarted at its global_step.
    assert step_beats(run_dir, 1)[:10] == list(range(1, 11)), step_beats(run_dir, 1)
    chosen = resume_choice(run_dir, 2)
    assert chosen["path"] and same_file(chosen["path"], tmp_path / "out" / "checkpoint-8"), chosen
    assert same_file(inc["last_good_checkpoint"], tmp_path / "out" / "checkpoint-8"), inc["last_good_checkpoint"]
    starts = records(tmp_path)
    assert [s["global_step"] for s in starts] == [0, 8], starts
    assert step_beats(run_dir, 2) == list(range(9, 13)), step_beats(run_dir, 2)  # counted on from the resume step
    assert "finished at step 12" in (run_dir / "attempts" / "0002" / "worker.log").read_text(errors="replace")
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001", "0002"]


def test_a_runaway_trainer_eval_generate_is_truncated_in_process_and_training_goes_on(tmp_path):
    pytest.importorskip("transformers")
    cfg = config(watchdog={"phase_budgets_s": {"generate": GENERATE_BUDGET_S, "eval": 60, "checkpoint": 30}})
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            "python",
            str(SCRIPTS / "hf_trainer_eval_generate.py"),
            "--output-dir",
            "out",
            "--max-steps",
            "12",
            "--save-steps",
            "4",
            "--eval-steps",
            "10",
            "--hang-once",
            "hang.marker",
            "--record",
            "starts.json",
        ],
    )
    assert_finished(r, run_dir)
    _, inc = the_incident(run_dir)
    assert inc["kind"] == "generate_truncated" and inc["attempt"] == 1 and inc["step"] == 10, inc
    assert inc["budget_s"] == GENERATE_BUDGET_S and inc["tokens"]["0"] >= inc["limit"] > 8, inc
    # the Trainer's processing class reached the watch: the prompt and the output's end are text, not ids
    assert inc["prompt"] == "question 7: what is 7 plus 7? answer:" and inc["output_tail"], inc
    st = json.loads((run_dir / "state.json").read_text())
    assert st["restarts"] == 0 and st["attempt"] == 1
    assert step_beats(run_dir, 1) == list(range(1, 13))
    assert [s["global_step"] for s in records(tmp_path)] == [0]
    log = (run_dir / "attempts" / "0001" / "worker.log").read_text(errors="replace")
    assert "step 10: sample answer" in log  # generate() returned what it had; the callback went on


# ---- a plain PyTorch loop: a pure-Python spin in the forward --------------------------------------------------------


def test_plain_loop_spin_is_caught_by_the_step_deadline_and_resumes_bitwise_through_resume_args(tmp_path):
    torch = pytest.importorskip("torch")
    script = SCRIPTS / "plain_loop.py"
    common = ["--steps", "12", "--save-every", "2"]
    # The reference: the same script, uninterrupted, with no hangwatch anywhere.
    bare_env = {k: v for k, v in user_env().items() if k != "PYTHONPATH"}
    ref = subprocess.run(
        [sys.executable, str(script), *common, "--ckpt-dir", "ref-ckpts", "--out", "ref.pt"],
        cwd=tmp_path,
        env=bare_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    cfg = config(
        watchdog={"step_timeout_s": 5},
        worker={"resume_args": ["--resume", "{checkpoint}"]},
        checkpoint={"confirm_steps": 1},
    )
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            "python",
            str(script),
            *common,
            "--ckpt-dir",
            "ckpts",
            "--out",
            "final.pt",
            "--spin-once",
            "spin.marker",
            "--spin-at",
            "8",
            "--record",
            "starts.json",
        ],
    )
    assert_finished(r, run_dir)

    _, inc = the_incident(run_dir)
    where = f"{inc.get('summary')}\n{json.dumps(inc.get('deadline'))}\n{inc.get('stuck_frame')}"
    assert inc["attempt"] == 1 and inc["deadline"]["name"] == "step", where
    assert function_of(inc["stuck_frame"]) == "nsa_select_blocks", where
    assert "nsa_select_blocks" in inc["summary"], where
    assert inc["evidence"]["heartbeats"] is True, inc["evidence"]

    # step-6.pt was confirmed by step 7; attempt 2 was started with `--resume <step-6.pt>` appended.
    chosen = resume_choice(run_dir, 2)
    assert chosen["path"] and same_file(chosen["path"], tmp_path / "ckpts" / "step-6.pt"), chosen
    starts = records(tmp_path)
    assert [(s["start_step"], s["resume"] is None) for s in starts] == [(0, True), (6, False)], starts
    assert same_file(starts[1]["resume"], tmp_path / "ckpts" / "step-6.pt"), starts
    assert step_beats(run_dir, 2) == list(range(7, 13)), step_beats(run_dir, 2)

    # Interrupted + resumed ends bitwise where the uninterrupted run ends.
    got, want = torch.load(tmp_path / "final.pt"), torch.load(tmp_path / "ref.pt")
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


def test_a_plain_loop_that_ignores_the_resume_point_is_labelled_with_its_own_steps_and_told_so(tmp_path):
    """No `worker.resume_args`: attempt 2 is handed step-4.pt (HANGWATCH_RESUME_FROM) and reads none of it, so it
    trains from its step 1 again.  Its beats and checkpoints carry its own steps (not 4 + n), the goodput ledger
    counts what it does again as redone, the resume audit blames no figure, and an incident says what to change."""
    script = SCRIPTS / "plain_loop.py"
    cfg = config(watchdog={"step_timeout_s": 5}, checkpoint={"confirm_steps": 1})
    cmd = ["python", str(script), "--steps", "10", "--save-every", "4", "--ckpt-dir", "ckpts", "--out", "final.pt"]
    r, run_dir = run_hangwatch(tmp_path, cfg, [*cmd, "--spin-once", "spin.marker", "--spin-at", "6"])
    assert_finished(r, run_dir)

    assert resume_choice(run_dir, 2)["step"] == 4  # it was handed step-4.pt …
    assert step_beats(run_dir, 2) == list(range(1, 11)), step_beats(run_dir, 2)  # … and its steps are its own
    found = {inc["kind"]: inc for _, inc in incidents(run_dir)}
    assert set(found) == {"stall", "resume_ignored"}, [(k, i.get("summary")) for k, i in found.items()]
    ignored = found["resume_ignored"]
    assert ignored["attempt"] == 2 and ignored["resume_step"] == 4, ignored
    assert "did not resume from the checkpoint it was given" in ignored["summary"], ignored["summary"]
    assert "worker.resume_args" in ignored["summary"] and "HANGWATCH_RESUME_FROM" in ignored["summary"]
    # each checkpoint is on record at the step in its own name
    ledger = json.loads((run_dir / "checkpoints.json").read_text())["checkpoints"]
    named = {Path(e["path"]).name: e["step"] for e in ledger}
    assert named == {"step-4.pt": 4, "step-8.pt": 8, "final.pt": 10}, named  # step-8.pt: not 4 + 8
    audits = json.loads((run_dir / "resume-audit.json").read_text())["audits"]
    assert [a["verdict"] for a in audits] == ["not_resumed"], audits
    goodput = json.loads((run_dir / "goodput.json").read_text())
    assert goodput["categories"]["redone"] > 0, goodput["categories"]


# ---- Lightning: validation_step waits for ever --------------------------------------------------------------------


def test_lightning_validation_step_hang_is_caught_and_fit_resumes(tmp_path):
    pytest.importorskip("lightning")
    cfg = config(
        watchdog={"phase_budgets_s": {"eval": EVAL_BUDGET_S, "validation": EVAL_BUDGET_S}},
        checkpoint={"confirm_steps": 1},
    )
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            "python",
            str(SCRIPTS / "lightning_val_hang.py"),
            "--out",
            "out",
            "--max-steps",
            "10",
            "--ckpt-every",
            "2",
            "--val-every",
            "4",
            "--hang-once",
            "hang.marker",
            "--record",
            "starts.json",
        ],
    )
    assert_finished(r, run_dir)

    # The stall, then the resume audit's finding: Lightning restarts an epoch it resumes in the middle of (its
    # DataLoader is not resumable, as it warns), so the replayed step 3 trains on another batch than before.
    found = incidents(run_dir)
    assert [i["kind"] for _, i in found] == ["stall", "resume_diverged"], [(d.name, i["summary"]) for d, i in found]
    diverged = found[1][1]["resume_audit"]
    assert diverged["difference"]["step"] == 3 and diverged["difference"]["figure"] == "loss", diverged
    inc = found[0][1]
    where = "\n".join(str(inc.get(k)) for k in ("summary", "deadline", "stuck_frame", "user_frame"))
    assert inc["attempt"] == 1 and inc["phase"] in ("eval", "validation"), where
    assert inc["deadline"]["name"] == "phase" and inc["deadline"]["budget_s"] == EVAL_BUDGET_S, where
    assert "validation_step" in (function_of(inc["stuck_frame"]), function_of(inc.get("user_frame"))), where
    assert "validation_step" in inc["summary"], where

    # The validation after step 4 hung; step 2's checkpoint (confirmed by step 3) is the last good one — step 4's,
    # written just before the validation, was never followed by a step.  fit() got it as its ckpt_path.
    chosen = resume_choice(run_dir, 2)
    assert chosen["path"] and same_file(chosen["path"], tmp_path / "out" / "checkpoints" / "step-0002.ckpt"), chosen
    starts = records(tmp_path)
    assert [s["global_step"] for s in starts] == [0, 2], starts
    assert starts[0]["ckpt_path"] is None and same_file(starts[1]["ckpt_path"], chosen["path"]), starts
    assert step_beats(run_dir, 2) == list(range(3, 11)), step_beats(run_dir, 2)


# ---- torchrun, 2 ranks: rank 1 blocks before a collective, rank 0 waits in it ---------------------------------------


def test_torchrun_rank_blocked_before_a_collective_is_named_the_culprit_and_the_run_resumes(tmp_path):
    torchrun = "torchrun" if (VENV_BIN / "torchrun").exists() else None
    launcher = [torchrun] if torchrun else ["python", "-m", "torch.distributed.run"]
    cfg = config(
        watchdog={"step_timeout_s": 8, "startup_timeout_s": 180},
        worker={"resume_args": ["--resume", "{checkpoint}"]},
        checkpoint={"confirm_steps": 1},
    )
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            *launcher,
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "ddp_block.py"),
            "--steps",
            "10",
            "--save-every",
            "2",
            "--ckpt-dir",
            "ckpts",
            "--block-once",
            "block.marker",
            "--block-at",
            "5",
            "--block-rank",
            "1",
            "--record",
            "starts.json",
        ],
        timeout=300,
    )
    assert_finished(r, run_dir)

    _, inc = the_incident(run_dir)
    ranks = {f["rank"]: f for f in inc.get("ranks") or []}
    where = f"{inc.get('summary')}\n{json.dumps(inc.get('deadline'))}\n{json.dumps(ranks, default=str)[:3000]}"
    assert inc["attempt"] == 1 and inc["kind"] == "stall" and inc["deadline"]["name"] == "step", where
    assert inc["culprit_rank"] == 1 and sorted(ranks) == [0, 1], where
    assert ranks[1]["role"] == "culprit" and function_of(ranks[1]["stuck_frame"]) == "load_shard", where
    assert ranks[0]["role"] == "victim" and "all_reduce" in (ranks[0]["collective"] or ""), where
    assert function_of(inc["stuck_frame"]) == "load_shard" and "load_shard" in inc["summary"], where
    assert sorted(inc["evidence"]["stacks"]["faulthandler"]) == [0, 1], inc["evidence"]

    # Rank 0 checkpointed every 2 steps.  Step 4's was never followed by a step (rank 1 blocked in step 5), so
    # step 2's (confirmed by step 3) is the last good one; attempt 2 resumed there on both ranks through
    # worker.resume_args.
    chosen = resume_choice(run_dir, 2)
    assert chosen["path"] and same_file(chosen["path"], tmp_path / "ckpts" / "step-2.pt"), chosen
    starts = records(tmp_path)
    assert [s["start_step"] for s in starts] == [0, 2] and same_file(starts[1]["resume"], chosen["path"]), starts
    assert step_beats(run_dir, 2, rank=0)[-1] == 10 and step_beats(run_dir, 2, rank=1)[-1] == 10


# ---- a shell script whose inner `python -I` job goes silent: output is all there is -------------------------------


@pytest.fixture(scope="module")
def shell_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("shell")
    can_spy, _ = py_spy_attach()
    cfg = config(
        watchdog={"output_silence_timeout_s": 3, "startup_timeout_s": 60, "py_spy": can_spy, "py_spy_timeout_s": 15}
    )
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            "sh",
            str(SCRIPTS / "inner.sh"),
            "--steps",
            "20",
            "--step-s",
            "0.2",
            "--spin-once",
            "spin.marker",
            "--spin-at",
            "8",
        ],
        timeout=180,
    )
    return tmp_path, r, run_dir


def test_shell_script_job_that_goes_silent_is_caught_by_output_silence(shell_run):
    tmp_path, r, run_dir = shell_run
    assert_finished(r, run_dir)
    _, inc = the_incident(run_dir)
    where = f"{inc.get('summary')}\n{json.dumps(inc.get('deadline'))}\n{json.dumps(inc.get('evidence'))}"
    assert inc["attempt"] == 1 and inc["deadline"]["name"] == "output_silence", where
    ev = inc["evidence"]
    assert ev["heartbeats"] is False and ev["instrumentation"] == "auto", where
    assert "step 7/20" in json.dumps(ev["output"]), where  # the last line it printed before going silent
    assert not beats(run_dir, 1), "python -I: no instrumentation can have entered the job"
    assert "job finished" in (run_dir / "attempts" / "0002" / "worker.log").read_text(errors="replace")


def test_shell_script_silent_job_py_spy_dump_names_the_spinning_function(shell_run):
    can_spy, why = py_spy_attach()
    if not can_spy:
        pytest.skip(f"py-spy cannot dump a process here: {why}")
    tmp_path, r, run_dir = shell_run
    assert r.returncode == 0, explain(r, run_dir)
    d, inc = the_incident(run_dir)
    dumps = sorted(d.glob("py-spy-pid*.txt"))
    assert dumps, sorted(p.name for p in d.iterdir())
    assert any("wait_for_lease" in p.read_text(errors="replace") for p in dumps), [p.read_text()[:2000] for p in dumps]
    assert inc["evidence"]["stacks"]["py_spy"], inc["evidence"]
    assert function_of(inc["stuck_frame"]) == "wait_for_lease" and "wait_for_lease" in inc["summary"], inc["summary"]


# ---- a healthy job, longer than the startup deadline, uninstrumented ----------------------------------------------


def test_healthy_job_printing_progress_outlives_the_startup_deadline_without_an_incident(tmp_path):
    startup_s = 3
    cfg = config(watchdog={"startup_timeout_s": startup_s, "output_silence_timeout_s": 5}, worker={"instrument": "off"})
    began = time.monotonic()
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        ["python", str(SCRIPTS / "healthy_long.py"), "--steps", "16", "--step-s", "0.5", "--load-s", "1"],
        timeout=120,
    )
    took = time.monotonic() - began
    assert_finished(r, run_dir)
    assert took > 2 * startup_s, f"the job must outlive the startup deadline: {took:.1f}s"
    assert incidents(run_dir) == []
    assert sorted(p.name for p in (run_dir / "attempts").iterdir()) == ["0001"]
    assert not beats(run_dir, 1), "instrument: off: no heartbeats"
    assert "finished 16 steps" in (run_dir / "attempts" / "0001" / "worker.log").read_text(errors="replace")


# ---- a script that already adds HangwatchCallback itself -----------------------------------------------------------


def test_script_with_its_own_hangwatch_callback_beats_each_step_once(tmp_path):
    pytest.importorskip("transformers")
    r, run_dir = run_hangwatch(
        tmp_path,
        config(),
        ["python", str(SCRIPTS / "uses_callback.py"), "--output-dir", "out", "--max-steps", "8", "--save-steps", "4"],
    )
    assert_finished(r, run_dir)
    assert incidents(run_dir) == []
    steps = step_beats(run_dir, 1)
    dupes = {s: n for s, n in collections.Counter(steps).items() if n > 1}
    assert not dupes, f"duplicate step beats: {dupes} in {steps}"
    assert steps == list(range(1, 9)), steps


# ---- torchrun, 2 ranks: a synced eval generate() that never stops is ended at the same token on both ------------


def test_a_runaway_synced_generate_on_two_ranks_is_ended_at_the_same_token_without_a_restart(tmp_path):
    torchrun = "torchrun" if (VENV_BIN / "torchrun").exists() else None
    launcher = [torchrun] if torchrun else ["python", "-m", "torch.distributed.run"]
    cfg = config(watchdog={"startup_timeout_s": 180, "phase_budgets_s": {"generate": 5}})
    r, run_dir = run_hangwatch(
        tmp_path,
        cfg,
        [
            *launcher,
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "ddp_runaway_generate.py"),
            "--steps",
            "8",
            "--eval-at",
            "4",
        ],
        timeout=300,
    )
    assert_finished(r, run_dir)
    _, inc = the_incident(run_dir)
    assert inc["kind"] == "generate_truncated" and inc["ranks"] == [0, 1], inc
    assert inc["tokens"] == {"0": inc["limit"], "1": inc["limit"]}, inc  # the same token on both ranks
    log = worker_logs(run_dir)
    assert f"rank 0 generated {inc['limit']} tokens" in log and f"rank 1 generated {inc['limit']} tokens" in log, log
    assert "done" in log
    st = json.loads((run_dir / "state.json").read_text())
    assert st["restarts"] == 0 and st["attempt"] == 1
    assert step_beats(run_dir, 1, rank=0) == list(range(1, 9)) and step_beats(run_dir, 1, rank=1) == list(range(1, 9))
