"""The benchmark's plumbing, on tiny trial counts: it runs real supervisors, writes both result files,
and every figure it reports is computed from what it measured (never a timing threshold here)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "scripts" / "bench"  # run as `python scripts/bench`, the way `hangwatch bench` does
sys.path.insert(0, str(ROOT / "scripts"))

from bench import __main__ as cli  # noqa: E402
from bench.detection import DEADLINES  # noqa: E402
from bench.harness import summary  # noqa: E402


def run_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=180)


def test_hangwatch_bench_finds_the_checkouts_benchmark():
    """`hangwatch bench` as a user types it runs this checkout's scripts/bench (its own --help here)."""
    p = subprocess.run(
        [sys.executable, "-m", "hangwatch.supervisor", "bench", "--help"],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith("usage: bench") and "--only SECTION" in p.stdout, p.stdout


@pytest.mark.slow
def test_quick_bench_writes_results_computed_from_its_runs(tmp_path):
    out = tmp_path / "out"
    p = run_bench(
        tmp_path,
        "--quick",
        "--only",
        "detection,footprint",
        "--out",
        str(out),
        "--workdir",
        str(tmp_path),
        "--keep",
        "--jobs",
        "4",
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench-results.json").read_text())
    md = (out / "bench-results.md").read_text()
    assert p.stdout.strip() == md.strip()  # the table printed is the table written

    m = res["machine"]
    for key in ("cores", "python", "torch", "date", "load_average_start", "load_average_end"):
        assert m[key] is not None, key
    assert set(res["sections"]) == {"detection", "footprint"}

    det = res["sections"]["detection"]
    for dl in DEADLINES:
        rows = det["deadlines"][dl]["raw"]
        assert len(rows) == 2, rows
        for r in rows:
            assert r.get("fired") == dl, r
            inc = json.loads((Path(r["incident"]) / "incident.json").read_text())
            # the figure is the supervisor's own record of this very incident
            assert r["overdue_s"] == inc["deadline"]["overdue_s"]
            assert r["budget_s"] == inc["deadline"]["budget_s"]
            assert r["detection_to_gone_s"] == inc["timings"]["detection_to_gone_s"]
        overdue = [r["overdue_s"] for r in rows]
        s = det["deadlines"][dl]["overdue_s"]
        assert (s["n"], s["min"], s["median"], s["max"]) == (2, min(overdue), statistics.median(overdue), max(overdue))
        assert f"| {dl} | 2 | " + " / ".join(f"{s[k]:.3f}" for k in ("min", "median", "p95", "max")) in md
    # the budgets differ between trials: they are spread over one poll interval
    budgets = sorted(r["budget_s"] for r in det["deadlines"]["step"]["raw"])
    assert budgets[0] < budgets[1]

    fp = res["sections"]["footprint"]
    assert "error" not in fp, fp
    assert fp["cpu_percent"] == summary(fp["cpu_percent_per_second"])
    assert fp["rss_mib"] == summary([b / 2**20 for b in fp["rss_bytes_samples"]])
    assert len(fp["rss_bytes_samples"]) >= 3 and all(b > 0 for b in fp["rss_bytes_samples"])
    assert fp["heartbeat_lines_in_window"] > 0  # the eight ranks were really beating
    assert len(fp["start"]) == 2 and all(s["to_socket_ready_s"] > 0 for s in fp["start"])
    assert f"{fp['cpu_percent_whole_window']:.2f} % of one core" in md


def test_unknown_section_is_refused_with_the_known_ones(tmp_path):
    p = run_bench(tmp_path, "--only", "detection,latency", "--out", str(tmp_path))
    assert p.returncode == 2
    assert "unknown section(s) latency" in p.stderr and "side_by_side" in p.stderr
    assert not (tmp_path / "bench-results.json").exists()


def test_summary_of_samples():
    assert summary([]) == {"n": 0}
    s = summary([3.0, 1.0, 2.0, None, 10.0])
    assert s == {"n": 4, "min": 1.0, "median": 2.5, "p95": 10.0, "max": 10.0}


def test_help_names_every_section_and_the_exit_status():
    p = subprocess.run([sys.executable, str(BENCH), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    for name in cli.SECTIONS:
        assert name in p.stdout
    assert "1 when a section raised" in p.stdout


def test_a_section_that_raises_is_reported_and_fails_the_run(tmp_path, monkeypatch, capsys):
    def run_section(name, work, args, res):
        if name == "detection":
            raise RuntimeError("no supervisor today")
        return {
            "method": "m",
            "ranks": 1,
            "hz": 1.0,
            "window_s": 1.0,
            "cpu_percent_whole_window": 1.5,
            "cpu_percent": summary([1.0]),
            "rss_mib": summary([40.0]),
            "heartbeat_lines_in_window": 3,
            "lines_per_s": 3.0,
            "torn_lines": 0,
            "start_to_worker_spawned_s": summary([0.1]),
            "start_to_socket_ready_s": summary([0.2]),
        }

    monkeypatch.setattr(cli, "run_section", run_section)
    code = cli.main(["--only", "detection,footprint", "--out", str(tmp_path), "--workdir", str(tmp_path)])
    assert code == 1
    res = json.loads((tmp_path / "bench-results.json").read_text())
    assert res["sections"]["detection"]["error"] == "RuntimeError: no supervisor today"
    assert "no supervisor today" in res["sections"]["detection"]["traceback"]
    md = (tmp_path / "bench-results.md").read_text()
    assert "### detection: not measured" in md
    assert "| CPU, whole window | 1.50 % of one core |" in md  # the other section still reported
    assert "section(s) failed: detection" in capsys.readouterr().err


def test_recovery_table_has_a_column_per_world_size(tmp_path, monkeypatch):
    """The recovery section's figures for one rank and for two, side by side, each cell from its own world."""
    from bench.recovery import FIGURES

    def world(base: float, nproc: int) -> dict:
        out = {
            "raw": [],
            "trials": 3,
            "errors": [] if nproc == 1 else ["no stall incident"],
            **{key: summary([base + i, base + 2 * i]) for i, key in enumerate(FIGURES)},
        }
        return out if nproc == 1 else {**out, "culprit_named": 2}

    def run_section(name, work, args, res):
        return {"method": "m", "trials": 3, "worlds": {"1": world(1.0, 1), "2": world(100.0, 2)}}

    monkeypatch.setattr(cli, "run_section", run_section)
    assert cli.main(["--only", "recovery", "--out", str(tmp_path), "--workdir", str(tmp_path)]) == 0
    md = (tmp_path / "bench-results.md").read_text()
    assert "| figure | 1 rank | 2 ranks (torchrun, gloo) |" in md
    one, two = world(1.0, 1), world(100.0, 2)
    gone = one["detection_to_gone_s"], two["detection_to_gone_s"]
    assert (
        f"| detection → process tree gone | {gone[0]['median']:.2f} s (n=2; min {gone[0]['min']:.2f}, "
        f"p95 {gone[0]['p95']:.2f}, max {gone[0]['max']:.2f}) | {gone[1]['median']:.2f} s (n=2; "
    ) in md
    assert "| verdict names the hung rank as the culprit | – (one process) | 2 of 2 |" in md
    assert "| trials that could not be measured | none | no stall incident |" in md
    assert "not measured (run the heartbeat section) | – |" in md


def test_world_summary_counts_the_verdicts_that_named_the_hung_rank():
    from bench.recovery import world_summary

    rows = [
        {"hang_rank": 1, "culprit_rank": 1, "detection_to_gone_s": 6.0},
        {"hang_rank": 1, "culprit_rank": 0, "detection_to_gone_s": 8.0},
        {"hang_rank": 1, "culprit_rank": None, "detection_to_gone_s": 7.0},
        {"hang_rank": 1, "error": "no stall incident"},
    ]
    w = world_summary(rows, 2)
    assert (w["trials"], w["errors"], w["culprit_named"]) == (4, ["no stall incident"], 1)
    assert w["detection_to_gone_s"] == summary([6.0, 8.0, 7.0])
    assert "culprit_named" not in world_summary(rows[:1], 1)  # one process: no verdict to count
