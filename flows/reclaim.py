"""reclaim: cancel runs that hold GPUs they do not use, fleet-wide, from what Prometheus
holds of their live samples; on a schedule, or `gpuflow reclaim`."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from gpuflow.tasks.platform import reclaim as reclaiming


@flow(name="reclaim")
def reclaim(
    prometheus_url: str = "http://127.0.0.1:9090",
    below_pct: float = 5.0,
    window: str = "15m",
    grace: str = "10m",
    dry_run: bool = False,
) -> dict[str, Any]:
    """Warn about runs whose every GPU stayed under `below_pct` for `window`; cancel those
    idle for `window` + `grace` (their own teardown runs) unless tagged gpuflow.io/keep.
    `dry_run`: say what would be cancelled and the GPU-hours it would save; cancel nothing."""

    settings = reclaiming.check(prometheus_url, below_pct, window, grace)
    logger = get_run_logger()
    said: list[str] = []

    def say(line: str, loud: bool) -> None:
        said.append(line)
        (logger.warning if loud else logger.info)(line)

    decided = reclaiming.reclaim_pass(settings, dry_run, say)
    cancelled = [r for r in decided if r.action == "cancel"]
    create_markdown_artifact(
        key="gpuflow-reclaim",
        markdown="\n".join(
            [
                f"# reclaim{' (dry run)' if dry_run else ''}: GPUs under {below_pct:g}% for"
                f" {window} (+{grace} grace)",
                "",
                *(f"- {line}" for line in said),
            ]
        ),
        description="Idle runs found, warned and cancelled",
    )
    return {
        "idle": len(decided),
        "warned": sum(r.action == "warn" for r in decided),
        "cancel": [r.flow_run_id for r in cancelled],  # cancelled, or would be on a dry run
        "spared": [r.flow_run_id for r in decided if r.action == "keep"],
        "gpu_hours_saved": sum(r.gpu_hours_saved for r in cancelled),
        "dry_run": dry_run,
    }
