"""The script an interpreter is given must be there before anything starts (`deep.script_of`, `load_checked`): a
`python nosuch.py` would exit 2 at once and be restarted; the check names the file and where it was looked up."""

from __future__ import annotations

from pathlib import Path

import pytest

from hangwatch.common.config import ConfigError, load_checked
from hangwatch.common.config.deep import script_of

SCRIPTS = [
    # (argv, the index of its script file, or None)
    (["python", "train.py"], 1),
    (["python3", "-u", "train.py", "--steps", "3"], 2),
    (["/usr/bin/python3.11", "-uB", "train.py"], 2),
    (["python", "-W", "error", "train.py"], 3),  # -W takes the next word
    (["python", "-Werror", "train.py"], 2),  # … or the rest of its own
    (["python", "-X", "dev", "-u", "train.py"], 4),
    (["python", "-uX", "importtime", "train.py"], 3),
    (["python", "--check-hash-based-pycs", "always", "train.py"], 3),
    (["python", "-I", "--", "train.py"], 3),
    (["python", "-m", "pkg.train"], None),  # a module: found by its own import system
    (["python", "-um", "pkg.train"], None),
    (["python", "-c", "print(1)"], None),
    (["python", "-"], None),  # stdin
    (["python"], None),
    (["python", "-u"], None),
    (["torchrun", "--nproc-per-node", "2", "train.py", "--lr", "1e-4"], 3),
    (["torchrun", "--nproc_per_node=2", "--standalone", "sub/train.py", "x.py"], 3),
    (["torchrun", "-m", "pkg.train"], None),
    (["torchrun", "--no-python", "./train"], None),
    (["python", "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"], 5),
    (["bash", "run.sh"], None),  # not an interpreter we read
    (["./train"], None),
    (["accelerate", "launch", "train.py"], None),
    ([], None),
]


@pytest.mark.parametrize("argv, index", SCRIPTS, ids=[" ".join(a) or "empty" for a, _ in SCRIPTS])
def test_which_word_is_the_script(argv, index):
    assert script_of(argv) == index


def problems(tmp_path: Path, command: list[str], cwd: Path | None = None) -> list[str]:
    text = "run_dir: runs/x\n" + (f"worker:\n  cwd: {cwd}\n" if cwd else "")
    (tmp_path / "c.yaml").write_text(text)
    try:
        load_checked(tmp_path / "c.yaml", command=command, environ={"PATH": "/usr/bin:/bin"})
    except ConfigError as exc:
        return exc.problems
    return []


def test_a_missing_script_is_refused_naming_the_file_and_where_it_was_looked_for(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "train.py").write_text("print('hi')\n")
    path = tmp_path / "c.yaml"
    assert problems(tmp_path, ["python", "nosuch.py"]) == [
        f"{path}: worker.command.1: 'nosuch.py': no such file in {tmp_path} (where the command runs: worker.cwd)"
    ]
    assert problems(tmp_path, ["python", "-u", "nosuch.py"])[0].endswith(
        f"worker.command.2: 'nosuch.py': no such file in {tmp_path} (where the command runs: worker.cwd)"
    )
    assert problems(tmp_path, ["python", str(tmp_path / "gone.py")])[0].endswith(
        f"worker.command.1: {tmp_path / 'gone.py'}: no such file"
    )
    # relative to worker.cwd, where the command runs: train.py there is sub/train.py
    assert problems(tmp_path, ["python", "train.py"], cwd=tmp_path / "sub") == []
    assert problems(tmp_path, ["python", "sub/train.py"], cwd=tmp_path / "sub")[0].endswith(
        f"'sub/train.py': no such file in {tmp_path / 'sub'} (where the command runs: worker.cwd)"
    )


@pytest.mark.parametrize(
    "command",
    [
        ["python", "train.py", "--data", "nosuch.py"],  # the script's own arguments are its business
        ["python", str(Path(__file__))],
        ["python", "-m", "nosuch"],
        ["python", "-c", "import nosuch"],
        ["python3", "-u", "./train.py"],
    ],
)
def test_what_is_there_or_not_a_script_file_passes(tmp_path, command):
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert problems(tmp_path, command) == []
