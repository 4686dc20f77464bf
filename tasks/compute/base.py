"""The Backend protocol and the handles that flow between pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Literal, Protocol

from pydantic import BaseModel

from tasks.spec import JobSpec

OWNER_LABEL = "gpuflow.io/owner"
RUN_LABEL = "gpuflow.io/flow-run-id"
JOB_LABEL = "gpuflow.io/job"


def owner_labels(flow_run_id: str, job_name: str) -> dict[str, str]:
    """Return the labels put on every resource a run makes, so a reaper can find them."""
    return {OWNER_LABEL: "gpuflow", RUN_LABEL: flow_run_id, JOB_LABEL: job_name}


class Cluster(BaseModel):
    """Everything teardown needs; teardown never depends on in-memory state.

    A cluster is `nodes` machines with the same GPUs each: `gpu_indices` are the GPUs held
    on every node, so the job has nodes x len(gpu_indices) GPUs in all."""

    backend: str
    name: str
    owner: dict[str, str]
    hostname: str
    workspace: str
    gpu_indices: list[int] = []
    gpu_products: list[str] = []
    nodes: int = 1
    node_names: list[str] = []  # as the nodes reach each other; empty: [hostname]
    cpus_per_node: int | None = None
    rendezvous: str | None = None  # host:port every node reaches (multi-node training)
    # what a backend needs to find the cluster again (kubernetes: block, namespace)
    backend_config: dict[str, str] = {}
    gpu_lease_id: str | None = None
    created_at: datetime
    adopted: bool = False

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpu_indices)

    def hosts(self) -> list[str]:
        """Return each node's name, node 0 first."""
        return list(self.node_names) or [self.hostname] * self.nodes


class WorkUnit(BaseModel):
    """One command a backend runs on one node of its cluster, and how its success is
    judged: by its exit code, by the frames it leaves in storage, or by the status files
    of the MPI ranks it launches."""

    name: str  # "main", "chunk-3", "node-1", "launcher": named so in logs
    command: list[str]
    env: dict[str, str] = {}  # the kind's own variables, over the run's environment
    node: int = 0
    gpus: list[int] | None = None  # GPU indices on its node; None: every GPU the node holds
    judge: Literal["exit_code", "frames", "rank_status"] = "exit_code"
    frames: list[int] = []  # judge "frames": what must be in storage afterwards
    world_size: int | None = None  # training: ranks over every node
    hostfile: str | None = None  # an MPI launcher: the hosts and slots its ranks go to


class JobResult(BaseModel):
    exit_code: int | None
    signal: int | None = None
    started_at: datetime
    ended_at: datetime
    duration_s: float
    timed_out: bool = False
    cancelled: bool = False
    log_tail: list[str] = []
    # counts from the job's memory cgroup over this run (oom_kill: out-of-memory kills)
    memory_events: dict[str, int] = {}


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
    # True when the job runs on this machine (preflight inspects it); a backend whose jobs
    # run elsewhere also gives `describe(spec)`: preflight rows saying where and how
    checks_host: bool

    def check(self, spec: JobSpec) -> None:
        """Raise InvalidSpec if this backend cannot run `spec`; makes nothing."""

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return resources for `spec`. Idempotent: a retry with the same owner adopts what
        exists. Raises CapacityError when nothing is free (retryable), ProvisionError otherwise."""

    def run(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        on_line: LineSink,
        should_stop: StopCheck | None = None,
        grace_s: float = 30.0,
    ) -> JobResult:
        """Run `unit` on its node with `env` (the job's variables: spec env, storage
        credentials, secrets; the backend adds what its nodes need and the unit's own env
        over it) and its GPUs, streaming lines, and return its outcome. On timeout, or
        when `should_stop` says so, the unit is stopped and the result says which. On an
        interruption of this process the unit gets SIGTERM, `grace_s` to save its state,
        then SIGKILL, and the interruption propagates. Several units may run at once."""

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Release everything `cluster` holds. Idempotent: never raises on "already gone"."""

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return clusters whose owner labels include `selector`, for a reaper."""
