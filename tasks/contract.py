"""What kinds, backends and the pipeline agree on: the cluster a backend provisions, the
work units a kind hands it, a unit's result, what a kind needs and what a backend can do,
and the environment every unit starts with.

Kinds and backends both import this module and never each other; the pipeline matches a
kind's `Needs` with a backend's `Capabilities` before anything is provisioned."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from pydantic import BaseModel

from gpuflow.tasks.spec import UNIT_VARIABLES  # noqa: F401 - what gpuflow sets for every unit
from gpuflow.tasks.storage import S3Settings

OWNER_LABEL = "gpuflow.io/owner"
RUN_LABEL = "gpuflow.io/flow-run-id"
JOB_LABEL = "gpuflow.io/job"
RENDEZVOUS_PORT = 29400  # torch's default, where a cluster names no port of its own


def owner_labels(flow_run_id: str, job_name: str) -> dict[str, str]:
    """Return the labels put on every resource a run makes, so a reaper can find them."""
    return {OWNER_LABEL: "gpuflow", RUN_LABEL: flow_run_id, JOB_LABEL: job_name}


class Capabilities(BaseModel):
    """What a backend can do, as data: the pipeline matches it with a kind's `Needs`, and
    kinds read it from the cluster (never a backend's name)."""

    runs_here: bool = False  # units run on this machine: preflight inspects it
    where: str = "this machine"  # where units run, in a user's words ("the cluster's nodes")
    local_files: bool = True  # units can read and write this machine's files (file:// URLs)
    samples_nodes: bool = False  # its nodes sample their own GPUs; the run stage samples nothing
    # ... into the run's workspace (NODE_SAMPLES) as they sample, where the run stage reads
    # them while the job runs (limits.idle_gpu, live push) when it sees that folder
    node_samples_in_workspace: bool = False
    # it keeps a service's replicas itself (a Deployment scaled by a HorizontalPodAutoscaler)
    serves_replicas: bool = False
    # a run may claim one node more while it runs, and give one back (a fleet: a host's
    # GPUs, the fleet growing for it): a service's replicas each hold a claim of their own
    adds_nodes: bool = False
    runs_images: bool = False  # it runs a job's units in the spec's image (image:)


class Needs(BaseModel):
    """What a kind needs from the backend that runs it, as data."""

    # spec field -> program the units start; looked up before provisioning where units run here
    programs: dict[str, str] = {}
    # spec field -> program gpuflow starts beside the units on their host (never in the
    # job's image: a service's endpoint)
    host_programs: dict[str, str] = {}
    # spec field -> URL the units read or write; units that do not run here need them in S3
    inputs: dict[str, str] = {}
    mpi_launcher: bool = False  # one unit launches ranks on every node (mpirun)
    shell: bool = False  # its units start through /bin/sh (an image without one cannot run it)
    gpuflow: bool = False  # its units run gpuflow's own modules (an image needs gpuflow in it)


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
    # where names are not addresses (Slurm's node names): each node's address, node order
    node_addresses: list[str] = []
    cpus_per_node: int | None = None
    rendezvous: str | None = None  # host:port every node reaches (multi-node training)
    capabilities: Capabilities = Capabilities()
    # the backend's own state, a JSON object its typed model reads (`state_of`)
    state: dict[str, Any] = {}
    gpu_lease_id: str | None = None
    # what the whole cluster is paid per hour where the backend knows it (an EC2 offer's
    # spot price); None: the price table's
    hourly_usd: float | None = None
    created_at: datetime
    adopted: bool = False

    @property
    def gpus_per_node(self) -> int:
        return len(self.gpu_indices)

    def hosts(self) -> list[str]:
        """Return each node's name, node 0 first."""
        return list(self.node_names) or [self.hostname] * self.nodes

    def addresses(self) -> list[str]:
        """Return each node's address as the others reach it, node 0 first."""
        return list(self.node_addresses) or self.hosts()


class Offer(BaseModel):
    """What a backend could give a job now, and at what price: one candidate's row in a
    pool's choice. Read only; nothing is made to answer it."""

    where: str  # in a user's words: "kubernetes/onprem (namespace gpu)", "ec2 g6.xlarge spot"
    gpu_product: str | None = None  # the product it would give (None: any, or unknown)
    gpus_free: int | None = None  # GPUs of that product free now (None: not known before launch)
    hourly_usd: float = 0.0  # every node of the job, while held
    can_start: bool = True  # the job could start now without waiting for GPUs
    why_not: str = ""  # why it cannot start now (or what is not known), one phrase
    queue_ahead: int | None = None  # jobs waiting before it (a batch queue)
    preemptible: bool = False  # its GPUs may be taken back (spot): a preempted job moves on


class MpiLaunch(BaseModel):
    """What makes a unit an MPI launcher: its mpirun starts ranks on every node of the
    cluster, at the hosts and slots of its hostfile (a backend may start it its own way:
    an MPIJob, an srun that shares the job's allocation)."""

    hostfile: str  # one `name slots=N` line per node, in node order

    def hosts(self) -> list[tuple[str, int]]:
        """Return each node's name and its ranks (slots), in node order."""
        found = []
        for line in self.hostfile.splitlines():
            words = line.split()
            if words:
                slots = next((w[6:] for w in words if w.startswith("slots=")), "1")
                found.append((words[0], int(slots)))
        return found


class WorkUnit(BaseModel):
    """One command a backend runs on one node of its cluster; its exit code says how it
    went (a render chunk's kind also looks for its `frames` in storage)."""

    name: str  # "main", "chunk-3", "node-1", "launcher": named so in logs
    command: list[str]
    env: dict[str, str] = {}  # the kind's own variables, over the run's environment
    node: int = 0
    gpus: list[int] | None = None  # GPU indices on its node; None: every GPU the node holds
    frames: list[int] = []  # a render chunk: the frames it must leave in storage
    world_size: int | None = None  # training: ranks over every node
    launcher: MpiLaunch | None = None  # an MPI launcher: where its ranks go
    reads: list[str] = []  # files or folders of this host it reads (an image: mounted, read-only)
    writes: list[str] = []  # folders of this host it writes (an image: mounted)
    # False: gpuflow's own program beside the job's units (a service's endpoint), run on
    # the host itself, never in the job's image
    in_image: bool = True


class Replicated(BaseModel):
    """A service a backend keeps itself (`serves_replicas`): replicas of one command, each
    listening on `port`, checked, behind one address, scaled between `least` and `most`
    on the replicas' GPU utilisation by the backend's own autoscaler."""

    name: str  # the service's name, in the user's words
    command: list[str]
    env: dict[str, str] = {}  # the service's own variables (PORT), over the run's
    port: int  # where each replica listens, and the address's port
    ready_path: str | None = None  # HTTP GET; None: a TCP connect
    live_path: str | None = None
    period_s: float = 1.0
    failures: int = 3
    start_timeout_s: float = 600.0
    least: int = 1
    most: int = 1
    gpus: int = 0  # per replica
    gpu_util: float | None = None  # target % of DCGM_FI_DEV_GPU_UTIL per replica
    down_after_s: float = 30.0  # the autoscaler's scale-down stabilisation window


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


class StopReason(StrEnum):
    """Why gpuflow stopped a unit before it ended by itself."""

    TIMEOUT = "timeout"  # it ran past its time limit
    CANCELLED = "cancelled"  # the run was cancelled, or a stop check said so


class UnitEnd(BaseModel):
    """How a unit ended, as a backend saw it: exit code or signal, and whether (and why)
    gpuflow stopped it; `tail` holds lines the backend adds to its log (a lost node)."""

    exit_code: int | None = None
    signal: int | None = None
    stop: StopReason | None = None
    tail: list[str] = []
    memory_events: dict[str, int] = {}

    def result(self, started_at: datetime, ended_at: datetime, log_tail: list[str]) -> JobResult:
        """Return the unit's JobResult: this end between those times, with its last lines."""
        return JobResult(
            exit_code=self.exit_code,
            signal=self.signal,
            started_at=started_at,
            ended_at=ended_at,
            duration_s=(ended_at - started_at).total_seconds(),
            timed_out=self.stop == StopReason.TIMEOUT,
            cancelled=self.stop == StopReason.CANCELLED,
            log_tail=log_tail or self.tail,
            memory_events=self.memory_events,
        )


class RunOutcome(BaseModel):
    """The run stage's outcome: the job's result, a failure sentence, which limit stopped it."""

    result: JobResult
    failure: str | None = None  # one sentence when the job failed deterministically
    stopped_by: str | None = None  # the limit that stopped it: max_duration, max_cost_usd, idle_gpu
    # seconds the run's node was held, summed over claims that came and went (a fleet
    # service's replicas, each a claim of the run's size): what its GPU-hours and cost
    # count; None: the run's cluster for the job's whole duration
    held_s: float | None = None

    @property
    def ended(self) -> str:
        """Return how the run ended in one word: cancelled, failed or completed."""
        if self.result.cancelled and self.stopped_by is None:
            return "cancelled"
        return "failed" if self.failure else "completed"


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
    # what a job could still do to escape that tracking (empty: nothing known)
    escapes: str = ""


LineSink = Callable[[str, str], None]  # (stream name, line)
StopCheck = Callable[[], bool]  # polled while the job runs; True stops it as cancelled


class UnitRunner(Protocol):
    """What the pipeline hands a kind that schedules its own units (render chunks): one
    unit at a time on the run's backend, under the run's limits, stop checks and secrets."""

    cluster: Cluster
    # errors a unit's end raises at once, not retried here: the run's pool hands the job
    # to its next candidate (capacity; a preemption where it moves on)
    handed_on: tuple[type[Exception], ...]
    limit: str  # the limit the deadline comes from: max_duration, or max_cost_usd
    storage: S3Settings  # the run's storage settings, resolved once for every unit
    hourly_usd: float | None  # what the run's cluster is paid per hour (None: unknown)

    def run(
        self,
        unit: WorkUnit,
        on_line: LineSink,
        env: Mapping[str, str],
        deadline: float,
        stop: StopCheck | None = None,
    ) -> JobResult:
        """Run `unit` with the run's variables plus `env` until it ends, the wall-clock
        `deadline` (time.time()) passes, or `stop()` says so (ended as cancelled, like a
        cancelled run); lines go to `on_line` unredacted."""

    def serve(
        self,
        app: Replicated,
        on_change: Callable[[dict[str, Any]], None],
        deadline: float,
    ) -> JobResult:
        """Have the run's backend (one that `serves_replicas`) keep `app` until `deadline`
        or the run's stop check; `on_change` gets what it reports as it changes (replicas
        wanted and ready, the autoscaler's metric); ended as cancelled on a cancel."""

    def add_node(self, deadline: float, stop: StopCheck | None = None) -> int:
        """Claim one node more for the run (a backend that `adds_nodes`), as its nodes
        were claimed, waiting for room until `deadline` (time.time()) or `stop()`; return
        its index (its address is `cluster.addresses()[index]`). CapacityError when none
        came, JobCancelled when `stop` ended the wait."""

    def drop_node(self, node: int) -> None:
        """Give back `node` (claimed by add_node, or one of the run's first) once its units
        ended: its GPUs are free for other runs."""

    def stopping(self) -> bool:
        """Return True once the run is to stop: cancelled in the API, or stopped idle."""

    def idle_stop(self) -> str | None:
        """Return why limits.idle_gpu stopped the run, if it did."""

    def redact(self, text: str) -> str:
        """Return `text` with the run's secrets masked."""


State = TypeVar("State", bound=BaseModel)


def state_of(cluster: Cluster, model: type[State]) -> State:
    """Return the backend's typed state stored on `cluster`."""
    return model.model_validate(cluster.state)


def cluster_env(cluster: Cluster, attempt: int = 1) -> dict[str, str]:
    """Return what every unit of `cluster` learns of the others: the first node's address
    (and the rendezvous port, where the cluster names one), every node's address in node
    order, and which attempt of the run this is (1 first)."""
    hosts = cluster.addresses()
    env = {
        "GPUFLOW_MASTER_ADDR": hosts[0],
        "GPUFLOW_NODE_ADDRS": ",".join(hosts),
        "GPUFLOW_ATTEMPT": str(attempt),
    }
    host, _, port = (cluster.rendezvous or "").rpartition(":")
    env["GPUFLOW_MASTER_ADDR"] = host or hosts[0]
    env["GPUFLOW_MASTER_PORT"] = port or str(RENDEZVOUS_PORT)
    return env


def run_port(run_id: str) -> int:
    """Return a port of the run's own for its nodes to meet on (20000-31999: below
    Linux's ephemeral range), so that two runs whose nodes share an address (hosts that
    serve several runs, or one loopback) do not meet on the same port."""
    return 20000 + int(hashlib.sha256(run_id.encode()).hexdigest(), 16) % 12000


def unit_env(node: int, nodes: int, workspace: str, gpus: list[int] | None) -> dict[str, str]:
    """Return what gpuflow sets for every unit on every backend: its workspace and output
    folder, its node's rank and the number of nodes, and with `gpus` the devices it sees
    (None where the node's device plugin chooses them)."""
    env = {
        "GPUFLOW_WORKSPACE": workspace,
        "GPUFLOW_OUTPUT_DIR": f"{workspace.rstrip('/')}/outputs",
        "GPUFLOW_NODE_RANK": str(node),
        "GPUFLOW_NODES": str(nodes),
    }
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return env


class RunStates(Protocol):
    """What a reaper asks the Prefect API about a run (given by the caller)."""

    def state(self, run_id: str, api_url: str | None) -> str:
        """Return "running", "away" (the API does not answer), "unknown" to the API, or
        the final state's name in lower case."""

    def states(self, runs: Sequence[tuple[str, str | None]]) -> dict[tuple[str, str | None], str]:
        """Return `state` of each (run id, API url), asking each API once (a reaper of
        hundreds of runs)."""


class ReapReport(BaseModel):
    """What one backend's reaper found: counts by what they count, and the flow runs to
    mark Crashed (id, the API that records it) because their gpuflow died."""

    counts: dict[str, float] = {}
    crashed: list[tuple[str, str | None]] = []
