"""Section `prewarm`: the restart of the built-in worker with `restart.prewarm` off (a cold spawn once the stuck
tree is gone), `true` (a standby spawned at detection loads torch, transformers, peft, the model and the data on
the CPU while the stuck attempt is dumped and killed, and is released once the tree is gone) and `always` (the
standby is spawned once the first attempt steps, and is ready long before the hang), side by side, in
alternating runs of the same hang; with this run's own cold start (the first attempt: spawned → first step)
measured in every run, and whether they all ended in the same weights.  Then the same hang, cold against
`always`, on a ~1B-parameter Llama built from a config and saved as safetensors (float32, on the CPU), where
the cold start is the loading of the weights; with the standby's RAM as `status` reports it."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

from .harness import (
    PY,
    ROOT,
    control,
    demo_worker_config,
    env,
    first,
    hangwatch_run,
    read_beats,
    stall_incidents,
    summary,
    supervisor_log,
    wait_exit,
    write_yaml,
)

HANG_AT = 12
STEP_TIMEOUT_S = 3.0
RUN_LIMIT_S = 300.0
MODES = ("cold", "prewarm", "always")
PREWARM = {"cold": False, "prewarm": True, "always": "always"}
# The large model: a Llama of ~1.06 B parameters, float32 (4.2 GB of safetensors), trained with LoRA on the CPU.
LARGE = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 18,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
LARGE_MODES = ("cold", "always")
LARGE_HANG_AT = 6
LARGE_STEP_TIMEOUT_S = 60.0
LARGE_RUN_LIMIT_S = 1200.0
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hangwatch" / "bench"
FIGURES = (
    "spawn_to_first_step_s",
    "detection_to_gone_s",
    "detection_to_next_process_s",
    "standby_preload_s",
    "standby_spawn_to_ready_s",
    "ready_and_released_to_first_step_s",
    "release_to_start_beat_s",
    "handoff_to_first_step_s",
    "detection_to_next_step_s",
    "next_step_minus_cold_start_s",
    "handoff_to_first_step_over_cold_start",
)


def trial_config(run_dir: Path, prewarm) -> dict:
    return demo_worker_config(
        run_dir,
        train={"max_steps": 24, "sleep_per_step_s": 0.05},
        eval={"every_steps": 0},
        checkpoint={"every_steps": 5, "confirm_steps": 2},
        watchdog={"step_timeout_s": STEP_TIMEOUT_S},
        restart={"backoff_initial_s": 0, "prewarm": prewarm, "in_process": False},  # the restart is what is measured
        faults=[{"kind": "block_c", "at_step": HANG_AT}],
    )


def log_times(run_dir: Path) -> list[tuple[str, Optional[int], float, dict]]:
    """(event, attempt, wall time, record) of every supervisor.log record with a timestamp."""
    out = []
    for rec in supervisor_log(run_dir):
        try:
            t = dt.datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (KeyError, ValueError):
            continue
        out.append((rec.get("event"), rec.get("attempt"), t, rec))
    return out


def when(times: list, event: str, attempt: Optional[int] = None) -> Optional[float]:
    return next((t for e, a, t, _ in times if e == event and (attempt is None or a == attempt)), None)


def weights_digest(run_dir: Path) -> Optional[str]:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def minus(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else a - b


def trial(tmp: Path, mode: str) -> dict:
    """One run: the demo model hangs in C at step HANG_AT; the supervisor detects, dumps, kills, restarts."""
    run_dir = tmp / "run"
    return measure(tmp, mode, trial_config(run_dir, PREWARM[mode]), RUN_LIMIT_S)


def measure(tmp: Path, mode: str, cfg: dict, limit_s: float) -> dict:
    """Run `cfg` to its end; the restart's figures from its log, beats and incident; the standby as `status` showed
    it meanwhile (its RAM while it waited)."""
    run_dir = Path(cfg["run_dir"])
    proc = hangwatch_run(write_yaml(tmp / "cfg.yaml", cfg), tmp / "supervisor.out")
    t0 = time.time()
    seen: list[dict] = []
    done = threading.Event()
    watcher = threading.Thread(target=watch_standby, args=(run_dir, seen, done), daemon=True)
    watcher.start()
    code = wait_exit(proc, limit_s)
    done.set()
    watcher.join(10)
    row: dict = {"mode": mode, "supervisor_exit": code, "dir": str(tmp), "run_wall_s": time.time() - t0}
    ready = [s for s in seen if s.get("state") == "ready" and s.get("rss_mb")]
    row["standby_rss_mb"] = max((s["rss_mb"] for s in ready), default=None)
    times = log_times(run_dir)
    step_1 = first(read_beats(run_dir, 1), "step")
    row["spawn_to_first_step_s"] = minus(step_1 and step_1["t"], when(times, "worker_spawned", 1))
    incs = stall_incidents(run_dir)
    if not incs:
        row["error"] = "no stall incident"
        return row
    inc = incs[0]
    nxt = inc["attempt"] + 1
    detected = inc["time_unix"]
    beats = read_beats(run_dir, nxt)
    start, step = first(beats, "start"), first(beats, "step")
    prewarmed = bool(start and start.get("prewarmed"))
    loaded = next((b for b in beats if b["event"] == "progress" and "standby_preload_s" in b), {})
    handoff = when(times, "standby_released", nxt) if prewarmed else when(times, "worker_spawned", nxt)
    next_process = when(times, "standby_spawned", nxt) if prewarmed else when(times, "worker_spawned", nxt)
    row.update(
        prewarmed=prewarmed,
        detection_to_gone_s=(inc.get("timings") or {}).get("detection_to_gone_s"),
        detection_to_next_process_s=minus(next_process, detected),
        standby_preload_s=loaded.get("standby_preload_s"),
        standby_ready_before_release=(loaded.get("standby_wait_s") or 0) > 0 if prewarmed else None,
        standby_spawn_to_ready_s=minus(loaded.get("standby_ready_t"), next_process),
        ready_and_released_to_first_step_s=minus(
            step and step["t"], max(handoff or 0, loaded.get("standby_ready_t") or 0)
        )
        if handoff and loaded.get("standby_ready_t")
        else None,
        release_to_start_beat_s=minus(start and start["t"], handoff),
        handoff_to_first_step_s=minus(step and step["t"], handoff),
        detection_to_next_step_s=minus(step and step["t"], detected),
        weights=weights_digest(run_dir),
    )
    row["next_step_minus_cold_start_s"] = minus(row["detection_to_next_step_s"], row["spawn_to_first_step_s"])
    cold = row["spawn_to_first_step_s"]
    row["handoff_to_first_step_over_cold_start"] = (
        None if row["handoff_to_first_step_s"] is None or not cold else row["handoff_to_first_step_s"] / cold
    )
    if mode != "cold" and not prewarmed:
        row["error"] = "the next attempt did not come from the standby"
    if mode == "always":
        spawned = when(times, "standby_spawned", nxt)
        row["standby_spawned_before_detection_s"] = minus(detected, spawned)
    return row


def watch_standby(run_dir: Path, seen: list, done: threading.Event) -> None:
    """`status` every 0.5 s while the run lasts: the standby it reports (None outside `restart.prewarm`)."""
    while not done.wait(0.5):
        result, _ = control(run_dir, "status", 5.0)
        if isinstance(result, dict) and isinstance(result.get("standby"), dict):
            seen.append(result["standby"])


# ---------------------------------------------------------------- the ~1B model


def large_model_dir() -> tuple[Path, int]:
    """The ~1B Llama, built once from LARGE (seeded) and kept in the user's cache: (its directory, parameters)."""
    key = hashlib.sha256(repr(sorted(LARGE.items())).encode()).hexdigest()[:12]
    where = CACHE / f"llama-1b-{key}"
    marker = where / "params.txt"
    if not marker.exists():
        code = (
            "import sys, torch; from pathlib import Path; from transformers import LlamaConfig, LlamaForCausalLM; "
            "from hangwatch.daemon.model import build_tiny_tokenizer; d = Path(sys.argv[1]); "
            f"torch.manual_seed(0); m = LlamaForCausalLM(LlamaConfig(**{LARGE!r})); "
            "m.save_pretrained(d, safe_serialization=True); build_tiny_tokenizer(512).save_pretrained(d); "
            "(d / 'params.txt').write_text(str(sum(p.numel() for p in m.parameters())))"
        )
        where.mkdir(parents=True, exist_ok=True)
        subprocess.run([PY, "-c", code, str(where)], cwd=ROOT, env=env(), check=True, timeout=1800)
    return where, int(marker.read_text())


def large_config(run_dir: Path, model_dir: Path, mode: str) -> dict:
    return demo_worker_config(
        run_dir,
        model={"name_or_path": str(model_dir), "dtype": "float32", "device": "cpu"},
        data={"max_length": 32},
        lora={"modules_to_save": []},  # the usual LoRA fine-tune: adapters only (the demo also trains its embeddings)
        train={"max_steps": LARGE_HANG_AT + 4, "micro_batch_size": 1, "grad_accum": 1, "sleep_per_step_s": 0.0},
        eval={"every_steps": 0, "prompts": []},
        checkpoint={"every_steps": 2, "confirm_steps": 1},
        watchdog={"step_timeout_s": LARGE_STEP_TIMEOUT_S, "first_steps_timeout_s": 900, "startup_timeout_s": 900},
        restart={"backoff_initial_s": 0, "prewarm": PREWARM[mode], "in_process": False},
        faults=[{"kind": "block_c", "at_step": LARGE_HANG_AT}],
    )


def large_section(work: Path) -> dict:
    model_dir, params = large_model_dir()
    rows = {
        m: measure(work / f"large-{m}", m, large_config(work / f"large-{m}" / "run", model_dir, m), LARGE_RUN_LIMIT_S)
        for m in LARGE_MODES
    }
    cold, warm = rows["cold"], rows["always"]
    ratio = (
        None
        if not cold.get("detection_to_next_step_s") or warm.get("detection_to_next_step_s") is None
        else warm["detection_to_next_step_s"] / cold["detection_to_next_step_s"]
    )
    return {
        "params": params,
        "model_bytes": sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        "modes": {m: mode_summary([rows[m]]) for m in LARGE_MODES},
        "always_over_cold": ratio,
        "same_final_weights": cold.get("weights") is not None and cold.get("weights") == warm.get("weights"),
    }


def mode_summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    out: dict = {
        "raw": rows,
        "trials": len(rows),
        "errors": [r["error"] for r in rows if "error" in r],
        **{key: summary([r.get(key) for r in ok]) for key in FIGURES},
    }
    out["below_cold_start"] = sum(1 for r in ok if (r.get("next_step_minus_cold_start_s") or 0) < 0)
    out["standby_ready_before_release"] = sum(1 for r in ok if r.get("standby_ready_before_release"))
    out["standby_rss_mb"] = summary([r.get("standby_rss_mb") for r in ok])
    out["standby_spawned_before_detection_s"] = summary([r.get("standby_spawned_before_detection_s") for r in ok])
    return out


def section(work: Path, quick: bool) -> dict:
    out = demo_section(work, quick)
    # A ~1B model is minutes of CPU per run: measured in the full benchmark only.
    out["large"] = None if quick else large_section(work)
    return out


def demo_section(work: Path, quick: bool) -> dict:
    trials = 1 if quick else 3
    rows: dict[str, list] = {m: [] for m in MODES}
    for i in range(trials):  # interleaved, so that a busier stretch of the machine falls on both alike
        for m in MODES:
            rows[m].append(trial(work / f"{m}-{i}", m))
    pairs = list(zip(rows["cold"], rows["prewarm"]))
    same = [
        a.get("weights") is not None and a.get("weights") == b.get("weights") == c.get("weights")
        for a, b, c in zip(rows["cold"], rows["prewarm"], rows["always"])
    ]
    # The prewarmed restart against a cold start in the same situation: the cold run's restart, same round.
    versus = [
        minus(b.get("detection_to_next_step_s"), a.get("handoff_to_first_step_s"))
        for a, b in pairs
        if "error" not in a and "error" not in b
    ]
    return {
        "method": f"{trials} runs of `hangwatch run` per mode, alternating, on the demo model (configs/demo.yaml "
        f"watchdog: dump_grace_s 3, term_grace_s 5; step_timeout_s {STEP_TIMEOUT_S:g}; checkpoint every 5 "
        f"steps, confirmed after 2; 0.05 s sleep per step; no backoff): a block_c fault (a mutex locked "
        f"twice) at step {HANG_AT}, `restart.prewarm` false (cold) or true (prewarm). Cold start: "
        "the run's first attempt, `worker_spawned` log line → its first step line. Detection: the incident "
        "time. `always`: `restart.prewarm: always`, the standby spawned once the first attempt stepped. Next process: "
        "the cold worker's `worker_spawned`, or the `standby_spawned` line. Handoff: "
        "`worker_spawned` (cold) or `standby_released` (prewarm) → the next attempt's first step line. "
        "Standby preload: its `load` progress beat's standby_preload_s (imports, model and data on the CPU); "
        "ready before release: its standby_wait_s > 0; ready → first step: the first step line − the "
        "later of `standby_released` and that beat's standby_ready_t (wall clock). Against a cold start: "
        "the prewarmed run's detection → next step − the cold run's spawn → first step of its restart, "
        "same round. Weights: sha256 of final/*.safetensors of the three runs of a round. Standby RAM: the "
        "largest `rss_mb` of a ready standby in `status` (asked every 0.5 s).",
        "trials": trials,
        "modes": {m: mode_summary(rows[m]) for m in MODES},
        "same_final_weights": f"{sum(same)} of {len(same)}",
        "prewarm_detection_to_next_step_minus_cold_restart_start_s": summary(versus),
        "below_cold_restart_start": f"{sum(1 for v in versus if v is not None and v < 0)} of {len(versus)}",
    }


def render(p: dict) -> tuple:
    """(title, header, rows, how) for report.py."""
    modes = p["modes"]

    def cell(s: Optional[dict], unit: str = "s", digits: int = 2) -> str:
        if not s or not s.get("n"):
            return "–"
        if s["n"] == 1:
            return f"{s['median']:.{digits}f} {unit}"
        return f"{s['median']:.{digits}f} {unit} (n={s['n']}; min {s['min']:.{digits}f}, max {s['max']:.{digits}f})"

    def row(label: str, key: str, unit: str = "s", digits: int = 2, of: dict = modes) -> list[str]:
        return [label] + [cell(of[m].get(key), unit, digits) if m in of else "–" for m in MODES]

    def count(key: str) -> list[str]:
        return [f"{modes[m][key]} of {modes[m]['trials'] - len(modes[m]['errors'])}" for m in MODES]

    rows = [
        row("this run's cold start: first attempt spawned → first step", "spawn_to_first_step_s"),
        row("detection → process tree gone", "detection_to_gone_s"),
        row(
            "detection → next attempt's process spawned (cold worker / standby; `always`: negative, before)",
            "detection_to_next_process_s",
        ),
        row("standby: imports, model and data on the CPU", "standby_preload_s"),
        row("standby: spawned → preloaded (its own start included)", "standby_spawn_to_ready_s"),
        ["standby ready before its release"] + ["–"] + count("standby_ready_before_release")[1:],
        row("standby's RAM while it waits (`status`)", "standby_rss_mb", "MiB", 0),
        row(
            "standby: released and preloaded (the later of the two) → first step: what a restart costs once "
            "the standby is ready",
            "ready_and_released_to_first_step_s",
        ),
        row("spawn (cold) / release (standby) → its `start` beat", "release_to_start_beat_s"),
        row("spawn (cold) / release (standby) → first step of the next attempt", "handoff_to_first_step_s"),
        row("· as a fraction of this run's cold start", "handoff_to_first_step_over_cold_start", "×", 2),
        row("**detection → first step of the next attempt** (goal with `always`: ≤ 2 s)", "detection_to_next_step_s"),
        row(
            "detection → next step − this run's cold start (below 0: shorter than a cold start)",
            "next_step_minus_cold_start_s",
        ),
        ["runs where detection → next step was below the cold start"] + count("below_cold_start"),
        [
            "`true`: detection → next step − the cold restart's spawn → first step, same round",
            "–",
            cell(p["prewarm_detection_to_next_step_minus_cold_restart_start_s"]),
            "–",
        ],
        ["same final weights, cold vs `true` vs `always` run of a round (bitwise)", p["same_final_weights"], "–", "–"],
        ["runs that could not be measured"] + ["; ".join(modes[m]["errors"]) or "none" for m in MODES],
    ]
    large = p.get("large")
    how = p["method"]
    if large:
        lm = large["modes"]
        label = (
            f"~1B Llama ({large['params'] / 1e9:.2f} B parameters, {large['model_bytes'] / 1e9:.1f} GB safetensors, "
            "float32, CPU)"
        )
        rows += [
            [f"**{label}**", "", "", ""],
            row("· cold start: first attempt spawned → first step", "spawn_to_first_step_s", of=lm),
            row("· standby: imports, model and data on the CPU", "standby_preload_s", of=lm),
            row("· standby's RAM while it waits (`status`)", "standby_rss_mb", "MiB", 0, of=lm),
            row("· **detection → first step of the next attempt**", "detection_to_next_step_s", of=lm),
            [
                "· `always` ÷ cold, detection → next step (goal ≤ 0.5)",
                "–",
                "–",
                "–" if large["always_over_cold"] is None else f"{large['always_over_cold']:.2f}",
            ],
            [
                "· same final weights, cold vs `always` (bitwise)",
                "yes" if large["same_final_weights"] else "NO",
                "–",
                "–",
            ],
            ["· runs that could not be measured"]
            + ["; ".join(lm[m]["errors"]) or "none" if m in lm else "–" for m in MODES],
        ]
        how += (
            " The ~1B model: transformers' LlamaForCausalLM built from a config "
            f"({', '.join(f'{k} {v}' for k, v in LARGE.items())}), seeded, saved with save_pretrained as safetensors "
            f"(kept in {CACHE}); one run per mode, cold then `always`, LoRA r 8 on every projection and nothing else "
            "trained, micro-batch 1 of at most 32 tokens, checkpoint every 2 steps confirmed after 1, block_c at step "
            f"{LARGE_HANG_AT}, step_timeout_s {LARGE_STEP_TIMEOUT_S:g}."
        )
    elif "large" in p:
        rows.append(["~1B Llama", "not measured under --quick", "–", "–"])
    return (
        "7. Restart with `restart.prewarm` (hang in C): cold spawn vs a standby spawned at the stall (`true`) "
        "vs one kept ready (`always`)",
        ["figure", "prewarm off (cold spawn)", "`true` (standby at the stall)", "`always` (standby kept ready)"],
        rows,
        how,
    )
