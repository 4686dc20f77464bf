"""gpuflow's Prefect block types: configuration and credentials.

Register them with `prefect block register -m gpuflow.blocks` (or `gpuflow blocks init`, which also
creates the documents a fresh setup needs).
"""

from importlib.util import find_spec

from gpuflow.blocks.alibaba import AlibabaCredentials, EcsGpuFleet
from gpuflow.blocks.ec2_fleet import Ec2GpuFleet
from gpuflow.blocks.gpu_fleet import GpuFleet
from gpuflow.blocks.local_host import LocalGpuHost
from gpuflow.blocks.prices import GpuPriceTable
from gpuflow.blocks.registry_credentials import RegistryCredentials
from gpuflow.blocks.slurm_cluster import SlurmCluster
from gpuflow.blocks.tencent import CvmGpuFleet, TencentCredentials

# the Kubernetes pool's block holds prefect-kubernetes' cluster config: gpuflow[kubernetes]
if find_spec("prefect_kubernetes") is not None:
    from gpuflow.blocks.kubernetes_pool import KubernetesGpuPool

__all__ = [
    "AlibabaCredentials",
    "CvmGpuFleet",
    "Ec2GpuFleet",
    "EcsGpuFleet",
    "GpuFleet",
    "GpuPriceTable",
    "KubernetesGpuPool",
    "LocalGpuHost",
    "RegistryCredentials",
    "SlurmCluster",
    "TencentCredentials",
]
