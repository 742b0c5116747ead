"""Put hangwatch's incidents, restarts and the run's goodput on the experiment-tracker runs a training script logs to.

The supervisor runs this file as a short-lived helper with the *worker's* Python interpreter:

    <worker python> <path>/daemon/trackers/report.py  < payload.json

and reads one JSON line back from stdout: {"wandb": "ok" | "<error>", "mlflow": ..., "tensorboard": ...} (one entry
per tracker of the payload).  Why a separate process, and why this file imports nothing of hangwatch:

* the supervisor must never import W&B, MLflow or torch (its RSS budget is 40 MiB, and a tracker library that hangs
  or crashes must not take the supervisor with it), while the worker's interpreter has them: it is the interpreter
  the user's script logs with, so the versions match what wrote the runs;
* the file is run by path, not with `-m`: the user's environment need not have hangwatch installed.  So: the standard
  library, and each tracker's own library imported lazily, only when that tracker is in the payload.

Payload (stdin, JSON object):

    {"run": "<hangwatch run name>",
     "trackers": {"wandb": {...}, "mlflow": {...}, "tensorboard": {...}},   # the records of common/trackers.py
     "marks": [{"event", "title", "text", "step", "level", "incident", "kind", "attempt", "status"}, ...],
     "summary": {"goodput_pct", "lost_s", "wall_s", "attempts", "restarts", "incidents", "outcome", "status",
                 "step"} | null,
     "timeout_s": 60}

Exit status 0 once the payload was read (a tracker's failure is its entry's text, one line; one tracker's failure
never stops the others); 2, with one line on stderr, for a payload that cannot be read.  The libraries' own output
goes to stderr: stdout carries the result line only.

Each tracker is reported by a child of its own (this file again, `--in-process`, with that tracker only), all at
once: the libraries take seconds each to import, and one that hangs or crashes its interpreter cannot keep the
others from reporting.  A little before `timeout_s` whatever is not done is reported as timed out (the caller kills
the helper at its own timeout anyway).  What is written where, per tracker: report_wandb, report_mlflow and
report_tensorboard below.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time

TRACKERS = ("tensorboard", "mlflow", "wandb")  # the order they run in in one process: the local, quick ones first
# marks that report a way out of an incident rather than one: they do not replace the run's "last incident"
NOT_INCIDENTS = ("recovered", "resume_verified")
LEVELS = ("INFO", "WARN", "ERROR")
STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED", "SCHEDULED")
ERROR_CHARS = 500


class PayloadError(Exception):
    pass


# --- the payload -------------------------------------------------------------------------------------------------


def read_payload(text: str) -> dict:
    """The payload, normalised (every mark with every key); PayloadError when it cannot be used at all."""
    try:
        data = json.loads(text)
    except ValueError as e:
        raise PayloadError(f"not JSON ({e})") from None
    if not isinstance(data, dict):
        raise PayloadError(f"not a JSON object but {type(data).__name__}")
    trackers = data.get("trackers")
    if not isinstance(trackers, dict):
        raise PayloadError("'trackers' is not an object")
    marks = data.get("marks") or []
    if not isinstance(marks, list):
        raise PayloadError("'marks' is not a list")
    for i, m in enumerate(marks):
        if not isinstance(m, dict):
            raise PayloadError(f"marks[{i}] is not an object")
    summary = data.get("summary")
    if summary is not None and not isinstance(summary, dict):
        raise PayloadError("'summary' is not an object")
    timeout = _number(data.get("timeout_s"))
    return {
        "run": str(data.get("run") or ""),
        "trackers": trackers,
        "marks": [_mark(m) for m in marks],
        "summary": _summary(summary) if summary else None,
        "timeout_s": timeout if timeout and timeout > 0 else 60.0,
    }


def _mark(m: dict) -> dict:
    event = _name(m.get("event")) or "incident"
    level = str(m.get("level") or "").upper()
    status = str(m.get("status") or "").upper() or None
    return {
        "event": event,
        "title": str(m.get("title") or f"hangwatch: {event}"),
        "text": str(m.get("text") or m.get("title") or event),
        "step": _int(m.get("step")),
        "level": level if level in LEVELS else "WARN",
        "incident": str(m["incident"]) if m.get("incident") not in (None, "") else None,
        "kind": str(m.get("kind") or event),
        "attempt": _int(m.get("attempt")),
        "status": status if status in STATUSES else None,
    }


def _summary(s: dict) -> dict:
    status = str(s.get("status") or "").upper() or None
    return {
        "goodput_pct": _number(s.get("goodput_pct")),
        "lost_s": _number(s.get("lost_s")),
        "wall_s": _number(s.get("wall_s")),
        "attempts": _int(s.get("attempts")),
        "restarts": _int(s.get("restarts")),
        "incidents": _int(s.get("incidents")),
        "outcome": str(s.get("outcome") or "") or None,
        "status": status if status in STATUSES else None,
        "step": _int(s.get("step")),
    }


def _int(v) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):
        return None


def _number(v) -> float | None:
    if isinstance(v, bool) or v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _name(v) -> str:
    """An event name fit for a metric key (letters, digits, `_`, `-`, `.`)."""
    return "".join(c if c.isalnum() or c in "_-." else "_" for c in str(v or "")).strip("_")


def _last_step(rec: dict, key: str | None = None) -> int | None:
    """The highest step the tracker run holds (as common/trackers.py's last_step: not importable here)."""
    value = rec.get("last_step")
    if isinstance(value, dict):
        value = (
            value.get(key) if key is not None else max((v for v in value.values() if _int(v) is not None), default=None)
        )
    return _int(value)


def _incident_no(mark: dict) -> int | None:
    return _int(mark["incident"]) if mark["incident"] and mark["incident"].isdigit() else None


def state_text(mark: dict) -> str:
    """What the tracker run's state says once hangwatch stopped an attempt: 'attempt 2 killed by hangwatch (stall at
    step 24)'."""
    who = f"attempt {mark['attempt']}" if mark["attempt"] is not None else "the run"
    where = f"{mark['kind']} at step {mark['step']}" if mark["step"] is not None else mark["kind"]
    if mark["status"] == "KILLED":
        return f"{who} killed by hangwatch ({where})"
    return f"{who} {(mark['status'] or mark['event']).lower()} ({where})"


def summary_state(s: dict) -> str:
    parts = []
    if s["attempts"] is not None:
        parts.append(f"{s['attempts']} attempt{'' if s['attempts'] == 1 else 's'}")
    if s["restarts"] is not None:
        parts.append(f"{s['restarts']} restart{'' if s['restarts'] == 1 else 's'}")
    if s["goodput_pct"] is not None:
        parts.append(f"goodput {s['goodput_pct']:.1f}%")
    outcome = s["outcome"] or (s["status"] or "ended").lower()
    return f"hangwatch run {outcome}" + (f" ({', '.join(parts)})" if parts else "")


def summary_markdown(run: str, s: dict) -> str:
    rows = [
        ("run", run or None),
        ("outcome", s["outcome"]),
        ("goodput", None if s["goodput_pct"] is None else f"{s['goodput_pct']:.1f} %"),
        ("time lost", None if s["lost_s"] is None else f"{s['lost_s']:.1f} s"),
        ("wall time", None if s["wall_s"] is None else f"{s['wall_s']:.1f} s"),
        ("attempts", s["attempts"]),
        ("restarts", s["restarts"]),
        ("incidents", s["incidents"]),
        ("last step", s["step"]),
    ]
    lines = ["| hangwatch | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows if v is not None]
    return "\n".join(lines)


def mark_markdown(mark: dict) -> str:
    """A mark as TensorBoard's text plugin shows it: the title, then the text kept line by line (a code block)."""
    return f"**{mark['title']}**\n\n```\n{mark['text']}\n```"


def error_text(e: BaseException) -> str:
    """One line: the exception's type and its message's lines joined (pydantic's, say, name the culprit on line 3)."""
    message = " | ".join(" ".join(line.split()) for line in str(e).splitlines() if line.strip())
    text = f"{type(e).__name__}: {message}" if message else type(e).__name__
    return text[:ERROR_CHARS]


# --- W&B -----------------------------------------------------------------------------------------------------------


def report_wandb(rec: dict, marks: list, summary: dict | None, run_name: str, remaining) -> str:
    """Resume the run (offline stays offline: a helper's own offline dir with the run's id, which `wandb sync` merges
    with the attempts' dirs), alert + a row per mark on hangwatch's own x-axis, the summary keys, finish."""
    mode = rec.get("mode")
    if mode == "disabled":
        return "disabled"
    run_id = rec.get("id")
    if not run_id:
        return "the record names no run id"
    if not marks and not summary:
        return "ok"
    root_dir = rec.get("root_dir")
    if root_dir:
        # wandb falls back to the system temp dir when `dir` is not writable: the marks would land where no one looks
        if not os.path.isdir(root_dir):
            return f"root_dir {root_dir} is not a directory"
        if not os.access(root_dir, os.R_OK | os.W_OK | os.X_OK):
            return f"root_dir {root_dir} is not writable"
    # the attempt's env may carry these; with resume="allow" they make init raise ("mutually exclusive")
    for var in ("WANDB_RESUME_FROM", "WANDB_FORK_FROM", "WANDB_RESUME"):
        os.environ.pop(var, None)
    os.environ["WANDB_SILENT"] = "true"
    import wandb

    settings = wandb.Settings(
        console="off",
        x_disable_stats=True,
        x_disable_meta=True,
        disable_git=True,
        disable_code=True,
        x_save_requirements=False,
        x_label="hangwatch",
        # the helper's finish must not mark the run finished on the server: the attempt may still be hung there,
        # and the next attempt resumes it (offline it writes its own exit record anyway, findings §5a)
        x_update_finish_state=False,
        init_timeout=max(5.0, min(90.0, remaining() - 5.0)),
        silent=True,
    )
    run = wandb.init(
        id=run_id,
        project=rec.get("project") or None,
        entity=rec.get("entity") or None,
        dir=root_dir or None,
        resume="allow",
        mode=mode or None,
        settings=settings,
    )
    try:
        if root_dir and os.path.realpath(run.settings.root_dir) != os.path.realpath(root_dir):
            return f"wandb wrote to {run.settings.root_dir}, not to root_dir {root_dir}"
        # hangwatch's own x-axis: a row logged without step= is the helper's own _step (0.. in its offline file),
        # never a step of the user's axis (step_key) that the training would then have to skip.  Online, a resumed
        # run's next _step is the run's: where the script's axis is _step itself (it logs with step=, no step_key)
        # a row here would take the step the next attempt logs next (wandb drops a step below the run's), so
        # there the alert and the summary carry the mark, without a row
        rows = bool(run.offline or rec.get("step_key"))
        if rows:
            run.define_metric("hangwatch/step")
            run.define_metric("hangwatch/*", step_metric="hangwatch/step")
        for m in marks:
            run.alert(title=m["title"], text=m["text"], level=getattr(wandb.AlertLevel, m["level"]))
            row = {f"hangwatch/{m['event']}": 1}
            step = m["step"] if m["step"] is not None else _last_step(rec)
            if step is not None:
                row["hangwatch/step"] = step
            if rows:
                run.log(row)
            if m["event"] not in NOT_INCIDENTS:
                run.summary["hangwatch/last_incident"] = m["text"]
            run.summary["hangwatch/last_event"] = f"{m['event']}: {m['title']}"
            n = _incident_no(m)
            if n is not None and n > _int(run.summary.get("hangwatch/incidents") or 0):
                run.summary["hangwatch/incidents"] = n
            if m["status"]:
                # W&B keeps no state an outside process can set (offline, the killed attempt's file cannot change):
                # the summary says what happened
                run.summary["hangwatch/state"] = state_text(m)
                if m["attempt"] is not None:  # kept when the run's end says the run's own state
                    run.summary[f"hangwatch/attempt_{m['attempt']}"] = state_text(m)
        if summary:
            for key in ("goodput_pct", "lost_s", "wall_s", "restarts", "incidents", "attempts", "outcome"):
                if summary[key] is not None:
                    run.summary[f"hangwatch/{key}"] = summary[key]
            run.summary["hangwatch/state"] = summary_state(summary)
    finally:
        run.finish(exit_code=0)
        wandb.teardown()
    return "ok"


# --- MLflow --------------------------------------------------------------------------------------------------------


def _local_store_path(uri: str) -> tuple[str, str] | None:
    """('sqlite' | 'file', local path) for a local store URI, None for anything else (a server, databricks...)."""
    from urllib.parse import unquote, urlparse

    if uri.startswith("sqlite:///"):
        return "sqlite", unquote(uri[len("sqlite:///") :].split("?", 1)[0])
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        path = unquote(parsed.path) if parsed.netloc in ("", "localhost") else None  # file:///abs, file:./rel
        return ("file", path) if path else None
    if (parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt")) and not uri.startswith("databricks"):
        return "file", uri  # a plain path
    return None


def report_mlflow(rec: dict, marks: list, summary: dict | None, run_name: str, remaining) -> str:
    """Tags, a metric per mark at its step, a text artifact per mark, and the run's status where hangwatch decides
    it."""
    run_id = rec.get("run_id")
    uri = rec.get("tracking_uri")
    if not run_id:
        return "the record names no run_id"
    if not marks and not summary:
        return "ok"
    if uri:
        local = _local_store_path(str(uri))
        if local is not None:
            kind, path = local
            # a relative URI read from another cwd, or a store gone: connecting would create an empty one there
            if not os.path.exists(path):
                return f"the tracking store {uri} is not there ({os.path.abspath(path)})"
            if kind == "file":
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # mlflow >= 3 refuses the file store without it
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    # a tracking server that does not answer: a few short tries, not mlflow's minutes of backoff
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(max(5.0, min(30.0, remaining() / 4)))))
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client = MlflowClient(tracking_uri=uri or None)
    run = client.get_run(run_id)
    incidents = _int(run.data.tags.get("hangwatch.incidents")) or 0
    texts = _artifact_names(client, run_id)
    for m in marks:
        now_ms = int(time.time() * 1000)
        if m["event"] not in NOT_INCIDENTS:
            client.set_tag(run_id, "hangwatch.last_incident", m["text"][:5000])
        client.set_tag(run_id, "hangwatch.last_event", f"{m['event']}: {m['title']}"[:5000])
        n = _incident_no(m)
        if n is not None and n > incidents:
            incidents = n
            client.set_tag(run_id, "hangwatch.incidents", str(n))
        step = m["step"] if m["step"] is not None else (_last_step(rec) or 0)
        client.log_metric(run_id, f"hangwatch/{m['event']}", 1.0, timestamp=now_ms, step=step)
        name = _artifact_name(m, texts)
        texts.add(name)
        client.log_text(run_id, f"{m['title']}\n\n{m['text']}\n", name)
        if m["status"]:
            _set_status(client, run_id, m["status"], state_text(m))
    if summary:
        now_ms = int(time.time() * 1000)
        step = summary["step"] if summary["step"] is not None else (_last_step(rec) or 0)
        metrics = [
            Metric(f"hangwatch/{key}", float(summary[key]), now_ms, step)
            for key in ("goodput_pct", "lost_s", "restarts")
            if summary[key] is not None
        ]
        if metrics:
            client.log_batch(run_id, metrics=metrics)
        for key in ("outcome", "goodput_pct", "restarts", "attempts", "incidents"):
            if summary[key] is not None:
                client.set_tag(run_id, f"hangwatch.{key}", str(summary[key]))
        client.log_text(run_id, summary_markdown(run_name, summary) + "\n", "hangwatch/summary.md")
        if summary["status"]:
            _set_status(client, run_id, summary["status"], summary_state(summary))
    return "ok"


def _artifact_names(client, run_id: str) -> set:
    try:
        return {f.path for f in client.list_artifacts(run_id, "hangwatch")}
    except Exception:
        return set()


def _artifact_name(mark: dict, taken: set) -> str:
    """hangwatch/incident-0001.txt for an incident; hangwatch/incident-0001-recovered.txt for what followed it;
    hangwatch/<event>-<n>.txt for a mark of no incident."""
    if mark["incident"]:
        base = f"hangwatch/incident-{_name(mark['incident'])}"
        return f"{base}.txt" if mark["event"] == "incident" else f"{base}-{mark['event']}.txt"
    n = 1
    while f"hangwatch/{mark['event']}-{n}.txt" in taken:
        n += 1
    return f"hangwatch/{mark['event']}-{n}.txt"


def _set_status(client, run_id: str, status: str, text: str) -> None:
    """End the run with `status` while nothing else decided its state: it is RUNNING (a killed worker never ends it),
    or it still has the status hangwatch itself set last (KILLED after a stall, now FAILED when hangwatch gives up).
    A state the script set (FINISHED by end_run, FAILED by its own handler) is left alone.

    Small race, accepted: the next attempt may already have resumed the run (RUNNING again) between the kill and
    this call; it is then marked ended while it logs, until that attempt's end_run sets its own final status."""
    run = client.get_run(run_id)
    current = run.info.status
    ours = run.data.tags.get("hangwatch.status")
    if current == status or not (current == "RUNNING" or (ours and current == ours)):
        return
    client.set_terminated(run_id, status)
    client.set_tag(run_id, "hangwatch.status", status)
    client.set_tag(run_id, "hangwatch.state", text[:5000])


# --- TensorBoard ---------------------------------------------------------------------------------------------------


def report_tensorboard(rec: dict, marks: list, summary: dict | None, run_name: str, remaining) -> str:
    """A scalar and a text per mark at its step, the goodput and a summary table, in an event file of hangwatch's own
    (`*.hangwatch`) in each of the run's log dirs.  No purge_step: the run's own points must stay."""
    dirs = rec.get("log_dirs")
    if not isinstance(dirs, list) or not dirs:
        return "the record names no log_dirs"
    if not marks and not summary:
        return "ok"
    from torch.utils.tensorboard import SummaryWriter

    errors = []
    for d in dirs:
        try:
            if not os.path.isdir(str(d)):
                raise FileNotFoundError(f"log dir {d} is not there")
            writer = SummaryWriter(log_dir=str(d), filename_suffix=".hangwatch")
            try:
                for m in marks:
                    step = m["step"] if m["step"] is not None else (_last_step(rec, d) or 0)
                    writer.add_scalar(f"hangwatch/{m['event']}", 1.0, step)
                    writer.add_text(f"hangwatch/{m['event']}", mark_markdown(m), step)
                if summary:
                    step = summary["step"] if summary["step"] is not None else (_last_step(rec, d) or 0)
                    if summary["goodput_pct"] is not None:
                        writer.add_scalar("hangwatch/goodput_pct", summary["goodput_pct"], step)
                    writer.add_text("hangwatch/summary", summary_markdown(run_name, summary), step)
            finally:
                writer.close()
        except Exception as e:
            errors.append(f"{d}: {error_text(e)}")
    return "ok" if not errors else "; ".join(errors)[:ERROR_CHARS]


REPORTERS = {"wandb": report_wandb, "mlflow": report_mlflow, "tensorboard": report_tensorboard}


# --- main ----------------------------------------------------------------------------------------------------------


class Results:
    """The result line, written once: when every tracker is done, or at the deadline with what is done by then."""

    def __init__(self, names: list, out_fd: int):
        self.entries = {name: "not run" for name in names}
        self.out_fd = out_fd
        self.lock = threading.Lock()
        self.written = False

    def set(self, name: str, value: str) -> None:
        with self.lock:
            if not self.written:
                self.entries[name] = value

    def write(self) -> bool:
        with self.lock:
            if self.written:
                return False
            self.written = True
            line = (json.dumps(self.entries) + "\n").encode()
        os.write(self.out_fd, line)
        return True


def deadline_of(timeout_s: float) -> float:
    """Seconds this process may take: a little less than the caller's timeout, so that a result line comes first."""
    return max(1.0, timeout_s - min(5.0, timeout_s * 0.1))


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        payload = read_payload(sys.stdin.read())
    except (PayloadError, OSError, UnicodeDecodeError) as e:
        print(f"hangwatch tracker report: unreadable payload: {e}".splitlines()[0], file=sys.stderr)
        return 2
    # stdout carries the result line only: what the libraries (and wandb-core, which inherits the fds) print goes
    # to stderr
    out_fd = os.dup(1)
    os.dup2(2, 1)
    results = Results(list(payload["trackers"]), out_fd)
    if "--in-process" in argv:
        run_in_process(payload, results)
    else:
        run_in_children(payload, results)
    results.write()
    return 0


def _checked(payload: dict, results: Results) -> list:
    """The trackers that can be reported on, in the order they run; the others get their entry here."""
    todo = []
    for name, rec in payload["trackers"].items():
        if name not in REPORTERS:
            results.set(name, f"unknown tracker {name!r}")
        elif not isinstance(rec, dict):
            results.set(name, "the record is not an object")
        else:
            todo.append(name)
    return sorted(todo, key=TRACKERS.index)


def run_in_children(payload: dict, results: Results) -> None:
    """One child per tracker (this file, --in-process, with that tracker only), all at once: the libraries' imports
    take seconds each (mlflow ~2 s + its store ~1 s, torch ~2.5 s, wandb ~1 s + its core ~1 s), and a tracker that
    hangs or crashes its interpreter cannot keep the others from reporting.  Children past the deadline are killed
    (wandb-core exits with its parent)."""
    import subprocess

    limit = deadline_of(payload["timeout_s"])
    started = time.monotonic()
    children = {}
    for name in _checked(payload, results):
        one = dict(payload, trackers={name: payload["trackers"][name]}, timeout_s=limit)
        try:
            proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--in-process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            proc.stdin.write(json.dumps(one).encode())
            proc.stdin.close()
        except OSError as e:
            results.set(name, f"could not start the helper: {error_text(e)}")
            continue
        children[name] = proc
    for name, proc in children.items():
        try:
            proc.wait(timeout=max(0.1, limit - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            results.set(name, f"timed out after {limit:.0f}s")
            continue
        out = proc.stdout.read().decode(errors="replace")
        proc.stdout.close()
        try:
            value = json.loads(out.strip().splitlines()[-1])[name]
        except (ValueError, IndexError, KeyError, TypeError):
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
            value = f"the helper for {name} ended with {how} and no result"
        results.set(name, str(value))


def run_in_process(payload: dict, results: Results) -> None:
    """The trackers one after the other in this interpreter (what each child does with its one tracker)."""
    limit = deadline_of(payload["timeout_s"])
    started = time.monotonic()
    current = {"name": None}

    def remaining() -> float:
        return limit - (time.monotonic() - started)

    def on_deadline() -> None:
        for name, value in list(results.entries.items()):
            if value == "not run":
                results.set(
                    name, f"timed out after {limit:.0f}s" if name == current["name"] else "not run: no time left"
                )
        if results.write():
            sys.stderr.flush()
            os._exit(0)

    timer = threading.Timer(limit, on_deadline)
    timer.daemon = True
    timer.start()
    for name in _checked(payload, results):
        current["name"] = name
        try:
            value = REPORTERS[name](
                payload["trackers"][name], payload["marks"], payload["summary"], payload["run"], remaining
            )
        except ImportError as e:
            value = f"{error_text(e)} (in {sys.executable})"
        except (Exception, SystemExit) as e:
            value = error_text(e)
        results.set(name, value)
    timer.cancel()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # every tracker is done (wandb finished and torn down, the writers closed, mlflow's calls synchronous): skip the
    # interpreter's teardown of the libraries' modules, ~1.5 s after mlflow's imports
    os._exit(code)
