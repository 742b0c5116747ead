"""The deadlines of a worker attempt, as pure bookkeeping over heartbeat lines and the worker's output.

Nothing here reads a clock: every call takes `now`, the supervisor's monotonic time at which it
read the line or checks.  The writer's own `t` is only recorded, never trusted for deadlines.

* **startup** — spawn → the first `start` line (from any rank).
* **phase** — time in the current phase of a rank; budget from the line's `budget_s`, else a budget the
  config sets for that phase name, else the one learned from the run (a multiple of the longest that phase
  took, once it completed a few times: `watchdog.phase_learn`), else the default (`phase_budgets_s`' own
  defaults, `default_phase_budget_s`).
  `train` has none unless one is given: it is governed by the step deadline.
* **step** — while in `train`: time since the later of the last step and entering `train`;
  `step_timeout_s` when fixed, else the budget learned from the run's step times (`calibration.py`: a multiple
  of the longest of the first few, refined with every step after), else `first_steps_timeout_s`.  Each rank's
  first two steps of an attempt are warm-up (a compile, a cache filled, the first step after a resume): they run
  under `first_steps_timeout_s` (or the learned budget, if longer), and the interval between them is no sample.
* **token** — inside `generate` (`watchdog.token_deadline`): time since the last progress beat that counted
  tokens.  Such a beat carries the longest gap between two new tokens since the one before (`token_s`, timed in
  the generating thread, the first decoding step left out); the budget is what the next beat may take at the
  speed seen: `token_timeout_factor` × the tokens a beat stands for × the p99 of the gaps, at least
  `token_timeout_min_s`.  It applies from the first generate on, once a beat has counted tokens: a generate
  whose tokens stop is a stall within seconds, and one that is slow but still producing them never is (its
  length is the phase budget's business, and a runaway `generate_overrun`'s).  Beats without `token_s` (a writer
  that does not time its tokens) arm nothing.
* **silence** — time since the rank's last line of any kind.
* **output_silence** — while no rank has sent `start` (a worker that does not beat): time since its
  output last grew (`output_tail`), else since spawn; `output_silence_timeout_s`.

Output that shows progress (`watchdog.progress_pattern`) ends the startup deadline as a `start` line
does (a worker that clearly works is not killed for not beating).  A progress line that names its step
(`step 30 loss …`: the pattern's `step` group, never a progress bar's) is a step: the first one ends a rank's
`load` phase — a script that steps no optimizer, known by its output — and from then on the rank is in `train`,
its steps those its output names and its step budget learned from them, as from step lines.  The output is read
in the loop's passes (at most once a second, at least every few seconds), each read dating all its lines at the
log's modification time, so a read of n steps teaches n samples: the time since the previous step seen (no gap in
it was longer) and n − 1 times that time shared out among them — and the first read, which ends `load`, teaches
n − 1 gaps, the time since the previous read's output shared out among its lines.  While such a rank is in
`train` its output counts as its lines for the silence deadline.  Progress without a step number (a tqdm bar, a
loss dict, an epoch) keeps a `load` phase alive: its budget counts from the later of entering `load` and the last
progress line.

A runaway `generate` the supervisor ordered to end in-process (`watchdog.generate_overrun: truncate`) gets a
grace (`grant_grace`): every phase that began before the order may run until the order's time plus the grace —
the generate itself, and the ranks waiting for it — so the truncation has time to land; a generate that does
not stop by then fires as any overdue phase does.

`load` (after `start`, while the worker imports its framework and loads the model: one long
call that cannot beat) is part of starting up: silence does not apply in it, and its phase
budget is the configured one for `load`, else `startup_timeout_s`.

A `progress` line resets only silence, so a loop that keeps saying "alive" without finishing a
step still runs into the step or phase deadline (and is reported as a livelock).  A rank that
sent `stop` has no deadlines left.  `shift(gap)` moves every anchor forward by a stretch in which
the supervisor itself was not running (SIGSTOP, a suspended laptop), so such a gap never fires.

The loop asks two things many times a second: when the earliest deadline falls due (its sleep) and
whether one is due (each pass).  Both come from `_due_at`, plain arithmetic over the anchors, kept
until an input changes the anchors (every method that moves one bumps a version); the `Expired`
records are built only once something is due.  A learned budget (a p99 over up to 1000 samples, a sort) is
recomputed after every new sample while there are fewer than 40, then after every `len/20` new ones (a 5%
turnover of the window: at 640 steps a second, 13 sorts instead of 640), and at once when learning begins or
the number of samples changed behind this object's back (a reload).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

from hangwatch.common.config import WatchdogCfg
from hangwatch.common.config.schema import DEFAULT_PHASE_BUDGETS_S
from hangwatch.supervisor.watch.calibration import Calibration

UNTIMED_PHASES = frozenset({"train", "idle"})  # train: the step deadline; idle: waiting for work is fine
QUIET_PHASES = frozenset({"load"})  # one long call that cannot beat: bounded by its phase budget instead
DUE_SLACK_S = 1e-6  # `check` takes the fast "nothing due" answer only this clearly before the earliest due time
WARM_UP_STEPS = 2  # a rank's first steps of an attempt run under first_steps_timeout_s; the interval between them
#                    (step 1 → 2: a recompile, lazily built optimizer state) is never a sample


@dataclass
class RankTrack:
    rank: int
    pid: Optional[int] = None
    started: bool = False
    stopped: bool = False
    last_line_at: float = 0.0
    phase: str = "init"
    phase_since: float = 0.0
    phase_budget: Optional[float] = None
    phase_budget_source: str = "none"
    step: int = 0
    last_step_at: Optional[float] = None
    train_since: Optional[float] = None
    last_progress_at: Optional[float] = None
    progress_since_step: int = 0  # progress lines since the last step or phase change
    skip_next_sample: bool = False
    abandoned: bool = False  # its current phase was abandoned in the process: its length is no sample to learn from
    steps_seen: int = 0  # steps since its last `start` (warm-up: the first WARM_UP_STEPS)
    output_steps: bool = False  # in `train` by its output: its steps are the step lines of the worker's log
    token_at: Optional[float] = None  # the last beat in this `generate` that counted tokens and timed their gaps
    tokens: int = 0  # …the count it gave (a smaller one: the next generate() call in the same phase)
    tokens_per_beat: int = 1  # …the tokens since the beat before it: what the next beat stands for
    skip_next_token: bool = False  # the next token beat's interval spans a suspension or an abandon
    last: dict = field(default_factory=dict)  # the last decoded line


class _Learned:
    """When a learned budget (a p99: a sort) is worth computing again: after each new sample while there are fewer
    than 40, then after every `len/20` new ones, and at once when the count changed behind the owner's back."""

    __slots__ = ("value", "seen", "fresh")

    def __init__(self):
        self.value: Any = None
        self.seen: Optional[int] = None  # how many samples there were when `value` was computed
        self.fresh = 0  # samples added through `added` since

    def added(self, before: int, after: int) -> None:
        """A sample went in through the owner: `before` → `after` samples (a full window stays at its size)."""
        if before == self.seen:
            self.seen = after
            self.fresh += 1

    def get(self, n: int, compute: Callable[[], Any], force: bool = False) -> Any:
        if force or self.value is None or n != self.seen or self.fresh >= max(1, n // 20):
            self.value, self.seen, self.fresh = compute(), n, 0
        return self.value


@dataclass(frozen=True)
class Expired:
    """A deadline that fired: which one, on which rank, and by how much."""

    name: str
    budget_s: float
    elapsed_s: float
    rank: Optional[int] = None
    phase: Optional[str] = None
    step: Optional[int] = None
    source: str = ""  # where the budget came from (line, config, calibrated, first_steps, …)
    progress_lines: int = 0  # progress beats received since the anchor: liveness without progress
    last_progress_age_s: Optional[float] = None  # how long ago the last of them arrived

    @property
    def livelock(self) -> bool:
        """Still beating `progress` late in the window (not just once before going quiet): alive, going nowhere."""
        return (
            self.name in ("step", "phase")
            and self.progress_lines > 0
            and self.last_progress_age_s is not None
            and self.last_progress_age_s <= self.budget_s / 2
        )

    @property
    def incident_kind(self) -> str:
        """The incident this deadline opens: startup_timeout, livelock or stall."""
        if self.name == "startup":
            return "startup_timeout"
        return "livelock" if self.livelock else "stall"

    @property
    def overdue_s(self) -> float:
        return max(0.0, self.elapsed_s - self.budget_s)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["overdue_s"] = round(self.overdue_s, 3)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        if self.last_progress_age_s is not None:
            d["last_progress_age_s"] = round(self.last_progress_age_s, 3)
        return d


class Deadlines:
    def __init__(self, wd: WatchdogCfg, calibration: Calibration):
        self.wd = wd
        self.calibration = calibration
        self.ranks: dict[int, RankTrack] = {}
        self.spawned_at: Optional[float] = None
        self.started = False
        self.extra: dict[str, tuple[float, float, str]] = {}  # name → (anchor, budget, source): e.g. the stop bound
        self._version = 0  # bumped by every input that can move an anchor (the `_due_at` cache's key)
        self._due_cache: tuple = (None, None)  # ((version, step budget, token gap), due time)
        self._step_learned = _Learned()  # (budget, source) of the step deadline
        self._token_learned = _Learned()  # the p99 token gap
        self.output_at: Optional[float] = None  # the worker's output last grew (this attempt)
        self.output_progress_at: Optional[float] = None  # …with a progress line
        self.grace: Optional[tuple[float, float]] = None  # (order time, seconds): a generate truncation under way

    # ---- inputs ---------------------------------------------------------------------------

    def arm_startup(self, now: float) -> None:
        self._version += 1
        self.spawned_at = now
        self.started = False
        self.ranks.clear()
        self.extra.clear()
        self.output_at = self.output_progress_at = None
        self.grace = None

    def output_seen(self, at: float, progress: bool, steps: int = 0) -> None:
        """The worker's output grew at `at` — with a progress line when `progress`, its lines naming `steps` new step
        numbers.  A step line ends a rank's `load` and is a step of that rank from then on (the module docstring)."""
        self._version += 1
        before = self.output_at
        self.output_at = at if self.output_at is None else max(self.output_at, at)
        if progress or steps > 0:
            self.output_progress_at = at if self.output_progress_at is None else max(self.output_progress_at, at)
        if steps <= 0:
            return
        for tr in self.ranks.values():
            if not tr.started or tr.stopped:
                continue
            if tr.phase in QUIET_PHASES and at > tr.phase_since:
                # Its lines came after the previous read's output: the gaps between them are at most that window
                # shared out among them.  (The gap after a first step is warm-up: left out.)
                since = tr.phase_since if before is None else max(tr.phase_since, before)
                self._enter_phase(tr, "train", at)
                tr.output_steps = True
                for _ in range(steps - 1 - (1 if tr.steps_seen == 0 else 0)):
                    self._added_step((at - since) / (steps - 1))
                tr.skip_next_sample = False
            elif tr.output_steps and tr.phase == "train":
                if tr.last_step_at is not None and at > tr.last_step_at:
                    # One sample per step named: the time since the previous step seen (at least each gap in it),
                    # then that time shared out among the rest.
                    span = at - tr.last_step_at
                    if tr.skip_next_sample:
                        tr.skip_next_sample = False
                    else:
                        if tr.steps_seen >= WARM_UP_STEPS:
                            self._added_step(span)
                        for _ in range(steps - 1):
                            self._added_step(span / steps)
            else:
                continue
            tr.steps_seen += steps
            tr.last_step_at = at
            tr.progress_since_step = 0

    @property
    def startup_armed(self) -> bool:
        return not self.started and self.spawned_at is not None and self.output_progress_at is None

    def _quiet_anchor(self, tr: RankTrack) -> float:
        """A `load` phase's budget counts from entering it, or from the last progress in the output after that."""
        if self.output_progress_at is not None and self.output_progress_at > tr.phase_since:
            return self.output_progress_at
        return tr.phase_since

    def arm_extra(self, name: str, now: float, budget_s: float, source: str = "") -> None:
        self._version += 1
        self.extra[name] = (now, budget_s, source)

    def grant_grace(self, now: float, grace_s: float) -> None:
        """A truncation was ordered at `now`: phases begun before it may run until `now + grace_s`."""
        self._version += 1
        self.grace = (now, grace_s)

    def _phase_limit(self, tr: RankTrack) -> tuple[Optional[float], str]:
        """The rank's phase budget, extended by a truncation's grace where the phase began before the order."""
        budget, source = tr.phase_budget, tr.phase_budget_source
        g = self.grace
        if g is not None and budget is not None and tr.phase not in QUIET_PHASES and tr.phase_since <= g[0]:
            extended = g[0] - tr.phase_since + g[1]
            if extended > budget:
                return extended, f"{source} + truncation grace"
        return budget, source

    def abandon(self, rank: int) -> None:
        """Rank `rank` is asked to abandon what it is stuck in: the phase's and the step's length teach nothing."""
        tr = self.ranks.get(rank)
        if tr is not None:
            self._version += 1
            tr.abandoned = True
            tr.skip_next_sample = True
            tr.skip_next_token = True

    def disarm_extra(self, name: str) -> None:
        self._version += 1
        self.extra.pop(name, None)

    def phase_budget(self, name: str, line_budget=None) -> tuple[Optional[float], str]:
        """A phase's budget and where it came from: the line's `budget_s`; a budget the config sets (other than
        the default); none for untimed phases, the startup timeout for `load`; the one learned from the run
        (`watchdog.phase_learn`); the default (`phase_budgets_s`' own, else `default_phase_budget_s`)."""
        if isinstance(line_budget, (int, float)) and not isinstance(line_budget, bool) and line_budget > 0:
            return float(line_budget), "line"
        configured = self.wd.phase_budgets_s.get(name)
        if configured is not None and configured != DEFAULT_PHASE_BUDGETS_S.get(name):
            return float(configured), "config"
        if name in UNTIMED_PHASES:
            return None, "none"
        if name in QUIET_PHASES:
            return float(self.wd.startup_timeout_s), "startup"
        learned = self.calibration.phase_budget(name) if self.wd.phase_learn else None
        if learned is not None:
            longest = self.calibration.phase_longest(name)
            return learned, f"learned: {self.wd.phase_learn_factor:g} × longest {longest:.3g}s"
        if configured is not None:
            return float(configured), "default"
        if self.wd.default_phase_budget_s is not None:
            return float(self.wd.default_phase_budget_s), "default"
        return None, "none"

    def phase_budgets(self) -> dict[str, dict]:
        """Every timed phase the run knows of — configured, or seen completing — with its budget and where it came
        from (status shows them: a default until the run taught it another)."""
        names = set(self.wd.phase_budgets_s) | set(self.calibration.phase_samples)
        out = {}
        for name in sorted(names - UNTIMED_PHASES):
            budget, source = self.phase_budget(name)
            if budget is not None:
                out[name] = {"budget_s": round(budget, 3), "source": source}
        return out

    def step_budget(self) -> tuple[float, str]:
        """The run's step budget and where it came from: `config` (fixed), `learned: …` (`Calibration.step_source`),
        else `first_steps`.  A rank's own first steps may run under a longer one (`_step_limit`)."""
        if self.wd.step_timeout_s is not None:
            return float(self.wd.step_timeout_s), "config"
        cal = self.calibration
        n = len(cal.step_samples)

        def compute() -> tuple[float, str]:
            learned = cal.step_budget()
            if learned is None:
                return float(self.wd.first_steps_timeout_s), "first_steps"
            return learned, cal.step_source()

        cached = self._step_learned.value
        begins = cached is not None and cached[1] == "first_steps" and n >= self.wd.calibrate_after
        return self._step_learned.get(n, compute, force=begins)

    def _step_limit(self, tr: RankTrack, run: tuple[float, str]) -> tuple[float, str]:
        """Rank `tr`'s step budget, given the run's (`step_budget`): during its warm-up at least
        `first_steps_timeout_s`."""
        if run[1] != "config" and tr.steps_seen < WARM_UP_STEPS and self.wd.first_steps_timeout_s >= run[0]:
            return float(self.wd.first_steps_timeout_s), "first_steps"
        return run

    def token_gap(self) -> Optional[float]:
        """The p99 of the gaps between a generate's tokens seen so far (None before any), recomputed as
        `_Learned` says."""
        samples = self.calibration.token_samples
        return self._token_learned.get(len(samples), self.calibration.token_gap)

    def _token_limit(self, tr: RankTrack, gap: Optional[float]) -> tuple[float, str]:
        """The budget of rank `tr`'s next token beat, and how it was made."""
        budget = self.calibration.token_budget(tr.tokens_per_beat, gap)
        floor = self.wd.token_timeout_min_s
        if gap is None:
            return budget, f"token floor {floor:g}s (no gap between tokens seen yet)"
        per = "token" if tr.tokens_per_beat == 1 else f"{tr.tokens_per_beat} tokens"
        made = f"learned: {self.wd.token_timeout_factor:g} × {per} × p99 gap {gap:.3g}s"
        return budget, made + (f", at least {floor:g}s" if budget <= floor else "")

    def _silence_anchor(self, tr: RankTrack) -> float:
        """A rank's last sign of life: its last line — and, while its steps are seen in the output, the output's."""
        if tr.output_steps and tr.phase == "train" and self.output_at is not None and self.output_at > tr.last_line_at:
            return self.output_at
        return tr.last_line_at

    def _added_step(self, duration_s: float) -> None:
        """A step sample into the calibration, counted for the budget cache (which tells the samples
        added here from a change made elsewhere by their number: a reload, a test)."""
        samples = self.calibration.step_samples
        before = len(samples)
        self.calibration.add_step(duration_s)  # (one it refused counts too: at worst an early recompute)
        self._step_learned.added(before, len(samples))

    def _added_token_gap(self, gap_s: float) -> None:
        samples = self.calibration.token_samples
        before = len(samples)
        self.calibration.add_token_gap(gap_s)
        self._token_learned.added(before, len(samples))

    def _enter_phase(self, tr: RankTrack, name: str, now: float, line_budget=None) -> None:
        if tr.started and tr.phase not in UNTIMED_PHASES and tr.phase != "init" and not tr.abandoned:
            self.calibration.add_phase(tr.phase, now - tr.phase_since)
        tr.abandoned = False
        tr.phase = name
        tr.phase_since = now
        tr.phase_budget, tr.phase_budget_source = self.phase_budget(name, line_budget)
        tr.progress_since_step = 0
        tr.output_steps = False
        tr.token_at, tr.tokens, tr.tokens_per_beat = None, 0, 1
        if name == "train":
            tr.train_since = now

    def _token_beat(self, tr: RankTrack, rec: dict, now: float) -> None:
        """A `progress` beat in `generate`: one that counts tokens and times their gaps (`token_s`) is the token
        deadline's anchor, its gap a sample, and the tokens since the previous one what the next one stands for."""
        tokens, gap = rec.get("tokens"), rec.get("token_s")
        if type(tokens) is not int or tokens < 1:  # (bool is no count)
            return
        if not isinstance(gap, (int, float)) or isinstance(gap, bool) or not math.isfinite(gap) or gap < 0:
            return
        if tr.skip_next_token:
            tr.skip_next_token = False
        else:
            self._added_token_gap(float(gap))
        since = tr.tokens if tr.token_at is not None and tokens > tr.tokens else 0  # smaller: the next call
        tr.token_at, tr.tokens, tr.tokens_per_beat = now, tokens, tokens - since

    def observe(self, rec: dict, now: float) -> RankTrack:
        """Apply one decoded heartbeat line read at `now`."""
        self._version += 1
        rank = rec.get("rank") if isinstance(rec.get("rank"), int) else 0
        tr = self.ranks.get(rank)
        if tr is None:
            tr = self.ranks[rank] = RankTrack(rank=rank, phase_since=now, last_line_at=now)
        tr.last_line_at = now
        tr.pid = rec.get("pid", tr.pid)
        tr.last = rec
        event = rec["event"]
        step = rec.get("step")
        if isinstance(step, int) and event != "checkpoint":
            tr.step = max(tr.step, step) if event != "start" else step
        if event == "start":
            tr.started = True
            tr.stopped = False
            self.started = True
            tr.phase = rec.get("phase") or "init"
            tr.phase_since = now
            tr.phase_budget, tr.phase_budget_source = self.phase_budget(tr.phase)
            tr.last_step_at = None
            tr.train_since = now if tr.phase == "train" else None
            tr.steps_seen, tr.output_steps = 0, False  # a new process: warm-up again
            tr.token_at, tr.tokens, tr.tokens_per_beat = None, 0, 1
        elif event == "phase":
            self._enter_phase(tr, str(rec.get("phase")), now, rec.get("budget_s"))
        else:
            phase = rec.get("phase")
            # A phase line went missing (torn): follow the phase every line carries — but a rank whose output ended
            # its `load` is in `train` while its own lines still say `load`.
            if phase and phase != tr.phase and not (tr.output_steps and phase in QUIET_PHASES):
                self._enter_phase(tr, str(phase), now)
            if event == "step":
                if tr.phase == "train":
                    if tr.last_step_at is not None and tr.train_since is not None and tr.last_step_at >= tr.train_since:
                        if tr.skip_next_sample:
                            tr.skip_next_sample = False
                        elif tr.steps_seen >= WARM_UP_STEPS:  # (the interval after its first step: warm-up)
                            self._added_step(now - tr.last_step_at)
                    tr.output_steps = False  # its own step lines from now on
                tr.steps_seen += 1
                tr.last_step_at = now
                tr.progress_since_step = 0
            elif event == "progress":
                tr.last_progress_at = now
                tr.progress_since_step += 1
                if tr.phase == "generate" and self.wd.token_deadline:
                    self._token_beat(tr, rec, now)
            elif event == "stop":
                tr.stopped = True
        return tr

    def shift(self, gap: float) -> None:
        """The supervisor was not running for `gap` seconds: that time counts for no deadline."""
        if gap <= 0:
            return
        self._version += 1
        if self.spawned_at is not None:
            self.spawned_at += gap
        if self.output_at is not None:
            self.output_at += gap
        if self.output_progress_at is not None:
            self.output_progress_at += gap
        self.extra = {k: (a + gap, b, s) for k, (a, b, s) in self.extra.items()}
        if self.grace is not None:
            self.grace = (self.grace[0] + gap, self.grace[1])
        for tr in self.ranks.values():
            tr.last_line_at += gap
            tr.phase_since += gap
            if tr.last_step_at is not None:
                tr.last_step_at += gap
            if tr.train_since is not None:
                tr.train_since += gap
            if tr.last_progress_at is not None:
                tr.last_progress_at += gap
            if tr.token_at is not None:
                tr.token_at += gap
            tr.skip_next_sample = True  # the interval spanning the gap is not a step time
            tr.skip_next_token = True  # …nor a gap between tokens (a whole machine suspended stops the writer too)

    # ---- outputs --------------------------------------------------------------------------

    def _candidates(self, now: float) -> list[Expired]:
        out: list[Expired] = []
        if self.startup_armed:
            out.append(Expired("startup", float(self.wd.startup_timeout_s), now - self.spawned_at, source="config"))
        if not self.started and self.spawned_at is not None:
            out.append(
                Expired(
                    "output_silence",
                    float(self.wd.output_silence_timeout_s),
                    now - max(self.spawned_at, self.output_at or self.spawned_at),
                    source="config",
                )
            )
        for name, (anchor, budget, source) in self.extra.items():
            out.append(Expired(name, budget, now - anchor, source=source))
        run_step = self.step_budget()
        gap = self.token_gap()
        for tr in self.ranks.values():
            if not tr.started or tr.stopped:
                continue
            common = dict(rank=tr.rank, phase=tr.phase, step=tr.step)
            age = now - tr.last_progress_at if tr.progress_since_step and tr.last_progress_at is not None else None
            if tr.phase not in QUIET_PHASES:
                out.append(
                    Expired(
                        "silence",
                        float(self.wd.silence_timeout_s),
                        now - self._silence_anchor(tr),
                        source="config",
                        **common,
                    )
                )
            budget, source = self._phase_limit(tr)
            if budget is not None:
                since = self._quiet_anchor(tr) if tr.phase in QUIET_PHASES else tr.phase_since
                out.append(
                    Expired(
                        "phase",
                        budget,
                        now - since,
                        source=source,
                        progress_lines=tr.progress_since_step,
                        last_progress_age_s=age,
                        **common,
                    )
                )
            if tr.phase == "train":
                anchor = max(x for x in (tr.last_step_at, tr.train_since, tr.phase_since) if x is not None)
                budget, source = self._step_limit(tr, run_step)
                out.append(
                    Expired(
                        "step",
                        budget,
                        now - anchor,
                        source=source,
                        progress_lines=tr.progress_since_step,
                        last_progress_age_s=age,
                        **common,
                    )
                )
            if tr.token_at is not None:
                budget, source = self._token_limit(tr, gap)
                out.append(Expired("token", budget, now - tr.token_at, source=source, **common))
        return out

    def active(self, now: float) -> list[dict]:
        """Every armed deadline: name, rank, budget, elapsed and remaining seconds."""
        return [
            {
                "name": e.name,
                "rank": e.rank,
                "budget_s": round(e.budget_s, 3),
                "elapsed_s": round(e.elapsed_s, 3),
                "remaining_s": round(e.budget_s - e.elapsed_s, 3),
                "source": e.source,
            }
            for e in self._candidates(now)
        ]

    def main_rank(self) -> int:
        """The rank whose phase and step stand for the run (the lowest that spoke; 0 before any)."""
        return min(self.ranks) if self.ranks else 0

    def _due_at(self) -> Optional[float]:
        """When the earliest armed deadline falls due (the anchors' clock), None when none is armed;
        the same deadlines as `_candidates`, without building them."""
        run_step = self.step_budget()
        gap = self.token_gap()
        key = (self._version, run_step[0], gap)
        if self._due_cache[0] == key:
            return self._due_cache[1]
        silence = self.wd.silence_timeout_s
        times: list[float] = []
        if self.startup_armed:
            times.append(self.spawned_at + self.wd.startup_timeout_s)
        if not self.started and self.spawned_at is not None:
            times.append(max(self.spawned_at, self.output_at or self.spawned_at) + self.wd.output_silence_timeout_s)
        for anchor, budget, _source in self.extra.values():
            times.append(anchor + budget)
        for tr in self.ranks.values():
            if not tr.started or tr.stopped:
                continue
            if tr.phase not in QUIET_PHASES:
                times.append(self._silence_anchor(tr) + silence)
            budget = self._phase_limit(tr)[0]
            if budget is not None:
                times.append((self._quiet_anchor(tr) if tr.phase in QUIET_PHASES else tr.phase_since) + budget)
            if tr.phase == "train":
                anchor = tr.phase_since
                if tr.train_since is not None and tr.train_since > anchor:
                    anchor = tr.train_since
                if tr.last_step_at is not None and tr.last_step_at > anchor:
                    anchor = tr.last_step_at
                times.append(anchor + self._step_limit(tr, run_step)[0])
            if tr.token_at is not None:
                times.append(tr.token_at + self.calibration.token_budget(tr.tokens_per_beat, gap))
        due = min(times) if times else None
        self._due_cache = (key, due)
        return due

    def next_due_s(self, now: float) -> Optional[float]:
        """Seconds until the earliest armed deadline falls due (≤ 0: due now); None when none is armed."""
        due = self._due_at()
        return None if due is None else due - now

    def check(self, now: float) -> Optional[Expired]:
        """The most overdue deadline that is due (elapsed ≥ budget), or None."""
        first = self._due_at()
        if first is None or now < first - DUE_SLACK_S:
            return None
        due = [e for e in self._candidates(now) if e.elapsed_s >= e.budget_s]
        if not due:
            return None
        return max(due, key=lambda e: (e.elapsed_s - e.budget_s, e.name != "silence"))


class SuspensionDetector:
    """Notices that the supervisor's own loop did not run for a while and says for how long.

    Before it sleeps the loop says when it plans to wake (`expect`: the earliest deadline, or
    sooner); without a plan a pass is expected `period` after the previous one.  A pass that comes
    more than `threshold − period` after its planned time means this process was not running —
    stopped, the machine overloaded or a virtual machine paused — and the lateness is handed to
    `Deadlines.shift`.  A stop that ends before the planned wake-up is not late at all, so SIGCONT
    says it instead (`observe(continued=True)`): then the whole time since the previous pass counts.
    Known blocking work of the loop itself (a snapshot, a dump request) calls `touch` so that it is
    not mistaken for a suspension.
    """

    def __init__(self, period: float, threshold: Optional[float] = None):
        self.period = period
        self.threshold = threshold if threshold is not None else max(2.0, 8 * period)
        self.last: Optional[float] = None
        self.planned: Optional[float] = None
        self.total_s = 0.0

    def expect(self, wake_at: float) -> None:
        """The loop plans its next pass at `wake_at` (it sleeps until then unless woken)."""
        self.planned = wake_at

    def observe(self, now: float, continued: bool = False) -> float:
        gap = 0.0
        if self.last is not None:
            if continued:
                gap = max(0.0, now - self.last)
            else:
                planned = self.planned if self.planned is not None else self.last + self.period
                late = now - planned
                if late > self.threshold - self.period:
                    gap = late
        self.total_s += gap
        self.last = now
        self.planned = None
        return gap

    def touch(self, now: float) -> None:
        self.last = now
