"""The bootstrap file every Python of a worker's tree reads (daemon/autoinstrument/boot/sitecustomize.py): it must
parse on any Python 3 (and 2.7: a `python2` child must not print a SyntaxError at start-up), carry the same
minimum version as the supervisor's side, and import nothing but the standard library at its top."""

from __future__ import annotations

import ast
import os
import subprocess

import pytest

from hangwatch.common import instrumentation

SITECUSTOMIZE = instrumentation.BOOT_DIR / "sitecustomize.py"
OLD_PYTHONS = ["/root/.pyenv/versions/2.7.18/bin/python", "/root/.pyenv/versions/3.6.15/bin/python"]


def test_the_boot_dir_is_a_package_with_the_bootstrap():
    assert (instrumentation.BOOT_DIR / "__init__.py").is_file() and SITECUSTOMIZE.is_file()
    assert instrumentation.BOOT_DIR.parent.name == "autoinstrument"


def test_conservative_syntax():
    ast.parse(SITECUSTOMIZE.read_text(), feature_version=(3, 4))  # no f-strings, annotations or `:=`


@pytest.mark.parametrize("python", OLD_PYTHONS)
def test_an_old_interpreter_compiles_it(python, tmp_path):
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed here")
    p = subprocess.run(
        [
            python,
            "-S",
            "-c",
            "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)",
            str(SITECUSTOMIZE),
            str(tmp_path / "s.pyc"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 0, p.stderr


def constant(name: str):
    tree = ast.parse(SITECUSTOMIZE.read_text())
    values = [
        ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
    ]
    assert len(values) == 1, name
    return values[0]


def test_its_constants_are_the_supervisors():
    """It cannot import common/instrumentation.py (an old interpreter could not parse it): the same values, twice."""
    assert constant("MIN_PYTHON") == instrumentation.MIN_PYTHON
    assert constant("TOO_OLD_NOTED") == instrumentation.ENV_TOO_OLD_NOTED


def test_it_imports_only_the_standard_library_at_its_top():
    import sys

    tree = ast.parse(SITECUSTOMIZE.read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names), names


def test_the_env_contract_points_at_the_bootstrap():
    env = instrumentation.instrument_env({"PYTHONPATH": "/mine"}, resume_step=12)
    assert env["PYTHONPATH"].split(os.pathsep) == [str(instrumentation.BOOT_DIR), "/mine"]
    assert env[instrumentation.ENV_RESUME_STEP] == "12" and env[instrumentation.ENV_INSTRUMENT] == "auto"
    assert (instrumentation.SOURCE_ROOT / "daemon" / "autoinstrument" / "__init__.py").is_file()


def test_it_reads_the_variables_the_supervisor_sets():
    from hangwatch.common.protocol import ENV_RUN_DIR

    source = SITECUSTOMIZE.read_text()
    for name in (
        instrumentation.ENV_INSTRUMENT,
        instrumentation.ENV_SOURCE_ROOT,
        instrumentation.ENV_BOOT_DIR,
        ENV_RUN_DIR,
    ):
        assert f'"{name}"' in source, name
