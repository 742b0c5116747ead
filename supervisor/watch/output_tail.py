"""The worker's output as evidence: when it last wrote anything, and when it last showed progress.

A worker hangwatch cannot instrument (`worker.instrument: off`, a program that is not Python, a Python too
old, a process that never beats) still writes its output to the attempt's `worker.log`.  `OutputTail` reads
what was appended since the last call — bounded per call, never blocking — and keeps three facts:

  * when output last grew (any byte: a hang is exactly the log that stops growing);
  * when a line last matched `watchdog.progress_pattern` (progress: a step line, a loss line, a tqdm counter),
    that line, the last `step` group seen, and how many steps the last read's lines named (`steps_read`: the
    step deadline of a script known by its output);
  * the last line, for the incident.

Lines end at `\\n` or `\\r` (tqdm redraws its bar with `\\r`); a line without its end yet waits for it.  The
time output grew is the file's modification time, taken after the read, mapped onto the loop's clock and
never before the previous read (as `beat_files.written_at` does for heartbeat lines); with `file_times`
off (a fake clock) it is the time of the read.  A log that grows faster than READ_CHUNK a call is read from
its last READ_CHUNK: only the newest lines matter.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

READ_CHUNK = 1 << 20  # most bytes read per call
PARTIAL_MAX = 64 * 1024  # an unterminated line is kept up to this long (then cut: a binary spew has no lines)
LINE_SHOWN = 300  # characters of a line kept for status and incidents
PROGRESS_BAR = re.compile(r"\d+/\d+\s*\[\d+:\d+|\d+%\|")  # tqdm's `12/100 [00:03<…` or `12%|██`
_ENDS = re.compile(rb"[\r\n]")


class OutputTail:
    def __init__(self, path: os.PathLike | str, pattern: Optional[str]):
        self.path = Path(path)
        self.regex = re.compile(pattern) if pattern else None
        self.offset = 0
        self.partial = b""
        self.skipped_bytes = 0  # bytes never read because the log outran READ_CHUNK
        self.last_output_at: Optional[float] = None
        self.last_line = ""
        self.last_progress_at: Optional[float] = None
        self.last_progress_line = ""
        self.progress_lines = 0
        self.step: Optional[int] = None
        self.steps_read = 0  # steps the last read's progress lines named (each a new number): for the step deadline
        self.read_at: Optional[float] = None
        self._fd: Optional[int] = None

    def read(self, now: float, wall_now: Optional[float] = None) -> tuple[bool, bool]:
        """Read what was appended; (output grew, a progress line came).  `wall_now`: time.time() at `now`, to date
        the growth by the file's modification time (None: date it `now`)."""
        previous, self.read_at = self.read_at, now
        self.steps_read = 0
        st = self._stat()
        if st is None:
            return False, False
        size = st.st_size
        if size < self.offset:  # truncated or replaced: read it from the start
            self.offset, self.partial = 0, b""
        if size == self.offset:
            return False, False
        if size - self.offset > READ_CHUNK:
            self.skipped_bytes += size - READ_CHUNK - self.offset
            self.offset, self.partial = size - READ_CHUNK, b""
        try:
            data = os.pread(self._fd, min(READ_CHUNK, size - self.offset), self.offset)
        except OSError:
            return False, False
        if not data:
            return False, False
        self.offset += len(data)
        when = now
        if wall_now is not None:
            try:
                mtime = os.fstat(self._fd).st_mtime
            except OSError:
                mtime = wall_now
            when = min(now, now - max(0.0, wall_now - mtime))
            if previous is not None:
                when = max(when, previous)
        self.last_output_at = when
        return True, self._lines(self.partial + data, when)

    def _lines(self, data: bytes, when: float) -> bool:
        pieces = _ENDS.split(data)
        self.partial = pieces.pop()[-PARTIAL_MAX:]
        progressed = False
        for raw in pieces:
            line = visible_text(raw.decode("utf-8", errors="replace"))
            if not line:
                continue
            self.last_line = line[:LINE_SHOWN]
            m = self.regex.search(line) if self.regex is not None else None
            if m is None:
                continue
            progressed = True
            self.progress_lines += 1
            self.last_progress_at = when
            self.last_progress_line = self.last_line
            step = m.groupdict().get("step")
            if step is None and "step" in self.regex.groupindex:  # `Epoch 2 step 30 …`: the epoch matched first
                step = next((s for s in (x.group("step") for x in self.regex.finditer(line)) if s), None)
            if step is not None and step.isdigit() and not PROGRESS_BAR.search(line):
                # The script's own words ("step 30 loss …"), never a progress bar's: a bar's counter and description
                # count micro-batches, eval batches or epochs as often as optimizer steps.  Lines that repeat the
                # step's number (`step 30 lr …` after `step 30 loss …`) are one step.
                if int(step) != self.step:
                    self.steps_read += 1
                self.step = int(step)
        return progressed

    def _stat(self) -> Optional[os.stat_result]:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            return os.fstat(self._fd)
        except OSError:
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def evidence(self, now: float) -> dict:
        """What the output said, for an incident and `status`."""

        def age(t: Optional[float]) -> Optional[float]:
            return None if t is None else round(now - t, 3)

        return {
            "log": str(self.path),
            "last_output_age_s": age(self.last_output_at),
            "last_line": self.last_line or None,
            "last_progress_age_s": age(self.last_progress_at),
            "last_progress_line": self.last_progress_line or None,
            "progress_lines": self.progress_lines,
            "step": self.step,
            **({"skipped_bytes": self.skipped_bytes} if self.skipped_bytes else {}),
        }


# What a terminal acts on and never shows.  ESC [ … final byte: CSI (colours, and the cursor moves tqdm draws nested
# bars with, `ESC[A`); ESC ] … BEL or ESC \: OSC (window titles, hyperlinks); ESC P/X/^/_ … ESC \: the other strings;
# ESC and one final byte (ESC 7, ESC (B).  A sequence cut off by the end of the text is dropped too.
_ESCAPES = re.compile(
    r"\x1b\][^\x07\x1b]*(?:\x07|\x1b\\|\Z)"
    r"|\x1b[PX^_][^\x1b]*(?:\x1b\\|\Z)"
    r"|\x1b\[[0-?]*[ -/]*(?:[@-~]|\Z)"
    r"|\x1b[ -/]*[0-~]"
)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # C0 and C1 controls but tab, a lone ESC included
_REDRAWS = re.compile(r"[\r\n]")


def visible_text(text: str) -> str:
    """What a terminal would leave on screen of one line of output: the text after the last carriage return that
    shows anything (a progress bar redraws itself over the same line with `\\r`), without ANSI escape sequences
    and control characters, stripped.  "" when nothing in it shows (a bare `ESC[A`, a lone `\\r`)."""
    for piece in reversed(_REDRAWS.split(_ESCAPES.sub("", text))):
        shown = _CONTROLS.sub("", piece).strip()
        if shown:
            return shown
    return ""
