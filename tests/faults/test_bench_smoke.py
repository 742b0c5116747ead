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
BENCH = ROOT / "scripts" / "bench.py"
sys.path.insert(0, str(ROOT / "scripts"))

import bench  # noqa: E402


def run_bench(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], cwd=ROOT, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
def test_quick_bench_writes_results_computed_from_its_runs(tmp_path):
    out = tmp_path / "out"
    p = run_bench(tmp_path, "--quick", "--only", "detection,footprint", "--out", str(out), "--workdir", str(tmp_path),
                  "--keep", "--jobs", "4")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "bench-results.json").read_text())
    md = (out / "bench-results.md").read_text()
    assert p.stdout.strip() == md.strip()  # the table printed is the table written

    m = res["machine"]
    for key in ("cores", "python", "torch", "date", "load_average_start", "load_average_end"):
        assert m[key] is not None, key
    assert set(res["sections"]) == {"detection", "footprint"}

    det = res["sections"]["detection"]
    for dl in bench.DEADLINES:
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
    assert fp["cpu_percent"] == bench.summary(fp["cpu_percent_per_second"])
    assert fp["rss_mib"] == bench.summary([b / 2**20 for b in fp["rss_bytes_samples"]])
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
    assert bench.summary([]) == {"n": 0}
    s = bench.summary([3.0, 1.0, 2.0, None, 10.0])
    assert s == {"n": 4, "min": 1.0, "median": 2.5, "p95": 10.0, "max": 10.0}
