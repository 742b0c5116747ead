#!/usr/bin/env python3
"""Render the configuration reference from the schema into README.md, between the markers

    <!-- config-reference:start -->
    <!-- config-reference:end -->

    python scripts/gen_config_reference.py            # rewrite README.md
    python scripts/gen_config_reference.py --check    # exit 1 when README.md is out of date

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


class MarkersMissing(Exception):
    pass


def render(readme_text: str, table: str) -> str:
    """`readme_text` with the table between the markers (replacing what was there)."""
    start = readme_text.find(START)
    end = readme_text.find(END)
    if start < 0 or end < 0 or end < start:
        raise MarkersMissing(f"README.md needs the markers {START} and {END} (in that order) around the config reference")
    head = readme_text[: start + len(START)]
    return f"{head}\n{table.rstrip()}\n{readme_text[end:]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if README.md is out of date")
    ap.add_argument("--readme", type=Path, default=REPO / "README.md")
    args = ap.parse_args(argv)
    try:
        current = args.readme.read_text()
    except FileNotFoundError:
        print(f"gen_config_reference: no {args.readme}", file=sys.stderr)
        return 2
    try:
        wanted = render(current, reference_markdown())
    except MarkersMissing as exc:
        print(f"gen_config_reference: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if wanted != current:
            print(f"gen_config_reference: the config reference in {args.readme} is out of date; "
                  "run: python scripts/gen_config_reference.py", file=sys.stderr)
            return 1
        print(f"{args.readme}: config reference is current")
        return 0
    if wanted != current:
        args.readme.write_text(wanted)
        print(f"{args.readme}: config reference updated")
    else:
        print(f"{args.readme}: config reference already current")
    return 0


if __name__ == "__main__":
    sys.exit(main())
