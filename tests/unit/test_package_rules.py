"""Each package's own import rule: the sibling packages and modules it may import, declared as `MAY_IMPORT` in its
`__init__` (beside the words of its docstring) and checked here on the source with `ast` — every import statement,
function-level and `TYPE_CHECKING` ones included — so that an arrow against the layering fails even on a code path
no other test runs.  The rule of the three layers (`common`, `daemon`, `supervisor`) is `test_import_contract`'s.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("common", "daemon", "supervisor")


def packages(root: Path) -> list[Path]:
    """Every first-level package of the three layers (`supervisor/loop`, `daemon/trainer`, …)."""
    return sorted(p.parent for layer in LAYERS for p in (root / layer).glob("*/__init__.py"))


def declared(package: Path) -> tuple[str, ...] | None:
    """The package's `MAY_IMPORT`, read from its `__init__` without importing it (None: not declared)."""
    tree = ast.parse((package / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAY_IMPORT" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    return None


def imported_siblings(package: Path) -> list[tuple[str, int, str]]:
    """(file, line, sibling) for every import of another member of the package's layer."""
    layer = package.parent.name
    prefix = f"hangwatch.{layer}."
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        own = ".".join(rel.with_suffix("").parts[:-1] if path.name == "__init__.py" else rel.with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level:
                base = own.split(".")[: len(own.split(".")) - node.level + (path.name == "__init__.py")]
                names = [prefix + ".".join(base + ([node.module] if node.module else []))]
            elif isinstance(node, ast.ImportFrom) and node.module == prefix[:-1]:  # from hangwatch.daemon import data
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith(prefix):
                    sibling = name[len(prefix) :].split(".")[0]
                    if sibling != package.name:
                        out.append((str(path.relative_to(package.parent.parent)), node.lineno, sibling))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for package in packages(root):
        allowed = declared(package)
        if allowed is None:
            found.append(f"{package.relative_to(root)}: no MAY_IMPORT in its __init__")
            continue
        layer = package.parent
        members = {p.stem for p in layer.glob("*.py")} | {p.parent.name for p in layer.glob("*/__init__.py")}
        found += [
            f"{package.relative_to(root)}: MAY_IMPORT names {n!r}, not in {layer.name}/"
            for n in allowed
            if n not in members
        ]
        for file, line, sibling in imported_siblings(package):
            if sibling not in allowed:
                found.append(
                    f"{file}:{line}: imports {layer.name}.{sibling}, not in {package.name}'s MAY_IMPORT {allowed}"
                )
    return found


def test_every_package_keeps_its_import_rule():
    assert packages(ROOT), "no package found"
    assert violations(ROOT) == []


def test_the_loop_is_imported_by_app_alone_and_nothing_reads_up_into_it():
    """The loop sits on top: no package names it (ops and control get the read model, not the loop)."""
    for package in packages(ROOT):
        if package.parent.name == "supervisor" and package.name not in ("loop", "cli"):
            assert "loop" not in (declared(package) or ()), package.name


@pytest.mark.parametrize(
    "where, line, expect",
    [
        ("supervisor/rules/policy.py", "from hangwatch.supervisor.loop.supervisor import Supervisor\n", "rules"),
        ("supervisor/watch/deadlines.py", "from hangwatch.supervisor.incidents import store\n", "watch"),
        (
            "supervisor/records/run_state.py",
            "if TYPE_CHECKING:\n    from hangwatch.supervisor.ops import alerts\n",
            "records",
        ),
        ("daemon/inbox/feed.py", "from hangwatch.daemon import trainer\n", "inbox"),
    ],
)
def test_the_check_fails_on_a_planted_violation(tmp_path, where, line, expect):
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, tmp_path / layer, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(tmp_path) == []
    target = tmp_path / where
    target.write_text(target.read_text() + "\n\ndef _planted():\n" + "".join(f"    {x}\n" for x in line.splitlines()))
    found = violations(tmp_path)
    assert len(found) == 1 and f"{expect}'s MAY_IMPORT" in found[0], found


def test_an_undeclared_rule_is_a_violation(tmp_path):
    for layer in LAYERS:
        shutil.copytree(ROOT / layer, tmp_path / layer, ignore=shutil.ignore_patterns("__pycache__"))
    init = tmp_path / "supervisor" / "rules" / "__init__.py"
    init.write_text(init.read_text().replace("MAY_IMPORT = ()", ""))
    assert violations(tmp_path) == ["supervisor/rules: no MAY_IMPORT in its __init__"]
