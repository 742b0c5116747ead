"""Which rank of a multi-rank stall is the culprit, and which only wait for it — from each rank's own evidence.

When one rank of a DDP job hangs, every other rank soon waits for it in a collective, and every rank's
deadline fires at about the same moment: which deadline fired first says nothing.  So each rank is read
from its own process (state, CPU) and its own stack (the stuck frame, the collective it waits in):

* a rank waiting in a collective (`all_reduce`, `barrier`, `wait` of c10d work, DDP's reducer, …), or in
  a phase it announced as waiting for its peers (`wait`), is a **victim**;
* a rank idle inside `backward()` with no C stack to look into (no py-spy, or py-spy could not read it:
  `collectives.probable_wait`) is **probably waiting** — DDP all-reduces the gradients in C++ hooks, below
  any Python frame — which its own evidence cannot tell from being the culprit: it is never named the
  culprit for being outside a collective, only counted with the ranks that wait;
* the rank that is not in a collective is the **culprit** — when several are not, the one behind the
  others in step count, else the only one spinning; when every rank waits (or probably waits), one that is
  behind in step count or in the NCCL collective sequence (flight recorder) is;
* anything else is **unknown**, and the verdict says it cannot tell, and why, instead of guessing.

The words of a rank that is not a victim name the call it is in (`landmarks.read_stack`): "rank 1: busy loop
in Python (CPU 99%) at sdpa_attention_forward (…), in generate(), called from on_evaluate (train.py:46)".

Pure: evidence in, verdict out.  The episode gathers the evidence (`RankEvidence`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

from hangwatch.supervisor.incidents.classify import process_condition
from hangwatch.supervisor.incidents.collectives import probable_wait, waits_in
from hangwatch.supervisor.incidents.dumps import frame_str
from hangwatch.supervisor.incidents.landmarks import read_stack

WAIT_PHASES = frozenset({"wait"})  # a phase a rank enters to wait for its peers (the built-in worker's barrier)
DEFINITE = frozenset({"gone", "io", "stopped", "busy"})  # conditions that say, without a stack, a rank is not waiting

CULPRIT, VICTIM, UNKNOWN = "culprit", "victim", "unknown"


@dataclass(frozen=True)
class RankEvidence:
    rank: int
    pid: Optional[int] = None
    proc: Optional[dict] = None  # its snapshot record (state, cpu_percent); None: no process left
    stack: list = field(default_factory=list)  # main-thread frames from its dump, innermost first ([]: no dump)
    native: list = field(default_factory=list)  # py-spy's native frames of its main thread, innermost first
    source_line: Optional[str] = None  # the text of its innermost frame's line
    step: Optional[int] = None
    phase: Optional[str] = None
    progress_lines: int = 0  # `progress` beats since its last step
    livelock: bool = False  # still beating progress late in the window, no step
    collective_seq: Optional[int] = None  # last collective it enqueued (NCCL flight recorder), when known
    truncated: bool = False  # its stack is faulthandler's innermost 100 frames only


@dataclass(frozen=True)
class RankFinding:
    rank: int
    pid: Optional[int]
    state: Optional[str]
    cpu_percent: Optional[float]
    condition: str  # busy | blocked | io | stopped | partly | gone
    classification: str
    stuck_frame: Optional[dict]
    collective: Optional[str]  # what it waits in, if anything
    step: Optional[int]
    phase: Optional[str]
    has_stack: bool
    role: str = UNKNOWN
    landmark: Optional[dict] = None  # the call its main thread is in (landmarks.read_stack)
    caller_frame: Optional[dict] = None  # the frame of the user's own code that called it
    landmark_words: str = ""  # "in generate(), called from on_evaluate (train.py:46)"
    probable: Optional[str] = None  # no C stack, idle in backward(): what it probably waits in (`probable_wait`)

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "state": self.state,
            "cpu_percent": self.cpu_percent,
            "classification": self.classification,
            "stuck_frame": self.stuck_frame,
            "collective": self.collective,
            "probable_wait": self.probable,
            "step": self.step,
            "phase": self.phase,
            "role": self.role,
            "landmark": self.landmark,
            "caller_frame": self.caller_frame,
        }

    @property
    def waits(self) -> bool:
        """It waits for its peers, or probably does: no culprit on its own evidence."""
        return self.collective is not None or self.probable is not None

    @property
    def words(self) -> str:
        """Its classification and the call it is in, for a rank that is not only waiting for its peers."""
        return f"{self.classification}, {self.landmark_words}" if self.landmark_words else self.classification


@dataclass(frozen=True)
class Verdict:
    culprit_rank: Optional[int]
    ranks: list  # RankFinding per rank, by rank
    summary: str  # the culprit first: "rank 1: busy loop … at f (x.py:9); rank 0 waiting in all_reduce"
    reason: str  # why that rank (or why none)

    def finding(self, rank: Optional[int]) -> Optional[RankFinding]:
        return next((f for f in self.ranks if f.rank == rank), None)


def read_rank(ev: RankEvidence, landmarks: tuple = ()) -> RankFinding:
    """One rank on its own evidence: its process condition, stuck frame, the collective it waits in and the call
    it is in; `landmarks`: the user's (`landmarks.user_landmarks`)."""
    procs = [ev.proc] if ev.proc else []
    condition, words = process_condition(procs)
    frame = ev.stack[0] if ev.stack else None
    if frame and condition != "gone":
        words += f" at {frame_str(frame)}"
    if ev.livelock:
        words = f"livelock: {ev.progress_lines} progress beat(s) but no step; {words}"
    collective = waits_in(ev.stack, ev.native, ev.source_line)
    if collective is None and ev.phase in WAIT_PHASES:
        collective = f"phase {ev.phase!r}"
    # Idle in backward() and no C stack to look into: DDP's all-reduce is below any Python frame.  Busy there, it
    # computes its gradients (or spins in a hook) and is read as ever.
    probable = probable_wait(ev.stack, ev.native) if collective is None and condition == "blocked" else None
    if probable is not None:
        words = f"{probable_words(probable)}; {words}"
    reading = read_stack(
        ev.stack, native=ev.native, source_line=ev.source_line, extra=landmarks, truncated=ev.truncated
    )
    return RankFinding(
        ev.rank,
        ev.pid,
        ev.proc.get("state") if ev.proc else None,
        ev.proc.get("cpu_percent") if ev.proc else None,
        condition,
        words,
        frame,
        collective,
        ev.step,
        ev.phase,
        bool(ev.stack),
        landmark=reading.landmark,
        caller_frame=reading.caller_frame,
        landmark_words=reading.words(),
        probable=probable,
    )


def probable_words(probable: str) -> str:
    """The reading of a rank that probably waits: "waiting, probably in DDP's gradient all-reduce — cannot tell the
    culprit from this rank alone"."""
    return f"waiting, probably in {probable} — cannot tell the culprit from this rank alone"


def decide(evidence: list[RankEvidence], landmarks: tuple = ()) -> Verdict:
    """The verdict over every rank that announced itself (one rank: it is the culprit, nothing to weigh);
    `landmarks`: the user's own (`landmarks.user_landmarks`), besides the built-in ones."""
    found = {ev.rank: read_rank(ev, landmarks) for ev in sorted(evidence, key=lambda e: e.rank)}
    seqs = {ev.rank: ev.collective_seq for ev in evidence if ev.collective_seq is not None}
    if not found:
        return Verdict(None, [], "cannot tell which rank is the culprit: no rank announced itself", "no ranks")
    if len(found) == 1:
        ((rank, f),) = found.items()
        return _verdict(found, rank, "the only rank")
    outside = [r for r, f in found.items() if not f.waits and (f.has_stack or f.condition in DEFINITE)]
    silent = [r for r, f in found.items() if not f.waits and r not in outside]  # no stack, nothing definite
    probably = [r for r, f in found.items() if f.collective is None and f.probable is not None]
    if outside and not silent:
        if len(outside) == 1:
            return _verdict(
                found,
                outside[0],
                "the only rank not waiting in a collective" + (", or probably in one" if probably else ""),
            )
        rank, why = _narrow(found, seqs, outside)
        if rank is not None:
            return _verdict(found, rank, why)
        return _cannot(found, f"ranks {_list(outside)} are all outside any collective and none stands out")
    if not outside and not silent:
        rank, why = _behind(found, seqs, list(found))
        if rank is not None:
            return _verdict(found, rank, why)
        if probably:
            return _cannot(
                found,
                f"every rank waits in a collective or probably does (rank(s) {_list(probably)} inside "
                f"backward(), with no C stack to show it)" + _same_step(found),
            )
        return _cannot(found, "every rank waits in a collective" + _same_step(found))
    return _cannot(
        found,
        f"rank(s) {_list(silent)} gave no stack"
        + (f" while rank(s) {_list(outside)} are outside any collective" if outside else ""),
    )


def _narrow(found: dict, seqs: dict, ranks: list[int]) -> tuple[Optional[int], str]:
    """Among several ranks outside a collective: the one behind in step count or in the NCCL collective sequence
    (with NCCL a rank's collective returns at once and it blocks later, at a CUDA sync, outside any collective
    frame), else the only one spinning."""
    rank, why = _behind(found, seqs, ranks)
    if rank is not None:
        return rank, why
    busy = [r for r in ranks if found[r].condition == "busy"]
    if len(busy) == 1:
        return busy[0], "the only rank outside a collective that spins"
    return None, ""


def _behind(found: dict, seqs: dict, ranks: list[int]) -> tuple[Optional[int], str]:
    """The one rank strictly behind all the others in step count, else in the collective sequence."""
    for what, values in (
        ("step", {r: found[r].step for r in ranks}),
        ("collective sequence", {r: seqs.get(r) for r in ranks}),
    ):
        known = {r: v for r, v in values.items() if isinstance(v, int)}
        if len(known) < len(ranks):
            continue  # a rank without the figure could be the one behind
        low = min(known.values())
        lowest = [r for r, v in known.items() if v == low]
        if len(lowest) == 1 and len(known) > 1:
            others = sorted({v for r, v in known.items() if r != lowest[0]})
            return lowest[0], f"behind the others in {what} ({low} against {', '.join(map(str, others))})"
    return None, ""


def _same_step(found: dict) -> str:
    steps = {f.step for f in found.values()}
    return f" at step {steps.pop()}" if len(steps) == 1 and None not in steps else ""


def _verdict(found: dict, culprit: int, reason: str) -> Verdict:
    ranks = [_with_role(f, CULPRIT if r == culprit else VICTIM if f.waits else UNKNOWN) for r, f in found.items()]
    c = found[culprit]
    # Being behind is the reason worth saying: the culprit may itself sit in a collective (a later one's peers wait).
    head = f"rank {culprit}, {reason}" if reason.startswith("behind") else f"rank {culprit}"
    parts = [f"{head}: {c.words}"] + _others(ranks, culprit)
    return Verdict(culprit, ranks, "; ".join(parts), reason)


def _cannot(found: dict, why: str) -> Verdict:
    ranks = [_with_role(f, VICTIM if f.collective is not None else UNKNOWN) for f in found.values()]
    parts = [f"cannot tell which rank is the culprit: {why}"] + _others(ranks, None)
    return Verdict(None, ranks, "; ".join(parts), why)


def _others(ranks: list[RankFinding], culprit: Optional[int]) -> list[str]:
    """Victims grouped by what they wait in ("ranks 0, 2 waiting in all_reduce"; "rank 1 waiting, probably in DDP's
    gradient all-reduce (no C stack)"), then the unknown ones."""
    groups: dict[str, list[int]] = {}
    for f in ranks:
        if f.role == VICTIM:
            what = f" in {f.collective}" if f.collective is not None else f", probably in {f.probable} (no C stack)"
            groups.setdefault(what, []).append(f.rank)
    out = [f"{'ranks' if len(rs) > 1 else 'rank'} {_list(rs)} waiting{what}" for what, rs in groups.items()]
    out += [
        f"rank {f.rank}: {f.words}" + ("" if f.has_stack else " (no stack)")
        for f in ranks
        if f.role == UNKNOWN and f.rank != culprit
    ]
    return out


def _with_role(f: RankFinding, role: str) -> RankFinding:
    return replace(f, role=role)


def _list(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))
