"""LocalGpuHost: settings for running on this host (the embedded default)."""

from __future__ import annotations

from prefect.blocks.core import Block
from pydantic import Field


class LocalGpuHost(Block):
    """Where workspaces go on this host and what an hour of its GPUs costs.

    Examples:
        Save settings once, then point a job at them with `placement.block`:
        ```python
        from gpuflow.blocks import LocalGpuHost
        LocalGpuHost(workspace_root="/scratch/gpuflow", gpu_hourly_usd=1.2).save("workstation")
        ```
    """

    _block_type_name = "gpuflow Local GPU Host"
    _block_type_slug = "gpuflow-local-gpu-host"
    _description = "Settings for running gpuflow jobs on the host the flow runs on."

    workspace_root: str | None = Field(
        default=None,
        title="Workspace root",
        description="Folder for job workspaces; defaults to $GPUFLOW_HOME/workspaces.",
    )
    gpu_hourly_usd: float = Field(
        default=0.0,
        ge=0,
        title="GPU hourly price (USD)",
        description="What one GPU-hour on this host costs you (amortised), for cost reports.",
    )
    cpu_core_hourly_usd: float = Field(
        default=0.0, ge=0, title="CPU core hourly price (USD)", description="For CPU-only runs."
    )
    strict_gpu_limit: bool = Field(
        default=False,
        title="Require the `gpu` concurrency limit",
        description="Fail instead of running unthrottled when the limit `gpu` does not exist.",
    )
