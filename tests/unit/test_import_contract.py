"""The import contract (docs/design.md, "Layering"): one shared layer, dependencies one way, a torch-free
supervisor, and no import cycle anywhere in the product.

    hangwatch.common      imports neither side, never the ML stack
    hangwatch.daemon      imports common, never the supervisor
    hangwatch.supervisor  imports common, never the daemon, never the ML stack (not even indirectly)
    daemon/heartbeat.py   the standard library and the stdlib-only parts of common (users' scripts import it)

    no cycles           no product module reaches itself through imports — `TYPE_CHECKING` and
                        function-level imports count as much as module-level ones

Checked on the source with `ast` (every import statement, function-level ones included, relative ones
resolved), so a forbidden import fails here even on a code path no other test runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"common": "hangwatch.common", "daemon": "hangwatch.daemon", "supervisor": "hangwatch.supervisor"}
ML_STACK = {
    "torch",
    "transformers",
    "peft",
    "numpy",
    "safetensors",
    "accelerate",
    "bitsandbytes",
    "lightning",
    "pytorch_lightning",
}
STDLIB_COMMON = {"hangwatch.common.protocol", "hangwatch.common.rundir"}  # what heartbeat.py may use
RULES = {
    # package: (forbidden hangwatch packages, forbidden third-party top-level names)
    "hangwatch.common": ({"hangwatch.daemon", "hangwatch.supervisor"}, ML_STACK),
    "hangwatch.daemon": ({"hangwatch.supervisor"}, set()),
    "hangwatch.supervisor": ({"hangwatch.daemon"}, ML_STACK),
}


def module_name(root: Path, folder: str, path: Path) -> str:
    rel = path.relative_to(root / folder).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([FOLDERS[folder], *parts])


def imports_of(path: Path, modname: str) -> list[tuple[int, str]]:
    """(line, absolute name) for every import statement, relative ones resolved.

    `from X import y` yields `X.y` (y may be a submodule: `from hangwatch import daemon`)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    base = modname.split(".") if is_pkg else modname.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out += [(node.lineno, f"{target}.{a.name}" if a.name != "*" else target) for a in node.names]
    return out


def violations(root: Path) -> list[str]:
    found = []
    for folder, package in FOLDERS.items():
        forbidden_pkgs, forbidden_top = RULES[package]
        for path in sorted((root / folder).rglob("*.py")):
            mod = module_name(root, folder, path)
            for line, target in imports_of(path, mod):
                top = target.split(".")[0]
                where = f"{path.relative_to(root)}:{line}"
                if any(target == p or target.startswith(p + ".") for p in forbidden_pkgs):
                    found.append(f"{where}: {mod} imports {target} ({package} must not import it)")
                elif top in forbidden_top:
                    found.append(f"{where}: {mod} imports {target} (no ML stack in {package})")
                elif top in FOLDERS:
                    found.append(f"{where}: {mod} imports {target} (import names live under `hangwatch.`)")
                elif (
                    folder == "daemon"
                    and path.name == "heartbeat.py"
                    and (
                        top not in sys.stdlib_module_names
                        and top != "__future__"
                        and not any(target == m or target.startswith(m + ".") for m in STDLIB_COMMON)
                        and target != "hangwatch.common"
                    )
                ):
                    found.append(f"{where}: heartbeat.py imports {target} (standard library only)")
    return found


def test_the_tree_keeps_the_contract():
    assert violations(ROOT) == []


BAD = [
    ("common", "config.py", "from hangwatch.supervisor import runner", "must not import"),
    ("common", "x.py", "import torch", "no ML stack"),
    ("daemon", "train.py", "def f():\n    from hangwatch.supervisor.cli.client import Client", "must not import"),
    ("daemon", "inbox/feed.py", "from ...supervisor import control", "must not import"),
    ("supervisor", "runner.py", "from hangwatch.daemon.heartbeat import Heartbeat", "must not import"),
    ("supervisor", "control/server.py", "from ...daemon import checkpoint", "must not import"),
    ("supervisor", "snapshot.py", "def gpu():\n    import torch.cuda", "no ML stack"),
    ("supervisor", "cli.py", "from supervisor.config import load_config", "under `hangwatch.`"),
    ("daemon", "heartbeat.py", "import yaml", "standard library only"),
]


@pytest.mark.parametrize("folder,name,source,expect", BAD, ids=[f"{b[0]}/{b[1]}" for b in BAD])
def test_the_check_fails_on_a_forbidden_import(tmp_path, folder, name, source, expect):
    for f in FOLDERS:
        (tmp_path / f).mkdir()
        (tmp_path / f / "__init__.py").write_text("")
    path = tmp_path / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source) + "\n")
    found = violations(tmp_path)
    assert len(found) == 1 and expect in found[0], found


def modules(root: Path) -> dict[str, Path]:
    """Every product module by its import name."""
    return {module_name(root, f, p): p for f in FOLDERS if (root / f).is_dir() for p in (root / f).rglob("*.py")}


def import_cycles(root: Path) -> list[list[str]]:
    """Each strongly connected set of product modules (more than one module, or one importing itself).

    An edge is any import statement anywhere in a module (`TYPE_CHECKING` blocks and function bodies
    included); `from P import x` is an edge to `P.x` when that is a module, else to `P`.  A package's
    `__init__` importing its own submodules is not an edge (a re-export, not a dependency)."""
    mods = modules(root)

    def resolve(name: str) -> Optional[str]:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for _, target in imports_of(path, m):
            r = resolve(target)
            if r is not None and r != m and not (path.name == "__init__.py" and r.startswith(m + ".")):
                edges[m].add(r)
    # Tarjan's strongly connected components, iteratively (no recursion limit on a deep chain)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(mods):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycle_among_product_modules():
    assert import_cycles(ROOT) == []


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    """A cycle hidden behind `TYPE_CHECKING` and a function-level import is still a cycle."""
    for f in FOLDERS:
        (tmp_path / f / "loop").mkdir(parents=True)
        (tmp_path / f / "__init__.py").write_text("")
        (tmp_path / f / "loop" / "__init__.py").write_text("from hangwatch.supervisor.loop import runner\n")
    sup = tmp_path / "supervisor"
    (sup / "loop" / "runner.py").write_text("from hangwatch.supervisor.loop import beats\n")
    (sup / "loop" / "beats.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from hangwatch.supervisor.loop.runner import Supervisor\n"
    )
    (sup / "loop" / "pacing.py").write_text("def f():\n    from ..loop import runner\n")
    assert import_cycles(tmp_path) == [["hangwatch.supervisor.loop.beats", "hangwatch.supervisor.loop.runner"]]
    (sup / "loop" / "runner.py").write_text("from hangwatch.supervisor.loop import beats, pacing\n")
    (sup / "loop" / "beats.py").write_text("")
    assert import_cycles(tmp_path) == [["hangwatch.supervisor.loop.pacing", "hangwatch.supervisor.loop.runner"]]


def test_every_package_is_found_for_the_wheel():
    """setup.py finds the packages; a folder of modules without an `__init__.py` would be left out."""
    for f in FOLDERS:
        for d in (ROOT / f).rglob("*.py"):
            if d.parent.name != "__pycache__":
                assert (d.parent / "__init__.py").exists(), f"{d.parent.relative_to(ROOT)} has no __init__.py"


def test_the_supervisor_never_loads_the_ml_stack_at_run_time():
    """The AST check covers our code; this covers third-party modules the supervisor imports."""
    mods = sorted(
        {module_name(ROOT, "supervisor", p) for p in (ROOT / "supervisor").rglob("*.py") if p.name != "__main__.py"}
    )
    code = (
        f"import importlib, sys\nfor m in {mods!r}: importlib.import_module(m)\n"
        f"bad = {sorted(ML_STACK)!r}\nprint(sorted(set(bad) & set(sys.modules)))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
