"""`hangwatch run -- CMD`, supervisor side, on fakes: the command line and its run dir, resume arguments, the
instrumentation environment, the output as evidence (tail, deadlines), bad checkpoints set aside, the tree's
unannounced Python processes, NVML per process, the interpreter probe's reading of scripts."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hangwatch.common.config import ConfigError, RestartCfg, WatchdogCfg, load_checked, parse_config, script_name
from hangwatch.common.config.schema import DEFAULT_PROGRESS_PATTERN
from hangwatch.common.exitcodes import EX_USAGE
from hangwatch.common.instrumentation import BOOT_DIR, ENV_INSTRUMENT, ENV_RESUME_STEP, instrument_env
from hangwatch.supervisor.cli.main import main
from hangwatch.supervisor.escalation.episode import gpu_processes, unannounced_pythons
from hangwatch.supervisor.processes import attempt as attempts
from hangwatch.supervisor.processes.interpreter import instrument_note, python_of, shebang_python
from hangwatch.supervisor.processes.process import ProcRef
from hangwatch.supervisor.records.checkpoint_ledger import BAD, GOOD, CheckpointLedger, Entry, set_aside_bad
from hangwatch.supervisor.rules.policy import RestartPolicy
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines
from hangwatch.supervisor.watch.output_tail import READ_CHUNK, OutputTail

# ---- the command line -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, name",
    [
        (["python", "train.py", "--lr", "1e-4"], "train"),
        (["python", "-m", "pkg.train"], "pkg.train"),
        (["torchrun", "--nproc-per-node", "2", "train.py"], "train"),
        (["accelerate", "launch", "--num_processes", "2", "sft.py"], "sft"),
        (["bash", "run.sh"], "run"),
        (["trl", "sft", "--model_name_or_path", "m"], "trl-sft"),
        (["./train"], "train"),
        (["python3", "-u", "/abs/dir/fit.py"], "fit"),
    ],
)
def test_a_command_names_its_run_dir_after_its_script(argv, name):
    assert script_name(argv) == name


def test_no_config_means_defaults_the_command_and_runs_slash_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    cfg, _ = load_checked(None, command=["python", "train.py"])
    assert cfg.worker.command == ["python", "train.py"] and cfg.worker.instrument == "auto"
    assert Path(cfg.run_dir) == tmp_path / "runs" / "train" and cfg.worker.cwd == str(tmp_path)
    cfg, _ = load_checked(None, run_dir=str(tmp_path / "elsewhere"), command=["python", "train.py"])
    assert Path(cfg.run_dir) == tmp_path / "elsewhere"


def test_a_config_with_a_command_keeps_its_settings_and_its_own_run_dir(tmp_path):
    (tmp_path / "new.py").write_text("print('hi')\n")  # the script must be there (relative to the config's directory)
    (tmp_path / "a.yaml").write_text(
        "watchdog: {step_timeout_s: 7}\nworker: {command: [old], resume_args: [--resume, '{checkpoint}']}\n"
    )
    cfg, _ = load_checked(tmp_path / "a.yaml", command=["python", "new.py"])
    assert cfg.worker.command == ["python", "new.py"] and cfg.watchdog.step_timeout_s == 7
    assert Path(cfg.run_dir) == tmp_path / "runs" / "new"
    (tmp_path / "b.yaml").write_text("run_dir: mine\n")
    cfg, _ = load_checked(tmp_path / "b.yaml", command=["python", "new.py"])
    assert Path(cfg.run_dir) == tmp_path / "mine"


def test_bad_new_keys_are_named():
    with pytest.raises(ConfigError) as err:
        parse_config("worker: {command: [x], instrument: maybe}\nwatchdog: {progress_pattern: '(unclosed'}\n")
    text = "\n".join(err.value.problems)
    assert "worker.instrument" in text and "watchdog.progress_pattern" in text and "not a regular expression" in text
    with pytest.raises(ConfigError, match="worker.resume_args.*only {checkpoint} and {step}"):
        parse_config("worker: {command: [x], resume_args: ['{path}']}\n")
    with pytest.raises(ConfigError, match="worker.resume_args.*null"):
        parse_config("data: {train: t.jsonl}\nworker: {resume_args: [--resume]}\n")


def test_run_without_config_or_command_is_a_usage_error():
    r = CliRunner().invoke(main, ["run"])
    assert r.exit_code == EX_USAGE and "after `--`" in r.output
    r = CliRunner().invoke(main, ["run", "--"])
    assert r.exit_code == EX_USAGE and "nothing after" in r.output


# ---- argv and environment of an attempt -------------------------------------------------------------------


def test_resume_args_follow_the_command_only_when_there_is_a_checkpoint(tmp_path):
    cfg = parse_config(
        "worker: {command: [python, t.py, --x], resume_args: [--resume, '{checkpoint}', --at, '{step}']}\n"
    )
    assert attempts.worker_argv(cfg, tmp_path / "c.yaml")[1:] == ["t.py", "--x"]
    argv = attempts.worker_argv(cfg, tmp_path / "c.yaml", resume_from="/ck/step-20.pt", resume_step=20)
    assert argv[0] == sys.executable and argv[1:] == ["t.py", "--x", "--resume", "/ck/step-20.pt", "--at", "20"]


def test_the_bootstrap_comes_first_on_pythonpath_once_and_only_for_auto(tmp_path):
    env = instrument_env({"PYTHONPATH": f"/mine{os.pathsep}{BOOT_DIR}"}, resume_step=12)
    assert (
        env["PYTHONPATH"] == f"{BOOT_DIR}{os.pathsep}/mine"
        and env[ENV_INSTRUMENT] == "auto"
        and env[ENV_RESUME_STEP] == "12"
    )
    cfg = parse_config("worker: {command: [python, t.py]}\n")
    e = attempts.worker_env(cfg, 1, environ={"PATH": "/bin"}, resume_from="/ck", resume_step=4)
    assert e["PYTHONPATH"] == str(BOOT_DIR) and e[ENV_RESUME_STEP] == "4"
    assert attempts.worker_env(cfg, 1, environ={})[ENV_RESUME_STEP] == ""  # nothing to resume: count from 0
    off = parse_config("worker: {command: [python, t.py], instrument: 'off'}\n")
    assert ENV_INSTRUMENT not in attempts.worker_env(off, 1, environ={})
    builtin = parse_config("data: {train: t.jsonl}\n")
    assert ENV_INSTRUMENT not in attempts.worker_env(builtin, 1, environ={})  # the built-in worker beats by itself


def test_a_command_that_exits_0_without_a_stop_line_has_finished():
    policy = RestartPolicy(RestartCfg())
    assert policy.on_exit(0.0, 0, None, own_command=True).action == "finish"
    assert policy.on_exit(0.0, 0, None).action == "restart"  # the built-in worker always says why it stops
    assert policy.on_exit(0.0, 1, None, own_command=True).action == "restart"


# ---- the output as evidence ---------------------------------------------------------------------------------


def test_output_tail_reads_lines_progress_steps_and_tqdm_redraws(tmp_path):
    log = tmp_path / "worker.log"
    tail = OutputTail(log, DEFAULT_PROGRESS_PATTERN)
    assert tail.read(1.0) == (False, False)  # no file yet
    log.write_bytes(b"loading\n")
    assert tail.read(2.0) == (True, False) and tail.last_line == "loading" and tail.last_output_at == 2.0
    with open(log, "ab") as f:
        f.write(b"step 3 loss 0.5\n 40%|####  | 4/10 [00:01<00:02]\r 50%|#####  | 5/10 [00:01<00:01]\rhalf a li")
    assert tail.read(3.0) == (True, True)
    assert tail.step == 3 and tail.progress_lines == 3 and tail.last_progress_line.startswith(" 50%".strip())
    assert tail.partial == b"half a li"  # waits for its end
    assert tail.read(4.0) == (False, False) and tail.last_output_at == 3.0
    with open(log, "ab") as f:
        f.write(b"ne\n")
    assert tail.read(5.0) == (True, False) and tail.last_line == "half a line"


def test_output_tail_dates_growth_by_the_files_mtime_and_skips_a_flood(tmp_path):
    log = tmp_path / "worker.log"
    log.write_bytes(b"x" * (READ_CHUNK + 100) + b"\nstep 9\n")
    os.utime(log, (1000.0, 1000.0))
    tail = OutputTail(log, DEFAULT_PROGRESS_PATTERN)
    grew, progressed = tail.read(50.0, wall_now=1004.0)
    assert grew and progressed and tail.last_output_at == pytest.approx(46.0) and tail.skipped_bytes == 108
    assert tail.step == 9 and tail.evidence(50.0)["skipped_bytes"] == 108
    log.write_bytes(b"")  # truncated: read again from the start
    with open(log, "ab") as f:
        f.write(b"step 1\n")
    assert tail.read(60.0) == (True, True)


def deadlines(**kw) -> Deadlines:
    wd = WatchdogCfg(startup_timeout_s=30, output_silence_timeout_s=20, silence_timeout_s=5, **kw)
    return Deadlines(wd, Calibration(wd))


def test_output_silence_counts_from_spawn_then_from_the_last_output_and_stops_once_a_rank_beats():
    d = deadlines()
    d.arm_startup(0.0)
    assert d.check(19.9) is None and d.check(20.0).name == "output_silence"
    d.output_seen(15.0, progress=False)
    assert d.next_due_s(15.0) == pytest.approx(15.0)  # startup (at 30) falls before output silence (15 + 20)
    assert d.check(29.9) is None and d.check(30.0).name == "startup"  # output alone is not progress
    d.output_seen(29.0, progress=True)
    assert d.check(30.0) is None and d.check(49.0).name == "output_silence"
    d.observe({"v": 1, "t": 0, "pid": 1, "rank": 0, "attempt": 1, "event": "start", "step": 0, "phase": "load"}, 40.0)
    assert all(e["name"] != "output_silence" for e in d.active(41.0))


def test_progress_in_the_output_keeps_a_load_phase_alive():
    d = deadlines()
    d.arm_startup(0.0)
    d.observe({"v": 1, "t": 0, "pid": 1, "rank": 0, "attempt": 1, "event": "start", "step": 0, "phase": "load"}, 1.0)
    assert d.check(31.0).name == "phase"  # load's budget: startup_timeout_s
    d.output_seen(25.0, progress=True)
    assert d.check(31.0) is None and d.check(55.0).name == "phase"
    d.shift(10.0)
    assert d.check(55.0) is None


# ---- checkpoints, processes, GPUs -----------------------------------------------------------------------------


def entry(path, status, step, seq):
    return Entry(path=str(path), step=step, status=status, attempt=1, rank=0, seq=seq, why="loss nan at step 9")


def test_bad_checkpoints_are_renamed_aside_never_deleted(tmp_path):
    bad, good, gone = tmp_path / "checkpoint-8", tmp_path / "checkpoint-4", tmp_path / "checkpoint-12"
    bad.mkdir()
    (bad / "model.pt").write_text("w")
    good.mkdir()
    (tmp_path / "checkpoint-8.hangwatch-bad").mkdir()  # an earlier one of that name: not overwritten
    book = CheckpointLedger(2, [entry(good, GOOD, 4, 1), entry(bad, BAD, 8, 2), entry(gone, BAD, 12, 3)])
    moved = set_aside_bad(book, None)
    assert [(e.step, dst) for e, dst in moved] == [(8, f"{bad}.hangwatch-bad.2")]
    assert not bad.exists() and (Path(f"{bad}.hangwatch-bad.2") / "model.pt").read_text() == "w" and good.is_dir()
    assert book.entries[str(bad)].set_aside == f"{bad}.hangwatch-bad.2"
    assert set_aside_bad(book, None) == []  # once
    assert CheckpointLedger.from_dict(book.to_dict(), 2).entries[str(bad)].set_aside.endswith(".2")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    other = tmp_path / "step-3.pt"
    other.write_text("w")
    book = CheckpointLedger(2, [entry(other, BAD, 3, 1)])
    assert set_aside_bad(book, None, rename=refuse) == [] and other.exists()


class Table:
    """A process table: pid → (name, cmdline, children)."""

    def __init__(self, procs):
        self.procs = procs

    def descendants(self, pid):
        out = []
        for child in self.procs.get(pid, ("", [], []))[2]:
            out += [ProcRef(child, 1.0), *self.descendants(child)]
        return out

    def describe(self, ref):
        name, cmdline, _ = self.procs[ref.pid]
        return {"pid": ref.pid, "name": name, "cmdline": cmdline}


class Announced:
    def __init__(self, pid):
        self.ref = ProcRef(pid, 1.0)


class FakeAttempt:
    def __init__(self, worker_pid, announced=()):
        self.worker = type("W", (), {"pid": worker_pid, "exited": False, "ref": ProcRef(worker_pid, 1.0)})()
        self.announced = {i: Announced(p) for i, p in enumerate(announced)}

    def announced_refs(self):
        return {r: a.ref for r, a in self.announced.items()}


def test_the_trees_unannounced_python_processes_are_found_not_a_ranks_loader_workers():
    table = Table(
        {
            10: ("bash", ["/bin/bash", "run.sh"], [11]),
            11: ("python3.11", ["python3", "job.py"], [12, 13]),
            12: ("pt_data_worker", ["/usr/bin/python3", "job.py"], []),
            13: ("sleep", ["sleep", "9"], []),
        }
    )
    assert [r.pid for r in unannounced_pythons(table, FakeAttempt(10))] == [11, 12]
    assert [r.pid for r in unannounced_pythons(table, FakeAttempt(10, announced=[11]))] == []


def test_gpu_processes_are_the_trees_own():
    gpu = {
        "available": True,
        "devices": [
            {
                "index": 0,
                "utilization_percent": 46,
                "processes": [
                    {"pid": 11, "used_memory_bytes": 5 << 30, "sm_util_percent": 3},
                    {"pid": 99, "used_memory_bytes": 1},
                ],
            }
        ],
    }
    assert gpu_processes(gpu, {11, 12}) == [
        {"pid": 11, "device": 0, "used_memory_bytes": 5 << 30, "sm_util_percent": 3, "device_utilization_percent": 46}
    ]
    assert gpu_processes({"available": False, "reason": "no GPU"}, {11}) == []


# ---- which Python a command runs ----------------------------------------------------------------------------


def script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_interpreter_of_a_command_is_read_from_python_or_a_shebang(tmp_path):
    env = {"PATH": str(tmp_path)}
    script(tmp_path / "torchrun", f"#!{sys.executable}\nimport sys\n")
    script(tmp_path / "envpy", "#!/usr/bin/env -S python3 -u\n")
    script(tmp_path / "run.sh", "#!/bin/bash\nexec python3 job.py\n")
    assert shebang_python(tmp_path / "envpy") == "python3" and shebang_python(tmp_path / "run.sh") is None
    assert python_of(["torchrun", "--nproc-per-node", "2", "t.py"], str(tmp_path), env) == sys.executable
    assert python_of(["python", "t.py"], None, env) == sys.executable
    assert python_of(["./run.sh"], str(tmp_path), env) is None
    assert "auto:" in instrument_note(["python", "t.py"], "auto", None, env)
    assert "not a Python" in instrument_note(["./run.sh"], "auto", str(tmp_path), env)
    assert instrument_note(["python", "t.py"], "off", None, env).startswith("off")
    old = script(tmp_path / "python2.7", "#!/bin/sh\necho 2 7\n")
    assert "too old" in instrument_note([str(old), "t.py"], "auto", None, env)


class GoneTable:
    def __init__(self, gone=()):
        self.gone = set(gone)

    def ref_of(self, pid):
        return ProcRef(pid, 1.0)

    def is_gone(self, ref):
        return ref.pid in self.gone


def start_line(pid, rank=0):
    return {"event": "start", "rank": rank, "pid": pid, "dump_path": f"/d/stack-{pid}.txt", "dump_signal": "SIGUSR1"}


def test_a_rank_goes_back_to_its_older_process_once_the_newer_one_is_gone(tmp_path):
    a = attempts.Attempt(1, tmp_path, worker=None, tail=None)
    table = GoneTable()
    a.announce(start_line(10), table)  # the wrapper
    a.announce(start_line(11), table)  # a child that took the rank over
    step_from_10 = {"event": "step", "rank": 0, "pid": 10}
    assert a.follow(step_from_10, table) is None and a.announced[0].ref.pid == 11  # 11 lives: it stays the rank
    table.gone.add(11)
    assert a.follow({"event": "step", "rank": 0, "pid": 99}, table) is None  # never announced: not followed
    back = a.follow(step_from_10, table)
    assert back.ref.pid == 10 and str(back.dump_path) == "/d/stack-10.txt" and a.announced[0].ref.pid == 10
