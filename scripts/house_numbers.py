"""The size of the supervisor's loop and what one stall costs it in writes: the figures docs/design.md quotes.

    .venv/bin/python scripts/house_numbers.py            # the static figures and one real stall (about 10 s)
    .venv/bin/python scripts/house_numbers.py --static   # the static figures only

Static (read from the source with `ast`, nothing imported): the lines of `supervisor/loop/supervisor.py` and of its
`Supervisor` class, the class's methods and attributes (distinct `self.NAME =` targets), its longest method, and the
extension points (the hooks of `concerns.base.Concern` and the methods of `nodes.interface.Nodes`).

Dynamic: one real stall.  A worker (a few lines of Python speaking the heartbeat protocol) beats one step and blocks
in C on its first attempt; the step deadline fires, the supervisor snapshots, dumps, kills and starts attempt 2, which
finishes.  Every run-dir write goes through the `FsOps` seam; a counting one records each, and the figures are the
writes of `state.json` and of `incident.json` from the first state record that says `stalled` to the first that says
attempt 2 is starting.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = """
import os, socket
from hangwatch.daemon.heartbeat import Heartbeat
hb = Heartbeat.from_env()
hb.start(resumed_from=None)
hb.step(1, loss=1.0)
if os.environ.get("HANGWATCH_ATTEMPT") == "1":
    a, b = socket.socketpair()
    a.recv(1)  # blocked in C: the step deadline fires
hb.stop("finished")
"""


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def _methods(cls: ast.ClassDef) -> list[ast.FunctionDef]:
    return [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def static_figures(root: Path = ROOT) -> dict:
    loop = root / "supervisor" / "loop" / "supervisor.py"
    tree = ast.parse(loop.read_text())
    sup = _class(tree, "Supervisor")
    methods = _methods(sup)
    attrs = {
        t.attr
        for n in ast.walk(sup)
        if isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        for t in (t.elts if isinstance(t, ast.Tuple) else [t])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    longest = max(methods, key=lambda m: m.end_lineno - m.lineno + 1)
    concern = _methods(_class(ast.parse((root / "supervisor/concerns/base.py").read_text()), "Concern"))
    nodes = _methods(_class(ast.parse((root / "supervisor/nodes/interface.py").read_text()), "Nodes"))
    hooks = [m.name for m in concern if not m.name.startswith("_")]
    return {
        "loop module lines": len(loop.read_text().splitlines()),
        "Supervisor class lines": sup.end_lineno - sup.lineno + 1,
        "methods": len(methods),
        "attributes": len(attrs),
        "longest method": f"{longest.name} ({longest.end_lineno - longest.lineno + 1} lines)",
        "methods over 60 lines": sum(1 for m in methods if m.end_lineno - m.lineno + 1 > 60),
        "extension points": f"{len(hooks) + len(nodes)} (Concern {len(hooks)}, Nodes {len(nodes)})",
    }


def one_stall() -> dict:
    """Run one real stall in this process and count the writes along it."""
    import logging

    import structlog
    import yaml

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))  # the figures only

    from hangwatch.common.config import load_config
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.loop.supervisor import Supervisor

    writes: list[tuple[str, object]] = []

    class CountingFs(FsOps):
        """The real writes, each recorded (file name, the state a state.json write records)."""

        def write_file(self, path, data, durable=True):
            super().write_file(path, data, durable)
            state = None
            if Path(path).name == "state.json":
                rec = json.loads(bytes(data).decode())
                state = (rec.get("state"), rec.get("attempt"))
            writes.append((Path(path).name, state))

        def write_json(self, path, data, durable=True):
            super().write_json(path, data, durable)
            writes.append((Path(path).name, None))

        def overwrite(self, path, data):
            super().overwrite(path, data)
            writes.append((Path(path).name, None))

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg_path = Path(tmp) / "cfg.yaml"
        cfg_path.write_text(
            yaml.safe_dump(
                {
                    "run_dir": str(run_dir),
                    "worker": {"command": [sys.executable, "-c", WORKER], "instrument": "off"},
                    "watchdog": {
                        "step_timeout_s": 2,
                        "silence_timeout_s": 3,
                        "first_steps_timeout_s": 2,
                        "dump_grace_s": 1,
                        "term_grace_s": 1,
                        "poll_interval_s": 0.1,
                        "py_spy": False,
                    },
                    "restart": {"backoff_initial_s": 0, "max_restarts": 2},
                }
            )
        )
        try:
            from hangwatch.supervisor.loop.seams import Seams
        except ImportError:  # a checkout from before the seams were one value
            sup = Supervisor(load_config(cfg_path), fs=CountingFs(), subreaper=True)
        else:
            sup = Supervisor(load_config(cfg_path), Seams(fs=CountingFs(), subreaper=True))
        code = sup.run()
    start = next(i for i, (_, s) in enumerate(writes) if s and s[0] == "stalled")
    end = next(i for i, (_, s) in enumerate(writes) if s and s[1] == 2)
    along = writes[start:end]
    return {
        "exit code": code,
        "state.json writes along the stall": sum(1 for name, _ in along if name == "state.json"),
        "incident.json writes along the stall": sum(1 for name, _ in along if name == "incident.json"),
        "states written": " → ".join(s[0] for name, s in along if name == "state.json"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--static", action="store_true", help="the static figures only")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure statically (default: this one)")
    args = ap.parse_args()
    figures = static_figures(args.root)
    if not args.static:
        figures.update(one_stall())
    for k, v in figures.items():
        print(f"{k:40} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
