"""Job kinds: one registry. Each kind is one module implementing tasks.jobs.base.JobKind;
adding a kind is that module plus one line in BUILT_IN (or a `register` call)."""

from __future__ import annotations

from importlib import import_module

from tasks.errors import InvalidSpec
from tasks.jobs.base import JobKind, Report, WorkUnit
from tasks.spec import JobSpec, add_job_model, remove_job_model

# job.kind -> "module:class" of its implementation, imported when first used
BUILT_IN = {
    "command": "tasks.jobs.command:CommandKind",
    "matmul": "tasks.jobs.matmul:MatmulKind",
    "train": "tasks.jobs.train:TrainKind",
    "render": "tasks.jobs.render:RenderKind",
    "hpc": "tasks.jobs.hpc:HpcKind",
}
_KINDS: dict[str, JobKind] = {}


def register(kind: JobKind) -> JobKind:
    """Add `kind` to the registry and its `job:` model to the spec; return it."""
    add_job_model(kind.model)
    _KINDS[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind `register` added; built-in kinds stay."""
    if name not in BUILT_IN:
        _KINDS.pop(name, None)
        remove_job_model(name)


def get_kind(name: str) -> JobKind:
    """Return the kind registered under `name`."""
    if name not in _KINDS:
        if name not in BUILT_IN:
            raise ValueError(f"unknown job kind {name!r}")
        module, attribute = BUILT_IN[name].split(":")
        _KINDS[name] = getattr(import_module(module), attribute)()
    return _KINDS[name]


def kind_of(spec: JobSpec) -> JobKind:
    """Return the kind that runs `spec`'s job."""
    return get_kind(spec.job.kind)


def check_job(spec: JobSpec) -> None:
    """Raise InvalidSpec when the job itself (not the host) cannot run as written."""
    from tasks.storage import StorageError, check_writable

    try:
        if spec.storage.artifacts:
            check_writable(spec.storage.artifacts, None, "storage.artifacts")
        kind_of(spec).check(spec)
    except StorageError as exc:
        raise InvalidSpec(str(exc)) from None


__all__ = [
    "BUILT_IN",
    "JobKind",
    "Report",
    "WorkUnit",
    "check_job",
    "get_kind",
    "kind_of",
    "register",
    "unregister",
]
