"""JobSpec: the one input model. Every field is checked here, before anything is provisioned."""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol, TypeVar, Union, get_args

import regex
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from gpuflow.tasks import yamlfile
from gpuflow.tasks.errors import InvalidSpec, InvalidValue
from gpuflow.tasks.gpus import canonical_product
from gpuflow.tasks.units import parse_duration, parse_size

# A number or text with a unit ("16Gi", "30m"): the JSON schema Prefect checks a
# deployment's parameters against says so too, or it would refuse "30m" before the flow.
Bytes = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema({"anyOf": [{"type": "integer"}, {"type": "string"}], "examples": ["16Gi"]}),
]
Seconds = Annotated[
    float,
    BeforeValidator(parse_duration),
    WithJsonSchema({"anyOf": [{"type": "number"}, {"type": "string"}], "examples": ["30m"]}),
]
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_BUILDING: ContextVar[bool] = ContextVar("gpuflow_spec_building", default=False)
# the folder of the spec file being read: relative paths in it (job.workdir) start there
_SPEC_DIR: ContextVar[Path | None] = ContextVar("gpuflow_spec_dir", default=None)


class SpecModel(BaseModel):
    """A section of a spec: unknown keys refused, values frozen. Built in Python
    (`Resources(gpus=2)`), a mistake is InvalidSpec with the same sentence YAML gets."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, /, **data: Any) -> None:
        # pydantic calls this for every section it validates: only the outermost turns the
        # error into a sentence, with the whole field path (limits.max_duration)
        outermost = not _BUILDING.get()
        token = _BUILDING.set(True)
        try:
            super().__init__(**data)
        except ValidationError as exc:
            if not outermost:
                raise
            raise InvalidValue(explain(exc, type(self))) from None
        finally:
            _BUILDING.reset(token)


_STORAGE_URL = re.compile(r"^(file:///|s3://[^/]+).*")


def storage_url(value: str) -> str:
    if not _STORAGE_URL.match(value):
        raise ValueError(
            f"{value!r} is not a storage URL; write file:///absolute/path or s3://bucket/prefix"
        )
    return no_climbing(value).rstrip("/")


def no_climbing(value: str) -> str:
    """Return a file:// URL whose path has no `..`: `file:///x/../../etc` would land in
    /etc, not under /x."""
    if value.startswith("file://") and ".." in value.removeprefix("file://").split("/"):
        raise ValueError(
            f"{value!r} climbs out of its folder with '..'; write the folder's own absolute path"
        )
    return value


StorageUrl = Annotated[str, AfterValidator(storage_url)]


SHELL_OPERATORS = frozenset(";|&<>()")
# ${NAME} is gpuflow's own expansion (from the unit's environment, no shell): allowed
SHELL_EXPANSION = re.compile(r"`|\$(?!\{[A-Za-z_][A-Za-z0-9_]*\})[\w({]")


def shell_syntax(line: str) -> str | None:
    """Return the first shell operator or expansion outside quotes in a one-string
    command (`;`, `&&`, `|`, `>`, `$(`, `$HOME`, a backquote), or None: split into words
    without a shell, `echo hi; echo there` would print `hi; echo there`."""
    lexer = shlex.shlex(line, posix=False, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        tokens = list(lexer)
    except ValueError:
        return None  # an unclosed quote: shlex.split names it
    for token in tokens:
        if token[:1] in ("'", '"') and token[-1:] == token[:1]:
            continue  # quoted: the program gets it as it is
        if set(token) <= SHELL_OPERATORS:
            return token
        if SHELL_EXPANSION.search(token):
            return token
    return None


MAX_CANDIDATES = 16  # a placement list's length

# Linux's limit on one environment string (NAME=value) and on one argument (MAX_ARG_STRLEN)
ENV_STRING_MAX = 128 * 1024
ENV_TOTAL_MAX = 1024 * 1024  # of env (or secret_env) in all: half of what exec takes
# what gpuflow sets for every unit (tasks/contract.py's unit_env and cluster_env): a
# job's env may not set them, and a command may name them as ${NAME}
UNIT_VARIABLES = (
    "GPUFLOW_WORKSPACE",
    "GPUFLOW_OUTPUT_DIR",
    "GPUFLOW_NODE_RANK",
    "GPUFLOW_NODES",
    "GPUFLOW_MASTER_ADDR",
    "GPUFLOW_MASTER_PORT",
    "GPUFLOW_NODE_ADDRS",
    "GPUFLOW_ATTEMPT",
)
SET_BY_GPUFLOW = frozenset(UNIT_VARIABLES)


def split_argv(value: Any) -> Any:
    """Return a command as a list of words: a string split like a shell does, and YAML's
    numbers and booleans in a list written as text (`[train.py, --epochs, 10, --fp16, true]`)."""
    if isinstance(value, str):
        if operator := shell_syntax(value):
            raise ValueError(
                f"holds the shell syntax {operator!r}, but a command runs without a shell;"
                " give it as a list of words, or run a shell on purpose:"
                f" [sh, -c, {json.dumps(value)}]"
            )
        value = shlex.split(value)
    if isinstance(value, list):
        words = [
            str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, int | float) else v
            for v in value
        ]
        for number, word in enumerate(words, start=1):
            if isinstance(word, str) and "\0" in word:
                raise ValueError(
                    f"word {number} holds a NUL byte, which no program can receive; remove it"
                )
            if isinstance(word, str) and len(word.encode()) >= ENV_STRING_MAX:
                raise ValueError(
                    f"word {number} is {len(word.encode()) / 1024:.0f} KiB; Linux passes at"
                    f" most {ENV_STRING_MAX // 1024} KiB in one argument: write it to a file"
                    " and pass the file's path"
                )
        return words
    return value


# job.kind -> the model of that kind's `job` section; each kind registers its own
# (gpuflow.tasks.kinds.registry), so this module knows no kind
JOB_MODELS: dict[str, type[BaseModel]] = {}


class Resources(SpecModel):
    """What each node of the job needs: GPUs, their product, memory, disk (spec `resources:`)."""

    # strict: `gpus: true` is not 1 GPU
    gpus: int = Field(0, ge=0, le=64, strict=True, description="GPUs to reserve on each node.")
    nodes: int = Field(
        1,
        ge=1,
        le=256,
        strict=True,
        description="Machines the job spans, each with resources.gpus GPUs.",
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


# placement.backend -> that backend's placement model; each backend registers its own
# (gpuflow.tasks.backends.registry), so this module knows no backend's settings
PLACEMENT_MODELS: dict[str, type[Placement]] = {}


class Placement(SpecModel):
    """Where the job runs (spec `placement:`): what every backend's placement has. Each
    backend registers a subclass with its own settings (add_placement_model), and a
    spec's placement is read as the one its `backend` names."""

    # a registered backend's name; the pipeline refuses others before provisioning
    backend: str = Field(
        "local",
        description="Where the job runs: local, kubernetes, ec2, slurm, fleet, alibaba, tencent.",
    )
    block: str | None = Field(
        None,
        description="Name of the block to read settings from: a LocalGpuHost (local), a"
        " KubernetesGpuPool (kubernetes), an Ec2GpuFleet (ec2), a SlurmCluster (slurm) or an"
        " EcsGpuFleet (alibaba) or a CvmGpuFleet (tencent).",
    )
    price_table: str | None = Field(
        None, description="Name of a GpuPriceTable block whose prices cost reports use."
    )
    gpu_wait: Seconds = Field(0.0, ge=0, description="How long to wait for a free GPU slot.")

    @model_validator(mode="before")
    @classmethod
    def _own_settings(cls, data: Any) -> Any:
        unknown = (
            [key for key in data if key not in cls.model_fields] if isinstance(data, dict) else []
        )
        if unknown:  # each named where it is: placement[1].partiton
            raise ValidationError.from_exception_data(
                cls.__name__,
                [
                    {
                        "type": PydanticCustomError(
                            "placement_field", _not_a_setting(cls, key, data)
                        ),
                        "loc": (key,),
                        "input": data[key],
                    }
                    for key in unknown
                ],
            )
        return data

    def where(self) -> str | None:
        """Return what tells this placement apart from another of its backend: its block
        (a backend adds its own: a namespace, a partition)."""
        return self.block

    def reads_api(self) -> bool:
        """Return True when checking this placement reads Prefect: the blocks it names (a
        backend adds what else it reads: the `gpu` concurrency limit)."""
        return bool(self.block or self.price_table)

    def label(self) -> str:
        """Return what this placement is called in a pool: kubernetes/onprem, ec2/fleet spot."""
        where = self.where()
        return f"{self.backend}/{where}" if where else self.backend


def _not_a_setting(model: type[Placement], key: str, data: dict[str, Any]) -> str:
    """Return what is wrong with `key`, which `model` has no field for, and the fix."""
    backend = data.get("backend", "local")
    owners = [name for name, other in PLACEMENT_MODELS.items() if key in other.model_fields]
    if backend in owners:  # the base model, built in Python with a backend's own setting
        return f"a setting of {backend} placements; build {PLACEMENT_MODELS[backend].__name__}"
    if owners:
        return (
            f"a setting of {', '.join(owners[:-1]) + ' and ' if len(owners) > 1 else ''}"
            f"{owners[-1]} placements, not of backend {backend!r};"
            f" remove it, or set backend: {owners[0]}"
        )
    known = list(model.model_fields)
    close = difflib.get_close_matches(key, known, n=1)
    fix = f"did you mean {close[0]!r}?" if close else f"remove it (known: {', '.join(known)})"
    return f"unknown field; {fix}"


def _absolute_folder(value: str) -> str:
    """Return `value` (a folder setting) as an absolute path: resolved once, where the spec
    is read, so that a reaper started in another folder finds it."""
    if not value.strip() or "\0" in value:
        raise ValueError("is empty; give a folder, e.g. /scratch/gpuflow")
    return str(Path(value).expanduser().absolute())


# a folder on the host that runs the job, e.g. /scratch/gpuflow (made absolute when read)
Folder = Annotated[str, AfterValidator(_absolute_folder)]


def _from_spec_dir(value: str | None) -> str | None:
    """Return a folder given relative to the spec file (or, for a spec built in Python,
    to the current folder) as an absolute path."""
    if value is None:
        return None
    if not value.strip():
        raise ValueError("is empty; give the folder that holds the job's code, e.g. .")
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = (_SPEC_DIR.get() or Path.cwd()) / path
    return os.path.normpath(path)


class CodeJob(SpecModel):
    """The fields of a job that runs the user's own code: the folder it starts in (sent
    to every node), the setup it needs there, and what a retried attempt adds."""

    workdir: Annotated[str | None, AfterValidator(_from_spec_dir)] = Field(
        None,
        description="Folder sent to every node, where the command starts (relative to the"
        " spec file). Its .gitignore and .gpuflowignore exclude files; .git is left out.",
    )
    workdir_max: Bytes = Field(
        parse_size("1Gi"), gt=0, description="The most job.workdir may send, e.g. 200Mi."
    )
    setup: list[str] = Field(
        default_factory=list,
        description="Shell lines run once on each node, in the working folder, before the"
        " job (e.g. pip install -r requirements.txt); the first that fails stops the job.",
    )
    resume_args: list[str] = Field(
        default_factory=list,
        description="Words added to the command on a retried attempt (e.g. [--resume])"
        ", for a script that resumes from a flag rather than by itself.",
    )
    # set by gpuflow when it packs workdir for a run: every attempt gets these bytes
    packed: str | None = Field(None, description="Set by gpuflow: the packed workdir's SHA-256.")

    @field_validator("setup", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("resume_args", mode="before")
    @classmethod
    def _words(cls, value: Any) -> Any:
        return split_argv(value)


def command_line(example: str) -> Any:
    """Return the type of a job's command: a list of words (a string split as a shell does,
    see split_argv) whose first names a program; an empty one is refused with `example`
    (e.g. "[python, train.py]") as the fix."""

    def named(value: list[str]) -> list[str]:
        if not value or not value[0].strip():
            raise ValueError(f"is empty; give the program to run, e.g. {example}")
        return value

    return Annotated[list[str], BeforeValidator(split_argv), AfterValidator(named)]


def add_placement_model(backend: str, model: type[Placement]) -> None:
    """Read `placement: {backend: <backend>}` as `model` from now on (the base Placement:
    the backend has no settings of its own)."""
    if model is Placement:
        PLACEMENT_MODELS.pop(backend, None)
    else:
        PLACEMENT_MODELS[backend] = model
    _PLACEMENT_ADAPTER.clear()


def remove_placement_model(backend: str) -> None:
    """Stop reading placements of `backend` as its own model."""
    PLACEMENT_MODELS.pop(backend, None)
    _PLACEMENT_ADAPTER.clear()


P = TypeVar("P", bound="Placement")
J = TypeVar("J")


def job_as(spec: JobSpec, model: type[J]) -> J:
    """Return `spec`'s job as `model`, the job model of the kind whose code reads it; a
    job of another kind here is InvalidSpec naming both (code given the wrong kind's spec)."""
    job = spec.job
    if not isinstance(job, model):
        raise InvalidSpec(
            f"job.kind: {job.kind} is not the kind this code runs ({model.__name__}); run it"
            " through the kind that registered it."
        )
    return job


def placement_as(spec: JobSpec, model: type[P]) -> P:
    """Return `spec`'s placement as `model`, its backend's own placement model (a spec
    reads it as that model already; one built before the backend was registered is read
    again), so a backend's settings are typed where it reads them."""
    placement = spec.placement
    if isinstance(placement, model):
        return placement
    return model.model_validate(placement.model_dump(exclude_unset=True))


def read_placement(value: Any) -> Placement:
    """Return `value` (a mapping, or a placement built in Python) as the placement model
    of the backend it names; the base model where that backend registered none."""
    if isinstance(value, Placement):
        model = PLACEMENT_MODELS.get(value.backend, Placement)
        if isinstance(value, model):
            return value
        value = value.model_dump(exclude_unset=True)
    if not PLACEMENT_MODELS:
        raise ValueError(
            "no backends are registered in this process; import gpuflow.tasks.pipeline.plugins"
            " (the pipeline and the CLI do) before reading a spec"
        )
    backend = value.get("backend", "local") if isinstance(value, dict) else "local"
    return PLACEMENT_MODELS.get(str(backend), Placement).model_validate(value)


_PLACEMENT_ADAPTER: list[TypeAdapter[Any]] = []  # the registered placements, for the schema


class PlacementSection:
    """The type of a spec's placement: the model its `backend` registered (or the base
    Placement), looked up when read, as the registered backends may grow."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            read_placement,
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda placement, info: placement.model_dump(mode=info.mode), info_arg=True
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict[str, Any]:
        if not _PLACEMENT_ADAPTER:
            models = tuple(PLACEMENT_MODELS.values()) or (Placement,)
            union: Any = Union[models] if len(models) > 1 else models[0]  # noqa: UP007
            _PLACEMENT_ADAPTER.append(TypeAdapter(union))
        return handler(_PLACEMENT_ADAPTER[0].core_schema)


class PlacementPolicy(SpecModel):
    """How a job placed on a list of candidates is placed: which candidate first, and
    where a preempted unit resumes."""

    choose: Literal["in-order", "cheapest", "soonest"] = Field(
        "in-order",
        description="in-order: try the candidates as listed; cheapest: the cheapest that can"
        " start now first; soonest: those that can start now first, in the listed order.",
    )
    on_preempt: Literal["same", "next"] | None = Field(
        None,
        description="Where a preempted job resumes: on the same candidate, or the next one"
        " that can start it (default: next after a spot interruption, else same).",
    )


class Storage(SpecModel):
    """Where artifacts go and the credentials storage URLs use (spec `storage:`)."""

    artifacts: str | None = Field(None, description="file:// folder for run artifacts.")
    aws_credentials: str | None = Field(
        None, description="Name of a prefect-aws AwsCredentials block for s3:// URLs."
    )
    staging: StorageUrl | None = Field(
        None,
        description="s3:// (or shared file://) prefix where a run's files for its nodes go"
        " (job.workdir's archive, named by its SHA-256), for nodes that cannot read this"
        " machine's files: Kubernetes pods on nodes of their own.",
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
        return no_climbing(value)


class IdleGpu(SpecModel):
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


_USER_RE = re.compile(r"^(invoking|image|root|\d{1,10}(:\d{1,10})?)$")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class Image(SpecModel):
    """image: the container image every unit of the job runs in, on every backend (a
    reference alone is short for {ref: ...}). gpuflow pins it by digest when it first
    resolves it: every unit, retried attempt and candidate of the run runs that digest."""

    ref: str = Field(description="e.g. ghcr.io/team/train:1.4, or a name@sha256:... digest.")
    credentials: str | None = Field(
        None, description="A RegistryCredentials block for a private registry."
    )
    pull: Literal["always", "missing", "never"] | None = Field(
        None,
        description="When to pull: default always for :latest or no tag, else when missing.",
    )
    user: str = Field(
        "invoking",
        description="Who the job runs as: invoking (you), image (its USER), root, or uid[:gid].",
    )
    digest: str | None = Field(None, description="Set by gpuflow: the digest the run pinned.")

    @model_validator(mode="before")
    @classmethod
    def _reference_alone(cls, data: Any) -> Any:
        return {"ref": data} if isinstance(data, str) else data

    @field_validator("ref")
    @classmethod
    def _reference(cls, value: str) -> str:
        from gpuflow.tasks.images import image_problem

        if (why := image_problem(value)) is not None:
            raise ValueError(why)
        return value

    @field_validator("user")
    @classmethod
    def _user(cls, value: str) -> str:
        if not _USER_RE.match(value):
            raise ValueError(
                f"{value[:40]!r} is not a user; write invoking, image, root or uid[:gid]"
                " (e.g. 1000:1000)"
            )
        return value

    @field_validator("digest")
    @classmethod
    def _digest(cls, value: str | None) -> str | None:
        if value is not None and not _DIGEST_RE.match(value):
            raise ValueError(f"{value[:80]!r} is not a sha256 digest; remove image.digest")
        return value

    @property
    def pinned(self) -> str:
        """The reference every unit runs: the name at the pinned digest once there is one."""
        if self.digest is None:
            return self.ref
        name = self.ref.split("@", 1)[0]
        head, _, last = name.rpartition("/")
        name = f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]
        return f"{name}@{self.digest}"  # engines refuse a tag beside a digest


class Limits(SpecModel):
    """How long the job may run and how it is stopped (spec `limits:`)."""

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


class StageRetry(SpecModel):
    """How often one stage is retried, and after what delay."""

    retries: int = Field(0, ge=0, le=20)
    delay_s: float = Field(5.0, ge=0, le=3600)
    jitter: float = Field(0.5, ge=0, le=1, description="Random spread as a fraction of the delay.")


class RetryPolicy(SpecModel):
    """Retries apply only to retryable errors (capacity, transient, preempted)."""

    provision: StageRetry = StageRetry(retries=3, delay_s=5.0)
    preflight: StageRetry = StageRetry(retries=1, delay_s=2.0)
    run: StageRetry = StageRetry(retries=3, delay_s=5.0)
    collect: StageRetry = StageRetry(retries=1, delay_s=2.0)


class MetricsSettings(SpecModel):
    """How the job's GPUs are sampled and where the samples go (spec `metrics:`)."""

    interval_s: float = Field(1.0, ge=0.05, le=3600, description="Seconds between samples.")
    pushgateway: str | None = Field(None, description="Pushgateway URL, e.g. http://host:9091.")
    push_interval_s: float = Field(
        15.0, ge=0.1, le=3600, description="Seconds between live pushes while the job runs."
    )
    plot: bool = Field(True, description="Draw utilisation over time as a PNG.")
    from_log: list[str] = Field(
        default_factory=list,
        description="Regexes with named groups over the job's output lines, e.g."
        r" 'step (?P<step>\d+) loss (?P<loss>[\d.]+)': each match is a row of the run's"
        " metrics (table, plot, live pushes; the last values in the summary).",
    )

    @field_validator("from_log", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("from_log")
    @classmethod
    def _named_groups(cls, value: list[str]) -> list[str]:
        for index, pattern in enumerate(value):
            try:
                compiled = regex.compile(pattern)  # the engine that reads the job's lines
            except regex.error as exc:
                raise ValueError(
                    f"[{index}] {pattern!r} is not a regular expression ({exc}); fix it"
                ) from None
            if not compiled.groupindex:
                raise ValueError(
                    f"[{index}] {pattern!r} has no named group, so no figure would be kept;"
                    r" name what it captures, e.g. loss (?P<loss>[\d.]+)"
                )
        return value

    @field_validator("pushgateway")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            shown = "the value given" if "@" in value else repr(value)  # it may hold a password
            raise ValueError(f"{shown} is not an http(s) URL; write e.g. http://127.0.0.1:9091")
        return value


_JOB_ADAPTER: list[TypeAdapter[Any]] = []  # the registered kinds' union, built when first read


def _job_adapter() -> TypeAdapter[Any]:
    """Return what reads a `job:` section: the registered kinds' models, by `kind`."""
    if not _JOB_ADAPTER:
        models = tuple(JOB_MODELS.values())
        if not models:
            raise ValueError(
                "no job kinds are registered in this process; import"
                " gpuflow.tasks.pipeline.plugins (the pipeline and the CLI do) before reading a spec"
            )
        union: Any = (
            Annotated[Union[models], Field(discriminator="kind")]  # noqa: UP007 - built at run time
            if len(models) > 1
            else models[0]
        )
        _JOB_ADAPTER.append(TypeAdapter(union))
    return _JOB_ADAPTER[0]


class JobModel(Protocol):
    """What every kind's job model is (a pydantic model with its `kind`), as code that
    does not know the kind sees it; a kind reads its own model (JobKind.job_of)."""

    @property
    def kind(self) -> str: ...

    def model_dump(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...

    def model_dump_json(self, *args: Any, **kwargs: Any) -> str: ...


class JobSection:
    """The type of a spec's `job:`: one of the models kinds register (add_job_model), read
    by its `kind`; the set may grow after JobSpec is made, so it is looked up when read."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            lambda value: _job_adapter().validate_python(value),
            serialization=core_schema.plain_serializer_function_ser_schema(
                lambda job, info: job.model_dump(mode=info.mode), info_arg=True
            ),
        )

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: Any, handler: Any) -> dict[str, Any]:
        return handler(_job_adapter().core_schema)


def _one_or_a_list(schema: dict[str, Any]) -> None:
    """The JSON schema of `placement`: one placement, or a list of candidates (a
    deployment's parameters are checked against it before the flow reads them)."""
    kept = ("description", "title")
    one = {key: schema.pop(key) for key in list(schema) if key not in kept}
    schema["anyOf"] = [one, {"type": "array", "items": one, "minItems": 1}]


class JobSpec(SpecModel):
    """Everything gpuflow needs to run one GPU job through the pipeline."""

    name: str = Field("job", description="Lowercase letters, digits and dashes.")
    job: Annotated[JobModel, JobSection]  # one of the registered kinds' models (add_job_model)
    resources: Resources = Resources()
    # read as the model of the backend it names (PlacementSection); default {backend: local}
    placement: Annotated[Placement, PlacementSection] = Field(
        default_factory=dict,
        validate_default=True,
        description="Where the job runs, or a list of candidates in the order of preference.",
        json_schema_extra=_one_or_a_list,
    )
    # filled from a `placement:` list, in the order of preference; `placement` is then the
    # candidate the run uses (the first until the pool chooses)
    candidates: tuple[Annotated[Placement, PlacementSection], ...] = Field(
        (), description="The placements a job may use, when `placement` is a list."
    )
    placement_policy: PlacementPolicy = PlacementPolicy()
    storage: Storage = Storage()
    limits: Limits = Limits()
    retry: RetryPolicy = RetryPolicy()
    env: dict[str, str] = Field(default_factory=dict, description="Plain environment variables.")
    secret_env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment variable -> name of a Prefect Secret block holding its value.",
    )
    metrics: MetricsSettings = MetricsSettings()
    image: Image | None = Field(
        None, description="The container image the job runs in, on every backend."
    )

    @model_validator(mode="before")
    @classmethod
    def _placement_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("placement"), list | tuple):
            given = list(data["placement"])
            if not given:
                raise ValueError(
                    "placement: the list of candidates is empty; give at least one placement"
                    " (a mapping such as {backend: local}), or one mapping instead of a list"
                )
            if "candidates" in data:
                raise ValueError(
                    "candidates: is filled from a placement list; give the list in placement only"
                )
            if len(given) > MAX_CANDIDATES:
                raise ValueError(
                    f"placement: {len(given)} candidates; a placement list holds at most"
                    f" {MAX_CANDIDATES} (each is checked and asked for offers before the job"
                    " starts)"
                )
            data = {**data, "placement": given[0], "candidates": given}
        return data

    @model_validator(mode="after")
    def _candidates_distinct(self) -> JobSpec:
        if self.placement_policy != PlacementPolicy() and len(self.candidates) < 2:
            raise ValueError(
                "placement_policy chooses among candidates, but placement names one;"
                " make placement a list of candidates or remove placement_policy"
            )
        seen: dict[str, int] = {}
        for index, candidate in enumerate(self.candidates):
            key = candidate.model_dump_json()
            if key in seen:
                raise ValueError(
                    f"placement[{index}] is the same candidate as placement[{seen[key]}];"
                    " remove one, or make them differ (another block, namespace, market...)"
                )
            seen[key] = index
        for index, candidate in enumerate(self.candidates or (self.placement,)):
            older = getattr(candidate, "image", None)  # Kubernetes' placement.image
            if older and self.image and older != self.image.ref.split("@", 1)[0]:
                where = f"placement[{index}]" if self.candidates else "placement"
                raise ValueError(
                    f"image is {self.image.ref!r} but {where}.image is {older!r}; a run has one"
                    f" image: remove {where}.image (it is deprecated; image: replaces it)"
                )
        if self.candidates and self.placement not in self.candidates:
            raise ValueError(
                "placement: the placement used is not one of the candidates; give the"
                " candidates as a placement list only"
            )
        return self

    @field_validator("name")
    @classmethod
    def _dns_name(cls, value: str) -> str:
        if len(value) > 40 or not _NAME_RE.match(value):
            raise ValueError(
                f"{value!r} is not a valid name; use up to 40 lowercase letters, digits and"
                " dashes, starting and ending with a letter or digit"
            )
        return value

    @field_validator("env", "secret_env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for key, item in value.items():
            if not _ENV_RE.match(key):
                raise ValueError(f"{key!r} is not an environment variable name; use A-Z, 0-9, _")
            if key in SET_BY_GPUFLOW:
                raise ValueError(
                    f"{key} is set by gpuflow for every unit (where this run's node keeps its"
                    " files and what it is); remove it, or read it in the job"
                )
            if "\0" in item:  # the value itself is never echoed: it may be a secret
                raise ValueError(
                    f"the value of {key} holds a NUL byte, which no environment can carry;"
                    " remove it"
                )
            size = len(key) + 1 + len(item.encode())
            if size >= ENV_STRING_MAX:
                raise ValueError(
                    f"the value of {key} is {size / 1024:.0f} KiB; Linux passes at most"
                    f" {ENV_STRING_MAX // 1024} KiB in one environment variable: write it to a"
                    " file and pass the file's path"
                )
        total = sum(len(k) + len(v.encode()) + 2 for k, v in value.items())
        if total > ENV_TOTAL_MAX:
            raise ValueError(
                f"the variables hold {total / 1024:.0f} KiB in all, over {ENV_TOTAL_MAX // 1024}"
                " KiB: a program starts with about 2 MiB of arguments and environment together"
                " (the host's own variables take their share); write the large values to"
                " files and pass their paths"
            )
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


def _field_names(loc: tuple[Any, ...], root: Any = None) -> list[str]:
    """Return the field names allowed where `loc` points (in `root`, default a JobSpec),
    for 'did you mean' hints."""
    kinds = JOB_MODELS
    model: Any = root or JobSpec
    parts = list(loc[:-1])
    if model is not JobSpec:
        pass
    elif parts[:1] == ["job"] and len(parts) > 1 and parts[1] in kinds:
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


def _sentence(error: Any, root: Any = None) -> str:
    loc = tuple(error["loc"])
    if loc[:1] == ("job",) and len(loc) > 1 and loc[1] in JOB_MODELS:
        loc = loc[:1] + loc[2:]  # drop the union's tag: job.command.command -> job.command
    if loc[:1] == ("candidates",) and len(loc) > 1:  # given as a placement list
        loc = (f"placement[{loc[1]}]", *loc[2:])
    where = ".".join(str(p) for p in loc) or "spec"
    kind = error["type"]
    if kind == "placement_field":
        return f"{where}: {error['msg']}"
    if kind == "extra_forbidden":
        known = _field_names(tuple(error["loc"]), root)
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
            where == "spec" and re.split(r"[.:\[ ]", msg, maxsplit=1)[0] in JobSpec.model_fields
        )
        return msg if named else f"{where}: {msg}"
    bound = {"greater_than_equal": "ge", "greater_than": "gt", "less_than_equal": "le"}.get(kind)
    if bound:
        limit = error["ctx"][bound]
        word = {"ge": "at least", "gt": "more than", "le": "at most"}[bound]
        return f"{where} must be {word} {limit} (got {error.get('input')!r}); change it"
    if kind == "literal_error" and isinstance(error.get("input"), str):
        allowed = re.findall(r"'([^']*)'", error.get("ctx", {}).get("expected", ""))
        close = difflib.get_close_matches(error["input"], allowed, n=1)
        if close:
            return (
                f"{where}: {error['input']!r} is not one of {', '.join(allowed)};"
                f" did you mean {close[0]!r}?"
            )
    hidden = loc[:1] in (("env",), ("secret_env",))
    if hidden and kind == "string_type":
        return f'{where}: environment values are text; quote it, e.g. {loc[-1]}: "4"'
    got = "" if hidden else f" (got {error.get('input')!r})"
    return f"{where}: {msg[0].lower()}{msg[1:]}{got}"


def registered_models() -> dict[str, type[BaseModel]]:
    """Return every registered kind's job model and backend's placement model by class name
    (what `gpuflow.<Name>` gives for a kind or backend registered after gpuflow was built)."""
    return {m.__name__: m for m in [*JOB_MODELS.values(), *PLACEMENT_MODELS.values()]}


def add_job_model(model: type[BaseModel]) -> None:
    """Accept `job: {kind: ...}` sections of `model`'s kind in every JobSpec from now on."""
    kind = model.model_fields["kind"].default
    if JOB_MODELS.get(kind) is not model:
        JOB_MODELS[kind] = model
        _rebuild_job_union()


def remove_job_model(kind: str) -> None:
    """Stop accepting job sections of `kind`."""
    if JOB_MODELS.pop(kind, None) is not None:
        _rebuild_job_union()


def _rebuild_job_union() -> None:
    _JOB_ADAPTER.clear()  # built again, from the models now registered, when next read


def explain(exc: ValidationError, root: Any = None) -> str:
    """Return one sentence per problem, each naming the field and the fix (fields of
    `root`, default a JobSpec)."""
    said = (_sentence(error, root) for error in exc.errors())
    return " ".join(s if s.endswith((".", "?")) else s + "." for s in said)


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
    token = _SPEC_DIR.set(Path(where).absolute().parent if where != "spec" else None)
    try:
        return JobSpec.model_validate(source)
    except ValidationError as exc:
        raise InvalidSpec(explain(exc)) from None
    finally:
        _SPEC_DIR.reset(token)
