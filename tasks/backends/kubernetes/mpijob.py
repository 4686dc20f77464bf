"""The one MPIJob builder: a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1) of one
Launcher and N Workers, as gpuflow makes them, and the checks of the operator's semantics
that its schema does not say. Pure: dicts in, dicts out."""

from __future__ import annotations

import re
from typing import Any

from gpuflow.tasks.gpus import GPU_RESOURCE as GPU

API_VERSION = "kubeflow.org/v2beta1"

TOLERATION_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
CLEAN_POD_POLICIES = {"None", "Running", "All"}
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# The operator names pods <job>-launcher and <job>-worker-<i>; both must stay DNS labels.
MAX_NAME = 63 - len("-worker-") - 4


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
