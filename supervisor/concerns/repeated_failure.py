"""The same failure twice in a row ends the run: a restart cannot help what happens identically each time.

A worker that ends with the same exception (kind and message) at the same step as the attempt before it — a
deterministic error: a typo'd path at start-up, a bad argument, a shape that never fits — would only do it again:
the restart policy would spend its whole crash-loop budget on identical attempts.  So at the second identical
failure the episode's decision becomes `fail`, and the incident says what repeated and where to look.  Failures
without an exception (a signal, a bare exit code) and stalls (a hang is often transient) are left to the restart
policy; so is an out-of-memory failure the OOM remediation answers with another micro-batch or batch (its next attempt
runs with another setting, so an OOM there is no repetition).

An out-of-memory failure is the same when its exception and the size it tried to allocate are: the rest of torch's
message (what is free, what other processes hold) moves a little from one attempt to the next.  Its words say what
to change — the batch size, by the framework argument `framework_oom` recorded when a framework trained — and the
message's figures ("Tried to allocate 2.0 GiB; 3.6 GiB allowed").

A failure without an exception is the same when it comes before any progress: a command that ends with the same exit
code (128+N for signal N) and the same last lines of output, before a step beat or a progress line of its own attempt,
as the attempt before it did — `python nosuch.py` ("can't open file"), an argparse typo ("usage: …", "error:
unrecognized arguments"), a script's own `sys.exit(3)` after its complaint — would say it again at every restart, and
the no-progress stop would only end it after several more.  It is judged once the attempt's tree is gone (the last of
its output and beats are read by then); its last lines are quoted in the incident (`last_output`, and its summary), so
the reason is where a person looks, not only in worker.log.

"The same last lines" is what the two outputs show at their end, as a terminal shows them (a redrawn progress bar as
its last state, no escape codes), compared as the characters of their last COMPARED_CHARS shown characters in any
order: stdout and stderr reach worker.log in the order hangwatch read them, which moves between two attempts when a
script writes to both at once — a line of one stream may even end up inside an unfinished line of the other.  Times,
long numbers (pids, ports) and addresses are masked: they move between two attempts of one failure; a small number
(an attempt's, a count) does not.  torchrun's report of a failed rank is left out (its times and pids are its own):
the rank's own words above it are the failure.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, replace
from typing import Optional

import structlog

from hangwatch.common.exitcodes import EXIT_NO_RETRY
from hangwatch.supervisor.concerns.base import Concern
from hangwatch.supervisor.concerns.events import AttemptStarted, Beat, OutputProgress
from hangwatch.supervisor.rules.answer import Answer
from hangwatch.supervisor.rules.oom_evidence import gib, parse_oom_message
from hangwatch.supervisor.rules.policy import Decision
from hangwatch.supervisor.watch.output_tail import LINE_SHOWN, visible_text

log = structlog.get_logger("hangwatch")

KINDS = ("crash", "oom")  # exits whose classification names an exception
TRIED = re.compile(r"Tried to allocate \d+(?:\.\d+)? (?:bytes|KiB|MiB|GiB)")
EXIT_KINDS = ("crash", "oom", "signal")  # the incidents of a worker's own end (a stall's are the deadline's)
SHOWN_LINES = 6  # the last lines of output quoted in the incident
COMPARED_CHARS = 240  # the last characters shown, whitespace aside, that must be the same (an error and its context)
TAIL_BYTES = 16 * 1024  # of worker.log, read at an attempt's end
# What moves between two attempts of one failure: an address, a date, a time of day, a number of 4 digits or more
MOVING = re.compile(r"0x[0-9a-fA-F]+|\d{4}-\d\d-\d\d|\d{1,2}:\d\d(?::\d\d)?(?:[.,]\d+)?|\d{4,}")
# Where torchrun's own account of a failed rank begins: its error line ("… failed (exitcode: 2) local_rank: 0 (pid: …)
# of binary: …"), else the ChildFailedError its traceback ends in (its report of times, hosts and pids follows)
TORCHRUN_REPORT = re.compile(r"failed \(exitcode: -?\d+\) local_rank|ChildFailedError")


def signature(kind: Optional[str], data: dict) -> Optional[tuple]:
    """What makes two failures the same: the kind, the exception in the classification, the step (None: an exit
    without an exception to compare)."""
    words = str(data.get("classification") or "")
    if kind not in KINDS or not any(m in words for m in ("crash with ", "out of memory: ")):
        return None
    tried = TRIED.search(words) if kind == "oom" else None
    if tried is not None:  # the figures after it (free, in use) differ a little between two attempts of one failure
        words = words[: tried.end()]
    return kind, words, data.get("step")


def oom_advice(data: dict) -> str:
    """What to change after the same out-of-memory failure twice: the batch (the framework's argument when one
    trained), with the figures of torch's message."""
    fr = data.get("framework_remediation") if isinstance(data.get("framework_remediation"), dict) else {}
    said = fr.get("oom_words")
    if not said:
        figures = parse_oom_message(str(data.get("classification") or ""))
        if figures:
            said = f"Tried to allocate {gib(figures['tried_mb'])}" + (
                f"; {gib(figures['allowed_mb'])} allowed"
                if figures.get("allowed_mb") is not None
                else f"; {gib(figures['free_mb'])} free of {gib(figures['total_mb'])}"
            )
    argument = fr.get("argument") or "the batch size of your training loop (its DataLoader's batch_size)"
    why = f"; hangwatch did not change the batch: {fr['why']}" if fr.get("why") else ""
    return (
        f"the same batch ran out of memory at the same step{f' ({said})' if said else ''}: lower {argument} and raise "
        f"the gradient accumulation by the same factor (the same examples per optimizer step), or shorten the "
        f"sequences{why}"
    )


@dataclass(frozen=True)
class EarlyEnd:
    """An attempt's own end before any progress: its exit code (128+N for signal N), the last lines of its output as
    a terminal would have shown them (quoted), and what it compares by (`said`)."""

    code: int
    lines: tuple[str, ...]
    said: str  # its last COMPARED_CHARS shown characters, whitespace aside, MOVING masked, in their order

    @property
    def last(self) -> str:
        return self.lines[-1]


def shown_lines(text: str) -> list[str]:
    """The lines of output that show anything, as a terminal leaves them (`visible_text`: a bar redrawn with `\\r` as
    its last state, escape codes gone); torchrun's report of a failed rank left out when the rank said anything above
    it."""
    lines = [line for raw in text.split("\n") if (line := visible_text(raw))]
    cut = next((i for i, line in enumerate(lines) if TORCHRUN_REPORT.search(line)), None)
    return lines[:cut] if cut else lines  # 0: nothing of the rank's own above it; the report is all there is


def early_end(code: Optional[int], sig: Optional[int], output: str, progressed: bool) -> Optional[EarlyEnd]:
    """The attempt's end as one an identical next attempt would repeat, or None: it made progress, it said nothing
    (nothing to compare, nothing to quote), or its exit is unknown."""
    status = 128 + sig if sig is not None else code
    lines = shown_lines(output)
    if progressed or status is None or not lines:
        return None
    said = "".join(MOVING.sub("#", "".join(line.split())) for line in lines)[-COMPARED_CHARS:]
    return EarlyEnd(status, tuple(line[:LINE_SHOWN] for line in lines[-SHOWN_LINES:]), said)


def same_end(before: Optional[EarlyEnd], now: Optional[EarlyEnd]) -> bool:
    """Two early ends in a row that a third attempt would only repeat: the same exit code, the same characters shown
    last (in any order: the two streams' bytes interleave as they were read)."""
    if before is None or now is None or before.code != now.code:
        return False
    return sorted(before.said) == sorted(now.said)


def log_tail(path) -> str:
    """The end of an attempt's worker.log, as written (carriage returns kept: `shown_lines` needs them); "" when it
    cannot be read."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - TAIL_BYTES))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", "replace")
    return text.split("\n", 1)[1] if size > TAIL_BYTES and "\n" in text else text  # the first line is probably cut


def status_words(code: int) -> str:
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name} ({code})"
        except ValueError:
            pass
    return f"exit code {code}"


class RepeatedFailure(Concern):
    priority = 30  # `decision`: after the OOM remedies: their restart with another setting is no repeat

    def __post_init__(self) -> None:
        self.name = "repeated_failure"
        self.previous: Optional[tuple] = None  # the last failure's signature (None: it had none, or none failed yet)
        self.previous_incident: Optional[str] = None
        # The early ends, judged when an attempt's tree is gone: the current attempt's progress and the attempt
        # before it
        self.progressed = False
        self.early: Optional[EarlyEnd] = None
        self.early_incident: Optional[str] = None

    # ---- an attempt's progress and end

    def on_attempt_started(self, ev: AttemptStarted) -> None:
        self.progressed = False

    def on_beat(self, ev: Beat) -> None:
        rec = ev.rec
        if rec.get("event") == "step":
            self.progressed = True

    def on_output_progress(self, ev: OutputProgress) -> None:
        self.progressed = True

    # ---- the decision, asked once the attempt's tree is gone (its output all read, its worker.log complete)

    def decision(self, attempt, episode, decision, now: float) -> Optional[Answer]:
        inc = episode.incident
        if inc is None:  # an end without an incident (a clean one, a peer's new generation): no repetition across it
            self.early, self.early_incident = None, None
            return None
        end = self.early_end(attempt, episode)
        fields: dict = {}
        if end is not None:  # an early end's last lines go into its incident
            summary = str(inc.data.get("summary") or "")
            if end.last not in summary:
                summary = f"{summary}; its output ended: {end.last}" if summary else f"its output ended: {end.last}"
            fields.update(last_output=list(end.lines), summary=summary)
        repeated = self.same_exception(episode, decision)
        if repeated is not None:
            decision = repeated.decision  # a failure already: the early end is only recorded, never reported again
        early = self.same_early_end(inc, end, decision, fields)  # asked either way: it follows the early ends
        if repeated is not None:
            return replace(repeated, fields={**fields, **repeated.fields})
        return early or (Answer(None, fields) if fields else None)

    def early_end(self, attempt, episode) -> Optional[EarlyEnd]:
        """How the attempt ended when it ended by itself before any progress (a beat's step, a progress line in its
        output, printed even just before it exited), else None."""
        w = attempt.worker
        if episode.expired is not None or episode.kind not in EXIT_KINDS or not w.exited:
            return None
        shown = attempt.output is not None and attempt.output.progress_lines > 0
        return early_end(w.exit_code, w.exit_signal, log_tail(w.log_path), self.progressed or shown)

    def same_exception(self, episode, decision) -> Optional[Answer]:
        inc = episode.incident
        if decision is None:
            return None
        sig = signature(episode.kind, inc.data)
        before, before_id = self.previous, self.previous_incident
        self.previous, self.previous_incident = sig, inc.id
        if sig is None or sig != before or decision.action != "restart" or decision.rollback:
            return None  # rollback: the OOM remediation's restart with another setting
        kind, words, step = sig
        where = f"after step {step}" if step else "before the first step"  # its last step beat (0: none yet)
        advice = (
            oom_advice(inc.data)
            if kind == "oom"
            else "fix the cause (the worker log of each attempt has the whole traceback) and run again"
        )
        reason = (
            f"the same failure twice in a row {where} (incidents {before_id} and {inc.id}): {words} — a restart "
            f"would only repeat it: {advice}"
        )
        log.error("repeated_failure", incident=inc.id, previous=before_id, step=step, text=words)
        # hangwatch's own do-not-retry status: the exception, at the same step, is what ended the run — not the exit
        # code the interpreter chose for it (an early end keeps the command's own: it is all the command said)
        return Answer(Decision("fail", reason, exit_code=EXIT_NO_RETRY), {"repeated": before_id})

    def same_early_end(self, inc, end: Optional[EarlyEnd], decision, fields: dict) -> Optional[Answer]:
        """The same early end as the attempt before it ends the run, unless something else already decided what
        follows.  `fields`: what this answer already adds to the incident."""
        before, before_id = self.early, self.early_incident
        self.early, self.early_incident = end, inc.id
        if decision is None or decision.action != "restart" or decision.rollback or not same_end(before, end):
            return None
        how = status_words(end.code)
        reason = (
            f"the same end twice in a row before any progress ({how}, incidents {before_id} and {inc.id}), its "
            f"output ending: {end.last} — a restart would only repeat it: fix the cause (the incident quotes the "
            "last lines of the output; each attempt's whole output is in its worker.log) and run again"
        )
        summary = fields.get("summary", inc.data.get("summary"))
        summary = f"{summary} — the same as incident {before_id}, before any progress: not restarted"
        log.error("repeated_early_end", incident=inc.id, previous=before_id, code=end.code, text=end.last)
        return Answer(Decision("fail", reason), {**fields, "repeated": before_id, "summary": summary})
