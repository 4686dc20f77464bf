"""What the fleet backend records of a run here (its placement, its hosts held, its record files) and how it reads its GpuFleet block and SSH key."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field

from gpuflow.tasks.host import (
    gpuflow_home,
)
from gpuflow.tasks.saved_blocks import load_block
from gpuflow.tasks.spec import Placement

if TYPE_CHECKING:
    from gpuflow.blocks.gpu_fleet import GpuFleet


PYTHON = "{python}"  # gpuflow's interpreter on the host (as the host program reads it)


STAGED = "{staged}"  # the host's folder of files staged for runs (as the host program reads it)


class FleetPlacement(Placement):
    """placement: for a fleet: which GpuFleet block."""

    backend: Literal["fleet"] = "fleet"
    fleet: str = Field(min_length=1, description="Name of the GpuFleet block the job runs on.")

    def where(self) -> str | None:
        return self.fleet

    def reads_api(self) -> bool:
        return True


class HostHold(BaseModel):
    """One node of a run: the host, and what its host program claimed there."""

    host: str
    address: str
    remote: str  # the run's name on the host (its local backend's cluster)
    gpu_indices: list[int] = []
    workspace: str = ""


class FleetState(BaseModel):
    fleet: str
    lease_s: float
    holds: list[HostHold] = []


def fleet_block(name: str) -> GpuFleet:
    from gpuflow.blocks.gpu_fleet import GpuFleet

    return load_block(
        GpuFleet,
        name,
        "placement.fleet",
        create=f"`gpuflow fleet apply FLEET.yaml` (or GpuFleet(hosts=[...]).save({name!r}))",
    )


def secret_text(name: str) -> str:
    """Return the text of the Secret block `name` (a fleet's private key)."""
    from prefect.blocks.system import Secret

    value = load_block(Secret, name, "ssh_key", create=f"Secret(value=KEY).save({name!r})").get()
    return value if isinstance(value, str) else json.dumps(value)


def record_path(name: str) -> Path:
    return gpuflow_home() / "fleet" / "clusters" / f"{name}.json"


def api_url(name: str) -> str | None:
    """Return the Prefect API the run `name` was recorded in (None: not known)."""
    path = record_path(name).with_suffix(".api")
    with contextlib.suppress(OSError):
        return path.read_text().strip() or None
    return None
