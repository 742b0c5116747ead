"""`python -m hangwatch.daemon.doctor CONFIG [--json | --plain] [--cheap] [--run-dir DIR]` — what
`hangwatch doctor` (and, with --cheap --plain, `hangwatch run` before its first attempt) runs.

It lives on the worker side because it runs the worker's own code (tokenizer, data, model, schedule,
generate), which the supervisor package never imports.  Exit 0 when no check FAILs, 1 when one does,
78 for a config that does not load (its problems on stderr, in `hangwatch run`'s words).
"""

from __future__ import annotations

import argparse
import sys
import time

from hangwatch.common.exitcodes import EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hangwatch doctor")
    ap.add_argument("config")
    ap.add_argument("--run-dir")
    ap.add_argument(
        "--cheap", action="store_true", help="no model load: config, data, tokenizer, schedule, disk, py-spy"
    )
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true")
    out.add_argument("--plain", action="store_true")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    from hangwatch.common.config import ConfigError, load_config
    from hangwatch.daemon.submit import say_config_problems

    try:
        cfg = load_config(a.config, a.run_dir)
    except ConfigError as exc:
        say_config_problems(exc.problems)
        return EXIT_CONFIG
    from hangwatch.daemon.standby_worker import quiet_libraries

    quiet_libraries()  # offline, no progress bars: as the worker
    from hangwatch.daemon.doctor.findings import exit_code
    from hangwatch.daemon.doctor.findings_view import as_json, as_plain, print_table
    from hangwatch.daemon.doctor.runner import Doctor

    findings = Doctor(cfg, cheap=a.cheap).run()
    seconds = time.monotonic() - t0
    mode = "cheap" if a.cheap else "full"
    if a.json:
        print(as_json(a.config, mode, findings, seconds))
    elif a.plain:
        print("\n".join(as_plain(findings, seconds)))
    else:
        print_table(a.config, mode, findings, seconds)
    sys.stdout.flush()
    return exit_code(findings)


if __name__ == "__main__":
    sys.exit(main())
