"""What a spec's `placement:` holds on EC2 (read by the backend and its catalog)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gpuflow.tasks.spec import Placement


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
