"""Terminal output of the CLI: status, the live view, incidents, stack dumps (rich).

Everything here takes the plain dicts the control socket returns and builds rich renderables; it
never talks to the daemon.  Fields a daemon does not send are shown as "-", and fields this module
does not know are left out of the human view (`--json` has them all).
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any, Iterable, Optional

from rich.cells import cell_len
from rich.console import Group
from rich.table import Table
from rich.text import Text

from hangwatch.supervisor.records.goodput import goodput_line

STATE_STYLES = {
    "starting": "cyan",
    "running": "green",
    "stalled": "bold red",
    "dumping": "bold red",
    "killing": "bold red",
    "backoff": "yellow",
    "stopping": "yellow",
    "paused": "yellow",
    "stopped": "dim",
    "finished": "bold green",
    "failed": "bold red",
}


def duration(seconds: Any) -> str:
    """0.4s, 12s, 3m05s, 2h07m, 3d04h."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "-"
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 10:
        return f"{sign}{s:.1f}s"
    if s < 60:
        return f"{sign}{s:.0f}s"
    m, sec = divmod(int(round(s)), 60)
    if m < 60:
        return f"{sign}{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    if h < 48:
        return f"{sign}{h}h{m:02d}m"
    d, h = divmod(h, 24)
    return f"{sign}{d}d{h:02d}h"


def number(value: Any, fmt: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return format(value, fmt) if isinstance(value, float) else str(value)
    return str(value)  # "NaN" / "Infinity" arrive as strings


def _state_text(state: Any) -> Text:
    name = str(state) if state is not None else "-"
    return Text(name, style=STATE_STYLES.get(name.lower(), "bold"))


def progress_bar(step: Any, max_steps: Any, width: int = 30) -> Optional[Text]:
    """A bar made of characters, so it reads the same in a terminal, a pipe and a log."""
    if not (isinstance(step, int) and isinstance(max_steps, int) and max_steps > 0):
        return None
    done = min(max(step, 0), max_steps)
    filled = round(width * done / max_steps)
    bar = Text()
    bar.append("█" * filled, style="green")
    bar.append("░" * (width - filled), style="dim")
    bar.append(f" {100 * done / max_steps:.0f}%")
    return bar


def status_view(st: dict, *, error: Optional[str] = None) -> Table:
    """The human status: one labelled row per aspect of the run."""
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    if error:
        grid.add_row("error", Text(error, style="bold red"))

    state = Text.assemble(_state_text(st.get("state")), f"   attempt {number(st.get('attempt'))}")
    if st.get("supervisor_pid") is not None:
        state.append(f"   supervisor pid {st['supervisor_pid']}, up {duration(st.get('uptime_s'))}")
    grid.add_row("state", state)

    worker = f"pid {number(st.get('pid'))}" if st.get("pid") is not None else "not running"
    pids = st.get("pids")
    if isinstance(pids, (dict, list)) and (
        len(pids) > 1 or st.get("pid") not in (list(pids.values()) if isinstance(pids, dict) else pids)
    ):
        worker += f"   {pids_text(pids)}"  # several ranks, or a launcher (torchrun) in front of them
    if st.get("backoff_remaining_s") is not None:
        worker += f"   next attempt in {duration(st['backoff_remaining_s'])}"
    if st.get("intent"):
        worker += f"   (then: {st['intent']})"
    grid.add_row("worker", worker)

    phase = Text(str(st.get("phase") or "-"))
    if st.get("phase_age_s") is not None:
        phase.append(f"   for {duration(st['phase_age_s'])}")
        if st.get("phase_budget_s") is not None:
            phase.append(f" of {duration(st['phase_budget_s'])} budget")
            if isinstance(st["phase_age_s"], (int, float)) and st["phase_age_s"] > 0.8 * st["phase_budget_s"]:
                phase.stylize("yellow")
    grid.add_row("phase", phase)

    step, max_steps = st.get("step"), st.get("max_steps")
    step_text = Text(f"{number(step)} / {number(max_steps)}  ")
    bar = progress_bar(step, max_steps)
    if bar is not None:
        step_text.append_text(bar)
    grid.add_row("step", step_text)

    grid.add_row(
        "training",
        f"loss {number(st.get('loss'))}   lr {number(st.get('lr'), '.3g')}   "
        f"{number(st.get('tokens_per_s'), '.1f')} tokens/s",
    )
    beat = f"{duration(st.get('last_beat_age_s'))} ago" if st.get("last_beat_age_s") is not None else "none yet"
    if st.get("torn_lines"):
        beat += f"   ({st['torn_lines']} torn/invalid lines skipped)"
    grid.add_row("heartbeat", beat)
    out = st.get("output")
    if isinstance(out, dict) and out.get("last_output_age_s") is not None:
        grid.add_row("output", Text(output_text(out)))
    prompt = st.get("waiting_for_input")
    if isinstance(prompt, dict):
        grid.add_row(
            "input",
            Text(
                f"waiting at a prompt: pid {prompt.get('pid')} reads its terminal {prompt.get('terminal')}",
                style="bold yellow",
            ),
        )

    deadlines = st.get("deadlines") or []
    ranks = [r for r in st.get("ranks") or [] if isinstance(r, dict)]
    if len(ranks) > 1:  # one line per rank; the deadlines are on them
        grid.add_row("ranks", ranks_text(ranks))
    elif deadlines:
        grid.add_row("deadlines", deadline_text(deadlines))
    budgets = st.get("phase_budgets")
    if isinstance(budgets, dict) and budgets:
        grid.add_row("budgets", Text(budgets_text(budgets)))
    good = st.get("last_good_checkpoint")
    grid.add_row("checkpoint", f"{good} (last good)" if good else "no good checkpoint yet")
    grid.add_row("restarts", number(st.get("restarts")))
    if isinstance(st.get("goodput"), dict):
        grid.add_row("goodput", Text(goodput_text(st["goodput"])))
    grid.add_row("incidents", incident_line(st.get("incidents"), st.get("last_incident")))
    grid.add_row("gpu", gpu_text(st.get("gpu")))
    if isinstance(st.get("queue"), dict):
        grid.add_row("queue", queue_text(st["queue"]))
    if isinstance(st.get("remediation"), dict):
        grid.add_row("remediation", str(st["remediation"].get("words")))
    if isinstance(st.get("framework_remediation"), dict):
        grid.add_row("remediation", Text(str(st["framework_remediation"].get("words"))))
    if isinstance(st.get("standby"), dict):
        grid.add_row("standby", standby_text(st["standby"]))
    if isinstance(st.get("in_process"), dict) and in_process_text(st["in_process"]):
        grid.add_row("in process", in_process_text(st["in_process"]))
    if isinstance(st.get("nodes"), dict):
        grid.add_row("nodes", nodes_text(st["nodes"]))
    if isinstance(st.get("quarantine"), dict):
        q = st["quarantine"]
        more = f" (+{q['more']} more)" if q.get("more") else ""
        grid.add_row("quarantine", f"{q.get('count')} example(s): {', '.join(map(str, q.get('ids') or []))}{more}")
    if st.get("run_dir"):
        grid.add_row("run dir", str(st["run_dir"]))
    return grid


def in_process_text(ip: dict) -> str:
    """Recoveries in the worker's process: `2 recovered without a restart: 1 stall, 1 out-of-memory step`; "" when
    none and no order waits."""
    names = {"stall": "stall", "nonfinite": "non-finite streak", "oom": "out-of-memory step"}
    counts = ip.get("recovered") if isinstance(ip.get("recovered"), dict) else {}
    parts = [f"{n} {names.get(k, k)}{'s' if n > 1 else ''}" for k, n in counts.items() if isinstance(n, int) and n]
    text = (
        f"{sum(counts[k] for k in counts if isinstance(counts[k], int))} recovered without a restart: "
        + ", ".join(parts)
        if parts
        else ""
    )
    waiting = ip.get("waiting")
    if isinstance(waiting, dict):
        text = (text + "; " if text else "") + f"waiting for the worker to abandon step {waiting.get('step')}"
    return text


def standby_text(sb: dict) -> str:
    """restart.prewarm's standby: `attempt 3 ready (pid 4242, preloaded in 4.1s; 812 MiB RAM, no GPU memory)`."""
    what = sb.get("state") or "?"
    if what == "ready" and sb.get("preload_s") is not None:
        what += f" (preloaded in {sb['preload_s']:.1f}s)"
    elif what == "preload failed":
        what += f" ({sb.get('error')}; the restart loads cold)"
    ram = f"{sb['rss_mb']:.0f} MiB RAM" if isinstance(sb.get("rss_mb"), (int, float)) else "RAM unknown"
    return f"attempt {sb.get('attempt')} {what}, pid {sb.get('pid')}: {ram}, no GPU memory until released"


def goodput_text(snap: dict) -> str:
    """The ledger's line as the supervisor wrote it; worded here only from a snapshot that lacks one."""
    line = snap.get("line")
    return line if isinstance(line, str) and line else goodput_line(snap)


def output_text(out: dict) -> str:
    """The worker's output as evidence: when it last wrote, and its last progress line."""
    text = f"last line {duration(out.get('last_output_age_s'))} ago"
    if out.get("last_progress_line"):
        text += f"; progress {duration(out.get('last_progress_age_s'))} ago: {str(out['last_progress_line'])[:80]}"
    if out.get("step") is not None:
        text += f" (step {out['step']})"
    return text


def nodes_text(n: dict) -> str:
    """ "node a, 2 nodes, generation 3 (rendezvous hangwatch-g3 at 127.0.0.1:29500, store ok, host); peers: b running g3
    (0.4 s); torchrun round 2 (restarted its ranks 1× within this attempt)"."""
    head = (
        f"node {n.get('node')}, {n.get('nnodes')} nodes, generation {n.get('attempt_generation')} "
        f"(rendezvous {n.get('rdzv_id')} at {n.get('endpoint')}, store {n.get('store')}"
        + (f", {n.get('store_role')}" if n.get("store_role") else "")
        + ")"
    )
    if n.get("waiting_since"):
        head += f"; waiting at the rendezvous for {duration(time.time() - float(n['waiting_since']))}"
    peers = n.get("peers") or {}
    others = [
        f"{name} {p.get('state')} g{p.get('gen')} ({number(p.get('age_s'), '.1f')} s)"
        for name, p in peers.items()
        if name != n.get("node")
    ]
    if others:
        head += "; peers: " + ", ".join(others)
    if n.get("torchrun_round_changes"):
        rounds = max((n.get("torchrun_rounds") or {}).values(), default=0)
        head += (
            f"; torchrun round {rounds + 1} (restarted its ranks {n['torchrun_round_changes']}× within this attempt)"
        )
    return head


def pids_text(pids: Any) -> str:
    """Announced pids by rank: {"0": 123, "1": 124} → "rank 0: 123, rank 1: 124"."""
    if isinstance(pids, dict):
        return ", ".join(
            f"rank {r}: {p}" for r, p in sorted(pids.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0)
        )
    if isinstance(pids, list):
        return ", ".join(str(p) for p in pids)
    return ""


def ranks_text(ranks: list[dict]) -> Text:
    """One line per rank: pid, phase and for how long, step, last beat, its deadlines, a straggler mark."""
    out = Text()
    for i, r in enumerate(ranks):
        if i:
            out.append("\n")
        out.append(f"rank {number(r.get('rank'))}", style="bold")
        out.append(
            f"  pid {number(r.get('pid'))}  {r.get('phase') or '-'} for {duration(r.get('phase_age_s'))}"
            f"  step {number(r.get('step'))}  beat {duration(r.get('last_beat_age_s'))} ago"
        )
        if r.get("stopped"):
            out.append("  stopped", style="dim")
        dls = [d for d in r.get("deadlines") or [] if isinstance(d, dict)]
        if dls:
            out.append("  ")
            out.append_text(deadline_text([{**d, "rank": None} for d in dls]))  # the rank is the line's
        s = r.get("straggler")
        if isinstance(s, dict):
            took, median = s.get("step_time_s"), s.get("others_median_s")
            ratio = (
                took / median
                if isinstance(took, (int, float)) and isinstance(median, (int, float)) and median > 0
                else None
            )
            out.append(
                f"  straggler: {duration(s.get('step_time_s'))} a step"
                + (f", {ratio:.1f}× the others' median" if ratio else ""),
                style="yellow",
            )
    return out


def budgets_text(budgets: dict) -> str:
    """ "generate 6s (learned: 5 × longest 1.2s)   eval 15m (default)": each phase's budget and where it came from."""
    parts = []
    for name, b in budgets.items():
        if isinstance(b, dict):
            parts.append(f"{name} {duration(b.get('budget_s'))} ({b.get('source')})")
    return "   ".join(parts)


def deadline_text(deadlines: Iterable[dict]) -> Text:
    out = Text()
    for i, d in enumerate(deadlines):
        if i:
            out.append("   ")
        remaining, budget = d.get("remaining_s"), d.get("budget_s")
        style = (
            "red"
            if isinstance(remaining, (int, float))
            and isinstance(budget, (int, float))
            and budget
            and remaining < 0.2 * budget
            else ""
        )
        name = str(d.get("name", "?"))
        if d.get("rank") not in (None, 0, "0"):
            name += f"[rank {d['rank']}]"
        out.append(f"{name} {duration(remaining)} left of {duration(budget)}", style=style)
    return out


def incident_line(count: Any, last: Any) -> str:
    text = number(count) if count is not None else "0"
    if isinstance(last, dict):
        text += f"   last: {last.get('id', '?')} {last.get('kind', '?')}"
        if last.get("summary"):
            text += f" — {last['summary']}"
    return text


def gpu_text(gpu: Any) -> str:
    """One line per device: utilisation and memory."""
    if not isinstance(gpu, dict):
        return "-"
    if not gpu.get("available"):
        return f"unavailable ({gpu.get('reason', 'no reason given')})"
    lines = []
    for d in gpu.get("devices") or []:
        parts = [f"GPU{d.get('index', len(lines))}"]
        if d.get("name"):
            parts.append(str(d["name"]))
        if isinstance(d.get("utilization_percent"), (int, float)):
            parts.append(f"util {d['utilization_percent']:.0f}%")
        used, total = d.get("memory_used_bytes"), d.get("memory_total_bytes")
        if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total:
            parts.append(f"mem {used / 2**30:.1f}/{total / 2**30:.1f} GiB")
        lines.append("  ".join(parts))
    return "\n".join(lines) or "no devices"


def queue_text(q: dict) -> str:
    """Continuous mode (keys of hangwatch.common.inbox_layout.queue_status)."""
    text = f"{number(q.get('waiting'))} waiting, {number(q.get('done'))} done, {number(q.get('rejected'))} rejected"
    if q.get("inbox"):
        text += f", {q['inbox']} arriving"
    if q.get("ledger_examples") is not None:
        text += f"; {number(q['ledger_examples'])} examples trained"
    if q.get("current_file"):
        text += f"   now: {q['current_file']}"
        prog = q.get("current_progress")
        if isinstance(prog, dict) and isinstance(prog.get("index"), int) and isinstance(prog.get("total"), int):
            text += f" (example {prog['index']} of {prog['total']})"
        elif isinstance(prog, (int, float)):
            text += f" ({100 * prog:.0f}%)" if prog <= 1 else f" ({prog})"
        elif prog is not None:
            text += f" ({prog})"
    return text


INCIDENT_COLUMNS = ("id", "kind", "time", "attempt", "step", "summary")
# The summary is what a person reads the list for: it gets every column the others leave, and at least this many
# (or its whole length, when every summary is shorter) before the less important columns give way — the time
# shortened, then dropped, then the step, then the attempt.  The id and the kind are never cut nor wrapped.
SUMMARY_ROOM = 36
_LAYOUTS = (
    (("id", "kind", "time", "attempt", "step"), "full"),
    (("id", "kind", "time", "attempt", "step"), "short"),
    (("id", "kind", "attempt", "step"), None),
    (("id", "kind", "attempt"), None),
    (("id", "kind"), None),
)
_GAP = 2  # between two columns: the table's padding of one on either side, no edge
_ISO = re.compile(r"^(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d)(?::(\d\d))?")


def incidents_table(incidents: list) -> "IncidentsTable":
    """The incidents as a table laid out for the width it is printed at (a terminal's, or 80 into a pipe)."""
    return IncidentsTable([inc for inc in incidents if isinstance(inc, dict)])


class IncidentsTable:
    """A rich renderable: the columns are chosen when the console says how wide it is (`_LAYOUTS`)."""

    def __init__(self, incidents: list[dict]):
        self.incidents = incidents

    def __rich_console__(self, console, options):
        yield self.table(options.max_width)

    def table(self, width: int) -> Table:
        rows = [_incident_cells(inc) for inc in self.incidents]
        summary_need = min(SUMMARY_ROOM, max((cell_len(r["summary"]) for r in rows), default=0))
        summary_need = max(summary_need, len("summary"))
        one_day = len({m.group(1, 2, 3) for r in rows if (m := _ISO.match(r["time"]))}) == 1
        for columns, time_form in _LAYOUTS:
            shown = [
                {**r, "time": _short_time(r["time"], one_day) if time_form == "short" else r["time"]} for r in rows
            ]
            widths = [max([len(col), *(cell_len(r[col]) for r in shown)]) for col in columns]
            if width - sum(widths) - _GAP * len(columns) >= summary_need:
                break
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in columns:
            table.add_column(col, no_wrap=True)
        table.add_column("summary", overflow="fold", ratio=1, min_width=min(summary_need, max(width // 3, 1)))
        for r in shown:
            table.add_row(*(Text(r[col]) for col in (*columns, "summary")))  # Text: a `[…]` is not rich markup
        return table


def _incident_cells(inc: dict) -> dict[str, str]:
    cells = {}
    for col in INCIDENT_COLUMNS:
        v = inc.get(col)
        if col == "summary" and not v:
            v = inc.get("classification")
        cells[col] = "-" if v is None else str(v)
    return cells


def _short_time(value: str, one_day: bool) -> str:
    """`2024-05-01T03:12:44+0000` as `03:12:44` when every incident listed is of one day, else `05-01 03:12`."""
    m = _ISO.match(value)
    if m is None:
        return value
    if one_day:
        return f"{m.group(4)}:{m.group(5)}" + (f":{m.group(6)}" if m.group(6) else "")
    return f"{m.group(2)}-{m.group(3)} {m.group(4)}:{m.group(5)}"


def incident_view(inc: dict) -> Group:
    """One incident: the headline fields, the record as JSON, then every multi-line text in it (a
    traceback, a log tail) printed as text under its key path — not as one escaped JSON string."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold", no_wrap=True)
    head.add_column()
    for key in (
        "id",
        "kind",
        "time",
        "attempt",
        "phase",
        "step",
        "deadline",
        "culprit_rank",
        "classification",
        "summary",
        "stuck_frame",
        "evidence",
    ):
        if inc.get(key) not in (None, "", [], {}):
            value = inc[key]
            head.add_row(key, value if isinstance(value, str) else json.dumps(value, default=str))
    if "landmark" in inc:  # incidents older than the landmark reading have no such key: no line
        head.add_row("landmark", Text(landmark_text(inc)))  # Text: "[kind]" is not rich markup
    if inc.get("dataloader_workers"):
        head.add_row("dataloader", Text(loader_workers_text(inc)))
    if isinstance(inc.get("remediation"), dict):
        head.add_row("remediation", Text(str(inc["remediation"].get("message") or inc["remediation"])))
    if isinstance(inc.get("framework_remediation"), dict):
        fr = inc["framework_remediation"]
        head.add_row("remediation", Text(str(fr.get("message") or fr)))
    if inc.get("quarantined"):
        head.add_row("quarantined", Text(json.dumps(inc["quarantined"], default=str)))
    texts: list[tuple[str, str]] = []
    record = _lift_texts(inc, "", texts)
    parts = [head, Text(""), Text(json.dumps(record, indent=2, default=str))]
    for path, text in texts:
        parts += [Text(""), Text(f"{path}:", style="bold"), Text(text.rstrip("\n"))]
    return Group(*parts)


def _frame(f: Any) -> str:
    """ "on_evaluate (train.py:46)"."""
    if not isinstance(f, dict):
        return "-"
    return f"{f.get('function', '?')} ({str(f.get('file') or '?').rsplit('/', 1)[-1]}:{f.get('line', '?')})"


def landmark_text(inc: dict) -> str:
    """The call the stack is in, who called it, the outermost frame of the user's code: one line each."""
    lm = inc.get("landmark")
    if isinstance(lm, dict):
        lines = [f"{lm.get('name', '?')} [{lm.get('kind', '?')}] at {_frame(lm.get('frame'))}"]
    else:
        lines = ["none: no landmark call on the stack"]
    lines.append(
        f"called from {_frame(inc.get('caller_frame'))}"
        if inc.get("caller_frame")
        else "called from: no frame of your own code"
    )
    if inc.get("user_outermost_frame"):
        lines.append(f"outermost own frame {_frame(inc['user_outermost_frame'])}")
    if inc.get("stack_truncated"):
        lines.append("stack truncated: faulthandler printed only its innermost 100 frames")
    return "\n".join(lines)


def loader_workers_text(inc: dict) -> str:
    """One line per DataLoader worker, the stuck one marked."""
    lines = []
    for w in inc.get("dataloader_workers") or []:
        if not isinstance(w, dict):
            continue
        mark = "STUCK " if w.get("pid") == inc.get("stuck_worker_pid") else ""
        lines.append(f"{mark}pid {w.get('pid')}: {w.get('activity', '?')}, {w.get('doing') or w.get('classification')}")
    if inc.get("stuck_worker_pid") is None and inc.get("dataloader_verdict"):
        lines.append(str(inc["dataloader_verdict"]))
    return "\n".join(lines)


def _lift_texts(value: Any, path: str, out: list) -> Any:
    """A copy of `value` whose multi-line strings are replaced by a pointer; the strings go to `out`."""
    if isinstance(value, dict):
        return {k: _lift_texts(v, f"{path}.{k}" if path else str(k), out) for k, v in value.items()}
    if isinstance(value, list):
        return [_lift_texts(v, f"{path}[{i}]", out) for i, v in enumerate(value)]
    if isinstance(value, str) and "\n" in value.strip("\n"):
        out.append((path, value))
        return f"<{value.count(chr(10)) + 1} lines: below, under {path}>"
    return value


def dump_text(dumps: dict) -> str:
    """Stacks per rank, each under a header line."""
    if not dumps:
        return "(no stacks: no worker announced a dump signal)\n"
    out = []
    for rank in sorted(dumps, key=lambda r: (len(str(r)), str(r))):
        text = dumps[rank] or "(empty: the process did not write a dump)\n"
        out.append(f"=== rank {rank} ===\n{text if text.endswith(chr(10)) else text + chr(10)}")
    return "".join(out)


def result_message(cmd: str, result: Any) -> str:
    """What a command that changes the run answered, as one line."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        if result.get("accepted"):
            text = f"{result['accepted']} accepted"
            if result.get("mode"):
                text += f" ({result['mode']})"
            if result.get("note"):
                text += f": {result['note']}"
            elif result.get("state"):
                text += f" (state was {result['state']})"
            return text
        if isinstance(result.get("message"), str):
            return result["message"]
    if result is None or result is True:
        return f"{cmd}: ok"
    return f"{cmd}: {json.dumps(result, default=str)}"
