"""Installing the service for a real config, and the hardened unit's exposure as systemd rates it."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "install-service.sh"
HANGWATCH = REPO / ".venv" / "bin" / "hangwatch"
MAX_EXPOSURE = 5.0  # the most exposure the shipped unit may rate; the README quotes the measured figure


def install(*args, check: bool = False) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", str(INSTALL), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def user_config(tmp_path: Path) -> Path:
    """A config as a user writes it: relative data paths next to the file."""
    src = tmp_path / "project"
    shutil.copytree(REPO / "configs" / "data", src / "data")
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg["data"]["train"], cfg["data"]["eval"] = "data/train.jsonl", "data/eval.jsonl"
    path = src / "night.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def exposure(unit: Path) -> float:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd provides it)")
    r = subprocess.run([analyze, "security", "--offline=true", str(unit)], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr
    return float(m.group(1))


def test_the_installed_unit_rates_at_most_5_in_systemd_analyze_security(tmp_path):
    root = tmp_path / "root"
    install("--root", root, "--bin", HANGWATCH, check=True)
    unit_dir = root / "etc/systemd/system"
    (unit_dir / "hangwatch@demo.service").symlink_to("hangwatch@.service")
    assert exposure(unit_dir / "hangwatch@demo.service") <= MAX_EXPOSURE


def test_the_exposure_check_notices_a_unit_without_hardening(tmp_path):
    """Guard for the test above: the same unit stripped of its hardening rates far worse."""
    text = (REPO / "systemd" / "hangwatch@.service").read_text()
    bare = text.split("# ---- Hardening")[0].replace("/usr/local/bin/hangwatch", str(HANGWATCH))
    unit = tmp_path / "hangwatch@demo.service"
    unit.write_text(bare)
    assert exposure(unit) > MAX_EXPOSURE + 2


def test_a_config_is_installed_resolved_and_readable_by_the_service_user(tmp_path):
    config = user_config(tmp_path)
    root = tmp_path / "root"
    r = install("--root", root, "--bin", HANGWATCH, "--user", "hwsvc", "--config", config, check=True)
    installed = root / "etc/hangwatch/night.yaml"
    assert stat.S_IMODE(installed.stat().st_mode) == 0o640
    assert "make it root:hwsvc" in r.stdout  # under --root the owner is left to the packager, and said so
    data = yaml.safe_load(installed.read_text())
    # Relative paths pointed next to the user's file; installed under /etc they must still point there.
    assert data["data"]["train"] == str(config.parent / "data" / "train.jsonl")
    assert data["data"]["eval"] == str(config.parent / "data" / "eval.jsonl")
    assert data["worker"]["cwd"] == str(config.parent)
    check = subprocess.run(
        [str(HANGWATCH), "validate-config", str(installed)], capture_output=True, text=True, timeout=120
    )
    assert check.returncode == 0, check.stdout + check.stderr
    dry = install(
        "--dry-run", "--root", tmp_path / "r2", "--bin", HANGWATCH, "--user", "hwsvc", "--config", config, check=True
    )
    assert f"+ chown root:hwsvc {tmp_path / 'r2'}/etc/hangwatch/night.yaml" in dry.stdout


def test_a_bad_config_is_refused_before_anything_is_written(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: x\nwatchdog:\n  startup_timeout: 5\n")
    root = tmp_path / "root"
    r = install("--root", root, "--bin", HANGWATCH, "--config", bad)
    assert r.returncode == 78
    assert f"{bad}:3: watchdog.startup_timeout" in r.stderr and "nothing installed" in r.stderr
    assert not root.exists()
