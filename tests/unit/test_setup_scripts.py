"""The set-up does what the README says: `demo.sh` sets up the Python environment only, `test.sh` also the system
packages of the Slurm tests (slurm-wlm, munge), saying so on stderr; either is quiet when everything is there.

The scripts run for real, in a copy of the checkout's scripts whose `.venv` is a stand-in (a `python`, `ruff` and
`hangwatch` that record how they were called) and with a PATH of stand-ins for `id` (root) and `apt-get` (records
its arguments): nothing is installed, on this machine or in its environment.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")
TOOLS = ("bash", "dirname", "mktemp", "rm", "cat", "grep", "tail", "touch")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")


def stub(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{BASH}\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path) -> Path:
    """The scripts and what they read, an up-to-date `.venv` stand-in, and a PATH without Slurm or munge."""
    root = tmp_path / "hangwatch"
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "demo.sh", "test.sh"):
        shutil.copy2(REPO / "scripts" / name, root / "scripts" / name)
    (root / "configs").mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy2(REPO / name, root / name)
        os.utime(root / name, (1_000_000, 1_000_000))
    calls = tmp_path / "calls"
    for tool in ("python", "ruff", "hangwatch"):
        stub(root / ".venv" / "bin" / tool, f'echo "{tool} $*" >> {calls}')
    # demo.sh asks python whether runs/demo holds a finished demo: it does not
    stub(root / ".venv" / "bin" / "python", f'echo "python $*" >> {calls}\ncase "$*" in *state.json*) exit 1 ;; esac')
    (root / ".venv" / ".hangwatch-installed").touch()  # installed after the last change of pyproject.toml
    bin_dir = tmp_path / "bin"
    stub(bin_dir / "id", "echo 0")
    stub(bin_dir / "apt-get", f'echo "apt-get $*" >> {calls}')
    for tool in TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return root


def run(checkout: Path, script: str, *args: str, path_extra: str = "") -> subprocess.CompletedProcess:
    bin_dir = checkout.parent / "bin"
    env = {"PATH": f"{path_extra}{bin_dir}", "HOME": str(checkout.parent)}
    return subprocess.run(
        [BASH, str(checkout / "scripts" / script), *args], capture_output=True, text=True, env=env, timeout=60
    )


def calls(checkout: Path) -> list[str]:
    path = checkout.parent / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_the_demo_sets_up_python_only_and_says_nothing_when_it_is_there(checkout):
    p = run(checkout, "demo.sh")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    assert not any(c.startswith("apt-get") for c in calls(checkout))
    assert calls(checkout)[-1] == "hangwatch run configs/demo.yaml"


def test_the_test_command_installs_slurm_and_munge_and_says_so(checkout):
    p = run(checkout, "test.sh", "tests/unit")
    assert p.returncode == 0, p.stderr
    assert p.stderr == "setup: installing slurm-wlm and munge for the Slurm tests (apt-get)\n"
    apt = [c for c in calls(checkout) if c.startswith("apt-get")]
    assert apt == ["apt-get install -y -q --no-install-recommends slurm-wlm munge"]
    assert calls(checkout)[-1] == "python -m pytest -q -ra --durations=10 tests/unit"


def test_with_slurm_there_the_test_set_up_is_quiet_too(checkout):
    sbin = checkout.parent / "sbin"
    stub(sbin / "slurmctld", "exit 0")
    stub(sbin / "munged", "exit 0")
    p = run(checkout, "setup.sh", "--with-slurm", path_extra=f"{sbin}:")
    assert (p.returncode, p.stderr) == (0, "")
    assert calls(checkout) == ["python -c import torch"]


def test_an_unknown_argument_is_refused_in_one_line(checkout):
    p = run(checkout, "setup.sh", "--with-slrum")
    assert p.returncode == 64
    assert p.stderr == "setup: unknown argument --with-slrum (usage: scripts/setup.sh [--with-slurm])\n"
