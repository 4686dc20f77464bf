"""What a spec's `placement:` holds on a cloud that rents instances (EC2, Alibaba Cloud ECS,
Tencent Cloud CVM): the market instances are rented on, and what a run keeps of its spec
to launch its instances again after a loss."""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, Field

from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import JobSpec, Limits, Placement, Resources, placement_as


class InstancePlacement(Placement):
    """placement: on a cloud's instances: the market they are rented on. Each provider's
    backend registers its own subclass (its `backend` name)."""

    market: Literal["spot", "on-demand", "spot-then-on-demand"] = Field(
        "spot-then-on-demand",
        description="Rent spot instances, on-demand ones, or spot first then on-demand.",
    )
    on_demand_after: int = Field(
        2,
        ge=1,
        le=100,
        description="spot-then-on-demand: rent on-demand after this many spot interruptions.",
    )
    spot_price_limit: float | None = Field(
        None,
        gt=0,
        description="The most a spot instance may cost an hour, in the cloud's own currency"
        " (USD on AWS, CNY on Alibaba Cloud and Tencent Cloud); none: up to its on-demand"
        " price (Alibaba's SpotAsPriceGo).",
    )

    def label(self) -> str:
        return f"{super().label()} {self.market}"


class Ask(BaseModel):
    """What a cloud is asked for a run's instances: its resources, its placement (market,
    block), its limits (the budget that caps an offer's price) and its prices. A cluster
    keeps this, never the spec, to launch its instances again after a loss."""

    resources: Resources
    placement: InstancePlacement
    limits: Limits
    prices: PriceTable = PriceTable()
    prices_field: str = "placement.price_table"  # where the prices were named, in sentences

    @classmethod
    def of(cls, spec: JobSpec, prices: PriceTable | None = None) -> Self:
        return cls(
            resources=spec.resources,
            placement=placement_as(spec, InstancePlacement),
            limits=spec.limits,
            prices=prices or PriceTable(),
        )
