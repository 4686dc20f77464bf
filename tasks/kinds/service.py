"""Kind `service`: a long-running command serving on a port, as replicas behind one
endpoint (HAProxy), scaled on GPU utilisation or request rate, to zero when idle
(gpuflow.tasks.service)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Capabilities, Cluster, Needs, RunOutcome, UnitRunner
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.kinds.code import check_code
from gpuflow.tasks.outputs import read_result
from gpuflow.tasks.service import native
from gpuflow.tasks.service.model import PORT_VARIABLE, ServiceJob, ServiceResult
from gpuflow.tasks.service.restarts import address_here
from gpuflow.tasks.service.serve import serve
from gpuflow.tasks.spec import JobSpec


class ServiceKind(JobKind[ServiceJob]):
    name = "service"
    model = ServiceJob
    result = ServiceResult
    schedules_units = True  # replicas start and stop as the load says

    def sized(self, spec: JobSpec, where: Capabilities) -> JobSpec:
        """Return `spec` as the backend provisions it: where the replicas share the run's
        node, room for replicas.max of them (resources.gpus each); where the backend keeps
        them itself (a Deployment), each replica's GPUs."""
        job = self.job_of(spec)
        if job.replica_gpus is not None:
            return spec  # sized already (a retried attempt, a pool's next candidate)
        each = spec.resources.gpus
        if where.serves_replicas:
            return spec.model_copy(update={"job": job.model_copy(update={"replica_gpus": each})})
        if where.adds_nodes:  # a node per replica, claimed as the load says
            return spec.model_copy(
                update={
                    "job": job.model_copy(update={"replica_gpus": each, "replica_claims": True})
                }
            )
        return spec.model_copy(
            update={
                "job": job.model_copy(update={"replica_gpus": each}),
                "resources": spec.resources.model_copy(update={"gpus": each * job.replicas.max}),
            }
        )

    def uses_torch(self, spec: JobSpec) -> bool:
        return self.job_of(spec).torch

    def needs(self, spec: JobSpec) -> Needs:
        job = self.job_of(spec)
        # the endpoint runs beside the replicas, or on this machine in front of claims
        endpoint = {} if job.replica_claims else {"job (its endpoint, HAProxy)": "haproxy"}
        programs = {}
        program = job.command[0]
        if "/" not in program and not (job.workdir and (Path(job.workdir) / program).is_file()):
            programs["job.command"] = program
        return Needs(programs=programs, host_programs=endpoint)

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        job = self.job_of(spec)
        gpus = job.replica_gpus if job.replica_gpus is not None else spec.resources.gpus
        if job.scaling.gpu_util is not None and gpus == 0:
            raise InvalidSpec(
                "job.scaling.gpu_util: scales on the replicas' GPU utilisation, but"
                " resources.gpus is 0, so a replica holds no GPU; ask for GPUs"
                " (resources.gpus) or scale on job.scaling.rps."
            )
        if spec.resources.nodes != 1:
            raise InvalidSpec(
                f"resources.nodes: a service's replicas are counted by job.replicas, each on"
                f" one node; remove nodes ({spec.resources.nodes})."
            )
        if where.serves_replicas:
            _check_kept(spec, job)
            return
        if not where.runs_here and not where.adds_nodes:
            raise InvalidSpec(
                f"placement.backend: services run on this machine (local), on a fleet (an"
                f" elastic one grows on EC2) and on Kubernetes; {spec.placement.backend} cannot"
                " serve one; use one of those."
            )
        if where.adds_nodes and shutil.which("haproxy") is None:
            raise InvalidSpec(
                "job: a service's endpoint runs on this machine, in front of its replicas on"
                f" {where.where}, and HAProxy is not installed here; install it"
                " (scripts/setup.sh --serve, or apt-get install haproxy)."
            )
        if (why := address_here(job.host)) is not None:
            raise InvalidSpec(
                f"job.host: the endpoint cannot listen on {job.host} on this machine ({why});"
                " give one of its addresses (127.0.0.1 for this machine alone, 0.0.0.0 for"
                " every network)."
            )
        check_code(spec, job, job.command, {PORT_VARIABLE, "GPUFLOW_REPLICA"}, where)
        if job.port is not None and _listening(job.host, job.port):
            raise InvalidSpec(
                f"job.port: {job.host}:{job.port} is in use on this machine; pick another"
                " port, or leave it out for a free one."
            )

    def schedule(self, spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
        if runner.cluster.capabilities.serves_replicas:
            return native.serve(spec, runner, deadline)  # the backend's own autoscaler
        return serve(spec, runner, deadline)

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        """The service's figures where people look: requests, latency, replicas over its
        life (each one's host, GPUs, requests and latency) and cost, in the summary."""
        done = read_result(artifacts / "outputs" / "result.json", ServiceResult)
        if done is None:
            return Report()
        latency = (
            "no request timed"
            if done.p50_ms is None
            else (f"p50 {done.p50_ms:g} ms, p95 {done.p95_ms:g} ms")
        )
        cost = "" if done.cost_usd is None else f", ${done.cost_usd:.4f}"
        per_1000 = done.cost_per_1000_requests_usd
        headline = [
            f"- **{done.requests} requests** ({done.errors} errors), {latency}, up to"
            f" {done.most_replicas} replica(s), {done.gpu_seconds:g} GPU-seconds{cost}"
            + ("" if per_1000 is None else f" (${per_1000:.4f} per 1000 requests)")
        ]
        lines = [
            "",
            "| replica | host | GPUs | started (s) | lived (s) | requests | p50 ms | p95 ms | GPU % | ended |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(
                f"| {r.replica} | {r.host or '-'} | {','.join(map(str, r.gpus)) or '-'}"
                f" | {r.started_s:.1f} | {r.served_s:.1f} | {r.requests} | {_ms(r.p50_ms)}"
                f" | {_ms(r.p95_ms)} | {_ms(r.gpu_util)} | {r.ended or '-'} |"
                for r in done.replicas
            ),
        ]
        rows = [
            {"metric": f"service.{name}", "value": value}
            for name, value in done.model_dump(
                include={"requests", "errors", "p50_ms", "p95_ms", "most_replicas", "cost_usd"}
            ).items()
        ]
        return Report(rows=rows, lines=lines if done.replicas else [], headline=headline)

    def summary(self, job: dict[str, Any]) -> list[str]:
        done = self.figures(job)
        if not isinstance(done, ServiceResult):
            return []
        latency = "" if done.p50_ms is None else f", p50 {done.p50_ms:g} ms, p95 {done.p95_ms:g} ms"
        cost = "" if done.cost_usd is None else f", ${done.cost_usd:.4f}"
        return [
            f"  served {done.requests} requests at {done.endpoint} ({done.errors} errors"
            f"{latency}) with up to {done.most_replicas} replica(s), {done.gpu_seconds:g}"
            f" GPU-seconds{cost}"
        ]


def _check_kept(spec: JobSpec, job: ServiceJob) -> None:
    """Refuse what a backend that keeps the replicas itself (a Deployment and an HPA)
    cannot do: requests per second, scaling to zero, a working folder."""
    where = spec.placement.backend
    if job.scaling.rps is not None:
        raise InvalidSpec(
            f"job.scaling.rps: on {where} the HorizontalPodAutoscaler scales on the replicas'"
            " GPU utilisation (DCGM_FI_DEV_GPU_UTIL through the custom metrics API) and reads"
            " no request rate; remove rps and set scaling.gpu_util."
        )
    if job.replicas.min == 0:
        raise InvalidSpec(
            f"job.replicas.min: on {where} a HorizontalPodAutoscaler keeps at least one"
            " replica (to zero needs KEDA or the HPAScaleToZero feature gate); set min to 1."
        )
    if job.workdir or job.setup:
        raise InvalidSpec(
            f"job.workdir: on {where} each replica runs its command in the image"
            " (placement.image); build your code into the image, or serve it on this"
            " machine (local)."
        )


def _listening(host: str, port: int) -> bool:
    """Return True when something accepts connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"
