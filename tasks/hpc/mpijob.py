"""The Kubernetes shape of an HPC job: a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1)
built from the same JobSpec, for clusters that run the operator. Pure: dicts in, dicts out.

One Launcher pod runs mpirun (no GPU); Worker pods, one per node, each hold
`resources.gpus` GPUs and `slotsPerWorker` ranks. The operator writes the hostfile from the
workers and points Open MPI at it, so mpirun needs no -H here. Every rank starts through
tasks.hpc.rank, as on this host, and takes its block of the pod's GPUs by local rank.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tasks.compute.base import owner_labels
from tasks.hpc import mpi
from tasks.spec import HpcJob, JobSpec

API_VERSION = "kubeflow.org/v2beta1"
GPU = "nvidia.com/gpu"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
TOLERATION_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
CLEAN_POD_POLICIES = {"None", "Running", "All"}
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The operator names pods <job>-launcher and <job>-worker-<i>; both must stay DNS labels.
MAX_NAME = 63 - len("-worker-") - 4


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
    from tasks.hpc.launch import program_argv

    ranks_argv = [
        "python",
        "-m",
        "tasks.hpc.rank",
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
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
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


def manifest(
    name: str,
    namespace: str,
    labels: dict[str, str],
    slots: int,
    workers: int,
    launcher_pod: dict[str, Any],
    worker_pod: dict[str, Any],
    deadline_s: int,
    ttl_s: int,
) -> dict[str, Any]:
    """Return an MPIJob of one Launcher and `workers` Workers of `slots` ranks each, as
    gpuflow makes them (printed by `gpuflow hpc --mpijob`, submitted by the Kubernetes
    backend): never restarted by the operator, since gpuflow's run stage decides retries."""
    return {
        "apiVersion": API_VERSION,
        "kind": "MPIJob",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "slotsPerWorker": slots,
            "mpiImplementation": "OpenMPI",
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "ttlSecondsAfterFinished": ttl_s,
                # the pods' own deadline: a hung or unschedulable job does not hold GPUs forever
                "activeDeadlineSeconds": max(1, deadline_s),
                "backoffLimit": 0,  # gpuflow's run stage decides about retries
            },
            "mpiReplicaSpecs": {
                "Launcher": _replica(1, launcher_pod, labels),
                "Worker": _replica(workers, worker_pod, labels),
            },
        },
    }


def _replica(replicas: int, pod: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
    return {
        "replicas": replicas,
        "restartPolicy": "Never",
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
    }


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


def problems(manifest: dict[str, Any]) -> list[str]:
    """Return what is wrong with an MPIJob manifest beyond its schema: the operator's
    semantics (replica names, slots x workers = ranks, integer GPU limits on workers
    only, restart policies, tolerations, DNS names)."""
    found: list[str] = []
    if manifest.get("apiVersion") != API_VERSION or manifest.get("kind") != "MPIJob":
        found.append(f"apiVersion/kind must be {API_VERSION} MPIJob")
    name = manifest.get("metadata", {}).get("name", "")
    if not _DNS_1123.match(name) or len(name) > MAX_NAME:
        found.append(f"metadata.name {name!r} is not a DNS-1123 label of at most {MAX_NAME}")
    spec = manifest.get("spec", {})
    replicas = spec.get("mpiReplicaSpecs", {})
    if set(replicas) != {"Launcher", "Worker"}:
        found.append(f"mpiReplicaSpecs must be Launcher and Worker, not {sorted(replicas)}")
        return found
    if replicas["Launcher"].get("replicas") != 1:
        found.append("mpiReplicaSpecs.Launcher.replicas must be 1")
    workers, slots = replicas["Worker"].get("replicas", 0), spec.get("slotsPerWorker", 0)
    if not isinstance(workers, int) or workers < 1 or not isinstance(slots, int) or slots < 1:
        found.append("Worker replicas and slotsPerWorker must be positive integers")
    command = replicas["Launcher"]["template"]["spec"]["containers"][0].get("command", [])
    if "-np" in command and workers * slots != int(command[command.index("-np") + 1]):
        found.append(f"mpirun -np must equal workers x slotsPerWorker ({workers} x {slots})")
    for role, replica in replicas.items():
        if replica.get("restartPolicy") not in ("Never", "OnFailure", "Always", "ExitCode"):
            found.append(f"{role}.restartPolicy {replica.get('restartPolicy')!r} is not valid")
        pod = replica["template"]["spec"]
        for container in pod.get("containers", []):
            gpus = container.get("resources", {}).get("limits", {}).get(GPU)
            if gpus is not None and (not isinstance(gpus, int) or gpus < 1):
                found.append(f"{role}: {GPU} limit {gpus!r} must be a positive integer")
            if gpus is not None and role == "Launcher":
                found.append("Launcher must not hold GPUs: it only runs mpirun")
        for toleration in pod.get("tolerations", []):
            if toleration.get("effect") not in TOLERATION_EFFECTS:
                found.append(f"{role}: toleration effect {toleration.get('effect')!r} is not valid")
    policy = spec.get("runPolicy", {})
    if policy.get("cleanPodPolicy") not in CLEAN_POD_POLICIES:
        found.append(f"runPolicy.cleanPodPolicy must be one of {sorted(CLEAN_POD_POLICIES)}")
    deadline = policy.get("activeDeadlineSeconds")
    if not isinstance(deadline, int) or deadline < 1:
        found.append("runPolicy.activeDeadlineSeconds must be a positive integer")
    return found


def pods(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Return each replica's pod as a plain v1 Pod, for schema validation of the templates."""
    name = manifest["metadata"]["name"]
    return [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-{role.lower()}", **replica["template"]["metadata"]},
            "spec": {**replica["template"]["spec"], "restartPolicy": replica["restartPolicy"]},
        }
        for role, replica in manifest["spec"]["mpiReplicaSpecs"].items()
    ]
