"""What the end-to-end tests check on the OS and in the Prefect API after a run."""

from __future__ import annotations

from pathlib import Path
from uuid import UUID

import psutil

from tasks.compute import gpu_slots


def leftovers(home: Path) -> dict[str, list[str]]:
    """Return whatever gpuflow state is left under `home`: workspaces, records, GPU claims."""

    def names(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []

    return {
        "workspaces": names(home / "workspaces"),
        "records": names(home / "local" / "clusters"),
        "gpu_claims": names(home / "local" / "gpus"),
    }


def nothing_left(home: Path) -> bool:
    return not any(leftovers(home).values())


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gpu_slots_in_use() -> int | None:
    return gpu_slots.slots_in_use()


def flow_run(flow_run_id: UUID | str):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(UUID(str(flow_run_id)))


def artifacts_of(flow_run_id: UUID | str) -> dict[str, object]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))])),
            artifact_filter=ArtifactFilter(),
        )
    return {a.key: a for a in found}


def logs_of(flow_run_id: UUID | str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(str(flow_run_id))])),
            limit=200,
        )
    return [log.message for log in logs]


def task_runs_of(flow_run_id: UUID | str):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(str(flow_run_id))]))
        )
