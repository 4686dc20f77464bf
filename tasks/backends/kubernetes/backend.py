"""The Kubernetes backend: a run's cluster is a headless Service (one DNS name per node, the
training rendezvous) plus a Secret with the job's variables; each work unit is a Job of one
pod on its node's share of GPUs. Every object carries the run's owner labels, a deadline and
a TTL of its own, so nothing outlives a dead orchestrator for long.

Pending is never silent: a pod the scheduler cannot place is explained in one sentence from
the scheduler's reason and the nodes' GPUs, waited for up to placement.gpu_wait when GPUs
are only busy, and refused at once when no node could ever take it.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from gpuflow.tasks import containers, extras
from gpuflow.tasks.backends import imaging
from gpuflow.tasks.backends.base import LogTail, UnitBackend, join_samples
from gpuflow.tasks.backends.kubernetes import manifests as objects
from gpuflow.tasks.backends.kubernetes import reap as reaping
from gpuflow.tasks.backends.kubernetes import serving
from gpuflow.tasks.backends.kubernetes.kubeapi import (
    KubeApi,
    KubeError,
    KubeUnreachable,
    load_config,
)
from gpuflow.tasks.backends.kubernetes.logs import LogFollower, log_nonce
from gpuflow.tasks.backends.kubernetes.pending import explain_pending, free_now, used_gpus
from gpuflow.tasks.backends.kubernetes.state import KubeState
from gpuflow.tasks.contract import (
    RUN_LABEL,
    Capabilities,
    Cluster,
    JobResult,
    Needs,
    Offer,
    ReapReport,
    Replicated,
    RunStates,
    StopCheck,
    StopReason,
    TeardownReport,
    UnitEnd,
    WorkUnit,
    state_of,
)
from gpuflow.tasks.errors import PREEMPTED_EXIT_CODE, CapacityError, InvalidSpec, ProvisionError
from gpuflow.tasks.host import env_number, gpuflow_home, this_process
from gpuflow.tasks.images import image_problem
from gpuflow.tasks.metrics.cost import PriceTable, hourly_rate
from gpuflow.tasks.metrics.sampler import NODE_SAMPLES, SAMPLES
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import JobSpec, Placement, placement_as

POLL_S = 1.0
MPIJOB_API = "kubeflow.org/v2beta1"  # the Kubeflow MPI Operator's
MPI_JOB_LABEL = "training.kubeflow.org/job-name"
MPI_ROLE_LABEL = "training.kubeflow.org/job-role"
LOG_DRAIN_S = 5.0  # how long an ended pod's last log lines may take to arrive
UNCLEAR_WAIT_S = 30.0  # pending for a reason gpuflow cannot weigh: wait at least this


class KubernetesPlacement(Placement):
    """placement: on a Kubernetes cluster: the namespace and the image of the job's pods."""

    backend: Literal["kubernetes"] = "kubernetes"
    namespace: str | None = Field(
        None, description="Kubernetes namespace (default: the block's, else the kubeconfig's)."
    )
    image: str | None = Field(
        None, description="Deprecated: the image the job's pods run; write image: instead."
    )

    @field_validator("image")
    @classmethod
    def _reference(cls, value: str | None) -> str | None:
        if value is not None and (why := image_problem(value)) is not None:
            raise ValueError(why)
        return value

    def where(self) -> str | None:
        return self.block or self.namespace


class KubernetesBackend(UnitBackend):
    """provision -> a Service; run(unit) -> a Job; teardown -> every object of the run."""

    name = "kubernetes"
    # the scheduler matches nodes; the job's GPUs are not this machine's. file:// URLs are
    # not refused: they reach pods whose nodes share those paths with this host
    capabilities = Capabilities(
        runs_here=False,
        runs_images=True,  # its pods run the spec's image (image:), else the block's
        where="the cluster's nodes",
        local_files=True,
        # each unit's pod samples its node's GPUs into its log; the samples are written
        # into the run's workspace here as they come
        samples_nodes=True,
        node_samples_in_workspace=True,
        serves_replicas=True,  # a service: a Deployment, a Service and an HPA
    )
    placement_model: ClassVar[type[Placement]] = KubernetesPlacement

    @classmethod
    def block_types(cls) -> list[type]:
        """Its pool's block holds prefect-kubernetes' cluster config: none without the extra."""
        from importlib.util import find_spec

        if find_spec("prefect_kubernetes") is None:
            return []
        from gpuflow.blocks.kubernetes_pool import KubernetesGpuPool

        return [KubernetesGpuPool]

    @classmethod
    def at(cls, placement: Placement | None = None) -> KubernetesBackend:
        """Return the backend for the placement's block and namespace (else the defaults)."""
        if placement is None:
            return cls()
        own = placement if isinstance(placement, KubernetesPlacement) else None
        return cls(placement.block, own.namespace if own is not None else None)

    @classmethod
    def reaper(cls, block: str | None, namespace: str | None) -> KubernetesBackend:
        return cls(block, namespace)

    @classmethod
    def of(cls, cluster: Cluster) -> KubernetesBackend:
        """Return the backend `cluster` was made with: its block and namespace."""
        state = state_of(cluster, KubeState)
        return cls(state.block, state.namespace)

    def __init__(self, block: str | None = None, namespace: str | None = None) -> None:
        self.block, self.namespace_wanted = block, namespace
        self._api: KubeApi | None = None  # connected on first use
        self._lock = threading.RLock()  # units of one job run in threads of their own

    # -- where and how -----------------------------------------------------------------
    @functools.cached_property
    def pool(self) -> Any:
        """Return the KubernetesGpuPool block named (read once), None without one."""
        if not self.block:
            return None
        # blocks import prefect-aws and prefect-kubernetes (about 1 s): read one only when used
        extras.require("kubernetes", "placement.block", "a KubernetesGpuPool block")
        from gpuflow.blocks.kubernetes_pool import KubernetesGpuPool

        return load_block(
            KubernetesGpuPool, self.block, "placement.block", otherwise="remove placement.block"
        )

    def api(self) -> KubeApi:
        """Return the API client: the block's cluster config, else kubectl's resolution."""
        with self._lock:
            return self._api or self._connect()

    def _connect(self) -> KubeApi:
        if self._api is None:
            pool = self.pool
            kubeconfig = None
            if pool is not None and pool.cluster_config is not None:
                kubeconfig = pool.cluster_config.config
            config = load_config(kubeconfig)
            self._api = KubeApi(config)
            self._api.namespace = (
                self.namespace_wanted or (pool.namespace if pool else None) or config.namespace
            )
        return self._api

    def settings(self, spec: JobSpec | None = None) -> objects.KubeSettings:
        """Return how pods are made: spec over block over defaults."""
        pool = self.pool
        values: dict[str, Any] = {"namespace": self.api().namespace}
        if pool is not None:
            values |= {
                "image": pool.image,
                "gpu_product": pool.gpu_product,
                "tolerations": pool.tolerations,
                "queue_name": pool.queue_name,
                "priority_class_name": pool.priority_class_name,
                "service_account": pool.service_account,
                "allow_privilege_escalation": pool.allow_privilege_escalation,
            }
        if spec is not None:
            values |= {
                "image": (spec.image.pinned if spec.image else None)
                or placement_as(spec, KubernetesPlacement).image
                or values.get("image"),
                "gpu_product": spec.resources.gpu_product or values.get("gpu_product"),
                "shm_bytes": spec.resources.shm,
                "cpu": spec.resources.cpu,
                "memory_bytes": spec.resources.memory,
                "stop_grace_s": spec.limits.stop_grace_s,
                "sample_interval_s": spec.metrics.interval_s,
            }
        values = {k: v for k, v in values.items() if v is not None}
        return objects.KubeSettings(**values)

    # -- verbs -------------------------------------------------------------------------
    def configure(self, spec: JobSpec, prices: PriceTable) -> tuple[JobSpec, PriceTable]:
        """Return the spec as it is (this backend reads its block itself) and the prices
        with the pool block's GPU price, where it gives one."""
        pool = self.pool
        if pool is None or pool.gpu_hourly_usd is None:
            return spec, prices
        return spec, prices.with_gpu_rate(self.name, pool.gpu_hourly_usd)

    def pin_image(self, spec: JobSpec, needs: Needs, say: Callable[[str], None]) -> JobSpec:
        """The image's digest from its registry where this machine reaches it (the pods
        then run that digest); a registry only the cluster reaches leaves the reference
        as written, said so. With image.credentials the pods pull with a Secret of the run's
        (made at provision, removed at teardown); else with the namespace's own."""
        if spec.image is None:
            return spec
        try:
            return imaging.pin_by_registry(spec, say)
        except InvalidSpec as exc:
            if "could not be reached" not in str(exc):
                raise
            say(f"image {spec.image.ref}: its registry is not reachable from here; the pods"
                " pull it as written (not pinned by digest)")  # fmt: skip
            return spec

    def check(self, spec: JobSpec, needs: Needs | None = None) -> None:
        """Raise InvalidSpec when the namespace is missing or the credentials cannot read
        it; makes nothing."""
        api = self.api()
        try:
            api.request("GET", f"/api/v1/namespaces/{api.namespace}")
        except KubeError as exc:
            if exc.status == 404:
                raise InvalidSpec(
                    f"placement.namespace: the namespace {api.namespace!r} does not exist on"
                    f" {api.config.server}; create it or name another."
                ) from None
            if exc.status != 403:  # reading namespaces is not needed to run jobs
                raise InvalidSpec(str(exc)) from None
        if (
            needs is not None
            and needs.mpi_launcher
            and spec.resources.nodes > 1
            and not self._serves_mpijobs()
        ):
            raise InvalidSpec(
                f"resources.nodes: MPI ranks on {spec.resources.nodes} nodes run as an MPIJob,"
                f" and {api.config.server} does not serve {MPIJOB_API} MPIJobs; install the"
                " Kubeflow MPI Operator there or use 1 node"
            )

    def offers(self, spec: JobSpec, prices: PriceTable) -> list[Offer]:
        """Return the cluster's offer: GPUs of the product free now on schedulable ready
        nodes (allocatable minus what running pods hold, from the API), priced by the pool
        block or the price table. An API that does not answer is an offer that cannot start."""
        settings = self.settings(spec)
        gpus, nodes = spec.resources.gpus, spec.resources.nodes
        hourly = hourly_rate(
            prices,
            self.name,
            [settings.gpu_product or ""] * gpus * nodes,
            spec.resources.cpu or 1.0,
            spec.resources.disk,
        )
        where = f"kubernetes/{self.block or 'kubeconfig'} (namespace {self.api().namespace})"
        try:
            found = self.api().request("GET", "/api/v1/nodes").get("items", [])
            pods = self.api().request("GET", "/api/v1/pods").get("items", [])
        except (KubeError, KubeUnreachable) as exc:
            return [Offer(where=where, hourly_usd=hourly, can_start=False, why_not=str(exc))]
        free, _, why = free_now(gpus, nodes, settings.gpu_product, found, used_gpus(pods))
        return [
            Offer(
                where=where,
                gpu_product=settings.gpu_product,
                gpus_free=free,
                hourly_usd=hourly,
                can_start=not why,
                why_not=why,
            )
        ]

    def describe(self, spec: JobSpec) -> list[dict[str, str]]:
        """Return preflight rows for `spec`: the cluster, namespace, image and GPUs its pods
        would use (defaults shown), and whether the namespace is there."""
        api, settings = self.api(), self.settings(spec)
        rows = [
            {
                "name": "cluster",
                "level": "pass",
                "message": f"{api.config.server} (credentials from {api.config.source})",
            },
            {"name": "image", "level": "pass", "message": settings.image},
        ]
        try:
            self.check(spec)
            rows.append({"name": "namespace", "level": "pass", "message": api.namespace})
        except InvalidSpec as exc:
            rows.append({"name": "namespace", "level": "fail", "message": str(exc)})
        gpus = spec.resources.gpus
        product = f" of {settings.gpu_product}" if settings.gpu_product else ""
        rows.append(
            {
                "name": "gpus",
                "level": "pass",
                "message": f"{spec.resources.nodes} node(s) x {gpus} nvidia.com/gpu{product};"
                f" tolerations {[t.get('key') for t in settings.tolerations] if gpus else 'none'}",
            }
        )
        return rows

    def provision(self, spec: JobSpec, owner: Mapping[str, str]) -> Cluster:
        """Return the run's cluster: its Service is the record. Idempotent: a retry adopts
        the Service an earlier try made. Raises ProvisionError when the API refuses."""
        api = self.api()
        name = objects.dns_name(f"gpuflow-{owner[RUN_LABEL]}")
        path = f"/api/v1/namespaces/{api.namespace}/services"
        existing = self._read(f"{path}/{name}")
        local_folder(name).mkdir(parents=True, exist_ok=True)
        if existing is not None:
            return self._cluster_of(existing).model_copy(update={"adopted": True})
        gpus, nodes = spec.resources.gpus, spec.resources.nodes
        settings = self.settings(spec)
        login = imaging.credentials_of(spec)
        if login[0] and login[1]:
            settings = settings.model_copy(update={"pull_secret": f"{name}-pull"})
        cluster = Cluster(
            backend=self.name,
            name=name,
            owner=dict(owner),
            hostname=objects.node_host_for(name, 0),
            # this host's side of the run: outputs the units send back, metric samples
            workspace=str(local_folder(name)),
            gpu_indices=list(range(gpus)),
            gpu_products=[settings.gpu_product] * gpus if settings.gpu_product else [],
            nodes=nodes,
            node_names=[f"{objects.node_host_for(name, i)}.{name}" for i in range(nodes)],
            rendezvous=f"{objects.node_host_for(name, 0)}.{name}:{objects.RENDEZVOUS_PORT}",
            created_at=datetime.now(UTC),
            capabilities=self.capabilities,
            state=KubeState(
                block=self.block,
                namespace=api.namespace,
                orchestrator=this_process(),
                api_url=os.environ.get("PREFECT_API_URL") or None,
                gpu_wait_s=spec.placement.gpu_wait,
                settings=settings,
            ).model_dump(mode="json"),
        )
        try:
            api.request("POST", path, objects.service(cluster, api.namespace))
        except KubeError as exc:
            if exc.status == 409:  # made meanwhile by a twin try: adopt it
                return self._cluster_of(self._read(f"{path}/{name}") or {}).model_copy(
                    update={"adopted": True}
                )
            raise ProvisionError(str(exc)) from None
        if settings.pull_secret and spec.image is not None:
            username, password = login
            assert username and password
            registry = containers.registry_of(spec.image.ref)
            manifest = objects.pull_secret(cluster, api.namespace, registry, username, password)
            self._put(f"/api/v1/namespaces/{api.namespace}/secrets", manifest, "pull secret")
        return cluster

    def start(
        self,
        cluster: Cluster,
        unit: WorkUnit,
        env: Mapping[str, str],
        timeout_s: float,
        tail: LogTail,
    ) -> _KubeUnit:
        """Start `unit` as a Job of one pod (an MPI launcher: as an MPIJob over every node,
        where the cluster runs the MPI Operator). A pod the scheduler cannot place is
        explained; one evicted or whose node was lost is a preemption (exit 75). On
        timeout, a stop or an interruption the object is deleted (its pods get the grace)."""
        api = self.api()
        settings = state_of(cluster, KubeState).settings
        nonce = log_nonce(cluster.name)
        self._put_secret(cluster, {**env, objects.NONCE_VARIABLE: nonce})
        deadline_s = int(timeout_s) + 1
        if unit.launcher is not None and self._serves_mpijobs():
            manifest = objects.mpi_job(cluster, unit, settings, deadline_s, _slots(unit))
            kind_path = f"/apis/{MPIJOB_API}/namespaces/{api.namespace}/mpijobs"
        else:
            manifest = objects.unit_job(cluster, unit, settings, deadline_s)
            kind_path = f"/apis/batch/v1/namespaces/{api.namespace}/jobs"
        name = manifest["metadata"]["name"]
        path = f"{kind_path}/{name}"
        if self._read(path) is not None:  # an earlier try's object: a retry starts afresh
            self._delete(path, grace_s=0)
            self._wait_gone(path)
        try:
            made = api.request("POST", kind_path, manifest)
        except KubeError as exc:
            raise ProvisionError(f"could not create {manifest['kind']} {name}: {exc}") from None
        workspace = Path(cluster.workspace)
        node_samples = workspace / NODE_SAMPLES.replace("*", name)
        follower = LogFollower(
            api, tail, workspace / "outputs", node_samples, nonce, notes=tail.on_line
        )
        # this object's pods only: an earlier try's pod may linger (Terminating on a lost node)
        selector = (
            f"{MPI_JOB_LABEL}={name}"
            if manifest["kind"] == "MPIJob"
            else f"batch.kubernetes.io/controller-uid={made['metadata']['uid']}"
        )
        return _KubeUnit(self, cluster, unit, path, selector, follower)

    def serve(
        self,
        cluster: Cluster,
        app: Replicated,
        env: Mapping[str, str],
        timeout_s: float,
        on_change: Callable[[dict[str, Any]], None],
        should_stop: StopCheck | None,
        grace_s: float,
    ) -> JobResult:
        """Keep `app` as a Deployment, a Service and an HPA (tasks/backends/kubernetes/
        serving.py) until `timeout_s` or `should_stop()`; then delete them."""
        settings = state_of(cluster, KubeState).settings
        return serving.serve(
            self.api(),
            cluster,
            app,
            settings,
            lambda variables: self._put_secret(cluster, variables),
            env,
            timeout_s,
            on_change,
            should_stop,
        )

    def _serves_mpijobs(self) -> bool:
        """Return True when the cluster serves Kubeflow's MPIJob API (the MPI Operator)."""
        try:
            return self._read(f"/apis/{MPIJOB_API}") is not None
        except KubeError:
            return False

    def _node_gone(self, node: str) -> bool:
        """Return True when `node` no longer exists (credentials that may not read nodes
        leave this to the pod garbage collector's DisruptionTarget)."""
        try:
            return self._read(f"/api/v1/nodes/{node}") is None
        except KubeError:
            return False

    def _refused_creation(self, path: str) -> None:
        """Raise ProvisionError when the Job controller says it cannot make the pod (a
        ResourceQuota, a policy); a pod still to come is no failure."""
        api = self.api()
        name = path.rsplit("/", 1)[-1]
        events = api.request(
            "GET",
            f"/api/v1/namespaces/{api.namespace}/events",
            params={"fieldSelector": f"involvedObject.name={name},reason=FailedCreate"},
        )
        for event in events.get("items", []):
            message = event.get("message", "")
            if "exceeded quota" in message:
                raise ProvisionError(
                    f"the namespace's ResourceQuota refuses the pod ({message.split(': ', 1)[-1]});"
                    " lower resources.gpus or ask for a larger quota."
                )
            raise ProvisionError(f"Kubernetes cannot create the pod: {message}")

    def _explain(self, cluster: Cluster, unit: WorkUnit, why: str) -> tuple[str, str]:
        api = self.api()
        settings = state_of(cluster, KubeState).settings
        gpus = cluster.gpus_per_node if unit.gpus is None else len(unit.gpus)
        try:
            nodes = api.request("GET", "/api/v1/nodes").get("items", [])
            pods = api.request("GET", "/api/v1/pods").get("items", [])
        except KubeError:  # may not list nodes: the scheduler's words are all there is
            return f"the scheduler cannot place it yet: {why}.", "unclear"
        machines = cluster.nodes if gpus else 1  # each GPU pod on a machine of its own
        used = used_gpus(pods)
        return explain_pending(gpus, settings.gpu_product, nodes, used, why, machines)

    @contextlib.contextmanager
    def outputs_here(self, cluster: Cluster) -> Iterator[Path]:
        """Take the output files the unit wrapper printed at the end of each of the run's
        ended pods (in their logs while the pods stand, for a gpuflow killed before it
        read them) into the run's folder here, and yield that folder. Only the wrapper's
        records count: they carry the run's nonce, read from the run's Secret."""
        api = self.api()
        folder = Path(cluster.workspace) / "outputs"
        where = f"/api/v1/namespaces/{api.namespace}"
        stored = (self._read(f"{where}/secrets/{cluster.name}-env") or {}).get("data", {})
        if objects.NONCE_VARIABLE in stored:
            nonce = base64.b64decode(stored[objects.NONCE_VARIABLE]).decode()
            selector = {"labelSelector": f"{objects.CLUSTER_LABEL}={cluster.name}"}
            for pod in api.request("GET", f"{where}/pods", params=selector).get("items", []):
                if pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
                    continue  # a pod that did not end has no outputs printed yet
                follower = LogFollower(api, lambda _stream, _text: None, folder, nonce=nonce)
                follower.read_to_end(f"{where}/pods/{pod['metadata']['name']}/log")
        yield folder

    def teardown(self, cluster: Cluster) -> TeardownReport:
        """Delete every object of `cluster` (Jobs and their pods, the Secret, the Service).
        Idempotent: objects already gone are no error."""
        api = self.api()
        ns, selector = api.namespace, f"{objects.CLUSTER_LABEL}={cluster.name}"
        service = self._read(f"/api/v1/namespaces/{ns}/services/{cluster.name}")
        jobs = api.request(
            "GET", f"/apis/batch/v1/namespaces/{ns}/jobs", params={"labelSelector": selector}
        ).get("items", [])
        for job in jobs:
            self._delete(f"/apis/batch/v1/namespaces/{ns}/jobs/{job['metadata']['name']}", 0)
        mpijobs = f"/apis/{MPIJOB_API}/namespaces/{ns}/mpijobs"
        if self._serves_mpijobs():  # the operator's launcher Job and workers go with them
            found = api.request("GET", mpijobs, params={"labelSelector": selector})
            for item in found.get("items", []):
                self._delete(f"{mpijobs}/{item['metadata']['name']}", 0)
                jobs.append(item)
        with contextlib.suppress(KubeError):  # pods go with their Jobs; this is quicker
            api.request(
                "DELETE", f"/api/v1/namespaces/{ns}/pods", params={"labelSelector": selector}
            )
        serving.remove(api, cluster)  # a service's Deployment, Service and HPA
        self._delete(f"/api/v1/namespaces/{ns}/secrets/{cluster.name}-env", 0)
        self._delete(f"/api/v1/namespaces/{ns}/secrets/{cluster.name}-pull", 0)
        self._delete(f"/api/v1/namespaces/{ns}/services/{cluster.name}", 0)
        shutil.rmtree(local_folder(cluster.name), ignore_errors=True)
        return TeardownReport(
            name=cluster.name, already_gone=service is None and not jobs, killed_processes=len(jobs)
        )

    def teardown_all(self, clusters: list[Cluster]) -> None:
        """Delete every object of `clusters` a collection at a time: one request per kind
        of object for all of them (label selector `gpuflow.io/cluster in (...)`); Services,
        which an API server may not delete as a collection, one by one. Idempotent; the
        reaper's way through hundreds of runs."""
        api = self.api()
        ns, names = api.namespace, [cluster.name for cluster in clusters]
        selector = {"labelSelector": f"{objects.CLUSTER_LABEL} in ({','.join(names)})"}
        body = {"propagationPolicy": "Background", "gracePeriodSeconds": 0}
        collections = [
            f"/apis/batch/v1/namespaces/{ns}/jobs",
            serving.HPAS.format(ns=ns),
            serving.APPS.format(ns=ns),
        ]
        if self._serves_mpijobs():  # the operator's launcher Job and workers go with them
            collections.append(f"/apis/{MPIJOB_API}/namespaces/{ns}/mpijobs")
        collections += [f"/api/v1/namespaces/{ns}/pods", f"/api/v1/namespaces/{ns}/secrets"]
        for path in collections:
            api.request("DELETE", path, body, params=selector)
        services = f"/api/v1/namespaces/{ns}/services"
        try:
            api.request("DELETE", services, body, params=selector)
        except KubeError as exc:
            if exc.status != 405:  # not served as a collection here: one at a time
                raise
            for cluster in clusters:
                self._delete(f"{services}/{cluster.name}", 0)
                self._delete(f"{services}/{serving.name_of(cluster)}", 0)
        for cluster in clusters:
            shutil.rmtree(local_folder(cluster.name), ignore_errors=True)

    def reap(self, dry_run: bool, say: Callable[[str], None], runs: RunStates) -> ReapReport:
        """Delete the objects of runs that are over, or whose gpuflow died on this host;
        with `dry_run`, only say which. Idempotent."""
        return reaping.reap(self, dry_run, say, runs)

    def list_owned(self, selector: Mapping[str, str]) -> list[Cluster]:
        """Return the clusters (Services) whose labels include `selector`."""
        api = self.api()
        wanted = ",".join(f"{k}={objects.dns_name(v)}" for k, v in selector.items())
        found = api.request(
            "GET", f"/api/v1/namespaces/{api.namespace}/services", params={"labelSelector": wanted}
        )
        return [self._cluster_of(s) for s in found.get("items", [])]

    # -- helpers -----------------------------------------------------------------------
    def _cluster_of(self, service: dict[str, Any]) -> Cluster:
        record = service.get("metadata", {}).get("annotations", {}).get(objects.CLUSTER_ANNOTATION)
        if not record:
            raise ProvisionError(
                f"the Service {service.get('metadata', {}).get('name')} carries no gpuflow record"
            )
        return Cluster.model_validate_json(record)

    def _read(self, path: str) -> dict[str, Any] | None:
        try:
            return self.api().request("GET", path)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def _delete(self, path: str, grace_s: float) -> None:
        body = {"propagationPolicy": "Background", "gracePeriodSeconds": int(grace_s)}
        try:
            self.api().request("DELETE", path, body)
        except KubeError as exc:
            if exc.status != 404:
                raise

    def _wait_gone(self, path: str, limit_s: float = 30.0) -> None:
        until = time.monotonic() + limit_s
        while self._read(path) is not None and time.monotonic() < until:
            time.sleep(0.2)

    def _put(self, path: str, manifest: dict[str, Any], what: str) -> None:
        """Make an object of the run's (kept as it is when a retry made it already)."""
        try:
            self.api().request("POST", path, manifest)
        except KubeError as exc:
            if exc.status != 409:
                raise ProvisionError(f"could not make the run's {what}: {exc}") from None

    def _put_secret(self, cluster: Cluster, env: dict[str, str]) -> None:
        api = self.api()
        path = f"/api/v1/namespaces/{api.namespace}/secrets"
        manifest = objects.secret(cluster, api.namespace, env)
        try:
            api.request("POST", path, manifest)
        except KubeError as exc:
            if exc.status != 409:
                raise ProvisionError(f"could not store the job's variables: {exc}") from None
            api.request("PUT", f"{path}/{cluster.name}-env", manifest)


def local_folder(cluster_name: str) -> Path:
    """Return this host's folder for a Kubernetes cluster: the outputs its units send back
    (copied to the run's artifacts by collect) and metric samples; gone at teardown."""

    return gpuflow_home() / "kubernetes" / objects.dns_name(cluster_name)


def kube_outage_s() -> float:
    """Return how long a running unit waits for an API server that does not answer."""
    return env_number("GPUFLOW_KUBE_OUTAGE_S", 120.0, 1.0, 86400.0)


class _KubeUnit:
    """A unit's Job (or MPIJob) and its pods, as follow_unit sees it: the launcher's (or
    the one pod's) end is the unit's; every pod is watched for placement and loss."""

    every_s = POLL_S

    def __init__(
        self,
        backend: KubernetesBackend,
        cluster: Cluster,
        unit: WorkUnit,
        path: str,
        selector: str,
        follower: LogFollower,
    ) -> None:
        self.backend, self.cluster, self.unit = backend, cluster, unit
        self.path, self.selector, self.follower = path, selector, follower
        api = backend.api()
        self.pods = f"/api/v1/namespaces/{api.namespace}/pods"
        self.gpu_wait = state_of(cluster, KubeState).gpu_wait_s
        self.pending_since: float | None = None
        self.unreachable_since: float | None = None
        self.seen: str | None = None
        self.stop_grace_s = 0.0

    def poll(self) -> UnitEnd | None:
        """Return the unit's end, or None while it runs. An API server that does not
        answer, or answers that it is starting (429, 5xx: restarted, upgraded), is waited
        for, up to GPUFLOW_KUBE_OUTAGE_S: the pods run on without it, and are followed
        again once it answers."""
        try:
            end = self._poll()
        except (KubeUnreachable, KubeError) as exc:
            starting = isinstance(exc, KubeUnreachable) or exc.status in (429, 500, 502, 503, 504)
            if not starting:  # a refusal (403, 404, 422) says something: no waiting
                raise
            self.unreachable_since = self.unreachable_since or time.monotonic()
            if time.monotonic() - self.unreachable_since < kube_outage_s():
                return None
            raise
        self.unreachable_since = None
        return end

    def _poll(self) -> UnitEnd | None:
        backend, pods = self.backend, self.pods
        listed = backend.api().request("GET", pods, params={"labelSelector": self.selector})
        found: list[dict[str, Any]] = listed.get("items") or []
        workers = [p for p in found if _role(p) == "worker"]
        pod = next((p for p in found if _role(p) != "worker"), None)
        unplaced: str | None = None
        for each in [p for p in (pod, *workers) if p is not None]:
            status, name = each.get("status", {}), each["metadata"]["name"]
            if _disrupted(status):
                return UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[f"pod {name} was disrupted"])
            node = each["spec"].get("nodeName")
            if status.get("phase") == "Running" and node and backend._node_gone(node):
                # lost with its node: no need to wait for the pod garbage collector
                return UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[f"node {node} was lost"])
            unplaced = unplaced or _unschedulable(status)
        if pod is None:
            if self.seen is not None:  # its node went away and took the pod along
                return UnitEnd(exit_code=PREEMPTED_EXIT_CODE, tail=[f"pod {self.seen} was lost"])
            backend._refused_creation(self.path)
        else:
            self.seen = pod["metadata"]["name"]
            status = pod.get("status", {})
            if cannot := cannot_start(pod):  # the kubelet cannot make its container
                self.backend._delete(self.path, 0)
                raise ProvisionError(f"unit {self.unit.name} cannot start: {cannot}")
            if status.get("phase") in ("Succeeded", "Failed"):
                self.follower.start(f"{pods}/{self.seen}/log", follow=False)  # ended unseen
                return _terminated(status)
            if status.get("phase") == "Running":
                self.follower.start(f"{pods}/{self.seen}/log")
        self._placement(unplaced)
        return None

    def _placement(self, unplaced: str | None) -> None:
        """Raise when a pod the scheduler cannot place never will be (ProvisionError), or
        was not placed within placement.gpu_wait (CapacityError)."""
        if unplaced is None:
            self.pending_since = None
            return
        self.pending_since = self.pending_since or time.monotonic()
        sentence, verdict = self.backend._explain(self.cluster, self.unit, unplaced)
        if verdict == "never":
            self.backend._delete(self.path, 0)
            raise ProvisionError(f"unit {self.unit.name} cannot be placed: {sentence}")
        # the scheduler's words alone (a node not ready yet) get a moment more
        patience = self.gpu_wait if verdict == "busy" else max(self.gpu_wait, UNCLEAR_WAIT_S)
        if time.monotonic() - self.pending_since >= patience:
            self.backend._delete(self.path, 0)
            raise CapacityError(
                f"unit {self.unit.name} was not placed within {patience:.0f} s"
                f" (placement.gpu_wait): {sentence}"
            )

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def stop(self, reason: StopReason, grace_s: float) -> UnitEnd:
        self.backend._delete(self.path, grace_s=grace_s)  # its pods get SIGTERM and the grace
        self.stop_grace_s = grace_s
        return UnitEnd()

    def interrupt(self, grace_s: float) -> None:
        self.follower.stop()
        self.backend._delete(self.path, grace_s=grace_s)

    def unconfirmed(self) -> UnitEnd:
        return UnitEnd()

    def finish(self, end: UnitEnd | None) -> UnitEnd | None:
        """Let an ended pod's last lines arrive, and add its node's samples to the run's."""
        if end is None:  # interrupted: the follower stopped with it
            return None
        # a stopped pod sends what its job wrote in its grace as its log's last lines
        self.follower.stop(drain_s=LOG_DRAIN_S + (self.stop_grace_s if end.stop else 0))
        if self.follower.samples is not None:
            join_samples(Path(self.cluster.workspace) / SAMPLES, self.follower.samples)
        return end


def _role(pod: dict[str, Any]) -> str:
    """Return an MPIJob pod's role (launcher, worker); "" for a unit Job's pod."""
    return pod["metadata"].get("labels", {}).get(MPI_ROLE_LABEL, "")


def _slots(unit: WorkUnit) -> int:
    """Return the ranks per node of an MPI launcher unit, from its hostfile."""
    hosts = unit.launcher.hosts() if unit.launcher else []
    return hosts[0][1] if hosts else 1


def _unschedulable(status: dict[str, Any]) -> str | None:
    for condition in status.get("conditions") or []:
        scheduled = condition.get("type") == "PodScheduled" and condition.get("status") == "False"
        if scheduled and condition.get("reason") == "Unschedulable":
            return condition.get("message", "").strip().rstrip(".")
    return None


def _disrupted(status: dict[str, Any]) -> bool:
    return (
        any(
            c.get("type") == "DisruptionTarget" and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        or status.get("reason") == "Evicted"
    )


# A container the kubelet is waiting to make, for a reason that waiting does not mend: an
# image it may not pull or cannot find (ImagePullBackOff comes after a second failed pull;
# a first ErrImagePull may be a registry's hiccup), a variable or volume it cannot fill.
NEVER_STARTS = {
    "ImagePullBackOff": "image",
    "ErrImageNeverPull": "image",
    "InvalidImageName": "image",
    "CreateContainerConfigError": "config",
    "CreateContainerError": "config",
}


def cannot_start(pod: dict[str, Any]) -> str | None:
    """Return why `pod`'s container will never start (one sentence with the fix), or None
    while it may still."""
    for container in pod.get("status", {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason", "")
        why = NEVER_STARTS.get(reason)
        if why is None:
            continue
        message = (waiting.get("message") or "").strip().rstrip(".")
        said = f"{reason}: {message}" if message else reason
        node = pod.get("spec", {}).get("nodeName") or "its node"
        if why == "image":
            return (
                f"the image {container.get('image')!r} is not on {node} and cannot be pulled"
                f" ({said}); build it and push it where the cluster pulls images from"
                " (infra/docker/Dockerfile, scripts/build-image.sh), or set placement.image"
                " or the KubernetesGpuPool block's image to one it has."
            )
        return (
            f"the kubelet on {node} cannot create its container ({said}); fix what the"
            " message names in the cluster (a Secret, a volume, the image's user)."
        )
    return None


def _terminated(status: dict[str, Any]) -> UnitEnd:
    """Return how an ended pod's container ended (an OOMKilled one: SIGKILL, one kill)."""
    for container in status.get("containerStatuses") or []:
        done = (container.get("state") or {}).get("terminated")
        if done:
            code = int(done.get("exitCode", 1))
            if done.get("reason") == "OOMKilled":  # the kubelet saw the container's cgroup
                return UnitEnd(signal=9, memory_events={"oom_kill": 1})
            if done.get("reason") in ("StartError", "ContainerCannotRun"):
                # the runtime could not start the container (its program is not in the image)
                said = (done.get("message") or done["reason"]).strip()
                return UnitEnd(exit_code=127, tail=[f"the container could not start: {said}"])
            if code > 128 and done.get("reason") != "Error":
                return UnitEnd(signal=code - 128)
            return UnitEnd(exit_code=code, tail=[m] if (m := done.get("message")) else [])
    return UnitEnd(exit_code=0 if status.get("phase") == "Succeeded" else 1)
