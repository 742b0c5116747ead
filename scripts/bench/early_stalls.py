"""Section early_stalls: false stalls and detection latency of the learned step and token budgets, simulated.

An hour of a run goes through the supervisor's own deadline code (`watch.deadlines.Deadlines` over a
`watch.calibration.Calibration`, the watchdog's defaults) on a fake clock — nothing sleeps, an hour takes well under
a second.  Each time below is drawn at random within [t, 3t] (seeded):

  * heartbeat profiles (a script under the automatic instrumentation): `load`, then optimizer steps — the interval
    after the first one a compile (`warmup`) — with every `eval_every` steps an `eval` phase (batches beating
    `progress`, then a `generate` of `tokens` tokens: a prefill, then a gap per token, a beat every 8 tokens with the
    longest gap since the last, as GenerateWatch writes them), and every `ckpt_every` steps a `checkpoint` phase;
  * output profiles (a script known by its `step N` lines, no optimizer): its lines are read as the supervisor's
    loop reads worker.log — in passes 1–5 s apart, each read dating its lines at the last one, and once more at a
    deadline before it is believed — with `checkpoint` phases (a wrapped `torch.save`) returning it to `load`.

Every deadline that fires in a healthy hour is a false stall (the figure must be 0).  Then the injected stalls,
each in fresh runs: a spin in step 5 (no line after step 4), the same late in the hour (in the first step that would
end past LATE_S), and a generate whose tokens stop at its first call (after 12 tokens); the latency is counted from
the last sign of progress (the last step line, or the return to `train` after an eval or a checkpoint; the last
token).
"""

from __future__ import annotations

import random
from typing import Iterator, Optional

from hangwatch.common.config import WatchdogCfg
from hangwatch.supervisor.watch.calibration import Calibration
from hangwatch.supervisor.watch.deadlines import Deadlines

from .harness import summary

HOUR_S = 3600.0
LATE_S = 3000.0  # the late spin: after the first step past this
TOKENS_PER_BEAT = 8
READ_EVERY_S = (1.0, 5.0)  # the loop's passes: at most once a second (OUTPUT_READ_S), at least every 5 s (IDLE_WAIT_S)

PROFILES = {
    "fast steps": dict(
        load=20,
        step=0.1,
        warmup=30,
        eval_every=300,
        batches=20,
        batch=0.5,
        tokens=64,
        token=0.02,
        prefill=0.2,
        ckpt_every=600,
        ckpt=5,
    ),
    "medium steps": dict(
        load=40,
        step=2.0,
        warmup=30,
        eval_every=50,
        batches=10,
        batch=2.0,
        tokens=64,
        token=0.1,
        prefill=1.0,
        ckpt_every=100,
        ckpt=20,
    ),
    "slow steps, slow tokens": dict(
        load=60,
        step=20.0,
        warmup=30,
        eval_every=10,
        batches=10,
        batch=5.0,
        tokens=48,
        token=0.5,
        prefill=3.0,
        ckpt_every=20,
        ckpt=30,
    ),
}
OUTPUT_PROFILES = {
    "output only, fast lines": dict(load=5, step=0.1, ckpt_every=1000, ckpt=5),
    "output only, slow lines": dict(load=10, step=5.0, ckpt_every=50, ckpt=20),
}


def vary(rnd: random.Random, t: float) -> float:
    return rnd.uniform(t, 3 * t)


# ---- what the worker writes -----------------------------------------------------------------------------------


def heartbeat_run(
    p: dict,
    rnd: random.Random,
    *,
    spin_after: Optional[int] = None,
    spin_late: bool = False,
    stop_tokens: Optional[int] = None,
):
    """(time, kind, payload) in order: `beat` lines of a script under the automatic instrumentation for an hour —
    or until its injected stall (`spin_after`: it spins in that step, its line never comes; `spin_late`: in the first
    step that would end past LATE_S; `stop_tokens`: the first generate's tokens stop after that many).  The last
    event is ("end", t, why)."""
    t = 0.5
    yield t, "beat", ("start", "load", {})
    t += vary(rnd, p["load"])
    step, evals = 0, 0
    while t < HOUR_S:
        step += 1
        if step == spin_after or (spin_late and t > LATE_S):
            yield t, "end", "spin"  # it spins in this step: its line never comes
            return
        if step == 1:
            yield t, "beat", ("phase", "train", {})
        yield t, "beat", ("step", "train", {"step": step})
        if step % p["eval_every"] == 0:
            evals += 1
            yield t, "beat", ("phase", "eval", {})
            for _ in range(p["batches"]):
                t += vary(rnd, p["batch"])
                yield t, "beat", ("progress", "eval", {})
            yield t, "beat", ("phase", "generate", {})
            t += vary(rnd, p["prefill"])  # → token 1
            last, longest = t, None
            for n in range(2, p["tokens"] + 1):
                t += vary(rnd, p["token"])
                if n > 2:  # the first decoding step is left out
                    longest = t - last if longest is None else max(longest, t - last)
                last = t
                if n % TOKENS_PER_BEAT == 0:
                    yield t, "beat", ("progress", "generate", {"tokens": n, "token_s": longest})
                    longest = None
                if stop_tokens is not None and evals == 1 and n == stop_tokens:
                    yield t, "end", "tokens stopped"
                    return
            yield t, "beat", ("phase", "eval", {})
            yield t, "beat", ("phase", "train", {})
        if step % p["ckpt_every"] == 0:
            yield t, "beat", ("phase", "checkpoint", {})
            t += vary(rnd, p["ckpt"])
            yield t, "beat", ("phase", "train", {})
        t += vary(rnd, p["warmup"] if step == 1 else p["step"])
    yield t, "end", "hour"


def output_run(p: dict, rnd: random.Random, *, spin_after: Optional[int] = None, spin_late: bool = False):
    """The same for a script that steps no optimizer: its `start` (phase `load`), then `line` events (a `step N`
    line) and, around a checkpoint, its `checkpoint` phase lines (back to `load`, the phase its heartbeat is in)."""
    t = 0.5
    yield t, "beat", ("start", "load", {})
    t += vary(rnd, p["load"])
    step = 0
    while t < HOUR_S:
        step += 1
        if step == spin_after or (spin_late and t > LATE_S):
            yield t, "end", "spin"
            return
        yield t, "line", step
        if step % p["ckpt_every"] == 0:
            yield t, "beat", ("phase", "checkpoint", {})
            t += vary(rnd, p["ckpt"])
            yield t, "beat", ("phase", "load", {})
        t += vary(rnd, p["step"])
    yield t, "end", "hour"


# ---- the supervisor's side ----------------------------------------------------------------------------------------


class Watch:
    """The deadlines on a fake clock, fed as the supervisor's loop feeds them: heartbeat lines when written (their
    files' times), the output in passes; at the earliest deadline the output is read once more before the deadline
    is believed."""

    def __init__(self, wd: WatchdogCfg):
        self.d = Deadlines(wd, Calibration(wd))
        self.d.arm_startup(0.0)
        self.now = 0.0
        self.log: list[tuple[float, int]] = []  # output lines written and not read yet: (time, step)
        self.fired = None  # (time, Expired) of the first deadline that fired

    def read_output(self, upto: float) -> None:
        lines = [x for x in self.log if x[0] <= upto]
        if not lines:
            return
        self.log = self.log[len(lines) :]
        steps = len({s for _, s in lines})
        self.d.output_seen(lines[-1][0], True, steps)

    def until(self, to: float) -> bool:
        """Nothing fires before `to`: True; else the first deadline that does is recorded (False)."""
        while True:
            due = self.d.next_due_s(self.now)
            if due is None or self.now + due > to:
                self.now = max(self.now, to)
                return True
            at = self.now + max(0.0, due) + 1e-9
            self.read_output(at)  # every file is read before a deadline is believed
            still = self.d.next_due_s(at)
            if still is not None and still <= 0:
                self.fired = (at, self.d.check(at))
                return False
            self.now = at

    def beat(self, at: float, event: str, phase: str, fields: dict) -> None:
        rec = {"v": 1, "t": at, "pid": 1, "rank": 0, "attempt": 1, "event": event, "step": 0, "phase": phase}
        self.d.observe({**rec, **fields}, at)


def simulate(events: Iterator, wd: WatchdogCfg, rnd: random.Random, output: bool) -> dict:
    """Drive a `Watch` with a worker's events (and, for output, read passes 1–5 s apart) until the worker's end;
    after an injected stall, until a deadline fires."""
    w = Watch(wd)
    counts = {"steps": 0, "generates": 0, "checkpoints": 0, "tokens": 0}
    next_read = rnd.uniform(*READ_EVERY_S)
    last_progress = 0.0
    ended = "hour"
    for at, kind, payload in events:
        while output and next_read <= at:  # the passes that read the output before this event
            if not w.until(next_read):
                return result(w, counts, last_progress, ended)
            w.read_output(next_read)
            next_read += rnd.uniform(*READ_EVERY_S)
        if not w.until(at):
            return result(w, counts, last_progress, ended)
        if kind == "end":
            ended = payload
            if payload == "tokens stopped":
                last_progress = at  # its last token (the supervisor saw the beat of token 8)
            break
        if kind == "line":
            w.log.append((at, payload))
            counts["steps"] += 1
            last_progress = at
            continue
        event, phase, fields = payload
        w.beat(at, event, phase, fields)
        if event == "step":
            counts["steps"] += 1
            last_progress = at
        elif event == "phase":
            if phase == "train":
                last_progress = at  # back from an eval or a checkpoint: the step deadline counts from here
            counts["generates"] += phase == "generate"
            counts["checkpoints"] += phase == "checkpoint"
        elif event == "progress" and "tokens" in fields:
            counts["tokens"] += TOKENS_PER_BEAT
            last_progress = at
    if ended != "hour":  # the worker is stuck: when does a deadline fire? (the loop's passes go on reading)
        give_up = w.now + 100_000.0
        while output and next_read < give_up and w.until(next_read):
            w.read_output(next_read)
            next_read += rnd.uniform(*READ_EVERY_S)
        w.until(give_up)
    return result(w, counts, last_progress, ended)


def result(w: Watch, counts: dict, last_progress: float, ended: str) -> dict:
    out = {"ended": ended, "simulated_s": round(w.now, 3), **counts}
    d = w.d
    out["step_budget"] = list(d.step_budget())
    gap = d.token_gap()
    out["token_gap_p99_s"] = gap
    if w.fired is not None:
        at, e = w.fired
        out["fired"] = {
            "at_s": round(at, 3),
            "deadline": e.name if e else None,
            "phase": e.phase if e else None,
            "budget_s": round(e.budget_s, 3) if e else None,
            "source": e.source if e else None,
            "after_last_progress_s": round(at - last_progress, 3),
        }
    return out


def run_profile(name: str, p: dict, seed: int, output: bool, **stall) -> dict:
    rnd = random.Random(f"{name}/{seed}/{sorted(stall.items())}")
    wd = WatchdogCfg()
    events = output_run(p, rnd, **stall) if output else heartbeat_run(p, rnd, **stall)
    return simulate(events, wd, random.Random(seed), output)


def section(work, quick: bool) -> dict:
    seeds = range(2 if quick else 10)
    healthy: dict[str, list[dict]] = {}
    stalls: dict[str, dict[str, list[dict]]] = {}
    for name, p, output in [(n, p, False) for n, p in PROFILES.items()] + [
        (n, p, True) for n, p in OUTPUT_PROFILES.items()
    ]:
        healthy[name] = [run_profile(name, p, s, output) for s in seeds]
        stalls[name] = {
            "spin in step 5": [run_profile(name, p, s, output, spin_after=5) for s in seeds],
            "spin after 50 min": [run_profile(name, p, s, output, spin_late=True) for s in seeds],
        }
        if not output:
            stalls[name]["generate stops at its first call"] = [
                run_profile(name, p, s, output, stop_tokens=12) for s in seeds
            ]
    false_stalls = {n: sum(1 for r in runs if "fired" in r) for n, runs in healthy.items()}
    latency = {
        n: {k: summary([r.get("fired", {}).get("after_last_progress_s") for r in runs]) for k, runs in by.items()}
        for n, by in stalls.items()
    }
    return {
        "method": f"{len(seeds)} seeded simulated hour(s) per profile through Deadlines/Calibration with the "
        "watchdog's defaults on a fake clock, every time random within [t, 3t]; then the same profiles with a stall "
        "injected",
        "profiles": {**PROFILES, **OUTPUT_PROFILES},
        "healthy": healthy,
        "stalls": stalls,
        "false_stalls": false_stalls,
        "false_stalls_total": sum(false_stalls.values()),
        "latency": latency,
    }


def render(s: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    from .report import fmt_s

    rows = []
    for name, runs in s["healthy"].items():
        steps = sum(r["steps"] for r in runs)
        gens = sum(r["generates"] for r in runs)
        row = [name, f"{len(runs)} h, {steps} steps, {gens} generates", f"**{s['false_stalls'][name]}**"]
        cells = []
        for kind in ("spin in step 5", "spin after 50 min", "generate stops at its first call"):
            runs_k = s["stalls"][name].get(kind)
            if not runs_k:
                cells.append("—")
                continue
            lat = s["latency"][name][kind]
            named = sorted({(r.get("fired") or {}).get("deadline") for r in runs_k} - {None})
            cells.append(f"{fmt_s(lat.get('median'), 1)} s / {fmt_s(lat.get('max'), 1)} s ({', '.join(named)})")
        rows.append(row + cells)
    return (
        "16. Early stalls: false stalls in an hour of ×3 jitter, and detection of a stall at step 5 and at the first "
        "generate",
        [
            "profile",
            "simulated",
            "false stalls",
            "spin in step 5 (median / max after the last step; deadline)",
            "spin after 50 min",
            "generate stops at its first call (after its last token)",
        ],
        rows,
        f"{s['method']} (bench/early_stalls.py).",
    )


__all__ = ["section", "render", "PROFILES", "OUTPUT_PROFILES"]
