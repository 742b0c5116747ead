"""The `hangwatch` CLI against a fake supervisor (a real control socket, a recording handler), and
`validate-config` / `run` on bad configs.  The real supervisor is driven in test_ops_e2e.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner
from fixtures.fakes.polled_server import PolledServer

from hangwatch.common.config import reference_text
from hangwatch.supervisor.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def hangwatch_argv() -> list[str]:
    """The installed console script when there is one, else the same entry point through -m."""
    script = Path(sys.executable).parent / "hangwatch"
    return [str(script)] if script.exists() else [sys.executable, "-m", "hangwatch.supervisor.cli.main"]


def hangwatch(*args, timeout=60, cwd=REPO, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HANGWATCH_RUN_DIR", None)
    env.pop("HANGWATCH_SOCKET", None)
    return subprocess.run(
        [*hangwatch_argv(), *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, **kw
    )


STATUS = {
    "state": "running",
    "attempt": 3,
    "pid": 4242,
    "pids": {"0": 4242, "1": 4243},
    "phase": "eval",
    "phase_age_s": 42.0,
    "phase_budget_s": 900,
    "step": 40,
    "max_steps": 100,
    "loss": 1.2345,
    "tokens_per_s": 2345.6,
    "lr": 1.5e-4,
    "last_beat_age_s": 0.7,
    "last_good_checkpoint": "/runs/x/checkpoints/step-00000030",
    "restarts": 2,
    "incidents": 2,
    "last_incident": {
        "id": "0002",
        "kind": "stall",
        "summary": "eval generate() stuck: busy loop in Python (CPU 100%)",
    },
    "deadlines": [{"name": "phase", "rank": 0, "budget_s": 900, "remaining_s": 858}],
    "gpu": {
        "available": True,
        "devices": [
            {
                "index": 0,
                "name": "NVIDIA H100",
                "utilization_percent": 46,
                "memory_used_bytes": 30 * 2**30,
                "memory_total_bytes": 80 * 2**30,
            }
        ],
    },
    "run_dir": "/runs/x",
    "supervisor_pid": 4000,
    "uptime_s": 7300,
    "torn_lines": 1,
    "queue": {"waiting": 2, "rejected": 1, "done": 5, "current_file": "batch-7.jsonl", "current_progress": 0.5},
}


class FakeSupervisor(PolledServer):
    def handler(self, req):
        self.requests.append(req)
        cmd = req["cmd"]
        if cmd == "status":
            return {"ok": True, "result": STATUS}
        if cmd == "restart":
            return {"ok": True, "result": {"accepted": "restart", "mode": req.get("mode"), "attempt": 3}}
        if cmd in ("stop", "pause"):
            return {"ok": True, "result": {"accepted": cmd, "state": "running"}}
        if cmd == "resume":
            return {"ok": False, "error": "not paused (state running)"}
        if cmd == "dump":
            return {
                "ok": True,
                "result": {
                    "dumps": {
                        "1": 'Thread 0x2 (most recent call first):\n  File "b.py", line 2 in g\n',
                        "0": 'Thread 0x1 (most recent call first):\n  File "a.py", line 9 in f\n',
                    }
                },
            }
        if cmd == "incidents":
            if "id" in req:
                return {
                    "ok": True,
                    "result": {
                        "id": req["id"],
                        "kind": "stall",
                        "attempt": 2,
                        "step": 20,
                        "classification": "busy loop in Python (CPU 100%)",
                        "stuck_frame": {"file": "model.py", "line": 88, "func": "forward"},
                    },
                }
            return {
                "ok": True,
                "result": [
                    {
                        "id": "0001",
                        "kind": "crash",
                        "time": "2026-01-01T03:00:00",
                        "attempt": 1,
                        "step": 12,
                        "summary": "RuntimeError: boom",
                    },
                    {
                        "id": "0002",
                        "kind": "stall",
                        "time": "2026-01-01T04:00:00",
                        "attempt": 2,
                        "step": 20,
                        "summary": None,
                        "classification": "busy loop in Python (CPU 100%)",
                    },
                ],
            }
        return {"ok": False, "error": f"unknown command {cmd!r}"}


@pytest.fixture
def fake(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with structlog.testing.capture_logs() as logged:  # the server's log lines, kept out of the CLI's stdout
        f = FakeSupervisor(run_dir / "hangwatch.sock", run_dir=run_dir)
        f.run_dir = run_dir
        f.logged = logged
        yield f
        f.close()


def cli(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env or {}, catch_exceptions=False)


def test_status_shows_the_run(fake):
    r = cli("status", "--run-dir", fake.run_dir)
    assert r.exit_code == 0, r.output
    out = r.output
    for expected in [
        "running",
        "attempt 3",
        "supervisor pid 4000",
        "up 2h01m",
        "pid 4242",
        "rank 0: 4242, rank 1: 4243",
        "eval",
        "for 42s of 15m00s budget",
        "40 / 100",
        "40%",
        "█",
        "loss 1.234",
        "lr 0.00015",
        "2345.6 tokens/s",
        "0.7s ago",
        "1 torn/invalid lines skipped",
        "/runs/x/checkpoints/step-00000030 (last good)",
        "restarts    2",
        "last: 0002 stall — eval generate() stuck",
        "phase 14m18s left of 15m00s",
        "GPU0  NVIDIA H100  util 46%  mem 30.0/80.0 GiB",
        "2 waiting, 5 done, 1 rejected   now: batch-7.jsonl (50%)",
        "run dir     /runs/x",
    ]:
        assert expected in out, f"{expected!r} not in:\n{out}"
    assert fake.requests == [{"cmd": "status"}]


def test_status_json_is_one_object(fake):
    r = cli("status", "--json", "--socket", fake.path)
    assert r.exit_code == 0
    lines = r.output.splitlines()
    assert len(lines) == 1
    assert json.loads(lines[0]) == STATUS


def test_watch_and_top_refresh(fake):
    r = cli("status", "--watch", "-n", "2", "--interval", "0.05", "--run-dir", fake.run_dir)
    assert r.exit_code == 0 and "running" in r.output
    r = cli("top", "-n", "3", "--interval", "0.05", "--run-dir", fake.run_dir)
    assert r.exit_code == 0 and "40 / 100" in r.output
    assert fake.requests == [{"cmd": "status"}] * 5
    r = cli("status", "--watch", "--json", "-n", "2", "--interval", "0.05", "--run-dir", fake.run_dir)
    assert [json.loads(line)["attempt"] for line in r.output.splitlines()] == [3, 3]


def test_commands_send_the_right_requests(fake):
    assert cli("restart", "--run-dir", fake.run_dir).output == "restart accepted (graceful)\n"
    assert cli("restart", "--now", "--run-dir", fake.run_dir).output == "restart accepted (now)\n"
    assert cli("stop", "--run-dir", fake.run_dir).output == "stop accepted (state was running)\n"
    assert cli("pause", "--run-dir", fake.run_dir).exit_code == 0
    assert fake.requests == [
        {"cmd": "restart", "mode": "graceful"},
        {"cmd": "restart", "mode": "now"},
        {"cmd": "stop"},
        {"cmd": "pause"},
    ]
    # Who asked for each change is on record.
    audit = [e for e in fake.logged if e["event"] == "control request"]
    assert [e["cmd"] for e in audit] == ["restart", "restart", "stop", "pause"]
    assert all(e["peer_uid"] == os.getuid() and e["peer_pid"] == os.getpid() for e in audit)


def test_a_refused_request_is_one_line_and_exit_1(fake):
    r = CliRunner().invoke(main, ["resume", "--run-dir", str(fake.run_dir)])
    assert r.exit_code == 1
    assert r.output == "hangwatch: resume: not paused (state running)\n"


def test_dump_prints_every_rank(fake):
    r = cli("dump", "--socket", fake.path)
    assert r.exit_code == 0
    assert (
        r.output.index("=== rank 0 ===") < r.output.index('File "a.py", line 9 in f') < r.output.index("=== rank 1 ===")
    )


def test_incidents_list_and_one(fake):
    r = cli("incidents", "--run-dir", fake.run_dir)
    assert r.exit_code == 0
    assert "0001" in r.output and "RuntimeError: boom" in r.output
    assert "busy loop in Python" in r.output  # classification stands in for a missing summary
    r = cli("incidents", "0002", "--run-dir", fake.run_dir)
    assert r.exit_code == 0 and "busy loop in Python (CPU 100%)" in r.output and '"func": "forward"' in r.output
    r = cli("incidents", "--json", "--run-dir", fake.run_dir)
    assert len(json.loads(r.output)) == 2
    assert fake.requests[1] == {"cmd": "incidents", "id": "0002"}


def test_environment_variables_find_the_daemon(fake):
    assert cli("status", "--json", env={"HANGWATCH_SOCKET": str(fake.path)}).exit_code == 0
    assert cli("status", "--json", env={"HANGWATCH_RUN_DIR": str(fake.run_dir)}).exit_code == 0


def test_a_socket_recorded_in_the_run_dir_is_found(tmp_path):
    run_dir, rt = tmp_path / "run", tmp_path / "runtime"
    rt.mkdir()
    f = FakeSupervisor(rt / "hangwatch.sock", run_dir=run_dir)
    try:
        r = cli("status", "--json", "--run-dir", run_dir)
        assert r.exit_code == 0 and json.loads(r.output)["state"] == "running"
    finally:
        f.close()


# ---- errors are one clear line, from the real entry point ---------------------------------------


def test_no_daemon_is_one_line_and_exit_69(tmp_path):
    r = hangwatch("status", "--socket", tmp_path / "none.sock")
    assert r.returncode == 69
    assert r.stderr == f"hangwatch: no hangwatch running at {tmp_path / 'none.sock'} (no such socket)\n"
    assert r.stdout == ""
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(tmp_path / "dead.sock"))
    dead.close()
    r = hangwatch("restart", "--socket", tmp_path / "dead.sock")
    assert (r.returncode, r.stderr) == (
        69,
        f"hangwatch: no hangwatch running at {tmp_path / 'dead.sock'} (connection refused)\n",
    )
    r = hangwatch("status", "--run-dir", tmp_path / "missing")
    assert (r.returncode, r.stderr) == (69, f"hangwatch: no run directory at {tmp_path / 'missing'}\n")


def test_no_daemon_given_and_no_run_here_is_a_usage_error(tmp_path):
    r = hangwatch("status", cwd=tmp_path)
    assert r.returncode == 64
    assert r.stderr == (
        f"hangwatch: no run under ./runs/ here ({tmp_path}): say which with --run-dir DIR (or --socket PATH, or set "
        "HANGWATCH_RUN_DIR)\n"
    )


# ---- logs ----------------------------------------------------------------------------------------


def _attempt_log(run_dir: Path, attempt: int, text: str) -> Path:
    d = run_dir / "attempts" / f"{attempt:04d}"
    d.mkdir(parents=True, exist_ok=True)
    p = d / "worker.log"
    with open(p, "a") as f:
        f.write(text)
    return p


def test_logs_prints_every_attempt_or_the_one_asked_for(tmp_path):
    _attempt_log(tmp_path, 1, "one-a\none-b\n")
    _attempt_log(tmp_path, 2, "two-a\ntwo-b\ntwo-c\n")
    (tmp_path / "attempts" / "0003").mkdir()  # spawned, no log yet: not "current" until its log exists
    (tmp_path / "supervisor.log").write_text('{"event": "supervisor_started"}\n')
    one, two = "──── attempt 1 (ended) ────\n", "──── attempt 2 (ended) ────\n"
    assert cli("logs", "--run-dir", tmp_path).output == f"{one}one-a\none-b\n{two}two-a\ntwo-b\ntwo-c\n"
    assert cli("logs", "-n", "1", "--run-dir", tmp_path).output == f"{two}two-c\n"
    assert cli("logs", "-n", "4", "--run-dir", tmp_path).output == f"{one}one-b\n{two}two-a\ntwo-b\ntwo-c\n"
    assert cli("logs", "--attempt", "1", "--run-dir", tmp_path).output == f"{one}one-a\none-b\n"
    assert cli("logs", "--supervisor", "--run-dir", tmp_path).output == '{"event": "supervisor_started"}\n'
    r = hangwatch("logs", "--attempt", "7", "--run-dir", tmp_path)
    assert (r.returncode, r.stderr) == (1, f"hangwatch: no attempt 7 in {tmp_path}; its attempts: 1, 2\n")


def test_logs_follow_moves_on_to_the_next_attempt(tmp_path, sigint_default):
    _attempt_log(tmp_path, 1, "first attempt line 1\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [*hangwatch_argv(), "logs", "-f", "--run-dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=REPO,
    )
    try:
        lines = []

        def read_until(text):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                line = proc.stdout.readline().decode()
                lines.append(line)
                if text in line:
                    return
            pytest.fail(f"{text!r} never printed; got {lines}")

        read_until("first attempt line 1")
        _attempt_log(tmp_path, 1, "first attempt line 2\n")
        read_until("first attempt line 2")
        _attempt_log(tmp_path, 1, "first attempt last words\n")
        _attempt_log(tmp_path, 2, "second attempt line 1\n")
        read_until("second attempt line 1")
        _attempt_log(tmp_path, 2, "second attempt line 2\n")
        read_until("second attempt line 2")
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=10)
    assert [line.strip() for line in lines] == [
        "──── attempt 1 (ended) ────",  # no supervisor here: nothing says it runs
        "first attempt line 1",
        "first attempt line 2",
        "first attempt last words",
        "──── attempt 2 (ended) ────",
        "second attempt line 1",
        "second attempt line 2",
    ]
    assert "following attempts/0001/worker.log" in err.decode() and "following attempts/0002/worker.log" in err.decode()
    assert "Traceback" not in err.decode()


# ---- configs -------------------------------------------------------------------------------------


GOOD = """\
run_dir: runs/x
worker:
  command: [python, train.py]
watchdog:
  silence_timeout_s: 60
"""


def test_validate_config_ok_prints_a_summary(tmp_path):
    cfg = tmp_path / "good.yaml"
    cfg.write_text(GOOD)
    (tmp_path / "train.py").write_text("print('training')\n")  # the script the command names is looked for
    r = hangwatch("validate-config", cfg)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"OK: {cfg}\n")
    assert f"run dir    {tmp_path / 'runs' / 'x'}" in r.stdout
    assert "worker     python train.py" in r.stdout
    assert "silence 60s" in r.stdout
    assert f"socket     {tmp_path / 'runs' / 'x' / 'hangwatch.sock'} (mode 0600)" in r.stdout


BAD = [
    (
        "watchdog:\n  silence_timout_s: 10\n",
        "{p}:2: watchdog.silence_timout_s: unknown key (did you mean 'silence_timeout_s'?)",
    ),
    (
        "worker:\n  command: [python, x.py]\nwatchdog:\n  startup_timeout_s: soon\n",
        "{p}:4: watchdog.startup_timeout_s: Input should be a valid number, unable to parse string as a number, got "
        "'soon'",
    ),
    (
        "worker:\n  command: [python, x.py]\nrestart:\n  max_restarts: -1\n",
        "{p}:4: restart.max_restarts: Input should be greater than or equal to 0, got -1",
    ),
]


@pytest.mark.parametrize("text,problem", BAD, ids=["unknown-key", "wrong-type", "out-of-range"])
def test_validate_config_names_the_problem_and_exits_78(tmp_path, text, problem):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    r = hangwatch("validate-config", cfg)
    assert r.returncode == 78
    assert r.stdout == ""
    assert r.stderr.splitlines() == ["hangwatch: invalid configuration (1 problem):", "  " + problem.format(p=cfg)]


def test_validate_config_missing_file(tmp_path):
    r = hangwatch("validate-config", tmp_path / "nope.yaml")
    assert r.returncode == 78
    assert r.stderr.splitlines()[1] == f"  {tmp_path / 'nope.yaml'}: no such config file"


@pytest.mark.parametrize("text,problem", BAD[:2], ids=["unknown-key", "wrong-type"])
def test_run_refuses_a_bad_config_with_exit_78(tmp_path, text, problem):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    r = hangwatch("run", cfg, "--run-dir", tmp_path / "run")
    assert r.returncode == 78
    assert r.stderr.splitlines() == ["hangwatch: invalid configuration (1 problem):", "  " + problem.format(p=cfg)]
    assert not (tmp_path / "run" / "attempts").exists()  # nothing was started


def test_run_missing_config_exits_78(tmp_path):
    r = hangwatch("run", tmp_path / "nope.yaml")
    assert r.returncode == 78
    assert r.stderr.splitlines()[1] == f"  {tmp_path / 'nope.yaml'}: no such config file"


def test_run_help_fits_a_screen_and_ends_with_the_exit_codes_and_config_keys_has_the_reference():
    r = cli("run", "--help")
    assert r.exit_code == 0
    lines = r.output.rstrip().splitlines()
    assert len(lines) <= 50, r.output  # a screen
    assert "-- CMD" in lines[0] and "config-keys" in r.output
    codes = r.output[r.output.index("Exit status:") :]
    for code, words in (("75", "requeue me"), ("79", "do not retry"), ("78", "nothing started"), ("73", "another")):
        assert any(line.strip().startswith(code) and words in line for line in codes.splitlines()), (code, codes)
    assert "watchdog.poll_interval_s" not in r.output  # the reference has a command of its own
    keys = cli("config-keys")
    assert keys.exit_code == 0
    assert keys.output.rstrip().splitlines() == reference_text().splitlines()  # verbatim, not re-wrapped


def test_incidents_and_run_summary_are_read_from_disk_once_the_run_ended(tmp_path):
    """After `hangwatch run` returned there is no socket; the incidents are still on disk."""
    from hangwatch.supervisor.cli.summary import run_summary
    from hangwatch.supervisor.incidents import IncidentStore
    from hangwatch.supervisor.records import run_state as statefile

    inc = IncidentStore(tmp_path).create(
        "stall", attempt=1, phase="generate", step=40, summary="phase deadline 10.0s exceeded in phase 'generate'"
    )
    (tmp_path / "final").mkdir()
    statefile.write(tmp_path / "state.json", {"state": "finished", "attempt": 2})
    r = CliRunner().invoke(main, ["incidents", "--run-dir", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.output
    listed = json.loads(r.output)
    assert [(i["id"], i["kind"]) for i in listed] == [(inc.id, "stall")]
    r = CliRunner().invoke(main, ["incidents", "--run-dir", str(tmp_path), "--json", inc.id])
    assert json.loads(r.output)["phase"] == "generate"
    r = CliRunner().invoke(main, ["incidents", "--run-dir", str(tmp_path), "0042"])
    assert r.exit_code == 1 and "no incident 0042" in r.output
    lines = run_summary(str(tmp_path), 0)
    assert "finished" in lines[0] and "2 attempt(s)" in lines[0]
    assert any(f"incident {inc.id} [stall]" in ln and "generate" in ln for ln in lines)
    assert any("final adapter" in ln and str(tmp_path / "final") in ln for ln in lines)


@pytest.mark.parametrize("argv", [["frob"], ["status", "--bogus"], ["--bogus"]])
def test_usage_errors_exit_64(argv):
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 64, r.output


# ---- what each command loads (a client command pays only for what it needs) ----------------------------

HEAVY = ("pydantic", "yaml", "structlog", "rich", "torch", "transformers", "numpy", "jinja2", "tokenizers")


def heavy_imports_of(*argv) -> tuple[object, list[str], str]:
    """(exit code, heavy packages and config modules imported, stdout) of one `hangwatch ARGV` in a fresh process."""
    code = (
        "import json, sys\n"
        "from hangwatch.supervisor.cli.main import main\n"
        "try:\n    main(sys.argv[1:], prog_name='hangwatch')\nexcept SystemExit as exc:\n    rc = exc.code\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))\n"
        "heavy += sorted(m for m in sys.modules if m == 'hangwatch.common.config' or "
        "m.startswith('hangwatch.daemon'))\n"
        "print(json.dumps([rc, heavy]), file=sys.stderr)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    p = subprocess.run(
        [sys.executable, "-c", code, *map(str, argv)], capture_output=True, text=True, timeout=60, env=env, cwd=REPO
    )
    rc, heavy = json.loads(p.stderr.strip().splitlines()[-1])
    return rc, heavy, p.stdout


# The rich view needs rich; render.py (result_message, dump_text) imports it at its top for the others.
@pytest.mark.parametrize(
    "argv,allowed",
    [
        (["status", "--json"], set()),
        (["status"], {"rich"}),
        (["incidents", "--json"], set()),
        (["restart"], {"rich"}),
        (["dump"], {"rich"}),
    ],
    ids=["status-json", "status", "incidents-json", "restart", "dump"],
)
def test_client_commands_load_neither_the_config_nor_the_ml_stack(fake, argv, allowed):
    rc, heavy, out = heavy_imports_of(*argv, "--socket", fake.path)
    assert rc in (0, None), out
    assert set(heavy) <= allowed, f"`hangwatch {' '.join(argv)}` imported {heavy}"
    if argv == ["status", "--json"]:
        assert json.loads(out) == STATUS


def test_help_leads_with_run_lists_every_command_and_the_reference_loads_when_asked():
    rc, heavy, out = heavy_imports_of("--help")
    assert rc in (0, None) and heavy == []
    for command in (
        "run",
        "validate-config",
        "status",
        "top",
        "restart",
        "stop",
        "pause",
        "resume",
        "dump",
        "logs",
        "incidents",
        "submit",
        "bench",
        "config-keys",
    ):
        assert f"\n  {command} " in out, command
    assert out.index("\n  run ") < out.index("\n  bench ")  # `run` leads the list: it is what a person came for
    rc, heavy, out = heavy_imports_of("run", "--help")
    assert rc in (0, None) and "Exit status" in out and heavy == []  # run's help needs no schema
    rc, heavy, out = heavy_imports_of("config-keys")
    assert rc in (0, None) and "watchdog.poll_interval_s" in out
    assert "pydantic" in heavy  # the reference is built from the schema, when it is asked for


def _inbox_config(tmp_path: Path, **data) -> Path:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        json.dumps(
            {
                "run_dir": str(tmp_path / "run"),
                "model": {"tiny": {"vocab_size": 128}, "device": "cpu"},
                "data": {"inbox": True, "max_length": 48, "truncation": "reject", **data},
            }
        )
    )
    return cfg


def test_submit_checks_with_the_light_tokenizer_and_never_imports_torch(tmp_path, monkeypatch):
    """The whole `hangwatch submit` (the CLI and the worker-side check it starts), with every import logged."""
    good = tmp_path / "good.jsonl"
    good.write_text(
        "".join(json.dumps({"prompt": f"upper: w{i}", "completion": f"W{i}"}) + "\n" for i in range(20))
        + json.dumps({"prompt": "p" * 60, "completion": "too long"})
        + "\n"
    )
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # inherited by the check's own process
    r = hangwatch("submit", "-v", "--config", _inbox_config(tmp_path, on_bad_lines="skip_lines"), good)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "accepted good.jsonl (20 examples; 1 bad line(s) will be left out)\n"
    assert (tmp_path / "run" / "inbox" / "good.jsonl").read_bytes() == good.read_bytes()
    assert "hangwatch: tokenizer: light (tiny, vocab_size=128)" in r.stderr
    imported = {
        line.rsplit("|", 1)[-1].strip().split(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "tokenizers" in imported and "pydantic" in imported  # the check ran, with the run's config
    assert not imported & {"torch", "transformers", "numpy"}


def test_submit_refuses_a_bad_config_or_a_run_without_an_inbox_in_the_usual_words(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  inbox: maybe\n")
    r = hangwatch("submit", "--config", bad, f)
    assert r.returncode == 78 and r.stdout == ""
    assert r.stderr.splitlines()[0] == "hangwatch: invalid configuration (1 problem):"
    assert r.stderr.splitlines()[1].startswith(f"  {bad}:2: data.inbox: ")
    plain = _inbox_config(tmp_path, inbox=False, train=str(f))
    r = hangwatch("submit", "--config", plain, f)
    assert (r.returncode, r.stderr) == (
        78,
        f"hangwatch: {plain}: data.inbox is false: the run at {tmp_path / 'run'} does not take files from an inbox\n",
    )


def test_a_request_does_its_meanwhile_work_after_sending_and_before_the_answer(tmp_path):
    """What `status` imports to show the answer loads while the supervisor is still answering."""
    import threading

    from hangwatch.supervisor.cli.client import Client, DaemonUnavailable

    got_line, may_answer = threading.Event(), threading.Event()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        with conn:
            conn.makefile("rb").readline()
            got_line.set()
            if may_answer.wait(10):  # the reply only comes once the client's meanwhile work has run
                conn.sendall(b'{"ok": true, "result": {"state": "running"}}\n')

    threading.Thread(target=serve, daemon=True).start()
    order = []

    def meanwhile():
        order.append(("request already sent", got_line.wait(10)))
        may_answer.set()

    try:
        assert Client(tmp_path / "s.sock", timeout=10).call("status", meanwhile=meanwhile) == {"state": "running"}
    finally:
        listener.close()
    assert order == [("request already sent", True)]
    with pytest.raises(DaemonUnavailable):  # nothing to overlap with: not run when no daemon answers
        Client(tmp_path / "none.sock").call("status", meanwhile=lambda: order.append("ran"))
    assert len(order) == 1
