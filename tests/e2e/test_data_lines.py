"""A data file's lines get one verdict, whoever reads them: `validate-config`, the doctor (which `run`
runs before its first attempt) and the worker read a line through the same check
(`example_shape.parse_line` / `example_of_line`).  A first line that is not an example (a header, a byte-order
mark, another format) is refused by both, at `file:1`, and so is a file none of whose first lines is one; a bad
line further on is the warning `file:N: why; the worker will skip this line` from both — never an OK from one
and a refusal from the other."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.fakes.workers import make_config, synthetic_examples

REPO = Path(__file__).resolve().parents[2]
EXPECTED = 'each line must be {"prompt", "completion"} or {"messages": [...]}'


def hangwatch(*args) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HANGWATCH_", "NOTIFY_SOCKET"))}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-m", "hangwatch.supervisor", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )


def with_train(tmp_path: Path, first: bytes, good: int = 30) -> tuple[Path, Path]:
    train = tmp_path / "data" / "train.jsonl"
    train.parent.mkdir(parents=True)
    train.write_bytes(first + b"".join(json.dumps(e).encode() + b"\n" for e in synthetic_examples(good)))
    return make_config(tmp_path), train


FIRST_LINES = {
    "a header": (b"prompt,completion\n", "not valid JSON: Expecting value: line 1 column 1 (char 0)"),
    "not UTF-8": (b"\xff\xfe header\n", "not UTF-8 (invalid start byte at byte 0)"),
    "a byte-order mark": (
        b"\xef\xbb\xbf" + json.dumps({"prompt": "a", "completion": "b"}).encode() + b"\n",
        "not valid JSON: Unexpected UTF-8 BOM",
    ),
}


@pytest.mark.parametrize("first", sorted(FIRST_LINES))
def test_a_bad_first_line_is_refused_by_validate_config_and_the_doctor_at_file_and_line(tmp_path, first):
    line, why = FIRST_LINES[first]
    cfg, train = with_train(tmp_path, line)
    checked = hangwatch("validate-config", cfg)
    assert checked.returncode == 78 and checked.stdout == "", checked.stderr
    assert f"data.train: {train}:1: {why}" in checked.stderr and EXPECTED in checked.stderr, checked.stderr
    doctor = hangwatch("doctor", cfg, "--cheap", "--json")
    findings = {f["check"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert doctor.returncode == 1 and findings["training data"]["status"] == "FAIL", findings["training data"]
    assert findings["training data"]["summary"].startswith(f"{train}:1: {why}")


def test_a_bad_line_after_good_ones_is_a_warning_from_both(tmp_path):
    cfg, train = with_train(tmp_path, b"", good=3)
    with open(train, "ab") as f:  # line 4: a line cut short, as a killed writer leaves one
        f.write(b'{"prompt": "a", "compl\n')
        f.writelines(json.dumps(e).encode() + b"\n" for e in synthetic_examples(20))
    checked = hangwatch("validate-config", cfg)
    assert checked.returncode == 0 and checked.stdout.startswith(f"OK: {cfg}"), checked.stderr
    warning = next(w for w in checked.stderr.splitlines() if f"{train}:4: " in w)
    assert "not valid JSON" in warning and warning.endswith("the worker will skip this line")
    doctor = hangwatch("doctor", cfg, "--cheap", "--json")
    findings = {f["check"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert doctor.returncode == 0 and findings["training data"]["status"] == "WARN", findings["training data"]
    assert any(d.startswith(f"{train}:4: not valid JSON") for d in findings["training data"]["details"])


def test_a_file_with_no_example_in_its_first_lines_is_refused_by_both_at_file_and_line(tmp_path):
    cfg, train = with_train(tmp_path, b"prompt,completion\n" + b"upper: cat,CAT\n" * 5, good=0)
    checked = hangwatch("validate-config", cfg)
    assert checked.returncode == 78 and checked.stdout == ""
    assert (
        f"data.train: {train}:1: not valid JSON: Expecting value: line 1 column 1 (char 0) (and every other of "
        f"the first 6 line(s)): {EXPECTED}"
    ) in checked.stderr
    doctor = hangwatch("doctor", cfg, "--cheap", "--json")
    findings = {f["check"]: f for f in json.loads(doctor.stdout)["findings"]}
    assert doctor.returncode == 1 and findings["training data"]["status"] == "FAIL"
    assert findings["training data"]["details"][0].startswith(f"{train}:1: not valid JSON")
