"""The user's own code on the run's nodes: job.workdir packed once per run (every attempt
gets the same bytes, named by their SHA-256), put where the nodes read it (the backend's
`stage`), and each unit started through gpuflow's starter (`python -m
gpuflow.tasks.workdir`), which unpacks it, runs job.setup once per node, expands `${NAME}`
from the unit's environment and becomes the command; a retried attempt adds
job.resume_args."""

from __future__ import annotations

import sys
from pathlib import Path

from gpuflow.tasks import starter
from gpuflow.tasks.backends.base import Backend
from gpuflow.tasks.contract import Cluster, WorkUnit
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.host import gpuflow_home, make_dirs
from gpuflow.tasks.spec import CodeJob, JobSpec
from gpuflow.tasks.storage import S3Settings
from gpuflow.tasks.units import format_bytes
from gpuflow.tasks.workdir import Packed, Start, WorkdirError, pack, variables

STARTER = starter.MODULE


def archives() -> Path:
    """Where this machine keeps packed working folders, by their SHA-256 (0700: this
    user's alone under GPUFLOW_HOME)."""
    return make_dirs(gpuflow_home() / "workdirs")


def pack_code(spec: JobSpec) -> tuple[JobSpec, Packed | None]:
    """Return the spec with its working folder packed (job.packed: the archive's SHA-256)
    and what was packed; the spec as it is when it has no working folder or one already
    packed here. InvalidSpec (one sentence) when the folder cannot be sent."""
    job = spec.job
    if not isinstance(job, CodeJob) or not job.workdir:
        return spec, None
    if job.packed and (archives() / f"{job.packed}.tar.gz").is_file():
        return spec, None  # packed already, on this machine
    try:
        packed = pack(Path(job.workdir), job.workdir_max, archives())
    except WorkdirError as exc:
        raise InvalidSpec(f"{exc}.") from None
    return spec.model_copy(update={"job": job.model_copy(update={"packed": packed.sha256})}), packed


def said(packed: Packed) -> str:
    """Return what a run's log says of its packed working folder."""
    return (
        f"job.workdir: {packed.files} files, {format_bytes(packed.size)}, packed as"
        f" {packed.sha256[:12]} (every attempt of this run gets these files);"
        f" {packed.left_out.said()}"
    )


def started(
    spec: JobSpec,
    cluster: Cluster,
    units: list[WorkUnit],
    backend: Backend,
    storage: S3Settings,
    attempt: int,
) -> list[WorkUnit]:
    """Return `units` as they start on `cluster`: in the packed working folder, after
    job.setup, with `${NAME}` expanded on their node and, from the second attempt on,
    job.resume_args added. Units of other jobs are returned as they are."""
    job = spec.job
    if not isinstance(job, CodeJob):
        return units
    extra = list(job.resume_args) if attempt > 1 else []
    archive = None
    if job.packed:
        path = archives() / f"{job.packed}.tar.gz"
        if not path.is_file():
            raise InvalidSpec(
                f"job.workdir: the archive packed for this run ({path}) is gone; run the job"
                " again, which packs the folder anew."
            )
        archive = backend.stage(cluster, path, storage, spec.storage.staging)
    expand = bool(variables([word for unit in units for word in unit.command] + extra))
    if archive is None and not job.setup and not expand:
        return [unit.model_copy(update={"command": [*unit.command, *extra]}) for unit in units]
    start = Start(archive=archive, sha256=job.packed, setup=job.setup, expand=expand)
    head = [sys.executable, "-m", STARTER, start.model_dump_json(), "--"]
    return [unit.model_copy(update={"command": [*head, *unit.command, *extra]}) for unit in units]
