"""What finished runs cost, from their own summaries (each run's gpuflow-metrics table):
GPU-hours, cost and idle share per job name, backend and GPU product, and per day.

Reading the runs is separate from adding them up, so the sums are pure and tested on
their own, and the report adds exactly what each run recorded.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any
from uuid import UUID

from pydantic import BaseModel

from gpuflow.tasks.metrics.plot import figure
from gpuflow.tasks.pictures import picture

METRICS_KEY = "gpuflow-metrics"  # the table artifact collect writes for every run


class RunCost(BaseModel):
    flow_run_id: str
    job: str
    backend: str
    gpu_product: str
    outcome: str
    ended: datetime
    gpu_hours: float
    gpu_hours_idle: float
    cost_usd: float


class Group(BaseModel):
    key: str
    runs: int
    gpu_hours: float
    gpu_hours_idle: float
    cost_usd: float

    @property
    def idle_share(self) -> float:
        return self.gpu_hours_idle / self.gpu_hours if self.gpu_hours else 0.0


def run_cost(table: Any, flow_run: Any) -> RunCost | None:
    """Return one run's figures from its metrics table (JSON text or rows); None when the
    table is not a gpuflow run's."""
    rows = json.loads(table) if isinstance(table, str) else table
    try:
        values = {row["metric"]: row["value"] for row in rows}
    except (TypeError, KeyError):
        return None
    if "cost_usd" not in values or "gpu_hours" not in values:
        return None
    spec = (flow_run.parameters or {}).get("spec")
    spec = spec if isinstance(spec, dict) else {}
    ended = flow_run.end_time or flow_run.expected_start_time or datetime.now(UTC)
    return RunCost(
        flow_run_id=str(flow_run.id),
        job=str(values.get("run.job") or spec.get("name") or flow_run.name),
        backend=str(
            values.get("run.backend") or (spec.get("placement") or {}).get("backend") or "local"
        ),
        gpu_product=str(values.get("run.gpu_product") or "unknown"),
        outcome=str(values.get("run.outcome") or (flow_run.state.name if flow_run.state else "")),
        ended=ended,
        gpu_hours=float(values["gpu_hours"] or 0.0),
        gpu_hours_idle=float(values.get("gpu_hours_idle") or 0.0),
        cost_usd=float(values["cost_usd"] or 0.0),
    )


def group_by(runs: Iterable[RunCost], field: str) -> list[Group]:
    """Return the runs' sums per value of `field` (job, backend, gpu_product), dearest first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for run in runs:
        row = sums[getattr(run, field)]
        row[0] += 1
        row[1] += run.gpu_hours
        row[2] += run.gpu_hours_idle
        row[3] += run.cost_usd
    groups = [
        Group(key=key, runs=int(n), gpu_hours=h, gpu_hours_idle=idle, cost_usd=usd)
        for key, (n, h, idle, usd) in sums.items()
    ]
    return sorted(groups, key=lambda g: (-g.cost_usd, -g.gpu_hours, g.key))


def day_of(run: RunCost) -> date:
    """Return the UTC day a run counts for: the day it ended."""
    return run.ended.astimezone(UTC).date()


def daily(runs: Iterable[RunCost]) -> dict[date, float]:
    """Return each UTC day's spend."""
    days: dict[date, float] = defaultdict(float)
    for run in runs:
        days[day_of(run)] += run.cost_usd
    return dict(sorted(days.items()))


def read_runs(client: Any, since: datetime, until: datetime) -> tuple[list[RunCost], int]:
    """Return the runs that ended in [since, until) with a summary, and how many ended
    there without one (they failed before collect: their cost is unknown)."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterKey,
        FlowRunFilter,
        FlowRunFilterEndTime,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    ended = FlowRunFilter(
        end_time=FlowRunFilterEndTime(after_=since, before_=until),
        state=FlowRunFilterState(
            type=FlowRunFilterStateType(
                any_=[StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
            )
        ),
    )
    flow_runs: dict[str, Any] = {}
    offset = 0
    while True:
        page = client.read_flow_runs(flow_run_filter=ended, limit=200, offset=offset)
        flow_runs.update((str(run.id), run) for run in page)
        if len(page) < 200:
            break
        offset += 200
    tables: dict[str, Any] = {}
    ids = [UUID(i) for i in flow_runs]
    for start in range(0, len(ids), 200):
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[METRICS_KEY])),
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids[start : start + 200])),
        )
        for artifact in sorted(artifacts, key=lambda a: a.created or since):
            tables[str(artifact.flow_run_id)] = artifact.data  # a retried collect: the last
    runs = []
    for run_id, table in tables.items():
        found = run_cost(table, flow_runs[run_id]) if run_id in flow_runs else None
        if found is not None and since <= found.ended < until:
            runs.append(found)
    return runs, len(flow_runs) - len(tables)


def markdown(
    runs: list[RunCost],
    since: datetime,
    until: datetime,
    unpriced: int,
    budget_usd: float | None,
    chart: Path | None,
) -> str:
    """Return the report: totals, then one table per grouping, then each day's spend."""
    total = Group(
        key="all",
        runs=len(runs),
        gpu_hours=sum(r.gpu_hours for r in runs),
        gpu_hours_idle=sum(r.gpu_hours_idle for r in runs),
        cost_usd=sum(r.cost_usd for r in runs),
    )
    lines = [
        f"# GPU spend {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC",
        "",
        f"- {total.runs} run(s): {total.gpu_hours:.3f} GPU-hours, ${total.cost_usd:.2f},"
        f" {total.idle_share:.0%} of the GPU-hours idle",
    ]
    if unpriced:
        lines.append(f"- {unpriced} run(s) ended before their metrics were collected: not counted")
    if chart is not None:
        lines.append(picture("chart", chart))
    for title, field in (("job", "job"), ("backend", "backend"), ("GPU product", "gpu_product")):
        lines += [
            "",
            f"## by {title}",
            "",
            f"| {title} | runs | GPU-hours | cost (USD) | idle share |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {g.key} | {g.runs} | {g.gpu_hours:.3f} | {g.cost_usd:.2f} | {g.idle_share:.0%} |"
            for g in group_by(runs, field)
        ]
    lines += ["", "## by day (UTC)", "", "| day | cost (USD) | budget |", "|---|---:|---|"]
    for day, usd in daily(runs).items():
        over = budget_usd is not None and usd > budget_usd
        mark = "—" if budget_usd is None else (f"over ${budget_usd:.2f}" if over else "within")
        lines.append(f"| {day} | {usd:.2f} | {mark} |")
    return "\n".join(lines) + "\n"


def chart_png(runs: list[RunCost], path: Path, title: str) -> Path | None:
    """Draw cost and GPU-hours (idle part hatched) per job, backend and GPU product."""
    if not runs:
        return None

    fields = (("job", "job"), ("backend", "backend"), ("GPU product", "gpu_product"))
    fig = figure(13, 6.5)
    axes = fig.subplots(2, 3)
    for column, (name, field) in enumerate(fields):
        groups = group_by(runs, field)[:12]
        keys = [g.key for g in groups]
        axes[0][column].bar(keys, [g.cost_usd for g in groups], color="#4c72b0")
        axes[0][column].set_title(f"cost by {name} (USD)")
        busy = [g.gpu_hours - g.gpu_hours_idle for g in groups]
        axes[1][column].bar(keys, busy, color="#55a868", label="busy")
        axes[1][column].bar(
            keys, [g.gpu_hours_idle for g in groups], bottom=busy, color="#c44e52", label="idle"
        )
        axes[1][column].set_title(f"GPU-hours by {name}")
        axes[1][column].legend(loc="upper right")
        for ax in (axes[0][column], axes[1][column]):
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
