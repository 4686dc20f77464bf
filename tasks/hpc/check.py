"""Checks an HPC job must pass before anything is provisioned: the rank layout, mpirun and
the program on PATH, inputs that exist, an output prefix that can be written."""

from __future__ import annotations

import shutil
from pathlib import Path

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.fetching import relative_names
from gpuflow.tasks.hpc import mpi
from gpuflow.tasks.hpc.launch import hosts_for
from gpuflow.tasks.hpc.model import HpcJob
from gpuflow.tasks.spec import JobSpec, job_as
from gpuflow.tasks.storage import S3Settings, StorageError, check_writable, store_for


def check_hpc(spec: JobSpec, s3: S3Settings | None, on_host: bool) -> None:
    """Raise InvalidSpec, one sentence naming the field and the fix, for the first problem;
    with `on_host`, the ranks run on this machine, whose mpirun and programs are checked."""
    job = job_as(spec, HpcJob)
    nodes = spec.resources.nodes
    hosts = hosts_for(
        job, spec.resources.gpus, [f"node-{i}" for i in range(nodes)] if nodes > 1 else None
    )
    if job.gpus_per_rank and not job.hosts and spec.resources.gpus == 0:
        raise InvalidSpec(
            f"job.gpus_per_rank: {job.gpus_per_rank} GPU(s) per rank but resources.gpus is 0;"
            f" set resources.gpus to {job.ranks * job.gpus_per_rank} or gpus_per_rank to 0"
        )
    try:
        mpi.check_layout(job.ranks, hosts, job.gpus_per_rank, job.oversubscribe)
    except mpi.LayoutError as exc:
        raise InvalidSpec(str(exc)) from None
    # mpirun, mpi4py and the program are this host's only where units run here (else the
    # job image's)
    if on_host and shutil.which(job.mpirun) is None:
        raise InvalidSpec(
            f"job.mpirun: {job.mpirun!r} was not found; install Open MPI (Debian: apt-get"
            " install openmpi-bin) or give the path of mpirun"
        )
    if on_host and job.md is not None and job.ranks > 1:
        try:
            import mpi4py  # noqa: F401
        except ImportError:
            raise InvalidSpec(
                "job.md: the MD workload needs mpi4py for several ranks; pip install mpi4py"
            ) from None
    if on_host and job.program and not _built_here(job):
        program = job.program[0]
        if "/" not in program and shutil.which(program) is None:
            raise InvalidSpec(
                f"job.program: {program!r} was not found on PATH; install it, give its path,"
                " or fetch it with job.inputs"
            )
        if Path(program).is_absolute() and not shutil.which(program):
            raise InvalidSpec(
                f"job.program: {program!r} does not exist or is not executable; fix the path"
            )
    for url in job.inputs:
        try:
            store = store_for(url, s3)
            present = store.exists(url)
            if not present:
                listed = store.list(url + "/")
                relative_names(url, listed)  # every key must land inside the workspace
                present = bool(listed)
        except StorageError as exc:
            raise InvalidSpec(f"job.inputs: {exc}") from None
        if not present:
            raise InvalidSpec(f"job.inputs: {url} does not exist; check the URL or upload it first")
    if job.output:
        check_writable(job.output, s3)


def _built_here(job: HpcJob) -> bool:
    """Return True when the program may come from the inputs or the build step: a relative
    path, which only exists in the workspace once they have run."""
    assert job.program is not None
    program = job.program[0]
    return "/" in program and not Path(program).is_absolute()


def preflight_checks(spec: JobSpec, hosts: list[mpi.Host]) -> list[dict[str, str]]:
    """Return preflight findings for an MPI job on `hosts` as {name, level, message}: the
    MPI found, where the ranks go, and what the MD workload will run on."""
    import subprocess
    from importlib import metadata

    job = job_as(spec, HpcJob)
    mpirun = shutil.which(job.mpirun) or job.mpirun
    try:
        version = subprocess.run(
            [mpirun, "--version"], capture_output=True, text=True, timeout=30
        ).stdout.splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return [{"name": "mpi", "level": "fail", "message": f"{mpirun} --version did not answer."}]
    try:
        bindings = f"mpi4py {metadata.version('mpi4py')}"
    except metadata.PackageNotFoundError:
        bindings = "no mpi4py"
    slots = sum(h.slots for h in hosts)
    checks = [
        {
            "name": "mpi",
            "level": "pass",
            "message": f"{version} at {mpirun}, {bindings}; {job.ranks} rank(s) on"
            f" {', '.join(f'{h.name} ({h.slots} slots)' for h in hosts)}.",
        }
    ]
    if job.ranks > slots:
        checks.append(
            {
                "name": "mpi-slots",
                "level": "warn",
                "message": f"{job.ranks} ranks share {slots} slot(s) (oversubscribed): expect"
                " each rank to run slower than on a core of its own.",
            }
        )
    if job.md is not None:
        where = (
            f"{job.gpus_per_rank} GPU(s) per rank"
            if job.gpus_per_rank
            else "the CPU (job.gpus_per_rank is 0)"
        )
        checks.append({"name": "md", "level": "pass", "message": f"MD runs on {where}."})
    return checks
