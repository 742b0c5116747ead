"""The documentation holds together: README.md and docs/*.md link only to files that exist, and speak of
hangwatch, not of how it was made.

    links       every relative Markdown link and image (`[text](target)`, `![alt](target)`, `[ref]: target`)
                resolves to an existing file or folder, relative to the file it is in; http(s), mailto and
                pure `#anchor` links are not checked, and `#anchor` is stripped from a file link
    words       nothing matches `this session`, `issue N` or `session N` (case-insensitive)
    hashes      no commit hash in prose: 7–40 lowercase hex characters with both a digit and a letter,
                outside fenced code blocks

`check_docs(root)` takes the folder holding README.md and docs/, so the second test can show on a planted
tree that each check reports what it should.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^(https?:|mailto:)", re.I)
WORDS = re.compile(r"this session|issue [0-9]+|session [0-9]+", re.I)
HEX = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def doc_files(root: Path) -> list[Path]:
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def blank(match: re.Match) -> str:
    """The match replaced by as many newlines as it held, so line numbers stay right."""
    return "\n" * match.group(0).count("\n")


def line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def check_docs(root: Path) -> list[str]:
    """Every problem in README.md and docs/*.md under `root`, one `FILE:LINE: what` string each."""
    problems = []
    for path in doc_files(root):
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8")
        prose = FENCE.sub(blank, text)  # no links and no hashes are read inside fenced code
        links_text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), prose)  # `[x](y)` in code is no link
        for m in [*LINK.finditer(links_text), *REF_DEF.finditer(links_text)]:
            target = m.group(1)
            if EXTERNAL.match(target) or target.startswith("#"):
                continue
            file_part = target.split("#", 1)[0].split("?", 1)[0]
            if not (path.parent / file_part).exists():
                problems.append(f"{rel}:{line_of(links_text, m.start())}: broken link {target!r}")
        for m in WORDS.finditer(text):
            problems.append(f"{rel}:{line_of(text, m.start())}: speaks of how the code was made: {m.group(0)!r}")
        for m in HEX.finditer(prose):
            problems.append(f"{rel}:{line_of(prose, m.start())}: looks like a commit hash: {m.group(0)!r}")
    return problems


def test_readme_and_docs_hold_together():
    assert (ROOT / "README.md").is_file() and len(doc_files(ROOT)) > 1, "README.md and docs/*.md expected"
    assert check_docs(ROOT) == []


def test_the_checker_reports_what_it_should(tmp_path):
    """A guard of the test above: on a planted tree each check fires, and only where it should."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# there\n")
    (tmp_path / "docs" / "pic.png").write_bytes(b"\x89PNG")
    (tmp_path / "README.md").write_text(
        "# x\n"
        "[fine](docs/there.md) [fine too](docs/there.md#a-heading) ![pic](docs/pic.png) [web](https://example.com/nowhere.md)\n"
        "[anchor](#somewhere) [mail](mailto:a@example.com) `[in code](missing-in-code.md)` step-00000030 deadbeef\n"
        "```\n[in a block](missing-in-block.md) 2b70f08\n```\n"
        "[broken](docs/missing.md#x)\n"
        "![broken image](docs/missing.png)\n"
        "[ref]: docs/also-missing.md\n"
        "As measured in this session, see Issue 17; commit 5c72002.\n"
    )
    (tmp_path / "docs" / "guide.md").write_text("[up](../README.md) [sibling](there.md) [gone](../nowhere/)\n")
    assert check_docs(tmp_path) == [
        "README.md:7: broken link 'docs/missing.md#x'",
        "README.md:8: broken link 'docs/missing.png'",
        "README.md:9: broken link 'docs/also-missing.md'",
        "README.md:10: speaks of how the code was made: 'this session'",
        "README.md:10: speaks of how the code was made: 'Issue 17'",
        "README.md:10: looks like a commit hash: '5c72002'",
        "docs/guide.md:1: broken link '../nowhere/'",
    ]


@pytest.mark.parametrize("word", ["session 3", "ISSUE 4"])
def test_the_word_check_is_case_insensitive(tmp_path, word):
    (tmp_path / "README.md").write_text(f"# x\n\nsee {word}\n")
    assert check_docs(tmp_path) == [f"README.md:3: speaks of how the code was made: {word!r}"]
