"""What a Slurm run records and reads (its placement, its cluster state, the job states it tells apart) and how GPUs are asked of Slurm (gres)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from gpuflow.tasks.gpus import PRODUCTS
from gpuflow.tasks.host import gpuflow_home
from gpuflow.tasks.spec import Folder, Placement

# squeue's states of a job that still holds (or waits for) its allocation


# squeue's states of a job that still holds (or waits for) its allocation


# squeue's states of a job that still holds (or waits for) its allocation
ACTIVE = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "RESIZING",
)


# ... and those of one that Slurm took back to run later
REQUEUED = ("PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PREEMPTED")


# pending reasons that pass once other jobs end: waiting on them is waiting for capacity
BUSY = ("Resources", "Priority", "None", "BeginTime", "Dependency")


# how long a job whose GPUs are idle may wait for the scheduler to reach it (its main and
# backfill cycles: 60 s and 30 s by default) before gpuflow gives up on it
SCHEDULER_CYCLES_S = 120.0


class SlurmState(BaseModel):
    """What a Slurm cluster record holds of the run's allocation."""

    job_id: str
    gres_type: str | None = None  # the gres type of the run's GPUs ("h100"), None: untyped
    block: str | None = None  # the SlurmCluster block that says how the cluster is reached
    bundle: str | None = None  # the run's image unpacked (image:): its steps run in it
    library: str | None = None  # gpuflow's library for the steps in it (oci.library)


def workspace_root(spec_root: str | None) -> Path:
    """Return where the run's workspaces go: placement.workspace_root (a folder every node
    sees), else GPUFLOW_HOME/slurm on this machine (the login node's shared home)."""
    return Path(spec_root) if spec_root else gpuflow_home() / "slurm"


def gres_type(gpu_product: str | None, types: Mapping[str, str] | None = None) -> str | None:
    """Return the gres type a gpu_product maps to: the block's map (`types`), else the short
    name sites give it in gres.conf, its first alias in lower case (NVIDIA-H100-80GB-HBM3:
    h100); None: any type."""
    if not gpu_product:
        return None
    if types and gpu_product in types:
        return types[gpu_product]
    aliases = PRODUCTS.get(gpu_product, (0, ()))[1]
    return (aliases[0] if aliases else gpu_product).lower()


def gres(count: int, kind: str | None) -> str:
    return f"gpu:{kind}:{count}" if kind else f"gpu:{count}"


def minutes(seconds: float) -> int:
    return max(1, int(-(-seconds // 60)))


class SlurmPlacement(Placement):
    """placement: on a Slurm cluster: the partition, and the folder every node shares."""

    backend: Literal["slurm"] = "slurm"
    partition: str | None = Field(
        None, description="The partition the job runs in (default: the cluster's)."
    )
    workspace_root: Folder | None = Field(
        None, description="Folder for job workspaces, shared by every node."
    )

    def where(self) -> str | None:
        return self.block or self.partition
