"""`python -m hangwatch.daemon.submit --config CONFIG [--run-dir DIR] [--priority N] FILE…` — what
`hangwatch submit` runs: check each file as the worker will (JSON, fields, lengths, label masks,
with the run's tokenizer) and publish each good one into <run_dir>/inbox/ by rename.

It lives on the worker side because checking lengths needs the tokenizer (transformers, torch),
which the supervisor package never imports.  Prints `accepted NAME (N examples)` or
`rejected NAME: why` per file; exits 65 when any file was rejected, 78 on a bad config.
"""
from __future__ import annotations

import argparse
import sys

from hangwatch.common.config import ConfigError, load_config
from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hangwatch submit")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir")
    ap.add_argument("--priority", type=int)
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.run_dir)
    except ConfigError as exc:
        print("\n".join(exc.problems), file=sys.stderr)
        return EXIT_CONFIG

    from hangwatch.daemon.data import load_tokenizer, validate_file
    from hangwatch.daemon.inbox.assess import validate_only
    from hangwatch.daemon.inbox.publish import publish

    files, priority = a.files, a.priority
    tokenizer = load_tokenizer(cfg)
    assessments = validate_only(files, lambda p: validate_file(p, tokenizer, cfg), run_dir=cfg.run_dir,
                                max_file_bytes=cfg.data.max_file_bytes, on_bad_lines=cfg.data.on_bad_lines)
    failed = 0
    for a in assessments:
        name = a.path.name
        if not a.accepted:
            failed += 1
            print(f"rejected {name}: " + "; ".join(a.why_not()))
            continue
        try:
            published = publish(a.path, cfg.run_dir, priority=priority)
        except (OSError, ValueError) as exc:
            failed += 1
            print(f"rejected {name}: could not publish into {cfg.run_dir}/inbox: {exc}")
            continue
        extra = f"; {a.problems_total} bad line(s) will be left out" if a.skipped_lines else ""
        renamed = f" as inbox/{published.name}" if published.name != name else ""
        print(f"accepted {name} ({a.examples} example{'s' if a.examples != 1 else ''}{extra}){renamed}")
    return EXIT_DATAERR if failed else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
