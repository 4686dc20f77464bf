"""The Kubernetes objects a run makes, as plain dicts: a headless Service that gives each
node a stable DNS name (the training rendezvous), a Secret with the job's variables (so no
secret appears in a manifest), and one Job per work unit. Pure: no API calls.
"""

from __future__ import annotations

import base64
import json
import math
import re
import sys
from typing import Any

from pydantic import BaseModel

from gpuflow.tasks.backends.kubernetes.mpijob import manifest
from gpuflow.tasks.contract import Cluster, WorkUnit, unit_env
from gpuflow.tasks.gpus import GPU_PRODUCT_LABEL as PRODUCT_LABEL
from gpuflow.tasks.gpus import GPU_RESOURCE as GPU

CLUSTER_LABEL = "gpuflow.io/cluster"
UNIT_LABEL = "gpuflow.io/unit"
NODE_LABEL = "gpuflow.io/node"  # the cluster node a multi-node pod stands for
HOST_TOPOLOGY = "kubernetes.io/hostname"
CLUSTER_ANNOTATION = "gpuflow.io/cluster-json"

RENDEZVOUS_PORT = 29400
WORKSPACE = "/workspace"
# The wrapper's log records start with one of these marks and the run's nonce
# (`@@gpuflow-sample-<nonce> {...}`): the nonce comes in the pod's Secret as NONCE_VARIABLE,
# which the wrapper takes out of the environment before the unit starts, so the job cannot
# print a record of gpuflow's by chance or by copying another run's log.
OUTPUT_MARK = "@@gpuflow-output"  # a log line carrying one of the unit's output files
OUTPUT_LEFT_MARK = "@@gpuflow-output-left"  # one too large to come back through the log
OUTPUT_MAX_KIB = 1024
SAMPLE_MARK = "@@gpuflow-sample"  # a log line carrying one metric sample of the pod's node
NONCE_VARIABLE = "GPUFLOW_LOG_NONCE"
# Every unit runs under this POSIX sh (any image has one): it makes $GPUFLOW_OUTPUT_DIR (an
# image's own folders are not the pod's workspace), samples the node's GPUs beside the unit
# where the image has gpuflow (one log line per sample), passes SIGTERM/SIGINT on to
# the unit, and when the unit ends prints each file of $GPUFLOW_OUTPUT_DIR (error.txt,
# result.json, ... up to OUTPUT_MAX_KIB each) as one base64 line the orchestrator takes out
# of the log and writes to the run's outputs, as the job contract says. Then it exits with
# the unit's code.
UNIT_WRAPPER = f"""\
mkdir -p "$GPUFLOW_OUTPUT_DIR" 2>/dev/null  # the job contract: the folder is there
nonce=${{{NONCE_VARIABLE}:-}}; unset {NONCE_VARIABLE}  # the unit never sees it
child= stopping= sampler=
trap 'stopping=1; [ -n "$child" ] && kill -TERM "$child" 2>/dev/null' TERM INT
"$@" &
child=$!
[ -n "$stopping" ] && kill -TERM "$child" 2>/dev/null
if [ -n "$GPUFLOW_SAMPLE_INTERVAL" ]; then  # this node's GPUs, sampled where they are,
  # until the unit is gone (a SIGTERM alone could land before the sampler is ready)
  GPUFLOW_SAMPLE_MARK="{SAMPLE_MARK}-$nonce " \
  "$GPUFLOW_PYTHON" -m gpuflow.tasks.metrics.sampler --out - \
    --gpus "$GPUFLOW_SAMPLE_GPUS" --interval "$GPUFLOW_SAMPLE_INTERVAL" \
    --host "$GPUFLOW_NODE_NAME" --until-pid "$child" 2>/dev/null </dev/null &
  sampler=$!
fi
wait "$child"; code=$?
while kill -0 "$child" 2>/dev/null; do wait "$child"; code=$?; done
if [ -n "$sampler" ]; then kill -TERM "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null; fi
if [ -d "$GPUFLOW_OUTPUT_DIR" ] && cd "$GPUFLOW_OUTPUT_DIR"; then
  find . -type f | head -n 200 | while IFS= read -r f; do
    [ -f "$f" ] || continue  # a name with a newline in it: not sent
    if [ "$(wc -c < "$f")" -le {OUTPUT_MAX_KIB * 1024} ]; then
      printf '{OUTPUT_MARK}-%s %s ' "$nonce" "${{f#./}}"; base64 < "$f" | tr -d '\\n'; echo
    else
      printf '{OUTPUT_LEFT_MARK}-%s %s %s\\n' "$nonce" "$(wc -c < "$f")" "${{f#./}}"
    fi
  done
fi
exit "$code"
"""


class KubeSettings(BaseModel):
    """How a run's pods are made: where, from which image, on which GPUs, under which
    queue; from the KubernetesGpuPool block or the spec, with visible defaults."""

    namespace: str = "default"
    image: str = "ghcr.io/gpuflow/gpuflow-job:0.1"
    python: str = "python"  # the image's interpreter, for units that run gpuflow's modules
    gpu_product: str | None = None
    tolerations: list[dict[str, Any]] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    queue_name: str | None = None
    priority_class_name: str | None = None
    ttl_after_finished_s: int = 600
    shm_bytes: int | None = None
    cpu: float | None = None
    memory_bytes: int | None = None
    # what a real kubelet holds the pods to: gpuflow makes the pods, so gpuflow sets these
    stop_grace_s: float = 30.0  # limits.stop_grace_s: SIGTERM -> SIGKILL on any stop
    sample_interval_s: float | None = 1.0  # metrics.interval_s; None: the pods sample nothing
    service_account: str | None = None  # none: no API token is mounted in the pod
    allow_privilege_escalation: bool = False  # False: no setuid gains, every capability dropped
    pull_secret: str | None = None  # the run's registry login (image.credentials), by name


def dns_name(text: str, limit: int = 63) -> str:
    """Return `text` as a DNS label: lowercase letters, digits and dashes."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:limit].rstrip("-")


def labels(cluster: Cluster) -> dict[str, str]:
    """Return the labels on every object of `cluster`: its owner labels (label-safe) and
    its own name."""
    safe = {k: dns_name(v) for k, v in cluster.owner.items()}
    return {**safe, CLUSTER_LABEL: cluster.name}


def node_host(cluster: Cluster, node: int) -> str:
    """Return node `node`'s host name (the pod's hostname under the headless Service)."""
    return node_host_for(cluster.name, node)


def node_host_for(cluster_name: str, node: int) -> str:
    return f"{cluster_name}-{node}"


def service(cluster: Cluster, namespace: str) -> dict[str, Any]:
    """Return the headless Service that names each node `<cluster>-<i>.<cluster>` and
    carries the cluster's record (teardown and the reaper read it back)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": cluster.name,
            "namespace": namespace,
            "labels": labels(cluster),
            "annotations": {CLUSTER_ANNOTATION: cluster.model_dump_json(exclude={"adopted"})},
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {CLUSTER_LABEL: cluster.name},
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT}],
        },
    }


def secret(cluster: Cluster, namespace: str, env: dict[str, str]) -> dict[str, Any]:
    """Return the Secret holding the job's variables (credentials and secrets included)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": f"{cluster.name}-env",
            "namespace": namespace,
            "labels": labels(cluster),
        },
        "type": "Opaque",
        "stringData": dict(env),
    }


def pull_secret(
    cluster: Cluster, namespace: str, registry: str, username: str, password: str
) -> dict[str, Any]:
    """Return the Secret the run's pods pull their image with (image.credentials): a
    dockerconfigjson for `registry`, removed with the run."""
    token = base64.b64encode(f"{username}:{password}".encode()).decode()
    config = json.dumps({"auths": {registry: {"auth": token}}})
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": f"{cluster.name}-pull",
            "namespace": namespace,
            "labels": labels(cluster),
        },
        "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": base64.b64encode(config.encode()).decode()},
    }


def unit_job(
    cluster: Cluster, unit: WorkUnit, settings: KubeSettings, deadline_s: int
) -> dict[str, Any]:
    """Return the Job that runs `unit` on node `unit.node` of `cluster`: one pod, never
    restarted (gpuflow's stages retry), with its GPUs, product, tolerations, /dev/shm, a
    deadline on the object itself and a TTL after it finishes."""
    # gpuflow's own modules (and a launcher after gpuflow's starter): the image's python
    command = [settings.python if word == sys.executable else word for word in unit.command]
    gpus = cluster.gpus_per_node if unit.gpus is None else len(unit.gpus)
    limits: dict[str, Any] = {GPU: str(gpus)} if gpus else {}
    requests: dict[str, Any] = {}
    if settings.cpu:
        requests["cpu"] = str(settings.cpu)
    if settings.memory_bytes:
        requests["memory"] = str(settings.memory_bytes)
        limits["memory"] = str(settings.memory_bytes)
    env = [
        *(
            {"name": k, "value": v}
            for k, v in unit_env(unit.node, cluster.nodes, WORKSPACE, None).items()
        ),
        *({"name": k, "value": v} for k, v in sorted(unit.env.items())),
        # the node the pod landed on, named in its samples
        {"name": "GPUFLOW_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
    ]
    if settings.sample_interval_s:
        env += [
            {"name": "GPUFLOW_PYTHON", "value": settings.python},
            {"name": "GPUFLOW_SAMPLE_INTERVAL", "value": f"{settings.sample_interval_s:g}"},
            # the container sees its own GPUs only, numbered from 0
            {"name": "GPUFLOW_SAMPLE_GPUS", "value": ",".join(str(i) for i in range(gpus))},
        ]
    volumes = [{"name": "workspace", "emptyDir": {}}]
    mounts = [{"name": "workspace", "mountPath": WORKSPACE}]
    shm: dict[str, Any] = {"medium": "Memory"}
    if settings.shm_bytes:
        shm["sizeLimit"] = str(settings.shm_bytes)
    volumes.append({"name": "dshm", "emptyDir": shm})
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    pod_labels = {**labels(cluster), UNIT_LABEL: dns_name(unit.name)}
    if settings.queue_name:
        pod_labels["kueue.x-k8s.io/queue-name"] = settings.queue_name
    container_security: dict[str, Any] = {}
    if not settings.allow_privilege_escalation:
        container_security = {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        }
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        # an eviction, a preemption or a deleted Job gives the unit the run's own window
        # between SIGTERM and SIGKILL (Kubernetes' default is 30 s whatever the job needs)
        "terminationGracePeriodSeconds": grace_seconds(settings.stop_grace_s),
        # the job's code gets no token for the namespace's default account
        "automountServiceAccountToken": settings.service_account is not None,
        "hostname": node_host(cluster, unit.node),
        "subdomain": cluster.name,
        "containers": [
            {
                "name": "unit",
                "image": settings.image,
                "command": ["/bin/sh", "-c", UNIT_WRAPPER, "gpuflow-unit"],
                "args": command,
                "workingDir": WORKSPACE,
                "env": env,
                "envFrom": [{"secretRef": {"name": f"{cluster.name}-env"}}],
                "resources": {"limits": limits, "requests": requests},
                "volumeMounts": mounts,
                **({"securityContext": container_security} if container_security else {}),
            }
        ],
        "volumes": volumes,
        "tolerations": settings.tolerations if gpus else [],
    }
    if settings.pull_secret:
        pod["imagePullSecrets"] = [{"name": settings.pull_secret}]
    if gpus and settings.gpu_product:
        pod["nodeSelector"] = {PRODUCT_LABEL: settings.gpu_product}
    if gpus and cluster.nodes > 1:  # `resources.nodes` machines, not fewer
        pod_labels[NODE_LABEL], pod["affinity"] = str(unit.node), node_apart(cluster, unit.node)
    if settings.priority_class_name:
        pod["priorityClassName"] = settings.priority_class_name
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": unit_job_name(cluster, unit),
            "namespace": settings.namespace,
            "labels": pod_labels,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": max(1, deadline_s),
            "ttlSecondsAfterFinished": settings.ttl_after_finished_s,
            "template": {"metadata": {"labels": pod_labels}, "spec": pod},
        },
    }


def node_apart(cluster: Cluster, node: int) -> dict[str, Any]:
    """Return the affinity of the GPU pod standing for node `node` of `cluster`."""
    others = {"key": NODE_LABEL, "operator": "NotIn", "values": [str(node)]}
    return apart(cluster, {"key": NODE_LABEL, "operator": "Exists"}, others)


def apart(cluster: Cluster, *others: dict[str, Any]) -> dict[str, Any]:
    """Return the affinity that keeps a pod off any machine holding a pod of `cluster` that
    stands for another of its nodes (`others` select those): a run asking for two nodes of
    8 GPUs gets two machines, even where one machine has 16 free."""
    selector = {"matchLabels": {CLUSTER_LABEL: cluster.name}, "matchExpressions": list(others)}
    term = {"labelSelector": selector, "topologyKey": HOST_TOPOLOGY}
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def grace_seconds(stop_grace_s: float) -> int:
    """Return `limits.stop_grace_s` as a pod's terminationGracePeriodSeconds: whole seconds,
    rounded up, at least 1 (0 would mean SIGKILL at once)."""
    return max(1, math.ceil(stop_grace_s))


def unit_job_name(cluster: Cluster, unit: WorkUnit) -> str:
    return dns_name(f"{cluster.name}-{unit.name}")


MPI_HOSTFILE_ENV = "GPUFLOW_MPI_HOSTFILE"
MPI_HOSTFILE = "/etc/mpi/hostfile"  # where the MPI Operator mounts the workers' hostfile
MPI_ROLE_LABEL = "training.kubeflow.org/job-role"  # the operator's label: launcher | worker


def mpi_job_name(cluster: Cluster) -> str:
    """Return the MPIJob's name: its pods are <name>-launcher-* and <name>-worker-<i>."""
    return dns_name(f"{cluster.name}-mpi", limit=63 - len("-launcher-xxxxx"))


def mpi_job(
    cluster: Cluster, unit: WorkUnit, settings: KubeSettings, deadline_s: int, slots: int
) -> dict[str, Any]:
    """Return the Kubeflow MPIJob that runs the MPI launcher `unit` over the cluster's
    nodes: one Worker pod per node (its GPUs, product, tolerations, /dev/shm, running the
    operator's sshd), `slots` ranks each, and a Launcher pod without GPUs running `unit`,
    which reads the workers' host names from the operator's hostfile
    ($GPUFLOW_MPI_HOSTFILE). Both run as root: the operator's SSH keys are root's."""

    def pod(of: WorkUnit) -> dict[str, Any]:
        spec = unit_job(cluster, of, settings, deadline_s)["spec"]["template"]["spec"]
        del spec["hostname"], spec["subdomain"]  # the operator names its pods
        spec["securityContext"] = {"runAsUser": 0}
        for container in spec["containers"]:
            # the operator's sshd changes user and needs its capabilities
            container.pop("securityContext", None)
            limits = container["resources"]["limits"]
            if GPU in limits:
                limits[GPU] = int(limits[GPU])
        return spec

    launcher = pod(unit.model_copy(update={"gpus": [], "node": 0}))
    launcher["containers"][0]["env"].append({"name": MPI_HOSTFILE_ENV, "value": MPI_HOSTFILE})
    launcher.pop("tolerations", None)
    launcher.pop("nodeSelector", None)
    worker = pod(WorkUnit(name="worker", command=[]))
    worker["containers"][0].update(command=["/usr/sbin/sshd", "-De"], args=[])
    worker.pop("affinity", None)  # each worker is a node of its own: one per machine
    if cluster.nodes > 1:
        workers = {"key": MPI_ROLE_LABEL, "operator": "In", "values": ["worker"]}
        worker["affinity"] = apart(cluster, workers)
    owner = {**labels(cluster), UNIT_LABEL: dns_name(unit.name)}
    made = manifest(
        mpi_job_name(cluster), settings.namespace, owner, slots, cluster.nodes,
        launcher, worker, deadline_s=deadline_s, ttl_s=settings.ttl_after_finished_s,
    )  # fmt: skip
    if settings.queue_name:  # Kueue admits the MPIJob as a whole
        made["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = settings.queue_name
    return made
