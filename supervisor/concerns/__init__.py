"""What the loop watches for besides the deadlines, one object each behind one interface (`base.Concern`):
a runaway generate ended in the process, whether your script resumed, the resume audit, OOM recovery (the built-in
worker's micro-batch, a framework script's batch), the same failure twice, the wait for processes SIGKILL cannot
end, the goodput ledger, the prewarmed standby, stragglers.
`registered` is the one place that says which run has which: a concern switched off in the config is not in the list.

May import: `processes`, `watch`, `incidents`, `records`, `rules` and `hangwatch.common`; never `loop`, `escalation`
(its types only, for annotations) or `nodes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Optional, TypeVar

from hangwatch.supervisor.concerns.base import Concern, RunContext
from hangwatch.supervisor.concerns.events import Event, PassState
from hangwatch.supervisor.rules.answer import Answer
from hangwatch.supervisor.rules.policy import Decision

if TYPE_CHECKING:
    from hangwatch.common.durable import FsOps
    from hangwatch.supervisor.escalation.episode import Episode
    from hangwatch.supervisor.processes.attempt import Attempt
    from hangwatch.supervisor.processes.process import ProcessTable
    from hangwatch.supervisor.processes.standby import SpawnStandby

__all__ = [
    "Answer",
    "Concern",
    "Event",
    "PassState",
    "RunContext",
    "by_priority",
    "decide",
    "highest",
    "merged",
    "registered",
    "tell",
]

T = TypeVar("T")


def registered(
    run: RunContext, *, table: "ProcessTable", config_path: Path, spawn_standby: "SpawnStandby"
) -> list[Concern]:
    """The concerns of this run, in the order the loop tells them its events (where their answers conflict, their
    `priority` decides, not this order)."""
    from hangwatch.supervisor.concerns.framework_oom import FrameworkOom
    from hangwatch.supervisor.concerns.generate_overrun import GenerateOverrun
    from hangwatch.supervisor.concerns.goodput_accounting import GoodputAccounting
    from hangwatch.supervisor.concerns.in_process_recovery import InProcessRecovery
    from hangwatch.supervisor.concerns.oom_recovery import OomRecovery
    from hangwatch.supervisor.concerns.output_settle import OutputSettle
    from hangwatch.supervisor.concerns.prewarmed_standby import PrewarmedStandby
    from hangwatch.supervisor.concerns.repeated_failure import RepeatedFailure
    from hangwatch.supervisor.concerns.resume_audit import ResumeAudit
    from hangwatch.supervisor.concerns.resume_check import ResumeCheck
    from hangwatch.supervisor.concerns.straggler_report import StragglerReport
    from hangwatch.supervisor.concerns.unkillable_wait import UnkillableWait

    cfg = run.cfg
    concerns: list[Concern] = [OutputSettle(run), GoodputAccounting(run), StragglerReport(run)]
    if cfg.watchdog.generate_overrun == "truncate":
        concerns.append(GenerateOverrun(run))
    if cfg.worker.command is not None:
        concerns.append(ResumeCheck(run))
    if cfg.watchdog.resume_audit.enabled:
        concerns.append(ResumeAudit(run))
    if cfg.worker.command is None and cfg.restart.oom_remediation:
        concerns.append(OomRecovery(run))
    if cfg.worker.command is None and cfg.restart.in_process:
        concerns.append(InProcessRecovery(run))
    if cfg.worker.command is not None and cfg.worker.instrument == "auto" and cfg.restart.oom_remediation:
        concerns.append(FrameworkOom(run))  # the batch of an HF / TRL / Lightning script, set by the instrumentation
    concerns.append(RepeatedFailure(run))  # after the OOM remediation: its restart with another setting is no repeat
    if cfg.restart.prewarm:
        concerns.append(PrewarmedStandby(run, table=table, config_path=config_path, spawn=spawn_standby))
    concerns.append(UnkillableWait(run))  # last; its `priority`, the highest: its failure overrides any decision
    return concerns


def tell(concerns: Iterable[Concern], event: Event) -> None:
    """One observed moment, to every concern in turn (`Concern.observe`); an exception in one propagates."""
    for c in concerns:
        c.observe(event)


def by_priority(concerns: Iterable[Concern]) -> list[Concern]:
    """The concerns in ascending priority (the highest last); equal priorities keep their registered order."""
    return sorted(concerns, key=lambda c: c.priority)


def highest(concerns: Iterable[Concern], ask: Callable[[Concern], Optional[T]], *, every: bool = False) -> Optional[T]:
    """The answer of the highest-priority concern that answers (equal priorities: the earlier registered's).  Asked
    from the highest priority down, stopping at the first answer; `every`: every concern is asked, in registered
    order (none may miss the moment), and the answers weighed afterwards."""
    concerns = list(concerns)
    ranked = sorted(concerns, key=lambda c: -c.priority)
    if not every:
        return next(filter(None, (ask(c) for c in ranked)), None)
    answers = {id(c): ask(c) for c in concerns}
    return next(filter(None, (answers[id(c)] for c in ranked)), None)


def merged(concerns: Iterable[Concern], ask: Callable[[Concern], dict]) -> dict:
    """Every concern's fields (each asked, in registered order), merged in ascending priority: a higher one's field
    wins."""
    answers = [(c.priority, ask(c)) for c in concerns]
    fields: dict = {}
    for _, f in sorted(answers, key=lambda pa: pa[0]):
        fields.update(f)
    return fields


def decide(
    concerns: Iterable[Concern],
    attempt: Optional["Attempt"],
    episode: "Episode",
    now: float,
    *,
    fs: "FsOps",
    write_failed: Callable[[OSError, Path], None],
    undecided: Callable[[], Optional[Answer]] = lambda: None,
) -> Optional[Decision]:
    """The one owner of an episode's decision, asked once, when its tree is gone: the decision the loop proposed
    (`episode.proposed`), then each concern's answer in ascending `priority` — each handed the decision so far, the
    highest one's replacement wins — and with still none, `undecided()` (the nodes, the way out, the policy).  Each
    answer's writes are made here, through `fs`, before the next concern is asked (a refused one is reported through
    `write_failed` and its `refused` answer taken instead); its incident fields go into the episode's incident before
    the next concern is asked (`Episode.note`), and `finish` saves the incident once."""
    decision, kind = episode.proposed, None
    for c in by_priority(concerns):
        answer = carried_out(c.decision(attempt, episode, decision, now), fs, write_failed)
        if answer is not None:
            decision = answer.decision or decision
            kind = answer.kind or kind
            episode.note(answer.fields)  # the next concern reads what this one found
    if decision is None:
        answer = carried_out(undecided(), fs, write_failed)
        if answer is not None:
            decision, kind = answer.decision, answer.kind or kind
            episode.note(answer.fields)
    episode.settle(decision, kind)
    return decision


def carried_out(
    answer: Optional[Answer], fs: "FsOps", write_failed: Callable[[OSError, Path], None]
) -> Optional[Answer]:
    """`answer` with its files written, in order; at the first the disk refuses: reported, and the answer's
    `refused(exc)` instead (without one, the run fails naming the file: what a decider wants written, the next
    attempt needs)."""
    if answer is None:
        return None
    for w in answer.writes:
        try:
            fs.write_file(w.path, w.data)
        except OSError as exc:
            write_failed(exc, w.path)
            if answer.refused is not None:
                return answer.refused(exc)
            return Answer(Decision("fail", f"{w.path} could not be written: {exc}"))
    return answer


# The sibling packages and modules this package may import (its rule, checked by the import-rule test).
MAY_IMPORT = ("escalation", "incidents", "processes", "records", "rules", "watch")
