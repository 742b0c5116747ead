"""Plain-text summaries the CLI prints: what a config will do, and how a run ended.

Pure functions of a config or a run dir on disk (no daemon, no terminal styling), so `run` and
`validate-config` say the same things the same way.
"""
from __future__ import annotations

from pathlib import Path

from hangwatch.common.config import Config
from hangwatch.common.rundir import STATE_NAME, read_json
from hangwatch.supervisor.control.paths import socket_path_for
from hangwatch.supervisor.incidents import IncidentStore


def run_summary(run_dir: str, code: int) -> list[str]:
    """What a person wants to know when `hangwatch run` returns: how it ended, what went wrong on the
    way (each incident and where its evidence is), and where the result is."""
    rd = Path(run_dir)
    state = read_json(rd / STATE_NAME) or {}
    lines = [f"hangwatch: run {state.get('state', 'ended')} (exit {code}) after {state.get('attempt', '?')} attempt(s); "
             f"run dir {rd}"]
    store = IncidentStore(rd)
    for inc, d in zip(store.list(), store.dirs()):
        lines.append(f"  incident {inc.get('id')} [{inc.get('kind')}] {d}: {inc.get('summary')}")
    final = rd / "final"
    if final.is_dir():
        lines.append(f"  final adapter: {final}  (PeftModel.from_pretrained(base, '{final}'))")
    return lines


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
    step = f"step {w.step_timeout_s:g}s" if w.step_timeout_s else (
        f"step calibrated after {w.calibrate_after} steps ({w.calibration_factor:g}× p99, "
        f"{w.step_timeout_min_s:g}–{w.step_timeout_max_s:g}s; first steps {w.first_steps_timeout_s:g}s)"
    )
    phases = ", ".join(f"{k} {v:g}s" for k, v in w.phase_budgets_s.items()) or "none"
    data = f"train {cfg.data.train or '-'}, eval {cfg.data.eval or '-'}" + (", inbox on" if cfg.data.inbox else "")
    faults = ", ".join(
        f.kind + (f" at step {f.at_step}" if f.at_step is not None else f" at eval {f.at_eval}") for f in cfg.faults
    ) or "none"
    r = cfg.restart
    mode = "0660, group " + cfg.control.group if cfg.control.group else "0600"
    return [
        ("run dir", cfg.run_dir),
        ("worker", worker),
        ("model", model),
        ("data", data),
        ("training", f"{cfg.train.max_steps} steps, micro-batch {cfg.train.micro_batch_size} × accum {cfg.train.grad_accum}, lr {cfg.train.lr:g}"),
        ("deadlines", f"startup {w.startup_timeout_s:g}s, silence {w.silence_timeout_s:g}s, {step}"),
        ("phases", phases),
        ("restarts", f"up to {r.max_restarts} in {r.window_s:g}s without progress, backoff {r.backoff_initial_s:g}s → {r.backoff_max_s:g}s"),
        ("checkpoint", f"every {cfg.checkpoint.every_steps} steps, keep {cfg.checkpoint.keep_last}, good after {cfg.checkpoint.confirm_steps} finite steps"),
        ("socket", f"{socket_path_for(cfg, cfg.run_dir)} (mode {mode})"),
        ("faults", faults),
    ]
