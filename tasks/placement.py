"""Placement: a job's `placement.block` fills in host settings and prices before anything runs."""

from __future__ import annotations

from blocks.local_host import LocalGpuHost
from blocks.prices import GpuPriceTable
from tasks.errors import InvalidSpec
from tasks.metrics.cost import PriceTable
from tasks.spec import JobSpec


def resolve(spec: JobSpec) -> tuple[JobSpec, PriceTable]:
    """Return the spec with its placement block's settings applied, and the prices to use.

    Values written in the spec win over the block's.
    """
    prices = _price_table(spec.placement.price_table)
    name = spec.placement.block
    if name is None or spec.placement.backend != "local":
        return spec, prices  # other backends read their own block (KubernetesGpuPool, ...)

    try:
        host = LocalGpuHost.load(name)
    except ValueError:
        raise InvalidSpec(
            f"placement.block: there is no LocalGpuHost block named {name!r};"
            f" create it with LocalGpuHost(...).save({name!r}) or remove placement.block."
        ) from None
    placement = spec.placement.model_copy(
        update={
            "workspace_root": spec.placement.workspace_root or host.workspace_root,
            "strict_gpu_limit": spec.placement.strict_gpu_limit or host.strict_gpu_limit,
        }
    )
    backend = spec.placement.backend
    prices.gpu_hourly_usd[backend] = {"*": host.gpu_hourly_usd}
    prices.cpu_core_hourly_usd[backend] = host.cpu_core_hourly_usd
    return spec.model_copy(update={"placement": placement}), prices


def needs_api(spec: JobSpec) -> bool:
    """Return True when checking `spec` reads Prefect: blocks it names (placement, prices,
    S3 credentials, secrets) or the `gpu` concurrency limit. Without any, every check runs
    before an API is chosen or started, so a typo costs no server start."""
    placement = spec.placement
    return bool(
        placement.block
        or placement.price_table
        or placement.strict_gpu_limit
        or spec.storage.aws_credentials
        or spec.secret_env
    )


def _price_table(name: str | None) -> PriceTable:
    """Return the prices of the GpuPriceTable block `name` over the defaults (defaults for None)."""
    if name is None:
        return PriceTable()

    try:
        return GpuPriceTable.load(name).table()
    except ValueError:
        raise InvalidSpec(
            f"placement.price_table: there is no GpuPriceTable block named {name!r}; create it"
            " with `gpuflow blocks init` or GpuPriceTable(...).save(name), or remove the field."
        ) from None
