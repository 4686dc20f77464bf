"""The Backend protocol and the handles that flow between pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Protocol

from pydantic import BaseModel

from tasks.spec import JobSpec

OWNER_LABEL = "gpuflow.io/owner"
RUN_LABEL = "gpuflow.io/flow-run-id"
JOB_LABEL = "gpuflow.io/job"


def owner_labels(flow_run_id: str, job_name: str) -> dict[str, str]:
    """Return the labels put on every resource a run makes, so a reaper can find them."""
    return {OWNER_LABEL: "gpuflow", RUN_LABEL: flow_run_id, JOB_LABEL: job_name}


class Cluster(BaseModel):
    """Everything teardown needs; teardown never depends on in-memory state."""

    backend: str
    name: str
    owner: dict[str, str]
    hostname: str
    workspace: str
    gpu_indices: list[int] = []
    gpu_products: list[str] = []
    gpu_lease_id: str | None = None
    created_at: datetime
    adopted: bool = False


class JobResult(BaseModel):
    exit_code: int | None
    signal: int | None = None
    started_at: datetime
    ended_at: datetime
    duration_s: float
    timed_out: bool = False
    cancelled: bool = False
    log_tail: list[str] = []


class TeardownReport(BaseModel):
    name: str
    already_gone: bool = False
    killed_processes: int = 0
    released_gpus: list[int] = []
    released_lease: bool = False
    removed_workspace: bool = False
    # how the job's processes were found: "cgroup", or "process groups, environment,
    # working directory" where this machine allows no cgroup
    process_tracking: str = ""


LineSink = Callable[[str, str], None]  # (stream name, line)
StopCheck = Callable[[], bool]  # polled while the job runs; True stops it as cancelled


class Backend(Protocol):
    """Every backend speaks these verbs; each says what it does on retry and when things are gone."""

    name: str

    def check(self, spec: JobSpec) -> None:
        """Raise InvalidSpec if this backend cannot run `spec`; makes nothing."""

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return resources for `spec`. Idempotent: a retry with the same owner adopts what
        exists. Raises CapacityError when nothing is free (retryable), ProvisionError otherwise."""

    def run(
        self,
        cluster: Cluster,
        command: list[str],
        env: Mapping[str, str],
        timeout_s: float,
        on_line: LineSink,
        should_stop: StopCheck | None = None,
        grace_s: float = 30.0,
    ) -> JobResult:
        """Run `command` to completion, streaming lines. On timeout, or when `should_stop`
        says so, the job is stopped and the result says which. On an interruption of this
        process the job gets SIGTERM, `grace_s` to save its state, then SIGKILL, and the
        interruption propagates."""

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Release everything `cluster` holds. Idempotent: never raises on "already gone"."""

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return clusters whose owner labels include `selector`, for a reaper."""
