"""The common hand-made watchdog, as people run it from cron or a shell loop — a baseline to compare.

Every `--poll-s` (30 s) it looks at the mtime of a status file (the worker's log); when the file has
not changed for `--threshold-s` (600 s) it `kill -9`s the worker and starts it again. It takes no
stack dump, kills only the pid it knows, and knows nothing about phases or steps.

    python scripts/baselines/cron_watchdog.py --status-file LOG --allowance-s 120 -- CMD...

Prints one JSON object: whether it noticed, when (seconds after start, and as wall-clock time), how
many times it polled and restarted, and whether the run finished within the allowance.  It takes no
stack dump by construction; whether one exists is for the caller to check in the run directory.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--status-file", required=True)
    ap.add_argument("--poll-s", type=float, default=30.0)
    ap.add_argument("--threshold-s", type=float, default=600.0)
    ap.add_argument("--allowance-s", type=float, required=True)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd and a.cmd[0] == "--" else a.cmd
    t0 = time.monotonic()
    started_unix = time.time()
    log = open(a.status_file, "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    noticed_at = noticed_unix = None
    polls = 0
    restarts = 0
    finished = False
    while time.monotonic() - t0 < a.allowance_s:
        time.sleep(min(a.poll_s, max(0.0, a.allowance_s - (time.monotonic() - t0))))
        polls += 1
        if proc.poll() is not None:
            if proc.returncode == 0:
                finished = True
                break
            restarts += 1
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            continue
        age = time.time() - os.stat(a.status_file).st_mtime
        if age > a.threshold_s:
            if noticed_at is None:
                noticed_at, noticed_unix = round(time.monotonic() - t0, 1), time.time()
            proc.kill()
            proc.wait()
            restarts += 1
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    print(
        json.dumps(
            {
                "noticed": noticed_at is not None,
                "noticed_after_s": noticed_at,
                "noticed_unix": noticed_unix,
                "started_unix": started_unix,
                "poll_s": a.poll_s,
                "threshold_s": a.threshold_s,
                "polls": polls,
                "restarts": restarts,
                "finished": finished,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
