"""fleet-scale: one period of an elastic fleet's scaler, on a schedule (the deployment
fleet-scale-local) or from `gpuflow fleet scale NAME`. Each decision is a Prefect event
(gpuflow.fleet.grew, gpuflow.fleet.shrank, gpuflow.fleet.kept, gpuflow.fleet.forgot) on the
resource gpuflow.fleet.NAME, and a row of the table artifact fleet-NAME-scale."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event

from gpuflow.tasks.backends.fleet.backend import FleetBackend
from gpuflow.tasks.backends.fleet.growth import scale
from gpuflow.tasks.backends.fleet.state import FleetPlacement
from gpuflow.tasks.backends.registry import get_backend

EVENTS = {
    "grow": "gpuflow.fleet.grew",
    "shrink": "gpuflow.fleet.shrank",
    "keep": "gpuflow.fleet.kept",
    "forget": "gpuflow.fleet.forgot",
}
# an instance's resource id in events: its cloud's service, then the instance's id
SERVICE = {"ec2": "aws.ec2", "alibaba": "alibaba.ecs", "tencent": "tencent.cvm"}


@flow(name="fleet-scale")
def fleet_scale(fleet: str) -> list[dict[str, Any]]:
    """Scale elastic fleet `fleet` once; return its decisions (action, instance, why)."""
    logger = get_run_logger()
    backend = get_backend("fleet", FleetPlacement(fleet=fleet))
    assert isinstance(backend, FleetBackend)
    decisions = scale(backend, logger.info)
    section = backend.fleet().elastic
    service = SERVICE.get(section.cloud, section.cloud) if section else "cloud"
    at = datetime.now(UTC).isoformat(timespec="seconds")
    rows = [{"at": at, **d.model_dump()} for d in decisions]
    for row in rows:
        logger.info(f"{row['action']} {row['instance'] or '-'}: {row['why']}")
        emit_event(
            event=EVENTS[row["action"]],
            resource={"prefect.resource.id": f"gpuflow.fleet.{fleet}"},
            related=[
                {
                    "prefect.resource.id": f"{service}.instance.{row['instance']}",
                    "prefect.resource.role": "instance",
                }
            ]
            if row["instance"]
            else [],
            payload={"why": row["why"]},
        )
    key = re.sub(r"[^a-z0-9-]+", "-", f"fleet-{fleet}-scale".lower())
    create_table_artifact(
        key=key,
        table=rows or [{"at": at, "action": "keep", "instance": "", "why": "nothing to do"}],
        description=f"fleet {fleet}: what its scaler decided at {at}",
    )
    return rows
