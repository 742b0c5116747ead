"""The worker's output on `hangwatch run`'s stdout (`ops/output_echo.py`): real files growing, a real thread."""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

from hangwatch.supervisor.ops.output_echo import OutputEcho


def view(attempt, log):
    return SimpleNamespace(attempt=attempt, worker=SimpleNamespace(log_path=log))


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_each_attempts_output_as_it_lands_with_a_line_where_the_next_began(tmp_path):
    out = io.BytesIO()
    echo = OutputEcho(out, poll_s=0.01)
    a1, a2 = tmp_path / "1.log", tmp_path / "2.log"
    a1.write_bytes(b"hello\nstep 1 loss 0.5\r 10%|#")
    echo.pass_done(view(1, a1), 0.0)
    assert wait_for(lambda: out.getvalue().endswith(b"10%|#"))  # bytes as written, a bar's \r too
    with open(a1, "ab") as f:
        f.write(b"\nTraceback ... RuntimeError: boom\n")
    a2.write_bytes(b"hello again\n")
    echo.pass_done(view(2, a2), 1.0)
    echo.pass_done(view(2, a2), 1.1)  # the same attempt: nothing changes
    assert wait_for(lambda: out.getvalue().endswith(b"hello again\n"))
    with open(a2, "ab") as f:
        f.write(b"done\n")
    echo.close()
    text = out.getvalue().decode()
    assert text == (
        "hello\nstep 1 loss 0.5\r 10%|#\nTraceback ... RuntimeError: boom\n"  # attempt 1's last words first
        "hangwatch: ──── attempt 2 ────\nhello again\ndone\n"  # close() copies what is left
    )


def test_a_run_that_picks_up_at_attempt_3_says_so_and_a_closed_stdout_stops_only_the_echo(tmp_path):
    class Gone(io.BytesIO):
        def write(self, data):
            raise BrokenPipeError("nobody reads")

    log = tmp_path / "3.log"
    log.write_bytes(b"x\n")
    out = io.BytesIO()
    echo = OutputEcho(out, poll_s=0.01)
    echo.pass_done(view(3, log), 0.0)
    echo.close()
    assert out.getvalue().startswith("hangwatch: ──── attempt 3 ────\n".encode())
    broken = OutputEcho(Gone(), poll_s=0.01)
    broken.pass_done(view(1, log), 0.0)
    broken.close()
    assert broken.failed and "nobody reads" in broken.failed
