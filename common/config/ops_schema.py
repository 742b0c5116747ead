"""Settings for telling people: alerts (apprise URLs, a command, a dead-man's ping) and Prometheus metrics.

Kept apart from schema.py so the operations side grows without touching the training settings; `Config`
includes these sections.  Nothing here imports apprise or prometheus-client: the worker loads the same
config and must not pay for them.
"""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

ALERT_EVENTS = (
    "incident",
    "recovered",
    "failed",
    "crash_loop",
    "no_progress",
    "lost_peer",
    "resume_diverged",
    "generate_truncated",
    "unkillable",
)
DEFAULT_METRICS_HOST = "127.0.0.1"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class AlertsCfg(_Section):
    urls: list[str] = Field(
        default_factory=list,
        description="apprise URLs, each its own channel: slack://…, discord://…, msteams://…, mailto://…, ntfy://…, "
        "tgram://…, json://host/path (a generic JSON webhook: {title, message, type}). See apprise's docs.",
    )
    on: list[str] = Field(
        default_factory=lambda: list(ALERT_EVENTS),
        description="Events that alert: incident (a stall or a crash, once handled: what fired, the culprit and its "
        "frame, what hangwatch did), recovered (training went past the step where the incident hit), failed (the run "
        "ended failed), crash_loop, no_progress (`restart.no_progress_restarts` restarts never stepped past the last "
        "good step), lost_peer (another node's failure made this one recover), resume_diverged (a step replayed after "
        "a restart differs from the same step before it: sent at once, never held), generate_truncated (a runaway "
        "generate() was ended at a token limit, nothing restarted: the first of the run is sent, later ones are "
        "counted into summaries), unkillable (processes of the worker's tree outlived SIGKILL: a reboot or a GPU reset "
        "may be needed; sent at once, never held).",
    )
    command: Optional[list[str]] = Field(
        None, description="An argv run per alert with the alert as one JSON object on stdin (exit 0: delivered)."
    )
    timeout_s: float = Field(10, gt=0, description="Most time one delivery (a URL, the command, a ping) may take.")
    retries: int = Field(2, ge=0, description="Further tries of a delivery that failed (1 s, then 2 s, 4 s … apart).")
    min_interval_s: float = Field(
        300,
        ge=0,
        description="After an incident alert, later incidents within this interval (or before the run "
        "recovers) are not sent one by one: they are counted into one summary, so a crash loop is one alert and one "
        "summary, never a storm.",
    )
    ping_url: Optional[str] = Field(
        None,
        description="Dead-man's switch (healthchecks-style URL, GET): pinged every `ping_every_s` while the run is "
        "healthy — stepping, or idle in continuous mode.  The pings stop when the run stalls, the supervisor hangs or "
        "the box dies, and the service that expects them raises the alarm.",
    )
    ping_every_s: float = Field(
        60, gt=0, description="Dead-man's ping interval; also how recent the last step must be."
    )

    @field_validator("on")
    @classmethod
    def _known_events(cls, v: list[str]) -> list[str]:
        unknown = [e for e in v if e not in ALERT_EVENTS]
        if unknown:
            raise ValueError(f"unknown alert event(s) {unknown}; known: {', '.join(ALERT_EVENTS)}")
        return v

    @field_validator("urls")
    @classmethod
    def _urls_look_like_urls(cls, v: list[str]) -> list[str]:
        bad = [u for u in v if "://" not in u]
        if bad:
            raise ValueError(f"not an apprise URL (scheme://…): {bad}")
        return v

    @field_validator("ping_url")
    @classmethod
    def _http_ping(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError(f"ping_url must be an http(s) URL, got {v!r}")
        return v

    @field_validator("command")
    @classmethod
    def _non_empty_command(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and not v:
            raise ValueError("command must name a program (an argv list), or be null")
        return v


class MetricsCfg(_Section):
    listen: Optional[str] = Field(
        None,
        description="HOST:PORT serving Prometheus /metrics (e.g. 127.0.0.1:9464; a bare PORT listens on "
        "127.0.0.1); null: no server.  Listening beyond loopback exposes run names and paths to that network.",
    )
    textfile: Optional[str] = Field(
        None, description="A .prom file rewritten (atomically) for node_exporter's textfile collector; null: none."
    )
    textfile_every_s: float = Field(15, gt=0, description="How often the textfile is rewritten.")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        host_port(v)
        return v

    @field_validator("textfile")
    @classmethod
    def _prom_suffix(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.endswith(".prom"):
            raise ValueError(f"node_exporter reads only *.prom files: {v!r}")
        return v


class TrackersCfg(_Section):
    report: bool = Field(
        True,
        description="Put hangwatch's incidents, restarts, resume verdicts and, at the end, the run's goodput on the "
        "experiment-tracker runs the worker logs to (W&B, MLflow, TensorBoard: the ones its hooks recorded in "
        "<run_dir>/trackers/), through a short-lived helper run with the worker's own Python; false: never.",
    )
    python: Optional[str] = Field(
        None,
        description="The interpreter the reports run with (it needs the trackers' libraries); null: the one the "
        "worker's command names (`python…`, or a script's `#!` line), else the supervisor's own.",
    )
    timeout_s: float = Field(
        60.0, gt=0, description="How long one report may take before its helper is killed (and the report lost)."
    )


def host_port(listen: str) -> tuple[str, int]:
    """'127.0.0.1:9464' → ('127.0.0.1', 9464); '9464' → ('127.0.0.1', 9464); '[::1]:9464' → ('::1', 9464)."""
    text = listen.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_METRICS_HOST, text
    host = host.strip("[]") or DEFAULT_METRICS_HOST
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"listen must be HOST:PORT or PORT, got {listen!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"port out of range in {listen!r}")
    return host, number
