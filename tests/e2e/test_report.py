"""`hangwatch report` on a real run with two incidents, opened in headless Chromium.

The run: `hangwatch run` over a stdlib training script that beats like a real one (loss, lr schedule,
tokens/s, step time, a good checkpoint every 10 steps, eval generations into evolution.jsonl) and resumes
from HANGWATCH_RESUME_FROM; attempt 1 hangs in C at step 23 (a stall), attempt 2 crashes at step 41, attempt
3 finishes.  The page must open without a network (no external script), and Chromium must draw the four
charts with both incidents marked and the goodput section (its timeline, a row for every category); the
resume audit of attempt 2 (it replayed steps 21–22) is listed; its screenshot is kept
(HANGWATCH_SAVE_SCREENSHOT=1 copies it to docs/report-screenshot.png, the README's picture).  Skips where no
Chromium is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from fixtures.fakes.sup_harness import PY, ROOT, env, incidents, run_supervisor, state
from fixtures.fakes.watchdog_settings import FAST_WATCHDOG

from hangwatch.supervisor.records.goodput import CATEGORIES, GOODPUT_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

TRAIN = r"""
import json, math, os, random, socket, sys, time
from hangwatch.daemon.heartbeat import Heartbeat

STEPS = 60
PROMPTS = [("reverse: cat", "tac"), ("upper: fox", "FOX")]
hb = Heartbeat.from_env()
attempt = int(os.environ["HANGWATCH_ATTEMPT"])
run_dir = os.environ["HANGWATCH_RUN_DIR"]
resume = Heartbeat.resume_from()
start = int(resume.rsplit("-", 1)[-1]) if resume else 0
hb.start(resumed_from=resume)


def read_shard():  # a read that never returns: blocked in C
    a, b = socket.socketpair()
    a.recv(1)


def output(reference, step):  # what a model that is learning says: closer to the reference as it trains
    keep = min(len(reference), step // 20)
    return reference[:keep] + "?" * (len(reference) - keep) + (" …" if keep < len(reference) else "")


with hb.phase("train"):
    for step in range(start + 1, STEPS + 1):
        if attempt == 1 and step == 23:
            read_shard()
        if attempt == 2 and step == 41:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        rng = random.Random(step)
        step_s = 0.03 + 0.01 * rng.random()
        time.sleep(step_s)
        lr = 3e-4 * min(1.0, step / 10) * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        loss = 2.4 * math.exp(-step / 22) + 0.35 + 0.08 * rng.random()
        hb.step(step, loss=loss, lr=lr, tokens_per_s=4096 / step_s, step_time_s=step_s, max_steps=STEPS)
        if step % 10 == 0:
            path = os.path.join(run_dir, "checkpoints", f"step-{step:08d}")
            os.makedirs(path, exist_ok=True)
            hb.checkpoint(path, step, good=True)
            with hb.phase("eval"), open(os.path.join(run_dir, "evolution.jsonl"), "a") as f:
                for prompt, ref in PROMPTS:
                    f.write(json.dumps({"step": step, "prompt": prompt, "reference": ref, "output": output(ref, step),
                                        "loss": loss, "attempt": attempt, "t": time.time()}) + "\n")
hb.stop("finished")
"""


def two_incident_run(tmp_path: Path) -> Path:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    run_dir = tmp_path / "night-run"
    cfg = {
        "run_dir": str(run_dir),
        "worker": {"command": [PY, str(script)]},
        "watchdog": {**FAST_WATCHDOG, "phase_budgets_s": {"eval": 5}},
        "restart": {"backoff_initial_s": 0, "max_restarts": 5},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rc, out = run_supervisor(path, timeout=120)
    assert rc == 0, out[-4000:]
    return run_dir


def chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--no-first-run",
            "--virtual-time-budget=15000",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_hangwatch_report_draws_the_night_with_both_incidents(tmp_path):
    run_dir = two_incident_run(tmp_path)
    assert state(run_dir)["state"] == "finished"
    incs = incidents(run_dir)
    assert [i["kind"] for i in incs] == ["stall", "crash"], [i["kind"] for i in incs]

    out = tmp_path / "report.html"
    p = subprocess.run(
        [PY, "-m", "hangwatch.supervisor.cli.report", "--run-dir", str(run_dir), "--out", str(out)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(out)
    page = out.read_text()
    # self-contained: plotly's JavaScript inlined, nothing fetched from a network
    assert not re.search(r"<script[^>]+src=", page) and not re.search(r"<link[^>]+href=\"?https?:", page)
    assert 'name="viewport"' in page
    for text in ("0001", "0002", "stall", "crash", "reverse: cat", "upper: fox", "FOX", "read_shard (", "train.py:"):
        assert text in page, text
    # the table: steps lost and time to recover (the stall hit step 22, resumed from 20; the crash at 40, from 40)
    rows = re.findall(
        r"<tr><td>(000\d)</td><td class=\"kind\">(\w+)</td><td class=\"num\">(\d+)</td>"
        r"<td class=\"num\">(\d+)</td>.*?<td class=\"num\">(\d+)</td><td class=\"num\">([\d.]+) s</td></tr>",
        page,
    )
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in rows] == [
        ("0001", "stall", "1", "22", "2"),
        ("0002", "crash", "2", "40", "0"),
    ]
    # where the time went: the ledger the supervisor kept, one row per category; the resume after the stall, audited
    assert (run_dir / GOODPUT_NAME).exists()
    assert re.findall(r'data-category="(\w+)"', page) == list(CATEGORIES)
    audits = page.split("<h2>Resume audits</h2>", 1)[1].split("<h2>", 1)[0]
    assert re.search(
        r'<td class="num">2</td><td class="num">20</td><td class="num">21–22</td>'
        r'<td class="verdict-verified">resume verified: steps 21–22 replayed, [^<]+</td><td>0001</td>',
        audits,
    )

    if BROWSER is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium): the page was checked, not drawn")
    dom = chromium("--dump-dom", out.resolve().as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    drawn = dom.stdout
    assert drawn.count('class="main-svg"') >= 1, "plotly drew no chart"
    for title in ("loss", "learning rate", "step time (s)", "tokens/s"):
        assert f">{title}<" in drawn, title
    assert ">0001 stall<" in drawn and ">0002 crash<" in drawn, "the incidents are not marked on the charts"
    assert drawn.count("attempt 3") >= 1
    goodput = drawn.split('<section id="goodput">', 1)[1].split("</section>", 1)[0]
    assert re.findall(r'data-category="(\w+)"', goodput) == list(CATEGORIES)
    assert goodput.count('class="main-svg"') >= 1, "plotly drew no timeline"
    assert ">training (kept steps)<" in goodput, "the timeline's legend names no category"

    png = tmp_path / "report-screenshot.png"
    shot = chromium(f"--screenshot={png}", "--window-size=1100,2300", out.resolve().as_uri())
    assert shot.returncode == 0 and png.stat().st_size > 50_000, shot.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("HANGWATCH_SAVE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(png, ROOT / "docs" / "report-screenshot.png")


def test_report_on_a_directory_without_a_run_says_so(tmp_path):
    p = subprocess.run(
        [PY, "-m", "hangwatch.supervisor.cli.report", "--run-dir", str(tmp_path)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 66
    assert p.stderr.strip() == f"hangwatch: no run in {tmp_path} (no state.json, no attempts/): pass --run-dir"
    assert json.dumps(p.stdout) == '""'
