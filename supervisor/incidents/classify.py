"""What the evidence says: a stalled worker from its processes' CPU and state, an ended one from its
last words (exit.json), exit code or signal, and the tail of its log — in that order of trust.

The words are the incident's `classification`, e.g. "busy loop in Python (CPU 100%)", "blocked in C
(CPU 0%, state S)", "uninterruptible I/O (state D)", "killed by SIGKILL (signal 9)".
"""

from __future__ import annotations

import re
import signal as _signal
from typing import Optional

from hangwatch.common.exitcodes import EXIT_CONFIG, EXIT_DATAERR, EXIT_IOERR, EXIT_TEMPFAIL
from hangwatch.supervisor.incidents.dumps import frame_str

OOM_PATTERNS = ("OutOfMemoryError", "out of memory", "MemoryError", "CUBLAS_STATUS_ALLOC_FAILED", "std::bad_alloc")
BUSY_CPU = 40.0  # % of one core: a hot loop (generous, CPUs are shared)
IDLE_CPU = 10.0


def process_condition(procs: list[dict]) -> tuple[str, str]:
    """(condition, words) of processes from their CPU and state; condition is one of `stopped`, `io`, `busy`,
    `blocked`, `partly` or `gone` (no process left).  Several processes (one rank's tree) count together:
    the busiest CPU and every state seen."""
    if not procs:
        return "gone", "no worker process left to inspect"
    states = {p.get("state") for p in procs}
    cpu = max(p.get("cpu_percent", 0.0) for p in procs)
    if states & {"T", "t"} and not states & {"R", "D"}:
        # Checked before CPU: a stopped process shows 0% CPU, which is not "blocked in C".
        return (
            "stopped",
            "stopped by a debugger (state t)" if "t" in states else "stopped (SIGSTOP or a debugger; state T)",
        )
    if "D" in states:
        return "io", f"uninterruptible I/O (state D, CPU {cpu:.0f}%)"
    if cpu >= BUSY_CPU or ("R" in states and cpu > IDLE_CPU):
        # a spinning loop never sleeps: always runnable (R), though it gets less than a core when CPUs are contended
        return "busy", f"busy loop in Python (CPU {cpu:.0f}%)"
    if cpu <= IDLE_CPU:
        state = "/".join(sorted(s for s in states if s)) or "?"
        return "blocked", f"blocked in C (CPU {cpu:.0f}%, state {state})"
    return "partly", f"partly busy (CPU {cpu:.0f}%)"


SLEEP_CALL = re.compile(r"\bsleep\s*\(")  # time.sleep(…), sleep(…): a C call with no frame of its own
SLEEP_NATIVE = re.compile(r"\b(pysleep|time_sleep|clock_nanosleep|nanosleep)\b")  # py-spy's native frames of it


def sleeping(source_line: Optional[str], native: list[str] = ()) -> bool:
    """The innermost frame sleeps: its line calls `sleep(` (faulthandler shows no frame for a C call), or py-spy's
    native frames of the main thread are in time.sleep's."""
    return bool(source_line and SLEEP_CALL.search(source_line)) or any(SLEEP_NATIVE.search(f) for f in native)


def classify_stall(
    kind: str, deadline: Optional[dict], procs: list[dict], frame: Optional[dict], asleep: bool = False
) -> str:
    """What the evidence shows about a stalled worker: CPU and state of its announced processes.  `asleep`: its
    innermost frame calls `time.sleep` — an idle process there is a Python loop that polls (and never moves on),
    not a call blocked in C."""
    condition, text = process_condition(procs)
    if condition == "gone":
        return text
    prompt = next((p for p in procs if p.get("reading_terminal")), None)
    if condition == "blocked" and prompt is not None:
        text = (
            f"waiting for input: pid {prompt['pid']} is blocked reading its terminal ({prompt['reading_terminal']}), "
            "a prompt nobody answered"
        )
    if condition == "blocked" and asleep:
        cpu = max(p.get("cpu_percent", 0.0) for p in procs)
        text = f"waiting in Python: a loop sleeping in time.sleep() (CPU {cpu:.0f}%)"
    if frame:
        text += f" at {frame_str(frame)}"
    if kind == "livelock" and deadline:
        text = (
            f"livelock: {deadline.get('progress_lines', 0)} progress beat(s) but no "
            f"{'step' if deadline.get('name') == 'step' else 'end of phase ' + repr(deadline.get('phase'))} "
            f"in {deadline.get('elapsed_s', 0):.1f}s; " + text
        )
    elif kind == "startup_timeout":
        text = "never sent its start beat; " + text
    return text


def signal_name(sig: Optional[int]) -> Optional[str]:
    if sig is None:
        return None
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def classify_exit(
    code: Optional[int],
    sig: Optional[int],
    last_words: Optional[dict],
    log_tail: str,
    *,
    killed_by_us: bool = False,
    sigkill_cause: Optional[str] = None,
    launcher: Optional[dict] = None,
) -> tuple[str, str]:
    """(kind, classification) of a worker that ended by itself.

    Last words (exit.json) first, then the exit code or signal, then what a launcher (torchrun's root
    cause report, `launcher`) says of its failed rank, then the log tail.  A SIGKILL hangwatch did not
    send is described by `sigkill_cause` (`episode.kernel_evidence.sigkill_cause`: the kernel's word, or "unknown").
    """
    lw = last_words or {}
    lw_kind = str(lw.get("kind") or "")
    lw_msg = str(lw.get("message") or "")
    lw_tb = str(lw.get("traceback") or "")
    lw_text = " ".join((lw_kind, lw_msg, lw_tb))
    exc_line = last_exception_line(lw_tb.splitlines()) or (f"{lw_kind}: {lw_msg}" if lw_kind or lw_msg else "")
    if code == EXIT_CONFIG and lw_kind == "oom":  # out of memory while loading: the model does not fit the device
        return "oom", f"{lw_msg.removeprefix('DoesNotFit: ')} (not restarted: the same model would not fit again)"
    if code == EXIT_CONFIG or lw_kind in ("config", "config_error"):
        return "config_error", f"configuration error: {lw_msg or exc_line or 'exit 78 (EX_CONFIG)'}"
    if code == EXIT_DATAERR or lw_kind in ("data", "data_error"):
        return "data_error", f"unusable data: {lw_msg or exc_line or 'exit 65 (EX_DATAERR)'}"
    if code == EXIT_TEMPFAIL or lw_kind in ("nan", "nonfinite", "non_finite"):
        return "nan", f"non-finite loss: {lw_msg or 'exit 75 (EX_TEMPFAIL)'}"
    if lw_kind == "checkpoint_failed":
        return "checkpoint_failed", f"checkpoint save failed: {lw_msg or exc_line}"
    if code == EXIT_IOERR or lw_kind == "disk":
        # Without last words (the disk took them too) the exit code alone says it.
        return "disk", f"the disk refused a write: {lw_msg or exc_line or 'exit 74 (EX_IOERR), no last words'}"
    if any(p in lw_text for p in OOM_PATTERNS) or lw_kind == "oom":
        return "oom", f"out of memory: {exc_line or lw_msg}"
    if last_words:
        return "crash", f"crash with {exc_line or lw_kind or 'an exception'}"
    if sig is not None:
        name = signal_name(sig)
        if sig == _signal.SIGKILL and not killed_by_us:
            cause = sigkill_cause or "not sent by hangwatch; what sent it is unknown"
            kind = "oom" if cause.startswith("the kernel's OOM killer") else "signal"
            return kind, f"killed by {name} (signal {sig}): {cause}"
        return "signal", f"killed by {name} (signal {sig})"
    if launcher and launcher.get("rank") is not None:
        exc = launcher.get("exception")
        how = f"killed by {launcher['signal']}" if launcher.get("signal") else f"exit code {launcher.get('exitcode')}"
        text = f"rank {launcher['rank']} failed first ({how}, pid {launcher.get('pid')}, per torchrun)"
        if launcher.get("signal") and not exc:
            kind = "oom" if "OOM killer" in launcher["signal"] and "not the OOM" not in launcher["signal"] else "signal"
            return kind, text
        if exc and any(p in exc for p in OOM_PATTERNS):
            return "oom", f"{text}: out of memory: {exc}"
        return "crash", f"{text}: {exc}" if exc else f"{text}; no exception in the log"
    tail_exc = last_exception_line(log_tail.splitlines())
    if tail_exc and any(p in tail_exc for p in OOM_PATTERNS):
        return "oom", f"out of memory: {tail_exc}"
    if tail_exc:
        return "crash", f"crash with {tail_exc} (from the worker log)"
    if any(p in log_tail for p in OOM_PATTERNS):
        line = last_oom_line(log_tail.splitlines())  # a traceback whose start is above the tail still ends in it
        return "oom", f"out of memory: {line} (from the worker log)" if line else "out of memory (from the worker log)"
    return "crash", f"exited with code {code} without last words"


# A launcher's own error about a child that failed (accelerate launch's subprocess.CalledProcessError, torchrun's
# ChildFailedError): the child's exception, printed before it, is the cause.
WRAPPER_ERRORS = re.compile(r"^(\w+\.)*(CalledProcessError|ChildFailedError)\b")


EXCEPTION_LINE = re.compile(r"^(\w+\.)*\w+(Error|Exception)\b: ")


def last_oom_line(lines: list[str]) -> Optional[str]:
    """The last `Type: message` line of `lines` whose exception is an out-of-memory one (torch's
    `torch.OutOfMemoryError: CUDA out of memory. Tried to allocate …`), or None."""
    for line in reversed(lines):
        text = line.strip()
        if EXCEPTION_LINE.match(text) and any(p in text for p in OOM_PATTERNS):
            return text
    return None


def last_exception_line(lines: list[str]) -> Optional[str]:
    """The `Type: message` line closing the last traceback in `lines` — the last that is not a launcher's error
    about its child (`WRAPPER_ERRORS`) when there is one: the child's own exception is the cause."""
    closing = []
    for idx in (i for i, l in enumerate(lines) if l.startswith("Traceback (most recent call last):")):
        for line in lines[idx + 1 :]:
            if line and not line.startswith((" ", "\t", "Traceback")):
                if line.startswith(("During handling", "The above exception")):
                    continue
                closing.append(line.strip())
                break
    if not closing:
        return None
    own = [c for c in closing if not WRAPPER_ERRORS.match(c)]
    return own[-1] if own else closing[-1]
