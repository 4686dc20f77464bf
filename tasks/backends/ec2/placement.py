"""What a spec's `placement:` holds on EC2 (read by the backend and its catalog)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gpuflow.tasks.metrics.cost import PriceTable
from gpuflow.tasks.spec import JobSpec, Limits, Placement, Resources, placement_as


class Ec2Placement(Placement):
    """placement: on EC2: the market instances are rented on."""

    backend: Literal["ec2"] = "ec2"
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

    def label(self) -> str:
        return f"{super().label()} {self.market}"


class Ec2Ask(BaseModel):
    """What EC2 is asked for a run's instances: its resources, its placement (market,
    fleet block), its limits (the budget that caps an offer's price) and its prices. A
    cluster keeps this, never the spec, to launch its instances again after a loss."""

    resources: Resources
    placement: Ec2Placement
    limits: Limits
    prices: PriceTable = PriceTable()

    @classmethod
    def of(cls, spec: JobSpec, prices: PriceTable | None = None) -> Ec2Ask:
        return cls(
            resources=spec.resources,
            placement=placement_as(spec, Ec2Placement),
            limits=spec.limits,
            prices=prices or PriceTable(),
        )
