"""What `pip install` puts on a machine: one top-level import name, `hangwatch`, every subpackage, and py-spy."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_no_top_level_name_but_hangwatch(tmp_path):
    out = tmp_path / "wheel"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = out.glob("hangwatch-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"hangwatch"}  # not `daemon` (python-daemon's name), not `supervisor` (supervisord's)
    for module in (
        "hangwatch/daemon/heartbeat.py",
        "hangwatch/daemon/__main__.py",
        "hangwatch/daemon/inbox/intake.py",
        "hangwatch/daemon/trainer/loop.py",
        "hangwatch/supervisor/cli/main.py",
        "hangwatch/supervisor/control/server.py",
        "hangwatch/supervisor/incidents/classify.py",
        "hangwatch/common/config/schema.py",
        "hangwatch/common/protocol.py",
    ):
        assert module in names, module
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "hangwatch = hangwatch.supervisor.cli.main:main" in entry
    # py-spy (native stacks at a stall) comes with every install; `[profiling]`, which used to bring it, still resolves
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("py-spy>=") and "extra ==" not in r for r in requires), requires
    assert "Provides-Extra: profiling" in meta


def test_the_installed_commands_work_from_anywhere(tmp_path):
    """The worker and the CLI are reachable by their public names outside the checkout."""
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch.daemon", "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 0 and "--config" in r.stdout, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "hangwatch.supervisor", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "run" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-c", "import daemon"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode != 0  # hangwatch adds no `daemon` module (python-daemon may own that name)
