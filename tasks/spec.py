"""JobSpec: the one input model. Every field is checked here, before anything is provisioned."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from tasks import yamlfile
from tasks.errors import InvalidSpec
from tasks.gpus import canonical_product
from tasks.hpc.mpi import Host
from tasks.units import parse_duration, parse_size

Bytes = Annotated[int, BeforeValidator(parse_size)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CommandJob(_Model):
    """Run an arbitrary program in the workspace, like a container entrypoint."""

    kind: Literal["command"] = "command"
    command: list[str] = Field(description="Program and arguments, e.g. [python, train.py].")
    torch: bool = Field(False, description="Check torch's CUDA in preflight for this command.")

    @field_validator("command", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            import shlex

            return shlex.split(value)
        if isinstance(value, list):
            # YAML reads `[train.py, --epochs, 10, --fp16, true]` with an int and a bool in it.
            return [
                str(v).lower()
                if isinstance(v, bool)
                else str(v)
                if isinstance(v, int | float)
                else v
                for v in value
            ]
        return value

    @field_validator("command")
    @classmethod
    def _not_empty(cls, value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError("is empty; give the program to run, e.g. [python, train.py]")
        return value


class MatmulJob(_Model):
    """The smoke job: a torch matrix-multiply benchmark reporting achieved TFLOP/s."""

    kind: Literal["matmul"] = "matmul"
    size: int = Field(4096, ge=64, le=65536, description="Square matrix size n (n x n).")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "bfloat16", description="Element type on GPU; the CPU path uses float32."
    )
    seconds: float = Field(5.0, gt=0, le=3600, description="How long to keep multiplying.")
    torch: bool = True


_STORAGE_URL = re.compile(r"^(file:///|s3://[^/]+).*")


def _storage_url(value: str) -> str:
    if not _STORAGE_URL.match(value):
        raise ValueError(
            f"{value!r} is not a storage URL; write file:///absolute/path or s3://bucket/prefix"
        )
    return value.rstrip("/")


StorageUrl = Annotated[str, AfterValidator(_storage_url)]


class CheckpointSettings(_Model):
    every_steps: int = Field(100, ge=1, description="Checkpoint every N optimiser steps.")
    every_minutes: float | None = Field(10.0, gt=0, description="... and at least this often.")
    keep: int = Field(3, ge=1, le=1000, description="How many checkpoints to keep.")


class ProfileSettings(_Model):
    """torch.profiler's schedule: skip `wait` steps, warm up `warmup`, record `active`."""

    wait: int = Field(1, ge=0, le=10_000)
    warmup: int = Field(1, ge=0, le=10_000)
    active: int = Field(3, ge=1, le=100)


class TrainJob(_Model):
    """Train a model on webdataset shards with torchrun: DDP or FSDP, AMP, checkpoints."""

    kind: Literal["train"] = "train"
    dataset: StorageUrl = Field(description="Prefix holding index.json and the shards.")
    eval_dataset: StorageUrl | None = Field(None, description="Held-out shards for evaluation.")
    output: StorageUrl = Field(description="Prefix for checkpoints/ and models/.")
    model: str = Field("tasks.training.models:small_cnn", description="module:factory.")
    model_args: dict[str, Any] = Field(default_factory=dict)
    task: Literal["classify", "lm"] = "classify"
    batch_size: int = Field(32, ge=1, le=65536, description="Samples per rank per micro-step.")
    max_steps: int = Field(1000, ge=1)
    lr: float = Field(1e-3, gt=0, le=10)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    grad_accum: int = Field(1, ge=1, le=1024)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    amp: Literal["auto", "off"] = Field("auto", description="bf16 where supported, else fp16.")
    activation_checkpointing: bool = False
    eval_every: int | None = Field(None, ge=1)
    eval_batches: int = Field(10, ge=1)
    shuffle_buffer: int = Field(1000, ge=0)
    num_workers: int = Field(2, ge=0, le=64)
    cpu_processes: int = Field(1, ge=1, le=64, description="Ranks when there is no GPU.")
    on_corrupt: Literal["skip", "fail"] = "skip"
    seed: int = 0
    log_every: int = Field(10, ge=1)
    log_sample_keys: bool = Field(
        False, description="Write each rank's (epoch, sample key) pairs to outputs/keys-rankN.txt."
    )
    checkpoint: CheckpointSettings = CheckpointSettings()
    profile: ProfileSettings | None = Field(
        None,
        description="Record a torch.profiler trace (Chrome trace JSON) of these steps on rank 0,"
        " with the top operators and each step's data wait vs compute.",
    )
    torch: bool = True

    @model_validator(mode="after")
    def _profile_fits(self) -> TrainJob:
        if self.profile is not None:
            steps = self.profile.wait + self.profile.warmup + self.profile.active
            if steps > self.max_steps:
                raise ValueError(
                    f"profile: wait + warmup + active is {steps} steps but job.max_steps is"
                    f" {self.max_steps}; profile fewer steps or train longer"
                )
        return self


def _chunk(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{value!r} is not a chunk size; give a whole number of frames of at least 1, or auto"
        )
    return value


class RenderJob(_Model):
    """Render frames of a Blender scene: chunks of frames, one Blender process per chunk."""

    kind: Literal["render"] = "render"
    scene: str = Field(
        description="The .blend, or a folder or .zip with it and its assets: a local path,"
        " file:/// or s3:// URL."
    )
    blend: str | None = Field(None, description="Which .blend in a folder or .zip holding several.")
    frames: str | None = Field(
        None, description='Frames, e.g. "1-240", "1,5,9", "1-240x10"; default: the scene\'s range.'
    )
    output: StorageUrl = Field(description="Prefix the frames are uploaded to.")
    pattern: str = Field(
        "frame_####", description="Frame file name; # runs become the frame number."
    )
    engine: str | None = Field(
        None, description="CYCLES, EEVEE or WORKBENCH; default: the scene's."
    )
    device: str | None = Field(
        None, description="Cycles device: CPU, CUDA, OPTIX, HIP, ONEAPI, METAL."
    )
    samples: int | None = Field(None, ge=1, le=1_000_000)
    resolution_x: int | None = Field(None, ge=4, le=65536)
    resolution_y: int | None = Field(None, ge=4, le=65536)
    resolution_percentage: int | None = Field(None, ge=1, le=1000)
    threads: int | None = Field(None, ge=1, le=1024, description="Render threads per Blender.")
    file_format: str | None = Field(
        None, description="PNG, JPEG, OPEN_EXR, TIFF, ...; default: the scene's."
    )
    denoise: bool | None = Field(None, description="Cycles denoising on/off; default: the scene's.")
    chunk: Annotated[int | Literal["auto"], BeforeValidator(_chunk)] = Field(
        "auto", description="Frames per Blender process, or auto (measured start-up vs frame time)."
    )
    max_workers: int | None = Field(
        None, ge=1, le=64, description="Chunks at once; default: one per GPU, or 1 without GPUs."
    )
    missing_files: Literal["fail", "warn"] = Field(
        "fail", description="When the scene refers to files that are not there."
    )
    frames_outside_scene: Literal["fail", "warn"] = Field(
        "fail", description="When job.frames asks for frames outside the scene's range."
    )
    blender: str = Field("blender", description="The Blender program: a name on PATH or a path.")
    chunk_retries: int = Field(2, ge=0, le=20, description="Retries of a chunk that crashed.")
    contact_sheet: bool = True
    preview_video: bool = Field(True, description="Make preview.mp4 when ffmpeg is installed.")
    torch: bool = False

    @field_validator("scene")
    @classmethod
    def _scene(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("is empty; give the .blend as a local path, file:/// or s3:// URL")
        if value.startswith("s3://") and not re.match(r"^s3://[^/]+/.+", value):
            raise ValueError(f"{value!r} names no object; write s3://bucket/path/scene.blend")
        if "://" in value and not value.startswith(("s3://", "file:///")):
            raise ValueError(
                f"{value!r} is not a path or storage URL; use a path, file:/// or s3://"
            )
        return value

    @field_validator("frames")
    @classmethod
    def _frames(cls, value: str | None) -> str | None:
        from tasks.render.frames import FrameSpecError, parse_frames

        if value is not None:
            try:
                parse_frames(value)
            except FrameSpecError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("engine", "device", "file_format")
    @classmethod
    def _known_name(cls, value: str | None, info: Any) -> str | None:
        from tasks.render.argv import DEVICES, ENGINES, FORMATS

        if value is None:
            return value
        known = {"engine": ENGINES, "device": DEVICES, "file_format": FORMATS}[info.field_name]
        if value.upper() not in known:
            close = difflib.get_close_matches(value.upper(), list(known), n=1, cutoff=0.75)
            hint = f"did you mean {close[0]}? " if close else ""
            if info.field_name == "device" and value.upper() == "GPU":
                hint = "name the kind of GPU (CUDA or OPTIX for NVIDIA, HIP for AMD); "
            raise ValueError(
                f"{value!r} is not known; {hint}use one of {', '.join(dict.fromkeys(known))}"
            )
        return value.upper()

    @field_validator("pattern")
    @classmethod
    def _pattern(cls, value: str) -> str:
        parts = value.split("/")
        if not value.strip() or value.startswith("/") or ".." in parts or not parts[-1]:
            raise ValueError(
                f"{value!r} is not a file name under job.output; write e.g. frame_#### or shot1/frame_####"
            )
        return value


def _argv(value: Any) -> Any:
    """Split a command written as one string; stringify YAML's numbers and booleans."""
    return CommandJob._split(value)


class MdSettings(_Model):
    """The built-in workload: a Lennard-Jones fluid (reduced units; argon for ns/day)."""

    atoms: int = Field(4000, ge=32, le=20_000_000, description="Atoms in the periodic box.")
    density: float = Field(0.8442, description="Number density rho* in sigma^-3 (liquid ~0.8).")
    temperature: float = Field(0.72, description="Initial temperature T* in epsilon/kB.")
    cutoff: float = Field(2.5, ge=1.5, le=6.0, description="Interaction cutoff in sigma.")
    skin: float = Field(0.3, gt=0, le=2.0, description="Neighbour-list skin in sigma.")
    dt: float = Field(0.005, gt=0, le=0.02, description="Time step in reduced time units.")
    steps: int = Field(1000, ge=1, le=100_000_000)
    thermo_every: int = Field(50, ge=1, description="Steps between thermo rows.")
    seed: int = Field(1, description="Seed of the initial velocities.")
    dtype: Literal["float64", "float32"] = "float64"
    compare_cpu: bool = Field(
        True, description="On a GPU, also time the same system on the CPU for a speedup."
    )
    cpu_steps: int = Field(100, ge=1, description="Steps of that CPU comparison run.")

    @field_validator("density")
    @classmethod
    def _density(cls, value: float) -> float:
        from tasks.hpc.box import MAX_DENSITY

        if not 0 < value <= MAX_DENSITY:
            raise ValueError(
                f"{value} is outside the fluid and solid range (0, {MAX_DENSITY}] sigma^-3;"
                " use e.g. 0.8442 for the liquid near its triple point"
            )
        return value

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        from tasks.hpc.box import MAX_TEMPERATURE

        if not 0 < value <= MAX_TEMPERATURE:
            raise ValueError(
                f"{value} is outside (0, {MAX_TEMPERATURE}] epsilon/kB, where a step of 0.005"
                " stays stable; use e.g. 0.72 (argon's liquid at about 86 K)"
            )
        return value

    @model_validator(mode="after")
    def _box_fits_cutoff(self) -> MdSettings:
        from tasks.hpc.box import box_for

        try:
            box_for(self.atoms, self.density, self.cutoff, self.skin)
        except ValueError as exc:
            raise ValueError(f"job.md.atoms: {exc}") from None
        return self


class HpcJob(_Model):
    """An MPI job: optional inputs and build step, then mpirun of a program (or the
    built-in molecular-dynamics workload) across ranks; outputs uploaded."""

    kind: Literal["hpc"] = "hpc"
    program: list[str] | None = Field(
        None, description="The program each rank runs, e.g. [./md, --steps, 1000]."
    )
    md: MdSettings | None = Field(None, description="Run the built-in MD workload instead.")
    build: list[str] | None = Field(
        None, description="Run once in the workspace before mpirun, e.g. [make, -j4]."
    )
    inputs: list[StorageUrl] = Field(
        default_factory=list, description="Objects or prefixes fetched into the workspace."
    )
    output: StorageUrl | None = Field(
        None, description="Prefix the outputs folder is uploaded to when the job ends."
    )
    ranks: int = Field(1, ge=1, le=65536, description="MPI processes (mpirun -np).")
    hosts: list[Host] | None = Field(
        None, description="Hosts mpirun reaches by ssh; default: this host."
    )
    slots: int | None = Field(
        None, ge=1, le=4096, description="Ranks this host takes; default: its CPU cores."
    )
    gpus_per_rank: int = Field(0, ge=0, le=64, description="GPUs each rank owns.")
    oversubscribe: bool = Field(False, description="Allow more ranks than slots.")
    mpirun: str = Field("mpirun", description="The mpirun program: a name on PATH or a path.")
    mpirun_args: list[str] = Field(
        default_factory=list, description="Extra mpirun options, e.g. [--mca, btl, tcp,self]."
    )
    torch: bool = False

    _split_program = field_validator("program", "build", mode="before")(
        classmethod(lambda cls, value: _argv(value))
    )

    @field_validator("program", "build")
    @classmethod
    def _not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or not value[0].strip()):
            raise ValueError("is empty; give a program and its arguments, e.g. [make, -j4]")
        return value

    @model_validator(mode="after")
    def _one_program(self) -> HpcJob:
        if (self.program is None) == (self.md is None):
            raise ValueError(
                "job.program and job.md: give exactly one, your MPI program or md: {} for the"
                " built-in molecular-dynamics workload"
            )
        return self


# job.kind -> the model of that kind's `job` section; tasks.jobs registers more (add_job_model)
JOB_MODELS: dict[str, type[BaseModel]] = {
    "command": CommandJob,
    "matmul": MatmulJob,
    "train": TrainJob,
    "render": RenderJob,
    "hpc": HpcJob,
}
BUILT_IN_KINDS = tuple(JOB_MODELS)
Job = Annotated[CommandJob | MatmulJob | TrainJob | RenderJob | HpcJob, Field(discriminator="kind")]


class Resources(_Model):
    gpus: int = Field(0, ge=0, le=64, description="GPUs to reserve on each node.")
    nodes: int = Field(
        1, ge=1, le=256, description="Machines the job spans, each with resources.gpus GPUs."
    )
    gpu_product: str | None = Field(None, description="e.g. NVIDIA-H100-80GB-HBM3 or H100.")
    allow_cpu: bool = Field(False, description="Run on CPU when no GPU is present.")
    cpu: float | None = Field(None, gt=0, description="CPU cores.")
    memory: Bytes | None = Field(None, description="Memory, e.g. 16Gi.")
    disk: Bytes = Field(parse_size("1Gi"), description="Free disk the workspace needs, e.g. 50Gi.")
    shm: Bytes | None = Field(None, description="Shared memory (/dev/shm), e.g. 8Gi.")

    @field_validator("gpu_product")
    @classmethod
    def _known_product(cls, value: str | None) -> str | None:
        return canonical_product(value) if value is not None else None

    @model_validator(mode="after")
    def _product_needs_gpus(self) -> Resources:
        if self.gpu_product and self.gpus == 0:
            raise ValueError(
                "resources.gpu_product is set but resources.gpus is 0;"
                " ask for at least one GPU or remove gpu_product"
            )
        return self


class Placement(_Model):
    backend: Literal["local", "kubernetes", "ec2"] = Field(
        "local", description="Where the job runs."
    )
    block: str | None = Field(
        None,
        description="Name of the block to read settings from: a LocalGpuHost (local), a"
        " KubernetesGpuPool (kubernetes) or an Ec2GpuFleet (ec2).",
    )
    market: Literal["spot", "on-demand", "spot-then-on-demand"] = Field(
        "spot-then-on-demand",
        description="ec2: rent spot instances, on-demand ones, or spot first then on-demand.",
    )
    on_demand_after: int = Field(
        2,
        ge=1,
        le=100,
        description="ec2, spot-then-on-demand: rent on-demand after this many spot interruptions.",
    )
    namespace: str | None = Field(
        None, description="Kubernetes namespace (default: the block's, else the kubeconfig's)."
    )
    image: str | None = Field(None, description="Kubernetes: the image the job's pods run.")
    price_table: str | None = Field(
        None, description="Name of a GpuPriceTable block whose prices cost reports use."
    )
    workspace_root: str | None = Field(None, description="Folder for job workspaces.")
    strict_gpu_limit: bool = Field(
        False, description="Fail when the Prefect concurrency limit `gpu` does not exist."
    )
    gpu_wait: Seconds = Field(0.0, ge=0, description="How long to wait for a free GPU slot.")


class Storage(_Model):
    artifacts: str | None = Field(None, description="file:// folder for run artifacts.")
    aws_credentials: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block for s3:// URLs."
    )

    @field_validator("artifacts")
    @classmethod
    def _scheme(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if value.startswith("s3://"):
            raise ValueError(
                "s3:// artifacts are not supported by this version; use a file:/// URL"
            )
        if not re.match(r"^file:///.+", value):
            raise ValueError(f"{value!r} is not a storage URL; write file:///absolute/path")
        return value


class IdleGpu(_Model):
    """Give back GPUs a job holds but does not use: every GPU it holds under `below_pct`
    for `for` in a row is idle."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True
    )

    below_pct: float = Field(
        5.0, gt=0, le=100, description="A GPU under this utilisation (in %) is idle."
    )
    for_: Seconds = Field(
        900.0, alias="for", ge=1, description="How long the GPUs must stay idle, e.g. 15m."
    )
    action: Literal["warn", "stop"] = Field(
        "warn",
        description="warn: a log line and the event gpuflow.gpu.idle; stop: those, then the"
        " job is stopped (SIGTERM first: training checkpoints) and the run fails saying why.",
    )


class Limits(_Model):
    max_duration: Seconds = Field(
        24 * 3600.0, gt=0, description="Longest the job may run, e.g. 2h; it is stopped after."
    )
    max_cost_usd: float | None = Field(None, gt=0, description="Stop the job before it costs more.")
    stop_grace_s: float = Field(
        30.0, ge=1, le=3600, description="Between SIGTERM and SIGKILL when the job is stopped."
    )
    orphan_after: Seconds = Field(
        900.0,
        ge=10,
        description="ec2: an instance whose orchestrator has been silent this long stops its"
        " job and terminates itself, e.g. 15m.",
    )
    idle_gpu: IdleGpu | None = Field(
        None, description="Warn about, or stop, a job whose GPUs stay idle, e.g. {for: 15m}."
    )


class StageRetry(_Model):
    retries: int = Field(0, ge=0, le=20)
    delay_s: float = Field(5.0, ge=0, le=3600)
    jitter: float = Field(0.5, ge=0, le=1, description="Random spread as a fraction of the delay.")


class RetryPolicy(_Model):
    """Retries apply only to retryable errors (capacity, transient, preempted)."""

    provision: StageRetry = StageRetry(retries=3, delay_s=5.0)
    preflight: StageRetry = StageRetry(retries=1, delay_s=2.0)
    run: StageRetry = StageRetry(retries=3, delay_s=5.0)
    collect: StageRetry = StageRetry(retries=1, delay_s=2.0)


class MetricsSettings(_Model):
    interval_s: float = Field(1.0, ge=0.05, le=3600, description="Seconds between samples.")
    pushgateway: str | None = Field(None, description="Pushgateway URL, e.g. http://host:9091.")
    push_interval_s: float = Field(
        15.0, ge=0.1, le=3600, description="Seconds between live pushes while the job runs."
    )
    plot: bool = Field(True, description="Draw utilisation over time as a PNG.")

    @field_validator("pushgateway")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            shown = "the value given" if "@" in value else repr(value)  # it may hold a password
            raise ValueError(f"{shown} is not an http(s) URL; write e.g. http://127.0.0.1:9091")
        return value


class JobSpec(_Model):
    """Everything gpuflow needs to run one GPU job through the pipeline."""

    name: str = Field("job", description="Lowercase letters, digits and dashes.")
    job: Job
    resources: Resources = Resources()
    placement: Placement = Placement()
    storage: Storage = Storage()
    limits: Limits = Limits()
    retry: RetryPolicy = RetryPolicy()
    env: dict[str, str] = Field(default_factory=dict, description="Plain environment variables.")
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variable -> name of a Prefect Secret block holding its value.",
    )
    metrics: MetricsSettings = MetricsSettings()

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if len(value) > 40 or not _NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a valid name; use up to 40 lowercase letters, digits and dashes"
            )
        return value

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key in value:
            if not _ENV_RE.match(key):
                raise ValueError(f"{key!r} is not an environment variable name; use A-Z, 0-9, _")
        return value

    @model_validator(mode="after")
    def _secret_names_distinct(self) -> JobSpec:
        both = sorted(set(self.env) & set(self.secret_env))
        if both:
            raise ValueError(f"{both[0]} is in both env and secret_env; keep it in one of them")
        return self

    @model_validator(mode="after")
    def _idle_gpu_watchable(self) -> JobSpec:
        idle = self.limits.idle_gpu
        if idle is None:
            return self
        if self.resources.gpus == 0:
            raise ValueError(
                "limits.idle_gpu watches the job's GPUs but resources.gpus is 0;"
                " ask for GPUs or remove limits.idle_gpu"
            )
        if idle.for_ < 2 * self.metrics.interval_s:
            raise ValueError(
                f"limits.idle_gpu.for ({idle.for_:g} s) is shorter than two samples"
                f" (metrics.interval_s is {self.metrics.interval_s:g} s); make it at least"
                f" {2 * self.metrics.interval_s:g} s"
            )
        return self


def _field_names(loc: tuple[Any, ...]) -> list[str]:
    """Return the field names allowed where `loc` points, for 'did you mean' hints."""
    kinds = JOB_MODELS
    model: Any = JobSpec
    parts = list(loc[:-1])
    if parts[:1] == ["job"] and len(parts) > 1 and parts[1] in kinds:
        model, parts = kinds[parts[1]], parts[2:]
    for part in parts:
        annotation = model.model_fields[part].annotation if part in model.model_fields else None
        # an optional section (MdSettings | None) names its fields like a plain one
        models = [a for a in (annotation, *get_args(annotation)) if hasattr(a, "model_fields")]
        annotation = models[0] if models else None
        if annotation is None:
            return []
        model = annotation
    return [field.alias or name for name, field in model.model_fields.items()]


def _sentence(error: dict[str, Any]) -> str:
    loc = tuple(error["loc"])
    if loc[:1] == ("job",) and len(loc) > 1 and loc[1] in JOB_MODELS:
        loc = loc[:1] + loc[2:]  # drop the union's tag: job.command.command -> job.command
    where = ".".join(str(p) for p in loc) or "spec"
    kind = error["type"]
    if kind == "extra_forbidden":
        known = _field_names(tuple(error["loc"]))
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        fix = f"did you mean {close[0]!r}?" if close else f"remove it (known: {', '.join(known)})"
        return f"{where}: unknown field; {fix}"
    if kind == "missing":
        if where == "job.command":
            return "job.command is required; give the program to run, e.g. [python, train.py]"
        return f"{where} is required; add it"
    if kind == "union_tag_not_found":
        return f"job.kind is required; use one of: {', '.join(JOB_MODELS)}"
    if kind == "union_tag_invalid":
        got = error.get("ctx", {}).get("tag", "")
        return f"job.kind: {got!r} is not a job kind; use one of: {', '.join(JOB_MODELS)}"
    msg = error["msg"].removeprefix("Value error, ")
    if kind == "value_error":
        # model-level checks already name their fields in full
        named = msg.startswith(where + ".") or (
            where == "spec" and msg.split(".", 1)[0] in JobSpec.model_fields
        )
        return msg if named else f"{where}: {msg}"
    bound = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le"}.get(kind)
    if bound:
        limit = error["ctx"][bound]
        word = {"ge": "at least", "gt": "more than", "le": "at most"}[bound]
        return f"{where} must be {word} {limit} (got {error.get('input')!r}); change it"
    hidden = loc[:1] in (("env",), ("secret_env",))
    if hidden and kind == "string_type":
        return f'{where}: environment values are text; quote it, e.g. {loc[-1]}: "4"'
    got = "" if hidden else f" (got {error.get('input')!r})"
    return f"{where}: {msg[0].lower()}{msg[1:]}{got}"


def add_job_model(model: type[BaseModel]) -> None:
    """Accept `job: {kind: ...}` sections of `model`'s kind in every JobSpec from now on."""
    kind = model.model_fields["kind"].default
    if JOB_MODELS.get(kind) is not model:
        JOB_MODELS[kind] = model
        _rebuild_job_union()


def remove_job_model(kind: str) -> None:
    """Stop accepting job sections of `kind` (the built-in kinds stay)."""
    if kind in JOB_MODELS and kind not in BUILT_IN_KINDS:
        del JOB_MODELS[kind]
        _rebuild_job_union()


def _rebuild_job_union() -> None:
    union = Union[tuple(JOB_MODELS.values())]  # noqa: UP007 - built at run time
    JobSpec.__pydantic_fields__["job"] = FieldInfo.from_annotation(
        Annotated[union, Field(discriminator="kind")]
    )
    JobSpec.model_rebuild(force=True)


def explain(exc: ValidationError) -> str:
    """Return one sentence per problem, each naming the field and the fix."""
    return " ".join(s if s.endswith((".", "?")) else s + "." for s in map(_sentence, exc.errors()))


def load_spec(source: JobSpec | dict[str, Any] | str | Path) -> JobSpec:
    """Return a validated JobSpec from a model, a dict, or a YAML/JSON file path."""
    if isinstance(source, JobSpec):
        return source
    where = "spec"
    if isinstance(source, str | Path) and not isinstance(source, dict):
        path = Path(source)
        where = str(path)
        source = yamlfile.read(path)
    if not isinstance(source, dict):
        raise InvalidSpec(
            f"{where}: the top level must be a mapping of fields (name, job, resources, ...),"
            f" not {type(source).__name__}."
        )
    try:
        return JobSpec.model_validate(source)
    except ValidationError as exc:
        raise InvalidSpec(explain(exc)) from None
