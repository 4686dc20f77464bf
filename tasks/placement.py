"""Placement: the prices a job is costed at (placement.price_table), and whether checking a
spec needs the Prefect API, both before anything runs."""

from __future__ import annotations

from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import JobSpec, Placement


def resolve(spec: JobSpec) -> tuple[JobSpec, PriceTable]:
    """Return the spec and the prices to use: the GpuPriceTable block that
    placement.price_table names over the defaults. The backend then applies its own
    placement block (`Backend.configure`)."""
    return spec, _price_table(spec.placement.price_table)


def prices_for(placement: Placement) -> PriceTable:
    """Return the prices `placement` uses (its price_table's block over the defaults)."""
    return _price_table(placement.price_table)


def prices_named(name: str | None, field: str) -> PriceTable:
    """Return the prices of the GpuPriceTable block `name` given in `field` (a fleet's)."""
    return _price_table(name, field)


def needs_api(spec: JobSpec) -> bool:
    """Return True when checking `spec` reads Prefect: blocks it names (placement, prices,
    S3 credentials, secrets) or the `gpu` concurrency limit, for any of its candidates. Without any, every check runs
    before an API is chosen or started, so a typo costs no server start."""
    places = spec.candidates or (spec.placement,)
    return bool(
        any(p.reads_api() for p in places) or spec.storage.aws_credentials or spec.secret_env
    )


def _price_table(name: str | None, field: str = "placement.price_table") -> PriceTable:
    """Return the prices of the GpuPriceTable block `name` over the defaults (defaults for
    None); `field` names where it was given, in sentences."""
    if name is None:
        return PriceTable()

    # blocks import prefect-aws and prefect-kubernetes (about 1 s): read one only when used
    from gpuflow.blocks.prices import GpuPriceTable

    return load_block(
        GpuPriceTable,
        name,
        field,
        create=f"`gpuflow blocks init` or GpuPriceTable(...).save({name!r})",
        otherwise="remove the field",
    ).table()
