"""gpuflow's Prefect block types: configuration and credentials.

Register them with `prefect block register -m blocks` (or `gpuflow blocks init`, which also
creates the documents a fresh setup needs).
"""

from blocks.ec2_fleet import Ec2GpuFleet
from blocks.kubernetes_pool import KubernetesGpuPool
from blocks.local_host import LocalGpuHost
from blocks.prices import GpuPriceTable
from blocks.slurm_cluster import SlurmCluster

__all__ = ["Ec2GpuFleet", "GpuPriceTable", "KubernetesGpuPool", "LocalGpuHost", "SlurmCluster"]
