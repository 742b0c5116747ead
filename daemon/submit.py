"""`python -m hangwatch.daemon.submit --config CONFIG [--run-dir DIR] [--priority N] [--verbose] FILE…` —
what `hangwatch submit` runs: load the run's config, check each file as the worker will (JSON, fields,
lengths, label masks, with the run's tokenizer) and publish each good one into <run_dir>/inbox/ by rename.

It lives on the worker side because checking lengths needs the tokenizer, which the supervisor package
never imports; and it does all of the work (the config included) so that the `hangwatch` process that
starts it loads nothing but the command line.  The tokenizer is the light one (daemon/light_tokenizer.py:
no torch) wherever it gives the worker's ids; --verbose says on stderr which one checked the files.
Prints `accepted NAME (N examples)` or `rejected NAME: why` per file; exits 65 when any file was
rejected, 78 on a bad config or one whose run takes no files from an inbox.
"""

from __future__ import annotations

import argparse
import logging
import sys

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_OK


def say_config_problems(problems: list[str]) -> None:
    """The words `hangwatch run` and `validate-config` use for a bad config: a headline, one line per problem."""
    n = len(problems)
    print(f"hangwatch: invalid configuration ({n} problem{'s' if n != 1 else ''}):", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)


def verbose_logging() -> None:
    """hangwatch's own debug lines (which tokenizer, and why) on stderr; other libraries' stay quiet."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hangwatch: %(message)s"))
    logger = logging.getLogger("hangwatch")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hangwatch submit")
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir")
    ap.add_argument("--priority", type=int)
    ap.add_argument("--verbose", "-v", action="store_true")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.verbose:
        verbose_logging()
    from hangwatch.common.config import ConfigError, load_config

    try:
        cfg = load_config(a.config, a.run_dir)
    except ConfigError as exc:
        say_config_problems(exc.problems)
        return EXIT_CONFIG
    if not cfg.data.inbox:
        print(
            f"hangwatch: {a.config}: data.inbox is false: the run at {cfg.run_dir} does not take files from an inbox",
            file=sys.stderr,
        )
        return EXIT_CONFIG

    from hangwatch.daemon.data import load_tokenizer, validate_file
    from hangwatch.daemon.inbox.assess import validate_only
    from hangwatch.daemon.inbox.publish import publish

    files, priority = a.files, a.priority
    tokenizer = load_tokenizer(cfg)
    assessments = validate_only(
        files,
        lambda p: validate_file(p, tokenizer, cfg),
        run_dir=cfg.run_dir,
        max_file_bytes=cfg.data.max_file_bytes,
        on_bad_lines=cfg.data.on_bad_lines,
    )
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
