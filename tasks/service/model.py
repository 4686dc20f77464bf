"""The `job:` section of a service: a long-running command that serves on a port, its
probes, how many replicas it may have and what scales them; and the figures it leaves."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gpuflow.tasks.spec import CodeJob, Seconds, SpecModel, command_line

# every replica reads the port it must listen on here (several share a host)
PORT_VARIABLE = "PORT"


class Probe(SpecModel):
    """A check of one replica: an HTTP GET of `path` that answers 2xx or 3xx, or, with no
    path, a TCP connect to its port."""

    path: str | None = Field(
        None,
        description="HTTP path asked with GET, e.g. /health (2xx or 3xx: passed); none: a"
        " TCP connect to the replica's port.",
    )
    period_s: float = Field(1.0, ge=0.1, le=300, description="Seconds between two checks.")
    timeout_s: float = Field(2.0, gt=0, le=300, description="Seconds one check may take.")
    failures: int = Field(
        3, ge=1, le=100, description="Checks failed in a row before the replica is replaced."
    )

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError(f"{value!r} is not a path; start it with /, e.g. /{value}")
        return value


class Replicas(SpecModel):
    """How many copies of the command serve at once."""

    min: int = Field(1, ge=0, le=64, strict=True, description="Fewest replicas (0: to zero).")
    max: int = Field(1, ge=1, le=64, strict=True, description="Most replicas.")

    @model_validator(mode="after")
    def _ordered(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(
                f"job.replicas: min ({self.min}) is above max ({self.max}); lower min or raise max"
            )
        return self


class Scaling(SpecModel):
    """What moves the replica count between min and max: a target GPU utilisation, a
    target request rate per replica, or both (the larger need wins)."""

    gpu_util: float | None = Field(
        None,
        gt=0,
        le=100,
        description="Target GPU utilisation in % per replica (as the HPA's 70): more"
        " replicas above it, fewer below.",
    )
    rps: float | None = Field(
        None, gt=0, description="Target requests per second per replica at the endpoint."
    )
    connections: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Open connections each replica takes at most (a WebSocket, a stream's"
        " client); one more waits at the endpoint for a replica the scaler adds.",
    )
    window_s: Seconds = Field(
        10.0, ge=1, le=3600, description="Seconds the request rate and utilisation average over."
    )
    down_after_s: Seconds = Field(
        30.0,
        ge=0,
        le=86400,
        description="Scale down only to the largest need seen this long (no flapping).",
    )
    to_zero_after_s: Seconds | None = Field(
        None,
        gt=0,
        le=86400,
        description="With replicas.min 0: end the last replica after this long without a"
        " request (default 300 s).",
    )

    @field_validator("gpu_util", mode="before")
    @classmethod
    def _percent(cls, value: Any) -> Any:
        if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
            raise ValueError(
                f"a utilisation target of {value} % can never be met; give a percentage above"
                " 0 and at most 100, e.g. 70"
            )
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 100:
            raise ValueError(
                f"{value} % is above 100, what a GPU can be busy; give at most 100, e.g. 70"
            )
        return value


if TYPE_CHECKING:  # what the validators make of it
    ServingCommand = list[str]
else:
    ServingCommand = command_line("[python, serve.py]")


class ServiceJob(CodeJob):
    """Serve a program behind one endpoint: replicas of `command`, each listening on the
    port in $PORT, scaled on GPU utilisation or request rate, down to zero when idle."""

    kind: Literal["service"] = "service"
    command: ServingCommand = Field(
        description="Program and arguments that serve on the port in $PORT, e.g."
        " [python, serve.py, --port, '${PORT}']."
    )
    port: int | None = Field(
        None,
        description="The endpoint's port on the serving host (none: a free one, shown in the"
        " run's artifacts).",
    )
    host: str = Field("127.0.0.1", description="Address the endpoint listens on.")
    replicas: Replicas = Field(default_factory=Replicas)
    scaling: Scaling = Field(default_factory=Scaling)
    ready: Probe = Field(
        default_factory=Probe,
        description="When a replica gets requests: after this check first passes.",
    )
    live: Probe | None = Field(
        None,
        description="Checked while a replica serves; `failures` in a row replace it"
        " (default: the readiness check).",
    )
    start_timeout_s: Seconds = Field(
        600.0,
        gt=0,
        le=86400,
        description="How long a replica may take to pass its readiness check before it is"
        " replaced.",
    )
    failures_max: int = Field(
        5,
        ge=1,
        le=1000,
        description="Replicas in a row that end by themselves or are never ready before the"
        " service fails (each next one starts after a back-off: 1 s, doubling, up to 60 s).",
    )
    request_wait_s: Seconds = Field(
        120.0,
        gt=0,
        le=3600,
        description="How long a request that arrives with no replica ready waits for one"
        " (a cold start) before it is answered 503.",
    )
    torch: bool = Field(False, description="Check torch's CUDA in preflight.")
    # set by gpuflow when it sizes the run: the GPUs each replica holds (resources.gpus
    # as the user gave it; the cluster then holds room for replicas.max of them)
    replica_gpus: int | None = Field(None, description="Set by gpuflow: GPUs per replica.")
    # set by gpuflow where each replica claims GPUs of its own (a fleet's hosts, as the
    # load says); the endpoint then runs on this machine, in front of them
    replica_claims: bool = Field(
        False, description="Set by gpuflow: each replica claims a node of its own."
    )

    @model_validator(mode="before")
    @classmethod
    def _no_job_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if "copies" in data:
                raise ValueError(
                    "job.copies: a service runs replicas of its command, counted by"
                    " job.replicas (min, max); remove copies"
                )
            if "launcher" in data:
                raise ValueError(
                    "job.launcher: each replica of a service is one process serving on $PORT;"
                    " a launcher (torchrun) runs a job to its end; remove launcher, or start"
                    " the ranks from the serving program"
                )
        return data

    @field_validator("port")
    @classmethod
    def _port(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= 65535:
            raise ValueError(f"{value} is not a TCP port; give one from 1 to 65535, or none")
        return value

    @model_validator(mode="after")
    def _zero(self) -> ServiceJob:
        if self.scaling.to_zero_after_s is not None and self.replicas.min > 0:
            raise ValueError(
                f"job.scaling.to_zero_after_s: ends the last replica, but replicas.min is"
                f" {self.replicas.min}; set replicas.min to 0 or remove to_zero_after_s"
            )
        return self

    @property
    def liveness(self) -> Probe:
        return self.live or self.ready

    @property
    def idle_to_zero_s(self) -> float | None:
        """Seconds without a request before the last replica ends; None: never."""
        if self.replicas.min > 0:
            return None
        return self.scaling.to_zero_after_s or 300.0


class ReplicaFigures(BaseModel):
    """One replica as the service saw it."""

    replica: str
    host: str = ""  # where it ran (a fleet's host; this machine's name otherwise)
    gpus: list[int] = []
    started_s: float  # seconds after the service started
    cold_start_s: float | None = None  # start to first passed readiness check
    served_s: float = 0.0  # seconds it lived
    requests: int = 0
    errors: int = 0  # 5xx answers
    p50_ms: float | None = None
    p95_ms: float | None = None
    gpu_util: float | None = None  # mean over its life, where it held GPUs
    ended: str = ""  # why it ended: scaled down, replaced (liveness), exited, run ended


class ServiceResult(BaseModel):
    """What a service leaves in outputs/result.json."""

    endpoint: str
    requests: int
    errors: int
    p50_ms: float | None = None
    p95_ms: float | None = None
    most_replicas: int
    decisions: int
    gpu_seconds: float
    cost_usd: float | None = None
    cost_per_hour_usd: float | None = None  # the service's GPU-hours over its life, per hour
    cost_per_1000_requests_usd: float | None = None
    cold_start_s: list[float] = []
    replicas: list[ReplicaFigures] = []
