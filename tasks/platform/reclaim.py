"""Fleet-wide idle-GPU reclaim: ask Prometheus which runs hold GPUs they do not use.

Runs push their live samples to the Pushgateway (group stage="run", dcgm-exporter's
names, labels flow_run_id and job); Prometheus scrapes it with honor_labels. A run is
idle when every GPU it holds stayed under `below_pct` over a window and it was already
reporting when the window began. Idle for `window`: warned (a log line, the event
gpuflow.gpu.idle). Idle for `window + grace`: cancelled through the Prefect API, so its
own teardown runs. A flow run tagged or labelled gpuflow.io/keep is spared, and so is
one the API no longer has running (its group is stale: GpuflowRunSilent says so).

Each pass decides from what Prometheus holds now, so no state is kept between passes.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal
from uuid import UUID

from pydantic import BaseModel

from gpuflow.tasks.errors import InvalidSpec, TransientError
from gpuflow.tasks.metrics.idle import send_idle_event
from gpuflow.tasks.metrics.prometheus import without_credentials
from gpuflow.tasks.units import parse_duration

KEEP = "gpuflow.io/keep"
UTIL = 'DCGM_FI_DEV_GPU_UTIL{stage="run"}'
Action = Literal["warn", "cancel", "keep", "not-running", "unknown"]


class IdleRun(BaseModel):
    flow_run_id: str
    job: str
    gpus: int
    hosts: list[str]
    util_max: float  # the busiest of its GPUs over the window, in %
    idle_s: float  # how long it has been idle at least: the window, or window + grace
    action: Action = "warn"
    state: str = ""
    gpu_hours_idle: float = 0.0  # GPUs x idle_s
    gpu_hours_saved: float = 0.0  # GPUs x the time left until its limits.max_duration

    def line(self, dry_run: bool) -> str:
        where = ", ".join(self.hosts)
        held = (
            f"run {self.flow_run_id} ({self.job}) holds {self.gpus} GPU(s) on {where}, none"
            f" over {self.util_max:g}% for {self.idle_s:.0f} s ({self.gpu_hours_idle:.2f}"
            " GPU-hours idle)"
        )
        saved = f"saves up to {self.gpu_hours_saved:.2f} GPU-hours (until its limits.max_duration)"
        return {
            "cancel": f"{'would cancel' if dry_run else 'cancelled'} {held}; {saved}",
            "warn": f"warned: {held}; it is cancelled once idle past the grace period",
            "keep": f"spared (tagged {KEEP}): {held}",
            "not-running": f"left alone: {held}, but its flow run is {self.state}; the"
            " Pushgateway group is stale",
            "unknown": f"left alone: {held}, but this Prefect API has no such flow run",
        }[self.action]


class Settings(BaseModel):
    prometheus_url: str
    below_pct: float
    window_s: float
    grace_s: float


def check(prometheus_url: str, below_pct: float, window: str, grace: str) -> Settings:
    """Return the pass's settings; InvalidSpec naming the parameter when one is wrong."""
    try:
        parts = urllib.parse.urlsplit(prometheus_url or "")
        bare, _ = without_credentials(prometheus_url or "")
        host = parts.hostname
    except ValueError:  # e.g. a port that is not a number
        parts, bare, host = None, "", None
    if parts is None or parts.scheme not in ("http", "https") or not host:
        shown = f"{bare!r}" if bare and "@" not in bare else "the value given"
        raise InvalidSpec(
            f"prometheus_url: {shown} is not an http(s) URL; give Prometheus's address,"
            " e.g. http://prometheus:9090"
        )
    if not 0 < below_pct <= 100:
        raise InvalidSpec(f"below_pct must be over 0 and at most 100 (got {below_pct}); change it")
    seconds = {}
    for name, value in (("window", window), ("grace", grace)):
        try:
            seconds[name] = parse_duration(value)
        except ValueError as exc:
            raise InvalidSpec(f"{name}: {exc}") from None
    if seconds["window"] < 1:
        raise InvalidSpec(f"window must be at least 1s (got {window!r}); e.g. 15m")
    if seconds["grace"] < 0:
        raise InvalidSpec(f"grace must not be negative (got {grace!r}); e.g. 10m")
    return Settings(
        prometheus_url=prometheus_url.rstrip("/"),
        below_pct=below_pct,
        window_s=seconds["window"],
        grace_s=seconds["grace"],
    )


def query(prometheus_url: str, promql: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Return an instant query's vector; TransientError naming Prometheus (without any
    credentials its URL carries) and the cause."""
    prometheus_url, auth = without_credentials(prometheus_url)
    url = f"{prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=auth), timeout=timeout_s
        ) as answer:
            body = json.load(answer)
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError):
            detail = json.loads(detail).get("error", detail)
        raise TransientError(
            f"Prometheus at {prometheus_url} refused {promql!r}: {detail}"
        ) from None
    except (urllib.error.URLError, OSError) as exc:
        cause = getattr(exc, "reason", exc)
        raise TransientError(f"could not reach Prometheus at {prometheus_url}: {cause}") from None
    except ValueError:
        raise TransientError(
            f"{prometheus_url} answered, but not as Prometheus's query API does; check the URL"
        ) from None
    if body.get("status") != "success":
        raise TransientError(f"Prometheus at {prometheus_url} refused {promql!r}: {body}")
    return body["data"]["result"]


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))}s"


def idle_runs(settings: Settings, idle_s: float) -> list[IdleRun]:
    """Return the runs every GPU of which stayed under the threshold for `idle_s` and that
    were reporting when that time began."""
    span = _duration(idle_s)
    busiest = query(settings.prometheus_url, f"max_over_time({UTIL}[{span}])")
    earlier = query(settings.prometheus_url, f"{UTIL} offset {span}")
    present = {(s["metric"].get("flow_run_id"), s["metric"].get("job")) for s in earlier}
    runs: dict[tuple[str, str], dict[str, Any]] = {}
    for series in busiest:
        labels = series["metric"]
        key = (labels.get("flow_run_id", ""), labels.get("job", ""))
        run = runs.setdefault(key, {"gpus": set(), "hosts": set(), "util": 0.0})
        run["gpus"].add((labels.get("Hostname", ""), labels.get("gpu", "")))
        run["hosts"].add(labels.get("Hostname", ""))
        run["util"] = max(run["util"], float(series["value"][1]))
    return [
        IdleRun(
            flow_run_id=run_id,
            job=job,
            gpus=len(run["gpus"]),
            hosts=sorted(run["hosts"]),
            util_max=run["util"],
            idle_s=idle_s,
            gpu_hours_idle=len(run["gpus"]) * idle_s / 3600.0,
        )
        for (run_id, job), run in sorted(runs.items())
        if run_id and run["util"] < settings.below_pct and (run_id, job) in present
    ]


def _flow_runs(client: Any, ids: list[str]) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    found: dict[str, Any] = {}
    valid = []
    for run_id in ids:
        try:
            valid.append(UUID(run_id))
        except ValueError:
            continue
    for start in range(0, len(valid), 200):
        batch = valid[start : start + 200]
        for run in client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=batch)), limit=len(batch)
        ):
            found[str(run.id)] = run
    return found


def _kept(run: Any) -> bool:
    labels = getattr(run, "labels", None) or {}
    value = str(labels.get(KEEP, "")).lower()
    return KEEP in (run.tags or []) or value not in ("", "false", "0", "no")


def _time_left_s(run: Any, now: datetime) -> float:
    """Return how long the run may still hold its GPUs: its spec's limits.max_duration
    from its start (24 h when it does not say)."""
    spec = (run.parameters or {}).get("spec")
    limit: Any = 24 * 3600.0
    if isinstance(spec, dict):
        limit = (spec.get("limits") or {}).get("max_duration", limit)
    try:
        limit = parse_duration(limit)
    except (TypeError, ValueError):
        limit = 24 * 3600.0
    started = run.start_time or now
    return max(0.0, started.timestamp() + limit - now.timestamp())


def decide(settings: Settings, client: Any) -> list[IdleRun]:
    """Return every idle run with what to do about it (not done yet)."""
    from prefect.client.schemas.objects import StateType

    warned = {r.flow_run_id: r for r in idle_runs(settings, settings.window_s)}
    overdue = {r.flow_run_id: r for r in idle_runs(settings, settings.window_s + settings.grace_s)}
    flow_runs = _flow_runs(client, list(warned | overdue))
    now = datetime.now(UTC)
    decided = []
    for run_id, idle in sorted((warned | overdue).items()):
        run = flow_runs.get(run_id)
        update: dict[str, Any] = {"action": "cancel" if run_id in overdue else "warn"}
        if run is None:
            update["action"] = "unknown"
        else:
            update["state"] = run.state.name if run.state else "unknown"
            if run.state is None or run.state.type != StateType.RUNNING:
                update["action"] = "not-running"
            elif _kept(run):
                update["action"] = "keep"
            update["gpu_hours_saved"] = idle.gpus * _time_left_s(run, now) / 3600.0
        decided.append(idle.model_copy(update=update))
    return decided


def reclaim_pass(
    settings: Settings, dry_run: bool, say: Callable[[str, bool], None]
) -> list[IdleRun]:
    """Run one pass: warn about idle runs (gpuflow.gpu.idle) and cancel the overdue ones (a
    dry run only says so: no event, no cancel); return what was decided. `say(line, loud)`:
    loud lines are about runs warned or cancelled."""
    from prefect.states import Cancelling

    from gpuflow.tasks.api_client import api_client

    started = time.monotonic()
    with api_client() as client:
        decided = decide(settings, client)
        for idle in decided:
            acted = idle.action in ("warn", "cancel")
            if acted and not dry_run:
                _emit_idle(idle, settings)
            if idle.action == "cancel" and not dry_run:
                client.set_flow_run_state(
                    UUID(idle.flow_run_id),
                    Cancelling(
                        message=f"gpuflow reclaim: its GPUs stayed under {settings.below_pct:g}%"
                        f" for {idle.idle_s:.0f} s"
                    ),
                )
            say(idle.line(dry_run), acted and not dry_run)
    cancelled = [r for r in decided if r.action == "cancel"]
    say(
        f"{len(decided)} idle run(s) in {time.monotonic() - started:.1f} s;"
        f" {'would cancel' if dry_run else 'cancelled'} {len(cancelled)},"
        f" saving up to {sum(r.gpu_hours_saved for r in cancelled):.2f} GPU-hours",
        False,
    )
    return decided


def _emit_idle(idle: IdleRun, settings: Settings) -> None:
    """Send gpuflow.gpu.idle about a run the reclaim pass found idle."""
    send_idle_event(
        {
            "flow_run_id": idle.flow_run_id,
            "job": idle.job,
            "gpus": idle.gpus,
            "hosts": idle.hosts,
            "idle_s": idle.idle_s,
            "below_pct": settings.below_pct,
            "action": idle.action,
            "source": "reclaim",
        }
    )
