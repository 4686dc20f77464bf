"""Job kinds by name. Each kind is one module implementing gpuflow.tasks.kinds.base.JobKind; adding
a kind is that module plus a `register` call, which also teaches the spec its `job:` model."""

from __future__ import annotations

from gpuflow.tasks.kinds.base import JobKind
from gpuflow.tasks.kinds.command import CommandKind
from gpuflow.tasks.kinds.hpc import HpcKind
from gpuflow.tasks.kinds.matmul import MatmulKind
from gpuflow.tasks.kinds.render import RenderKind
from gpuflow.tasks.kinds.service import ServiceKind
from gpuflow.tasks.kinds.stream import StreamKind
from gpuflow.tasks.kinds.train import TrainKind
from gpuflow.tasks.spec import JobSpec, add_job_model, remove_job_model

BUILT_IN = ("command", "matmul", "train", "render", "hpc", "service", "stream")
_KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    """Add `kind` to the registry and its `job:` model to the spec; return it."""
    add_job_model(kind.model)
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind `register` added; built-in kinds stay."""
    if name not in BUILT_IN and _KINDS.pop(name, None) is not None:
        remove_job_model(name)


def names() -> list[str]:
    """Return the names of the registered kinds, built-in first, in registration order."""
    return list(_KINDS)


def get_kind(name: str) -> JobKind:
    """Return the kind registered under `name`."""
    if name not in _KINDS:
        raise ValueError(f"unknown job kind {name!r}")
    return _KINDS[name]


def kind_of(spec: JobSpec) -> JobKind:
    """Return the kind that runs `spec`'s job."""
    return get_kind(spec.job.kind)


for _builtin in (
    CommandKind(),
    MatmulKind(),
    TrainKind(),
    RenderKind(),
    HpcKind(),
    ServiceKind(),
    StreamKind(),
):
    register(_builtin)
