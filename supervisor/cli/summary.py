"""Plain-text summaries the CLI prints: what a config will do, and how a run ended.

Pure functions of a config or a run dir on disk (no daemon, no terminal styling), so `run` and
`validate-config` say the same things the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from hangwatch.common.config import Config
from hangwatch.common.rundir import STATE_NAME, read_json
from hangwatch.supervisor.cli.rerun import shown
from hangwatch.supervisor.control.paths import socket_path_for
from hangwatch.supervisor.incidents import IncidentStore
from hangwatch.supervisor.incidents.store import RECORD_NAME
from hangwatch.supervisor.records.checkpoint_ledger import BAD, read_record
from hangwatch.supervisor.records.goodput import goodput_line, read_goodput


def run_summary(run_dir: str, code: int, brief: bool = False) -> list[str]:
    """What a person wants to know when `hangwatch run` returns: how it ended, what went wrong on the
    way (each incident and where its evidence is), what it cost (the goodput line) and whether each
    resumed attempt was the same training (the resume audits), which checkpoint a new run would resume
    from and which newer ones are not good (and why), and where the result is.  `brief`: a run without an
    incident says how it ended in one line (the rest is for runs that had something to tell)."""
    rd = Path(run_dir)
    state = read_json(rd / STATE_NAME) or {}
    lines = [
        f"hangwatch: run {state.get('state', 'ended')} (exit {code}) after {state.get('attempt', '?')} attempt(s); "
        f"run dir {shown(rd)}"
    ]
    store = IncidentStore(rd)
    final = rd / "final"
    if brief and not store.list():
        return lines + ([f"hangwatch: final adapter: {final}"] if final.is_dir() else [])
    for inc, d in zip(store.list(), store.dirs()):
        lines.append(f"  incident {inc.get('id')} [{inc.get('kind')}] {shown(d)}: {inc.get('summary')}")
    if state.get("state") == "failed":
        lines += output_lines(store.dirs())
    lines += goodput_lines(rd)
    lines += checkpoint_lines(rd)
    if final.is_dir():
        lines.append(f"  final adapter: {final}  (PeftModel.from_pretrained(base, '{final}'))")
    return lines


def output_lines(incident_dirs: list[Path]) -> list[str]:
    """The last lines of output of the failure that ended a failed run, as its incident quotes them (`last_output`:
    a command that ended the same way twice before any progress) — the reason in the command's own words, where a
    person reads, not only in worker.log; nothing when that failure quotes none.  A run's closing incident (a
    crash loop, no progress: status `final`) is not the failure: the one before it is."""
    for d in reversed(incident_dirs):
        rec = read_json(d / RECORD_NAME) or {}
        if rec.get("status") == "final":
            continue
        said = rec.get("last_output")
        if not isinstance(said, list) or not said:
            return []
        head = f"  its output ended (attempt {rec.get('attempt', '?')}, incident {rec.get('id', '?')}):"
        return [head, *(f"    {line}" for line in said)]
    return []


def goodput_lines(run_dir: Path) -> list[str]:
    """The goodput line (goodput.json), then one line per resume audit: "resume after incident 0003: resume
    verified: steps 31–39 replayed, loss bitwise equal"; nothing for what the run dir does not hold."""
    from hangwatch.supervisor.cli.report.run_records import (
        read_resume_audits,
    )  # the report's reader, once a run has ended

    out = []
    snap = read_goodput(run_dir)
    if snap is not None:
        line = snap.get("line")
        out.append(f"  {line if isinstance(line, str) and line else goodput_line(snap)}")
    for a in read_resume_audits(run_dir):
        where = f"after incident {a['incident']}" if a.get("incident") else f"of attempt {a.get('attempt', '?')}"
        raised = f" (incident {a['diverged_incident']})" if a.get("diverged_incident") else ""
        out.append(f"  resume {where}: {a.get('text') or a.get('verdict') or 'not audited'}{raised}")
    return out


SHOWN_BAD = 3  # the newest not-good checkpoints a summary names


def checkpoint_lines(run_dir: Path) -> list[str]:
    """The checkpoint ledger's word (checkpoints.json): the last good checkpoint, and the newest bad
    ones with why — "not good: loss nan at step 5"; nothing when the run dir has no record."""
    rec = read_record(run_dir)
    if not rec:
        return []
    entries = [e for e in rec.get("checkpoints") or [] if isinstance(e, dict)]
    out = []
    good = next((e for e in entries if e.get("path") == rec.get("last_good")), None)
    if good is not None:
        out.append(f"  last good checkpoint: {good['path']} (step {good.get('step')})")
    elif entries:
        out.append("  no good checkpoint")
    for e in [e for e in entries if e.get("status") == BAD][-SHOWN_BAD:]:
        out.append(f"  checkpoint {e.get('path')} (step {e.get('step')}) is not good: {e.get('why')}")
    return out


def command_preamble(cfg: Config, config_arg: Optional[str], verbose: bool = True) -> list[str]:
    """What `hangwatch run [CONFIG] -- CMD` says before it starts: where the run goes; with `verbose` also the
    effective config in short (what differs from the defaults: the rest is in <run dir>/config.yaml), what
    instrumentation the worker gets, and the one line that keeps the config for next time."""
    import shlex

    import yaml

    from hangwatch.common.rundir import CONFIG_NAME
    from hangwatch.supervisor.processes.interpreter import note_for

    where = shown(cfg.run_dir)
    if not verbose:
        return [f"hangwatch: watching `{shlex.join(cfg.worker.command or [])}`; run dir {where} (-v: more)"]
    own = cfg.model_dump(mode="json", exclude_defaults=True)
    lines = [
        f"hangwatch: supervising `{shlex.join(cfg.worker.command or [])}` in {where}",
        f"hangwatch: instrumentation: {note_for(cfg)}",
        f"hangwatch: effective config (every other setting at its default; all of them in {where}/{CONFIG_NAME}):",
    ]
    lines += ["    " + line for line in yaml.safe_dump(own, sort_keys=False).splitlines()]
    if slurm_text(cfg):  # a kept copy would pin this job's node list, ids and this node's run dir on the next job
        keys = ", ".join(f"worker.{k}" for k in cfg.worker._slurm.values)  # type: ignore[attr-defined]
        lines.append(
            f"hangwatch: {keys} and run_dir there are this Slurm job's: take them out of a kept copy, "
            "and the next job supplies its own"
        )
    if config_arg is None:
        lines.append(
            f"hangwatch: to keep it: cp {where}/{CONFIG_NAME} hangwatch.yaml  — next time: hangwatch run hangwatch.yaml"
        )
    else:
        lines.append(
            f"hangwatch: {config_arg} with this command is {where}/{CONFIG_NAME}  — next time: "
            f"hangwatch run {where}/{CONFIG_NAME}"
        )
    return lines


def slurm_text(cfg: Config) -> Optional[str]:
    """What the config took from a Slurm job (worker.nnodes auto), in one line; None when nothing."""
    from hangwatch.common.config.slurm import Derived, describe

    derived = cfg.worker._slurm
    return describe(derived, cfg.run_dir) if isinstance(derived, Derived) else None


def checkpoint_text(cfg: Config) -> str:
    """The `checkpoint` row: the built-in worker's schedule, or what the supervisor does with the
    checkpoints a script announces."""
    c = cfg.checkpoint
    if cfg.worker.command is None:
        return f"every {c.every_steps} steps, keep {c.keep_last}, good after {c.confirm_steps} finite steps"
    return (
        f"the worker's own (Heartbeat.checkpoint), good after {c.confirm_steps} later steps with a finite loss; "
        "every attempt gets the last good one in HANGWATCH_RESUME_FROM"
    )


def config_summary(cfg: Config) -> list[tuple[str, str]]:
    """(label, text) rows: what a valid config will run, watch and keep."""
    w = cfg.watchdog
    if cfg.worker.command is None:
        worker = "built-in training daemon (python -m hangwatch.daemon)"
    else:
        worker = " ".join(cfg.worker.command)
    if cfg.model.name_or_path:
        model = cfg.model.name_or_path
    else:
        t = cfg.model.tiny
        model = f"tiny (built locally: {t.num_layers} layers, hidden {t.hidden_size}, vocab {t.vocab_size})"
    step = (
        f"step {w.step_timeout_s:g}s"
        if w.step_timeout_s
        else (
            f"step calibrated after {w.calibrate_after} steps ({w.calibration_factor:g}× p99, "
            f"{w.step_timeout_min_s:g}–{w.step_timeout_max_s:g}s; first steps {w.first_steps_timeout_s:g}s)"
        )
    )
    phases = ", ".join(f"{k} {v:g}s" for k, v in w.phase_budgets_s.items()) or "none"
    data = f"train {cfg.data.train or '-'}, eval {cfg.data.eval or '-'}" + (", inbox on" if cfg.data.inbox else "")
    faults = (
        ", ".join(
            f.kind + (f" at step {f.at_step}" if f.at_step is not None else f" at eval {f.at_eval}") for f in cfg.faults
        )
        or "none"
    )
    r = cfg.restart
    mode = "0660, group " + cfg.control.group if cfg.control.group else "0600"
    slurm = slurm_text(cfg)
    return [
        ("run dir", cfg.run_dir),
        *([("slurm", slurm)] if slurm else []),
        ("worker", worker),
        ("model", model),
        ("data", data),
        (
            "training",
            f"{cfg.train.max_steps} steps, micro-batch {cfg.train.micro_batch_size} × accum {cfg.train.grad_accum},"
            f" lr {cfg.train.lr:g}",
        ),
        ("deadlines", f"startup {w.startup_timeout_s:g}s, silence {w.silence_timeout_s:g}s, {step}"),
        ("phases", phases),
        (
            "restarts",
            f"up to {r.max_restarts} in {r.window_s:g}s without progress,"
            f" backoff {r.backoff_initial_s:g}s → {r.backoff_max_s:g}s",
        ),
        ("checkpoint", checkpoint_text(cfg)),
        ("socket", f"{socket_path_for(cfg, cfg.run_dir)} (mode {mode})"),
        ("faults", faults),
    ]
