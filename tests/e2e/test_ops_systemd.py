"""The systemd unit, its installer, and the generated config reference in docs/configuration.md."""

from __future__ import annotations

import configparser
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "hangwatch@.service"
INSTALL = REPO / "scripts" / "install-service.sh"
GEN = REPO / "scripts" / "gen_config_reference.py"


def unit_sections(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    cp.optionxform = str  # keys are case-sensitive in unit files
    cp.read_string(path.read_text())
    return cp


def test_unit_has_what_a_notify_service_with_a_watchdog_needs():
    svc = unit_sections(UNIT)["Service"]
    assert svc["Type"] == "notify"
    assert svc["NotifyAccess"] == "main"
    assert int(svc["WatchdogSec"]) >= 60
    assert svc["Restart"] == "on-failure"
    assert "78" in svc["RestartPreventExitStatus"].split()
    assert svc["KillMode"] == "mixed"
    assert int(svc["TimeoutStopSec"]) >= 600  # the default checkpoint phase budget
    assert svc["RuntimeDirectory"] == svc["StateDirectory"] == svc["LogsDirectory"] == "hangwatch/%i"
    assert svc["ExecStart"] == "/usr/local/bin/hangwatch run /etc/hangwatch/%i.yaml --run-dir %S/hangwatch/%i"
    assert svc["ExecReload"] == "/bin/kill -HUP $MAINPID"


def fake_bin(tmp_path: Path) -> Path:
    b = tmp_path / "bin" / "hangwatch"
    b.parent.mkdir()
    b.write_text("#!/bin/sh\nexit 0\n")
    b.chmod(0o755)
    return b


def install(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), *map(str, args)], capture_output=True, text=True, timeout=60, **kw)


def snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


def test_install_dry_run_prints_every_step_and_changes_nothing(tmp_path):
    b = fake_bin(tmp_path)
    etc_unit = Path("/etc/systemd/system/hangwatch@.service")
    existed = etc_unit.exists()
    before = snapshot(tmp_path)
    r = install("--dry-run", "--bin", b, "--user", "hangwatch-test")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "+ install -d -m 0755 /etc/hangwatch /etc/systemd/system /etc/logrotate.d" in out
    assert "+ write /etc/systemd/system/hangwatch@.service (mode 0644):" in out
    assert f"    ExecStart={b} run /etc/hangwatch/%i.yaml --run-dir %S/hangwatch/%i" in out
    assert "+ write /etc/systemd/system/hangwatch@.service.d/10-user.conf (mode 0644):" in out
    assert "    User=hangwatch-test" in out
    assert "+ useradd --system" in out and "hangwatch-test" in out
    assert "+ write /etc/logrotate.d/hangwatch (mode 0644):" in out
    assert "dry run, nothing changed" in out
    assert snapshot(tmp_path) == before
    assert etc_unit.exists() == existed
    assert subprocess.run(["getent", "passwd", "hangwatch-test"], capture_output=True).returncode != 0


def test_install_into_a_root(tmp_path):
    b = fake_bin(tmp_path)
    root = tmp_path / "root"
    cfg = tmp_path / "demo.yaml"
    cfg.write_text("run_dir: x\nworker: {command: [python3, train.py]}\n")  # a user's own script…
    (tmp_path / "train.py").write_text("print('training')\n")  # …which is there
    r = install("--root", root, "--bin", b, "--user", "hw", "--config", cfg)
    assert r.returncode == 0, r.stderr
    unit = root / "etc/systemd/system/hangwatch@.service"
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    assert unit_sections(unit)["Service"]["ExecStart"] == f"{b} run /etc/hangwatch/%i.yaml --run-dir %S/hangwatch/%i"
    assert unit_sections(root / "etc/systemd/system/hangwatch@.service.d/10-user.conf")["Service"]["User"] == "hw"
    installed = (root / "etc/hangwatch/demo.yaml").read_text()
    # The config as `hangwatch run` will see it: validated, relative paths resolved against its folder.
    assert installed.startswith(f"# installed by scripts/install-service.sh from {cfg};")
    assert f"run_dir: {tmp_path / 'x'}\n" in installed and f"cwd: {tmp_path}\n" in installed
    assert stat.S_IMODE((root / "etc/hangwatch/demo.yaml").stat().st_mode) == 0o640
    assert "/var/log/hangwatch/*/supervisor.log" in (root / "etc/logrotate.d/hangwatch").read_text()
    assert "skipping systemctl daemon-reload (installing under" in r.stdout
    assert "systemctl enable --now hangwatch@demo" in r.stdout


def test_install_refuses_without_an_executable(tmp_path):
    r = install("--dry-run", "--bin", tmp_path / "nothing")
    assert r.returncode == 1
    assert (
        r.stderr.strip()
        == f"install-service: no hangwatch executable at {tmp_path / 'nothing'}; run scripts/setup.sh first or pass "
        "--bin PATH"
    )
    r = install("--frobnicate")
    assert r.returncode == 64 and "unknown argument: --frobnicate" in r.stderr


def test_installed_unit_passes_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd provides it)")
    b = fake_bin(tmp_path)
    root = tmp_path / "root"
    assert install("--root", root, "--bin", b).returncode == 0
    unit_dir = root / "etc/systemd/system"
    instance = unit_dir / "hangwatch@demo.service"
    instance.symlink_to("hangwatch@.service")
    r = subprocess.run(
        [analyze, "verify", str(instance)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "warning"},
    )
    # verify exits 0 even for unknown keys; it warns about them on stderr, naming the unit file.
    complaints = [line for line in r.stderr.splitlines() if "hangwatch@" in line]
    assert r.returncode == 0 and complaints == [], r.stderr


def test_guard_the_verify_test_can_fail(tmp_path):
    """A guard of the verify test above, not a test of hangwatch: it shows that `systemd-analyze verify`
    reports a typo'd key here, so that test's empty complaint list means something."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    bad = tmp_path / "hangwatch@.service"
    bad.write_text(
        UNIT.read_text()
        .replace("NotifyAccess=main", "NotifyAcess=main")
        .replace("/usr/local/bin/hangwatch", str(fake_bin(tmp_path)))
    )
    (tmp_path / "hangwatch@demo.service").symlink_to("hangwatch@.service")
    r = subprocess.run(
        [analyze, "verify", str(tmp_path / "hangwatch@demo.service")], capture_output=True, text=True, timeout=60
    )
    assert "NotifyAcess" in r.stderr


# ---- config reference (docs/configuration.md) ---------------------------------------------------


def gen(*args, **kw):
    return subprocess.run([sys.executable, str(GEN), *map(str, args)], capture_output=True, text=True, timeout=60, **kw)


def test_config_reference_in_docs_is_current():
    r = gen("--check")
    assert r.returncode == 0, (
        f"{r.stderr.strip()}\n(docs/configuration.md needs the markers <!-- config-reference:start --> / "
        "<!-- config-reference:end -->; `python scripts/gen_config_reference.py` fills them)"
    )
    assert "config-reference:start" not in (REPO / "README.md").read_text(), (
        "the config reference lives in docs/configuration.md, not in README.md"
    )


def test_gen_config_reference_writes_and_checks(tmp_path):
    from hangwatch.common.config import reference_markdown

    doc = tmp_path / "configuration.md"
    doc.write_text("# x\n\nbefore\n<!-- config-reference:start -->\nstale\n<!-- config-reference:end -->\nafter\n")
    assert gen("--check", "--file", doc).returncode == 1
    assert gen("--file", doc).returncode == 0
    text = doc.read_text()
    assert text.startswith("# x\n\nbefore\n<!-- config-reference:start -->\n| key | type | default | meaning |")
    assert text.endswith("<!-- config-reference:end -->\nafter\n")
    assert reference_markdown().strip() in text and "stale" not in text
    r = gen("--check", "--file", doc)
    assert r.returncode == 0, r.stderr
    doc.write_text("# no markers\n")
    r = gen("--check", "--file", doc)
    assert r.returncode == 2 and "needs the markers <!-- config-reference:start -->" in r.stderr
