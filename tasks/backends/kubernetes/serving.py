"""A service on Kubernetes: a Deployment of its replicas, a Service in front of them (the
cluster's own proxying), and a HorizontalPodAutoscaler (autoscaling/v2) on the pods'
DCGM_FI_DEV_GPU_UTIL through the custom metrics API, so the scaling goes on without
gpuflow: the HPA is the cluster's. gpuflow follows what they report and deletes them when
the run ends (teardown and the reaper find them by the run's labels; each carries the
run's deadline as an annotation the reaper honours)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from gpuflow.tasks.backends.kubernetes import manifests as objects
from gpuflow.tasks.backends.kubernetes.kubeapi import KubeApi, KubeError
from gpuflow.tasks.contract import Cluster, JobResult, Replicated, StopCheck
from gpuflow.tasks.errors import ProvisionError

GPU_METRIC = "DCGM_FI_DEV_GPU_UTIL"  # dcgm-exporter's name: a real cluster's series work as is
DEADLINE_ANNOTATION = "gpuflow.io/deadline"
APPS = "/apis/apps/v1/namespaces/{ns}/deployments"
HPAS = "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers"
SERVICES = "/api/v1/namespaces/{ns}/services"
POLL_S = 1.0


def name_of(cluster: Cluster) -> str:
    """Return the Deployment's, the Service's and the HPA's name for `cluster`'s service."""
    return objects.dns_name(f"{cluster.name}-serve")


def _meta(cluster: Cluster, ns: str, deadline: datetime) -> dict[str, Any]:
    return {
        "name": name_of(cluster),
        "namespace": ns,
        "labels": objects.labels(cluster),
        "annotations": {DEADLINE_ANNOTATION: deadline.isoformat(timespec="seconds")},
    }


def _probe(path: str | None, port: int, app: Replicated, first_s: float) -> dict[str, Any]:
    check: dict[str, Any] = (
        {"httpGet": {"path": path, "port": port}} if path else {"tcpSocket": {"port": port}}
    )
    return {
        **check,
        "periodSeconds": max(1, round(app.period_s)),
        "failureThreshold": app.failures,
        "initialDelaySeconds": int(first_s),
    }


def deployment(
    cluster: Cluster, app: Replicated, settings: objects.KubeSettings, deadline: datetime
) -> dict[str, Any]:
    """Return the Deployment of `app`'s replicas: each with its GPUs, its readiness and
    liveness checks, the run's variables from its Secret, and `PORT`."""
    selector = {objects.CLUSTER_LABEL: cluster.name, "gpuflow.io/service": name_of(cluster)}
    limits: dict[str, Any] = {objects.GPU: str(app.gpus)} if app.gpus else {}
    # gpuflow's own modules: the image's python
    command = [settings.python if word == sys.executable else word for word in app.command]
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(app.env.items())]
    env.append(
        {"name": "GPUFLOW_REPLICA", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    )
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": objects.grace_seconds(settings.stop_grace_s),
        "automountServiceAccountToken": settings.service_account is not None,
        "containers": [
            {
                "name": "replica",
                "image": settings.image,
                "command": command,
                "env": env,
                "envFrom": [{"secretRef": {"name": f"{cluster.name}-env"}}],
                "ports": [{"containerPort": app.port, "name": "serve"}],
                "resources": {"limits": limits},
                "readinessProbe": _probe(app.ready_path, app.port, app, 0),
                # liveness waits for the start bound: a slow start is not a failure
                "livenessProbe": _probe(app.live_path, app.port, app, app.start_timeout_s),
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
        "tolerations": settings.tolerations if app.gpus else [],
    }
    if app.gpus and settings.gpu_product:
        pod["nodeSelector"] = {objects.PRODUCT_LABEL: settings.gpu_product}
    if settings.pull_secret:  # the run's registry login (image.credentials)
        pod["imagePullSecrets"] = [{"name": settings.pull_secret}]
    if settings.service_account:
        pod["serviceAccountName"] = settings.service_account
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cluster, settings.namespace, deadline),
        "spec": {
            "replicas": max(1, app.least),
            "selector": {"matchLabels": selector},
            # one replica at a time, never fewer ready than wanted: a new version rolls
            "strategy": {"rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {
                "metadata": {"labels": {**objects.labels(cluster), **selector}},
                "spec": pod,
            },
        },
    }


def service(cluster: Cluster, app: Replicated, ns: str, deadline: datetime) -> dict[str, Any]:
    """Return the Service in front of the ready replicas (the service's one address)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cluster, ns, deadline),
        "spec": {
            "selector": {"gpuflow.io/service": name_of(cluster)},
            "ports": [{"name": "serve", "port": app.port, "targetPort": app.port}],
        },
    }


def autoscaler(cluster: Cluster, app: Replicated, ns: str, deadline: datetime) -> dict[str, Any]:
    """Return the HPA that scales the Deployment on its pods' GPU utilisation."""
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(cluster, ns, deadline),
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": name_of(cluster),
            },
            "minReplicas": max(1, app.least),
            "maxReplicas": app.most,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": GPU_METRIC},
                        "target": {"type": "AverageValue", "averageValue": f"{app.gpu_util:g}"},
                    },
                }
            ],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": 0},
                "scaleDown": {"stabilizationWindowSeconds": int(app.down_after_s)},
            },
        },
    }


def serve(
    api: KubeApi,
    cluster: Cluster,
    app: Replicated,
    settings: objects.KubeSettings,
    put_secret: Callable[[dict[str, str]], None],
    env: Mapping[str, str],
    timeout_s: float,
    on_change: Callable[[dict[str, Any]], None],
    should_stop: StopCheck | None,
) -> JobResult:
    """Make the service's objects (adopting an earlier try's), report each change of the
    replica counts and the HPA's reading until `timeout_s` or `should_stop()`, then delete
    them; return how it ended."""
    ns = api.namespace
    began = datetime.now(UTC)
    deadline = began + timedelta(seconds=timeout_s)
    put_secret(dict(env))
    made = [
        (APPS.format(ns=ns), deployment(cluster, app, settings, deadline)),
        (SERVICES.format(ns=ns), service(cluster, app, ns, deadline)),
    ]
    if app.gpu_util is not None and app.most > max(1, app.least):
        made.append((HPAS.format(ns=ns), autoscaler(cluster, app, ns, deadline)))
    for path, manifest in made:
        try:
            api.request("POST", path, manifest)
        except KubeError as exc:
            if exc.status != 409:  # 409: an earlier try's, adopted
                remove(api, cluster)
                raise ProvisionError(
                    f"could not create {manifest['kind']} {name_of(cluster)}: {exc}"
                ) from None
    on_change({"address": f"{name_of(cluster)}.{ns}.svc:{app.port}", "hpa": len(made) == 3})
    stop = time.monotonic() + timeout_s
    seen: dict[str, Any] = {}
    cancelled = False
    try:
        while time.monotonic() < stop:
            if should_stop is not None and should_stop():
                cancelled = True
                break
            now = _status(api, cluster)
            if now and now != seen:
                on_change(now)
                seen = now
            time.sleep(POLL_S)
    finally:
        remove(api, cluster)
    ended = datetime.now(UTC)
    return JobResult(
        exit_code=0,
        started_at=began,
        ended_at=ended,
        duration_s=(ended - began).total_seconds(),
        cancelled=cancelled,
        timed_out=not cancelled,
    )


def _status(api: KubeApi, cluster: Cluster) -> dict[str, Any]:
    ns, name = api.namespace, name_of(cluster)
    try:
        found = api.request("GET", f"{APPS.format(ns=ns)}/{name}")
    except KubeError:
        return {}
    status = found.get("status", {})
    now: dict[str, Any] = {
        "wanted": found.get("spec", {}).get("replicas", 0),
        "ready": status.get("readyReplicas", 0),
    }
    try:
        hpa = api.request("GET", f"{HPAS.format(ns=ns)}/{name}")
    except KubeError:
        return now
    for metric in hpa.get("status", {}).get("currentMetrics") or []:
        value = metric.get("pods", {}).get("current", {}).get("averageValue")
        if value is not None:
            now["gpu_util"] = _quantity(value)
    return now


def deadlines(api: KubeApi) -> dict[str, datetime]:
    """Return each cluster's service deadline (its Deployment's annotation), by cluster;
    none where this account may not list Deployments (a Role from before services)."""
    try:
        found = api.request(
            "GET", APPS.format(ns=api.namespace), params={"labelSelector": objects.CLUSTER_LABEL}
        )
    except KubeError as exc:
        if exc.status in (403, 404):
            return {}
        raise
    return {
        item["metadata"]["labels"][objects.CLUSTER_LABEL]: datetime.fromisoformat(stamp)
        for item in found.get("items", [])
        if (stamp := item["metadata"].get("annotations", {}).get(DEADLINE_ANNOTATION))
    }


def _quantity(text: str) -> float:
    """Return a Kubernetes quantity (`95`, `95500m`) as a number."""
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def remove(api: KubeApi, cluster: Cluster) -> None:
    """Delete the service's HPA, Deployment (its pods with it) and Service; idempotent."""
    ns, name = api.namespace, name_of(cluster)
    body = {"propagationPolicy": "Background", "gracePeriodSeconds": 0}
    for path in (HPAS, APPS, SERVICES):
        try:
            api.request("DELETE", f"{path.format(ns=ns)}/{name}", body)
        except KubeError as exc:
            if exc.status != 404:
                raise
