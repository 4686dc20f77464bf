"""gpuflow's Prefect block types: configuration and credentials."""

from blocks.local_host import LocalGpuHost

__all__ = ["LocalGpuHost"]
