"""What a supervisor process imports: only what its run path needs.

`hangwatch run` imports structlog without rich when its stderr is not a terminal, and with an asyncio that loads
at its first use (`ops.logsetup.import_structlog`), and the config's pydantic with a `secrets` that loads at its
first use (`ops.lean_imports`: no OpenSSL); alerts (apprise) and metrics (prometheus-client) load only
when configured, rich only to render for a person, the report only in `hangwatch report`.  Each check runs in a
fresh interpreter, since this one has imported everything already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[3]
OPTIONAL = (
    "rich",
    "pygments",
    "asyncio",
    "apprise",
    "prometheus_client",
    "plotly",
    "jinja2",
    "torch",
    "transformers",
    "numpy",
)
REPORT = "hangwatch.supervisor.cli.report.page"


def fresh(code: str, *argv: str) -> tuple[int, dict, str]:
    """Run `code` in a fresh interpreter; it prints one JSON object as its last stderr line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HANGWATCH_")}
    p = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, env=env, cwd=REPO
    )
    assert p.stderr.strip(), p.stdout
    return p.returncode, json.loads(p.stderr.strip().splitlines()[-1]), p.stdout + p.stderr


LOADED = (
    "def loaded():\n"
    f"    tops = {{m.split('.')[0] for m in sys.modules}}\n"
    f"    return sorted(tops & set({OPTIONAL!r})) + sorted(m for m in sys.modules if m == {REPORT!r})\n"
)

RUN = (
    "import json, sys\n" + LOADED + "from hangwatch.supervisor.cli.main import main\n"
    "try:\n    main(['run', *sys.argv[1:]], prog_name='hangwatch')\nexcept SystemExit as exc:\n    rc = exc.code\n"
    "print(json.dumps({'rc': rc, 'loaded': loaded(), 'structlog': 'structlog' in sys.modules,\n"
    "                  'openssl': '_hashlib' in sys.modules or 'ssl' in sys.modules}), file=sys.stderr)\n"
)

WORKER = (
    "from hangwatch.daemon.heartbeat import Heartbeat\n"
    "hb = Heartbeat.from_env(); hb.start(); hb.step(1, loss=1.0); hb.stop('finished')\n"
)


def config(tmp_path: Path, **extra) -> Path:
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "worker": {"command": [sys.executable, "-c", WORKER], "instrument": "off"},
        "watchdog": {"py_spy": False},
        **extra,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_run_with_nothing_optional_configured_imports_none_of_it(tmp_path):
    rc, got, out = fresh(RUN, str(config(tmp_path)))
    assert got["rc"] == 0, out
    assert got["structlog"] and got["loaded"] == [], out
    assert not got["openssl"], out  # pydantic's `secrets` (hmac → OpenSSL's libcrypto) not loaded: nothing used it


def test_metrics_load_prometheus_client_when_they_are_on(tmp_path):
    cfg = config(tmp_path, metrics={"textfile": str(tmp_path / "hangwatch.prom")})
    rc, got, out = fresh(RUN, str(cfg))
    assert got["rc"] == 0, out
    assert got["loaded"] == ["prometheus_client"], out


LEAN = (
    "import json, sys\n" + LOADED + "from hangwatch.supervisor.ops import logsetup\n"
    "logsetup.import_structlog(terminal=sys.argv[1] == 'tty')\n"
    "import structlog\n"
    "before = loaded()\n"
    "present = structlog.stdlib.asyncio.get_running_loop is not None  # the stand-in hands over the real one\n"
    "print(json.dumps({'before': before, 'after': loaded(), 'present': present}), file=sys.stderr)\n"
)


def test_structlog_without_rich_off_a_terminal_and_asyncio_on_first_use():
    _, got, out = fresh(LEAN, "pipe")
    assert got == {"before": [], "after": ["asyncio"], "present": True}, out
    _, got, out = fresh(LEAN, "tty")  # on a terminal the console renderer keeps rich's tracebacks
    assert "rich" in got["before"] and "asyncio" not in got["before"], out


LINES = (
    "import io, json, sys, tempfile\n"
    "from hangwatch.supervisor.ops import logsetup\n"
    "if sys.argv[1] == 'lean':\n    logsetup.import_structlog(terminal=False)\n"
    "import structlog\n"
    "stream = io.StringIO()\n"
    "path = logsetup.configure(tempfile.mkdtemp(), 'info', stream=stream, environ={})\n"
    "log = structlog.get_logger('hangwatch.runner')\n"
    "log.info('worker spawned', pid=123, argv=['python', 'x.py'])\n"
    "try:\n    raise ValueError('bad thing')\nexcept ValueError:\n    log.exception('request failed', cmd='dump')\n"
    "file = [json.loads(line) for line in path.read_text().splitlines()]\n"
    "for rec in file:\n    rec.pop('timestamp')\n"
    "console = [line.split(' ', 1)[1] for line in stream.getvalue().splitlines() if line.startswith('timestamp=')]\n"
    "print(json.dumps({'file': file, 'console': console, 'rich': 'rich' in sys.modules}), file=sys.stderr)\n"
)


def test_the_lean_import_logs_the_same_lines():
    _, lean, out = fresh(LINES, "lean")
    _, plain, _ = fresh(LINES, "plain")
    assert not lean.pop("rich") and plain.pop("rich")
    assert lean == plain, out
    assert "ValueError: bad thing" in lean["file"][1]["exception"]


CLIENT = (
    "import json, sys\n"
    "import hangwatch.supervisor.cli.main\n"
    "from hangwatch.supervisor.control import socket_path_in\n"
    "mods = sorted(m for m in sys.modules if m.startswith('hangwatch.supervisor.control.') or m.split('.')[0] in "
    "('structlog', 'pydantic', 'rich'))\n"
    "from hangwatch.supervisor.control import PeerPolicy, parse_request  # the others still load, when asked\n"
    "print(json.dumps({'mods': mods, 'later': [PeerPolicy.__module__, parse_request.__module__]}), file=sys.stderr)\n"
)


def test_a_client_command_loads_only_the_socket_paths_of_the_control_package():
    _, got, out = fresh(CLIENT)
    assert got == {
        "mods": ["hangwatch.supervisor.control.paths"],
        "later": ["hangwatch.supervisor.control.peer", "hangwatch.supervisor.control.wire"],
    }, out


def test_a_deferred_module_is_the_real_one_at_its_first_use():
    code = (
        "import json, sys\n"
        "from hangwatch.supervisor.ops.lean_imports import import_without\n"
        "import_without('pydantic.types', defer=('secrets',))\n"
        "import pydantic.types as t\n"
        "before = 'secrets' in sys.modules, '_hashlib' in sys.modules\n"
        "same = t.secrets.compare_digest('a', 'a')\n"
        "print(json.dumps({'before': before, 'after': '_hashlib' in sys.modules, 'same': same, "
        "'real': type(sys.modules['secrets']).__name__}), file=sys.stderr)\n"
    )
    rc, got, out = fresh(code)
    assert rc == 0, out
    assert got == {"before": [False, False], "after": True, "same": True, "real": "module"}, got


# Python 3.12's LogRecord asks the asyncio in sys.modules for its current task (`logging.logAsyncioTasks`); structlog
# builds a LogRecord while it is imported.  Emulated here so that every Python this suite runs on checks it.
ASKS_ASYNCIO = (
    "import json, logging, sys\n" + LOADED + "init = logging.LogRecord.__init__\n"
    "def record_init(self, *a, **k):\n"
    "    init(self, *a, **k)\n"
    "    aio = sys.modules.get('asyncio') if getattr(logging, 'logAsyncioTasks', True) else None\n"
    "    if aio:\n"
    "        try:\n"
    "            self.taskName = aio.current_task().get_name()\n"
    "        except Exception:\n"
    "            self.taskName = None\n"
    "logging.LogRecord.__init__ = record_init\n"
    "logging.logAsyncioTasks = True\n"
    "from hangwatch.supervisor.ops import logsetup\n"
    "logsetup.import_structlog(terminal=False)\n"
    "print(json.dumps({'loaded': loaded(), 'asks_again': logging.logAsyncioTasks}), file=sys.stderr)\n"
)


def test_a_log_record_asking_for_its_asyncio_task_does_not_load_asyncio():
    _, got, out = fresh(ASKS_ASYNCIO)
    assert got == {"loaded": [], "asks_again": True}, out
