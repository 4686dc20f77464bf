"""cost_report: what finished runs cost over a window, from their own summaries: GPU-hours,
cost and idle share per job name, backend and GPU product, as a markdown artifact and a PNG;
a day's spend over the budget emits gpuflow.budget.exceeded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import gpuflow_home
from gpuflow.tasks.metrics import spend
from gpuflow.tasks.units import parse_duration

BUDGET_EVENT = "gpuflow.budget.exceeded"


def _settings(
    window: str, until: str | None, budget_usd_per_day: float | None
) -> tuple[datetime, datetime]:

    try:
        span = parse_duration(window)
    except ValueError as exc:
        raise InvalidSpec(f"window: {exc}") from None
    if span < 1:
        raise InvalidSpec(f"window must be at least 1s (got {window!r}); e.g. 1d or 7d")
    if budget_usd_per_day is not None and budget_usd_per_day <= 0:
        raise InvalidSpec(
            f"budget_usd_per_day must be more than 0 (got {budget_usd_per_day:g}); or leave it out"
        )
    end = datetime.now(UTC)
    if until:
        try:
            end = datetime.fromisoformat(until)
        except ValueError:
            raise InvalidSpec(
                f"until: {until!r} is not a date and time; write e.g. 2026-11-30T00:00:00Z"
            ) from None
        end = end if end.tzinfo else end.replace(tzinfo=UTC)
    return end - timedelta(seconds=span), end


@flow(name="cost-report")
def cost_report(
    window: str = "1d",
    until: str | None = None,
    budget_usd_per_day: float | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Report the runs that ended in the `window` before `until` (default: now). `output`:
    the folder for the PNG (default GPUFLOW_HOME/reports)."""
    from prefect.events import emit_event

    from gpuflow.tasks.api_client import api_client

    since, end = _settings(window, until, budget_usd_per_day)
    logger = get_run_logger()
    with api_client() as client:
        runs, unpriced = spend.read_runs(client, since, end)
    folder = Path(output) if output else gpuflow_home() / "reports"
    chart = spend.chart_png(
        runs,
        folder / f"cost-{end:%Y%m%dT%H%M%S}.png",
        f"GPU spend, {window} to {end:%Y-%m-%d %H:%M} UTC",
    )
    create_markdown_artifact(
        key="gpuflow-cost-report",
        markdown=spend.markdown(runs, since, end, unpriced, budget_usd_per_day, chart),
        description=f"GPU spend over {window}",
    )
    over = {}
    for day, usd in spend.daily(runs).items():
        if budget_usd_per_day is not None and usd > budget_usd_per_day:
            over[str(day)] = usd
            top = spend.group_by([r for r in runs if spend.day_of(r) == day], "job")[:3]
            logger.warning(
                "%s: spent $%.2f, over the budget of $%.2f a day (most: %s)",
                day,
                usd,
                budget_usd_per_day,
                ", ".join(f"{g.key} ${g.cost_usd:.2f}" for g in top),
            )
            emit_event(
                event=BUDGET_EVENT,
                resource={"prefect.resource.id": f"gpuflow.budget.{day}"},
                payload={
                    "day": str(day),
                    "spend_usd": round(usd, 6),
                    "budget_usd": budget_usd_per_day,
                    "top_jobs": {g.key: round(g.cost_usd, 6) for g in top},
                },
            )
    logger.info(
        "%d run(s) over %s: %.3f GPU-hours, $%.4f%s",
        len(runs),
        window,
        sum(r.gpu_hours for r in runs),
        sum(r.cost_usd for r in runs),
        f"; chart {chart}" if chart else "",
    )
    return {
        "runs": len(runs),
        "unpriced": unpriced,
        "gpu_hours": sum(r.gpu_hours for r in runs),
        "gpu_hours_idle": sum(r.gpu_hours_idle for r in runs),
        "cost_usd": sum(r.cost_usd for r in runs),
        "by_job": {g.key: g.model_dump() for g in spend.group_by(runs, "job")},
        "by_backend": {g.key: g.model_dump() for g in spend.group_by(runs, "backend")},
        "by_gpu_product": {g.key: g.model_dump() for g in spend.group_by(runs, "gpu_product")},
        "over_budget": over,
        "chart": str(chart) if chart else None,
    }
