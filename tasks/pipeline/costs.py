"""What a run's cluster is paid: the backend's own figure where it knows it, else the
price table's for what it holds."""

from __future__ import annotations

from typing import Any

from gpuflow.tasks.contract import Cluster
from gpuflow.tasks.metrics import cost as pricing
from gpuflow.tasks.spec import JobSpec


def hourly_paid(spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable) -> float:
    """Return what `cluster` is paid per hour: the backend's own figure where it knows it
    (an EC2 offer's spot price), else the price table's for what it holds."""
    if cluster.hourly_usd is not None:
        return cluster.hourly_usd
    return pricing.hourly_rate(prices, **_priced(spec, cluster))


def cost_of(
    spec: JobSpec, cluster: Cluster, prices: pricing.PriceTable, seconds: float
) -> pricing.Cost:
    """Return what holding `cluster` for `seconds` cost, at the price it is paid."""
    if cluster.hourly_usd is None:
        return pricing.run_cost(prices, **_priced(spec, cluster), seconds=seconds)
    paid = cluster.hourly_usd
    return pricing.Cost(
        usd=paid * seconds / 3600,
        hourly_usd=paid,
        breakdown={"gpu" if cluster.gpu_indices else "cpu": paid * seconds / 3600},
    )


def _priced(spec: JobSpec, cluster: Cluster) -> dict[str, Any]:
    """Return what is priced: the backend, the GPUs held, CPU cores and disk."""
    return {
        "backend": cluster.backend,
        "products": cluster.gpu_products * cluster.nodes,
        "cpu_cores": spec.resources.cpu or 1.0,
        "disk_bytes": spec.resources.disk,
    }
