"""What a service tells of itself: its figures (per replica and in all: requests, latency,
cold starts, GPU-seconds, cost), pushed to the run's Pushgateway as it serves and written
with its outcome at its end; its events and artifacts."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpuflow.tasks.api_client import emit_run_event
from gpuflow.tasks.contract import RUN_LABEL, Cluster, JobResult, RunOutcome
from gpuflow.tasks.errors import TransientError
from gpuflow.tasks.host import write_atomic
from gpuflow.tasks.metrics.prometheus import push
from gpuflow.tasks.service import metrics
from gpuflow.tasks.service.model import ReplicaFigures, ServiceResult

if TYPE_CHECKING:
    from gpuflow.tasks.service.serve import Replica, Service

logger = logging.getLogger(__name__)


def outcome(service: Service, began: datetime, result: JobResult, limited: bool) -> RunOutcome:
    """Write the service's figures (result.json, the last push, an event) and return how
    it ended: by a limit, cancelled, or its endpoint's own end (a failure)."""
    ended, now = datetime.now(UTC), time.monotonic()  # one instant for every figure
    final = figures(service, now)
    service.pusher.push(final)
    write_atomic(
        Path(service.cluster.workspace) / "outputs" / "result.json",
        final.model_dump_json(indent=1),
    )
    service.event(
        "gpuflow.service.ended",
        {"requests": final.requests, "cost_usd": final.cost_usd},
    )
    job_result = JobResult(
        exit_code=0,
        started_at=began,
        ended_at=ended,
        duration_s=(ended - began).total_seconds(),
        cancelled=result.cancelled,
    )
    # on a fleet the run holds its replicas' claims, each for the replica's life
    held_s = sum(held(r, now)[1] for r in service.replicas) if service.claims else None
    if service.failure is not None:  # its replicas never served: not a completed service
        failed = job_result.model_copy(update={"exit_code": 1, "cancelled": False})
        return RunOutcome(result=failed, failure=f"{service.failure}.", held_s=held_s)
    if limited or result.timed_out:
        job_result = job_result.model_copy(update={"cancelled": False})
        return RunOutcome(result=job_result, stopped_by=service.limit, held_s=held_s)
    if result.cancelled:  # how a service ends: collected, then the run is Cancelled
        return RunOutcome(result=job_result, held_s=held_s)
    if time.time() >= service.deadline:
        return RunOutcome(result=job_result, stopped_by=service.limit, held_s=held_s)
    said = " | ".join(list(service.endpoint_lines)[-3:]) or "no output"
    failure = f"the endpoint (HAProxy) ended by itself ({said}); the service stopped"
    failed = job_result.model_copy(update={"exit_code": 1})
    return RunOutcome(result=failed, failure=failure, held_s=held_s)


class Pusher:
    """Pushes a service's figures to the run's Pushgateway every metrics.push_interval_s
    (and the final ones as the service ends); a failure is said once, never fatal."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.pushed = 0.0  # when the figures were last pushed (time.monotonic())
        self.warned = False
        self.sending = threading.Lock()

    def push(self, final: ServiceResult | None = None) -> None:
        service = self.service
        gateway = service.spec.metrics.pushgateway
        now = time.monotonic()
        if gateway is None or (
            final is None and now - self.pushed < service.spec.metrics.push_interval_s
        ):
            return
        self.pushed = now
        load = service._load(now)
        run = {"flow_run_id": service.run_id, "job": service.spec.name}
        text = metrics.exposition(
            final or figures(service), load.replicas, load.ready, load.rps, run
        )
        if final is not None:
            self.send(gateway, text)
        elif not self.sending.locked():  # a slow gateway never holds up the scaler
            threading.Thread(target=self.send, args=(gateway, text), daemon=True).start()

    def send(self, gateway: str, text: str) -> None:
        service = self.service
        with self.sending:
            try:
                push(gateway, text, service.run_id, service.spec.name, metrics.STAGE)
            except TransientError as exc:
                if not self.warned:
                    self.warned = True
                    service._say("warning", f"service metrics not pushed: {exc}")


def spent_out(service: Service) -> bool:
    """Return True once the replicas' claims (on a fleet) have cost limits.max_cost_usd."""
    budget, hourly = service.spec.limits.max_cost_usd, service.runner.hourly_usd
    if not service.claims or budget is None or not hourly:
        return False
    return sum(held(r)[1] for r in service.replicas) * hourly / 3600 >= budget


def held(replica: Replica, now: float | None = None) -> tuple[float, float]:
    """Return when `replica` ended (time.monotonic(); `now`, default this moment, if it
    runs) and how long it held its GPUs until then."""
    end = replica.ended_at or (time.monotonic() if now is None else now)
    return end, 0.0 if replica.held_from is None else max(0.0, end - replica.held_from)


def figures(service: Service, now: float | None = None) -> ServiceResult:
    """Return the service's figures at `now` (time.monotonic(), default this moment), per
    replica and in all."""
    now = time.monotonic() if now is None else now
    hourly = service.runner.hourly_usd  # the run's node: one replica's claim on a fleet
    share = 1 if service.claims else service.job.replicas.max
    per_replica_hour = None if hourly is None else hourly / share
    rows = []
    held_s = 0.0  # replica-seconds with GPUs held: what is paid
    gpu_seconds = 0.0
    for replica in service.replicas:
        end, replica_held = held(replica, now)
        held_s += replica_held
        gpu_seconds += replica_held * len(replica.gpus)
        latencies = sorted(replica.latencies)
        rows.append(
            ReplicaFigures(
                replica=replica.name,
                host=replica.host,
                gpus=replica.gpus,
                started_s=round(replica.started - service.started, 2),
                cold_start_s=None
                if replica.ready_at is None
                else round(replica.ready_at - replica.started, 2),
                served_s=round(end - replica.started, 2),
                requests=replica.requests,
                errors=replica.errors,
                p50_ms=percentile(latencies, 50),
                p95_ms=percentile(latencies, 95),
                gpu_util=round(statistics.fmean(replica.utils), 1) if replica.utils else None,
                ended=replica.why_ended,
            )
        )
    cost = None if per_replica_hour is None else held_s * per_replica_hour / 3600
    lived = max(now - service.started, 1e-9)
    latencies = sorted(service.latencies)
    return ServiceResult(
        endpoint=service.endpoint,
        requests=service.total_requests,
        errors=service.total_errors,
        p50_ms=percentile(latencies, 50),
        p95_ms=percentile(latencies, 95),
        most_replicas=max([d["to"] for d in service.decisions] or [0]),
        decisions=len(service.decisions),
        gpu_seconds=round(gpu_seconds, 2),
        cost_usd=None if cost is None else round(cost, 6),
        cost_per_hour_usd=None if cost is None else round(cost * 3600 / lived, 4),
        cost_per_1000_requests_usd=(
            round(cost * 1000 / service.total_requests, 6)
            if cost and service.total_requests
            else None
        ),
        cold_start_s=[r.cold_start_s for r in rows if r.cold_start_s is not None],
        replicas=rows,
    )


class Events:
    """Prefect events about one service: resource `gpuflow.service.<flow run id>`, related
    to its flow run; never a reason to stop the service."""

    def __init__(self, cluster: Cluster, name: str) -> None:
        self.run_id = cluster.owner.get(RUN_LABEL, cluster.name)
        self.name = name

    def __call__(self, event: str, payload: dict[str, Any]) -> None:
        emit_run_event(event, f"gpuflow.service.{self.run_id}", self.name, self.run_id, payload)


def percentile(ordered: list[int], percent: float) -> float | None:
    if not ordered:
        return None
    index = min(len(ordered) - 1, max(0, round(percent / 100 * len(ordered) + 0.5) - 1))
    return float(ordered[index])


def table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    try:
        from prefect.artifacts import create_table_artifact

        create_table_artifact(rows, key=key, description=description)
    except Exception:
        logger.debug("artifact %s not made", key, exc_info=True)


def markdown(key: str, text: str) -> None:
    try:
        from prefect.artifacts import create_markdown_artifact

        create_markdown_artifact(text, key=key)
    except Exception:
        logger.debug("artifact %s not made", key, exc_info=True)
