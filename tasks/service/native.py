"""A service on a backend that keeps replicas itself (Kubernetes: a Deployment, a Service
and a HorizontalPodAutoscaler): gpuflow hands it the service and follows it; the scaling
is the cluster's, and goes on without gpuflow. Each change the backend reports (replicas
wanted and ready, the autoscaler's reading) is an event and a row of the run's artifacts."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Replicated, RunOutcome, UnitRunner
from gpuflow.tasks.host import write_atomic
from gpuflow.tasks.service import report
from gpuflow.tasks.service import serve as local
from gpuflow.tasks.service.model import PORT_VARIABLE, ServiceJob, ServiceResult
from gpuflow.tasks.spec import JobSpec, job_as

DEFAULT_PORT = 8080  # where replicas listen, and the Service's port, when job.port is not set


def replicated(spec: JobSpec) -> Replicated:
    """Return the service of `spec` as a backend keeps it."""
    job = job_as(spec, ServiceJob)
    port = job.port or DEFAULT_PORT
    gpus = job.replica_gpus if job.replica_gpus is not None else spec.resources.gpus
    return Replicated(
        name=spec.name,
        command=list(job.command),
        env={PORT_VARIABLE: str(port)},
        port=port,
        ready_path=job.ready.path,
        live_path=job.liveness.path,
        period_s=job.ready.period_s,
        failures=job.liveness.failures,
        start_timeout_s=job.start_timeout_s,
        least=job.replicas.min,
        most=job.replicas.max,
        gpus=gpus,
        gpu_util=job.scaling.gpu_util,
        down_after_s=job.scaling.down_after_s,
    )


class Followed:
    """What the backend reported, turned into events, artifacts and figures."""

    def __init__(self, spec: JobSpec, runner: UnitRunner, app: Replicated) -> None:
        self.spec, self.runner, self.app = spec, runner, app
        self.key = f"service-{local.slug(spec.name)}"
        self.address = ""
        self.wanted = 0
        self.ready = 0
        self.since = time.monotonic()
        self.started = self.since
        self.replica_seconds = 0.0
        self.most = 0
        self.decisions: list[dict[str, Any]] = []
        self.say = local.run_logger()
        self.event = report.Events(runner.cluster, spec.name)

    def __call__(self, now: dict[str, Any]) -> None:
        if "address" in now:
            self.address = now["address"]
            how = "the cluster's HorizontalPodAutoscaler" if now.get("hpa") else "a fixed count"
            self.say(
                "info", f"service at {self.address} (a Deployment and a Service; scaled by {how})"
            )
            report.markdown(
                self.key, f"# {self.spec.name}\n\naddress: `{self.address}`\n\nscaled by {how}"
            )
            self.event("gpuflow.service.started", {"endpoint": self.address})
            return
        moment = time.monotonic()
        self.replica_seconds += self.ready * (moment - self.since)
        self.since, self.ready = moment, int(now.get("ready", 0))
        self.most = max(self.most, self.ready)
        wanted = int(now.get("wanted", 0))
        if wanted != self.wanted:
            util = now.get("gpu_util")
            why = "the Deployment's first replicas"
            if self.wanted and util is not None and self.app.gpu_util is not None:
                why = (
                    f"the HorizontalPodAutoscaler: GPUs {util:.0f} % busy at a target of"
                    f" {self.app.gpu_util:g} %"
                )
            row = {
                "at_s": round(moment - self.started, 1),
                "from": self.wanted,
                "to": wanted,
                "why": why,
                "gpu_util": util,
            }
            self.decisions.append(row)
            self.say("info", f"replicas {self.wanted} -> {wanted}: {why}")
            self.event("gpuflow.service.scaled", row)
            report.table(f"{self.key}-scaling", self.decisions[-200:], "scaling decisions")
            self.wanted = wanted

    def figures(self) -> ServiceResult:
        moment = time.monotonic()
        self.replica_seconds += self.ready * (moment - self.since)
        self.since, self.ready = moment, 0
        hourly = self.runner.hourly_usd
        cost = None if hourly is None else self.replica_seconds * hourly / self.app.most / 3600
        lived = max(time.monotonic() - self.started, 1e-9)
        return ServiceResult(
            endpoint=self.address,
            requests=0,  # the cluster's Service proxies them: gpuflow does not see them
            errors=0,
            most_replicas=self.most,
            decisions=len(self.decisions),
            gpu_seconds=round(self.replica_seconds * self.app.gpus, 2),
            cost_usd=None if cost is None else round(cost, 6),
            cost_per_hour_usd=None if cost is None else round(cost * 3600 / lived, 4),
        )


def serve(spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
    """Have the run's backend keep the service until `deadline` or the run's cancel."""
    app = replicated(spec)
    followed = Followed(spec, runner, app)
    began = datetime.now(UTC)
    result = runner.serve(app, followed, deadline)
    figures = followed.figures()
    write_atomic(
        Path(runner.cluster.workspace) / "outputs" / "result.json",
        figures.model_dump_json(indent=1),
    )
    followed.event("gpuflow.service.ended", {"cost_usd": figures.cost_usd})
    result = result.model_copy(update={"started_at": began})
    if result.cancelled:
        return RunOutcome(result=result)
    return RunOutcome(result=result, stopped_by=runner.limit)
