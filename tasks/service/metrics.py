"""A service's figures in Prometheus' text format, pushed to the run's Pushgateway as the
group `service` while it lives (and once more as it ends): replicas, request rate,
latency, cold starts, GPU utilisation and cost, per replica where they are a replica's."""

from __future__ import annotations

from gpuflow.tasks.metrics.prometheus import family
from gpuflow.tasks.service.model import ServiceResult

STAGE = "service"
REPLICAS_SHOWN = 50  # the latest replicas' latency and utilisation: a bounded group


def exposition(
    figures: ServiceResult, replicas: int, ready: int, rps: float, run: dict[str, str]
) -> str:
    """Return the text of a service's push: `figures` so far, the replicas now (`ready`
    of them serving) and the request rate over the scaling window."""
    live = figures.replicas[-REPLICAS_SHOWN:]
    lines = [
        *family(
            "gpuflow_service_replicas",
            "Replicas of the service now (label state: counted, ready).",
            "gauge",
            [(run | {"state": "counted"}, replicas), (run | {"state": "ready"}, ready)],
        ),
        *family(
            "gpuflow_service_requests_per_second",
            "Requests per second at the endpoint over the scaling window.",
            "gauge",
            [(run, rps)],
        ),
        *family(
            "gpuflow_service_requests_total",
            "Requests the endpoint answered, by replica.",
            "counter",
            [(run | {"replica": r.replica}, r.requests) for r in figures.replicas],
        ),
        *family(
            "gpuflow_service_errors_total",
            "5xx answers, by replica.",
            "counter",
            [(run | {"replica": r.replica}, r.errors) for r in figures.replicas],
        ),
        *family(
            "gpuflow_service_latency_ms",
            "Latency at the endpoint of a replica's requests (label quantile: 0.5, 0.95).",
            "gauge",
            [
                (run | {"replica": r.replica, "quantile": q}, value)
                for r in live
                for q, value in (("0.5", r.p50_ms), ("0.95", r.p95_ms))
                if value is not None
            ],
        ),
        *family(
            "gpuflow_service_cold_start_seconds",
            "A replica's start to its first passed readiness check.",
            "gauge",
            [
                (run | {"replica": r.replica}, r.cold_start_s)
                for r in figures.replicas
                if r.cold_start_s is not None
            ],
        ),
        *family(
            "gpuflow_service_replica_gpu_util",
            "Mean utilisation of a replica's GPUs over its life (in %).",
            "gauge",
            [(run | {"replica": r.replica}, r.gpu_util) for r in live if r.gpu_util is not None],
        ),
        *family(
            "gpuflow_service_gpu_seconds",
            "GPU-seconds the service's replicas held so far.",
            "gauge",
            [(run, figures.gpu_seconds)],
        ),
    ]
    costs = [
        ("gpuflow_service_cost_usd", "What the service cost so far (USD).", figures.cost_usd),
        (
            "gpuflow_service_cost_per_1000_requests_usd",
            "Cost per 1,000 requests so far (USD).",
            figures.cost_per_1000_requests_usd,
        ),
    ]
    for name, text, value in costs:
        if value is not None:
            lines += family(name, text, "gauge", [(run, value)])
    return "\n".join(lines) + "\n"
