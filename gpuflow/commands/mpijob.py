"""`gpuflow hpc --mpijob IMAGE`: the Kubernetes shape of an HPC job, a Kubeflow MPI
Operator MPIJob built from the same JobSpec (the hpc kind's rank command in the Kubernetes
backend's MPIJob builder), for clusters that run the operator. Pure: dicts in, dicts out.

One Launcher pod runs mpirun (no GPU); Worker pods, one per node, each hold
`resources.gpus` GPUs and `slotsPerWorker` ranks. The operator writes the hostfile from the
workers and points Open MPI at it, so mpirun needs no -H here. Every rank starts through
gpuflow.tasks.hpc.rank, as on this host, and takes its block of the pod's GPUs by local rank.
"""

from __future__ import annotations

import math
import re
from typing import Any

from gpuflow.tasks.backends.kubernetes.mpijob import MAX_NAME, manifest
from gpuflow.tasks.contract import owner_labels
from gpuflow.tasks.gpus import GPU_PRODUCT_LABEL
from gpuflow.tasks.gpus import GPU_RESOURCE as GPU
from gpuflow.tasks.hpc import mpi
from gpuflow.tasks.hpc.launch import program_argv
from gpuflow.tasks.hpc.model import HpcJob
from gpuflow.tasks.spec import JobSpec


class MpiJobError(ValueError):
    """The spec has no MPIJob shape; the message names the field and the fix."""


def layout(spec: JobSpec) -> tuple[int, int]:
    """Return (workers, slots per worker): GPUs per pod / GPUs per rank when ranks own
    GPUs, else job.slots (default 1) ranks per pod; ranks must fill the pods exactly."""
    job = _job(spec)
    if job.gpus_per_rank:
        gpus = spec.resources.gpus
        if gpus < job.gpus_per_rank or gpus % job.gpus_per_rank:
            raise MpiJobError(
                f"resources.gpus: {gpus} GPU(s) per pod do not split into ranks of"
                f" {job.gpus_per_rank}; make it a multiple of job.gpus_per_rank"
            )
        slots = gpus // job.gpus_per_rank
    else:
        slots = job.slots or 1
    workers = math.ceil(job.ranks / slots)
    if workers * slots != job.ranks:
        raise MpiJobError(
            f"job.ranks: {job.ranks} ranks do not fill {workers} worker pod(s) of {slots} slot(s);"
            f" use a multiple of {slots}"
        )
    return workers, slots


def build(
    spec: JobSpec,
    image: str,
    flow_run_id: str,
    namespace: str = "default",
    as_root: bool = True,
    ttl_s: int = 3600,
) -> dict[str, Any]:
    """Return the MPIJob manifest for `spec`, run by `image` (which holds gpuflow, Open MPI
    and sshd). `as_root` adds --allow-run-as-root: the operator's SSH keys mount at /root/.ssh."""
    job = _job(spec)
    workers, slots = layout(spec)
    name = f"{spec.name[: MAX_NAME - 9]}-{flow_run_id[:8]}".lower()
    labels = _label_values(owner_labels(flow_run_id, spec.name))
    ranks_argv = [
        "python",
        "-m",
        "gpuflow.tasks.hpc.rank",
        "--status-dir",
        "/tmp/gpuflow-ranks",
        "--gpus-per-rank",
        str(job.gpus_per_rank),
        "--",
        *["python" if i == 0 and job.md else a for i, a in enumerate(program_argv(job))],
    ]
    names = mpi.exported(spec.env, extra=[*spec.env, "LD_LIBRARY_PATH", "PATH", "PYTHONPATH"])
    command = mpi.mpirun_argv(
        ranks_argv, job.ranks, None, names, as_root=as_root, oversubscribe=job.oversubscribe
    )
    command[1:1] = job.mpirun_args
    env = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    shm: dict[str, Any] = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    if spec.resources.shm:
        shm["emptyDir"]["sizeLimit"] = str(spec.resources.shm)
    worker_pod: dict[str, Any] = {
        "containers": [
            {
                "name": "worker",
                "image": image,
                "command": ["/usr/sbin/sshd", "-De"],
                "env": [dict(e) for e in env],
                "resources": _worker_resources(spec, slots),
                "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
            }
        ],
        "volumes": [shm],
    }
    if spec.resources.gpus:
        worker_pod["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    if spec.resources.gpu_product:
        worker_pod["nodeSelector"] = {GPU_PRODUCT_LABEL: spec.resources.gpu_product}
    launcher_pod = {
        "containers": [
            {
                "name": "launcher",
                "image": image,
                "command": command,
                "env": [dict(e) for e in env],
                "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}},
            }
        ]
    }
    return manifest(
        name, namespace, labels, slots, workers, launcher_pod, worker_pod,
        deadline_s=int(spec.limits.max_duration), ttl_s=ttl_s,
    )  # fmt: skip


def _worker_resources(spec: JobSpec, slots: int) -> dict[str, Any]:
    requests: dict[str, Any] = {"cpu": str(spec.resources.cpu or slots)}
    if spec.resources.memory:
        requests["memory"] = str(spec.resources.memory)
    limits: dict[str, Any] = {}
    if spec.resources.gpus:
        limits[GPU] = spec.resources.gpus  # extended resources: requests default to limits
    if spec.resources.memory:
        limits["memory"] = str(spec.resources.memory)
    return {"requests": requests, "limits": limits} if limits else {"requests": requests}


def _label_values(labels: dict[str, str]) -> dict[str, str]:
    """Return labels whose values are valid label values (63 chars, alphanumeric ends)."""
    return {k: re.sub(r"[^-A-Za-z0-9_.]", "-", v)[:63].strip("-_.") for k, v in labels.items()}


def _job(spec: JobSpec) -> HpcJob:
    if not isinstance(spec.job, HpcJob):
        raise MpiJobError(f"job.kind: an MPIJob runs hpc jobs, not {spec.job.kind}")
    if spec.job.hosts:
        raise MpiJobError(
            "job.hosts: on Kubernetes the worker pods are the hosts; remove job.hosts"
        )
    if spec.job.inputs or spec.job.build or spec.job.output:
        raise MpiJobError(
            "job.inputs, job.build and job.output run in the workspace on this host; bake them"
            " into the image or run the job through gpuflow's local backend"
        )
    return spec.job
