#!/usr/bin/env python3
"""Render the configuration reference from the schema into docs/configuration.md, between the markers

    <!-- config-reference:start -->
    <!-- config-reference:end -->

    python scripts/gen_config_reference.py                 # rewrite docs/configuration.md
    python scripts/gen_config_reference.py --check         # exit 1 when docs/configuration.md is out of date
    python scripts/gen_config_reference.py --file F.md     # another Markdown file with the markers

One schema (common/config/schema.py) drives validation, this table and `hangwatch run --help`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hangwatch.common.config import reference_markdown  # noqa: E402

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
DEFAULT_TARGET = REPO / "docs" / "configuration.md"


class MarkersMissing(Exception):
    pass


def render(text: str, table: str, name: str = "docs/configuration.md") -> str:
    """`text` with the table between the markers (replacing what was there); `name` is for the error."""
    start = text.find(START)
    end = text.find(END)
    if start < 0 or end < 0 or end < start:
        raise MarkersMissing(f"{name} needs the markers {START} and {END} (in that order) around the config reference")
    head = text[: start + len(START)]
    return f"{head}\n{table.rstrip()}\n{text[end:]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if the file is out of date")
    # --readme: the option's former name, from when the table lived in README.md
    ap.add_argument(
        "--file",
        "--readme",
        dest="file",
        type=Path,
        default=DEFAULT_TARGET,
        help="the Markdown file holding the markers (default: docs/configuration.md)",
    )
    args = ap.parse_args(argv)
    try:
        current = args.file.read_text()
    except FileNotFoundError:
        print(f"gen_config_reference: no {args.file}", file=sys.stderr)
        return 2
    try:
        wanted = render(current, reference_markdown(), str(args.file))
    except MarkersMissing as exc:
        print(f"gen_config_reference: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if wanted != current:
            print(
                f"gen_config_reference: the config reference in {args.file} is out of date; "
                "run: python scripts/gen_config_reference.py",
                file=sys.stderr,
            )
            return 1
        print(f"{args.file}: config reference is current")
        return 0
    if wanted != current:
        args.file.write_text(wanted)
        print(f"{args.file}: config reference updated")
    else:
        print(f"{args.file}: config reference already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
