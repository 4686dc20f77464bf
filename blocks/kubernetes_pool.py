"""KubernetesGpuPool: where GPU flow runs go on a Kubernetes cluster, and how their pods ask
for GPUs. The cluster's credentials stay in prefect-kubernetes' own block."""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from prefect_kubernetes.credentials import KubernetesClusterConfig
from pydantic import Field

from gpuflow.tasks.gpus import GPU_RESOURCE as GPU


class KubernetesGpuPool(Block):
    """A Kubernetes work pool with GPU nodes: the cluster (a prefect-kubernetes
    KubernetesClusterConfig block), the namespace, and the job variables gpuflow's pool
    template takes (GPUs, product, tolerations, Kueue queue, priority).

    Examples:
        ```python
        from prefect_kubernetes.credentials import KubernetesClusterConfig
        from gpuflow.blocks import KubernetesGpuPool
        KubernetesGpuPool(
            cluster_config=KubernetesClusterConfig.load("prod"),
            work_pool_name="gpu-k8s",
            gpu_product="NVIDIA-H100-80GB-HBM3",
            queue_name="team-gpu",
        ).save("h100")
        ```
    """

    _block_type_name = "gpuflow Kubernetes GPU Pool"
    _block_type_slug = "gpuflow-kubernetes-gpu-pool"
    _description = "A Kubernetes work pool whose flow-run pods land on GPU nodes."

    cluster_config: KubernetesClusterConfig | None = Field(
        default=None,
        title="Cluster",
        description="prefect-kubernetes cluster config (kubeconfig); empty: in-cluster.",
    )
    work_pool_name: str = Field(
        default="gpu-kubernetes", title="Work pool", description="Prefect work pool name."
    )
    namespace: str = Field(default="default", title="Namespace")
    image: str | None = Field(
        default=None, title="Image", description="Image with gpuflow installed for flow runs."
    )
    gpu_count: int = Field(default=1, ge=0, le=64, title="GPUs per flow-run pod")
    gpu_product: str | None = Field(
        default=None,
        title="GPU product",
        description="nvidia.com/gpu.product node label, e.g. NVIDIA-H100-80GB-HBM3.",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=lambda: [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}],
        title="Tolerations",
    )
    gpu_hourly_usd: float | None = Field(
        default=None,
        ge=0,
        title="GPU hourly price (USD)",
        description="What one GPU of this cluster costs per hour (empty: the price table's).",
    )
    queue_name: str | None = Field(default=None, title="Kueue queue")
    priority_class_name: str | None = Field(default=None, title="Priority class")
    active_deadline_seconds: int = Field(default=86400, ge=1, title="Deadline (seconds)")
    service_account: str | None = Field(
        default=None,
        title="Unit pods' service account",
        description="The account whose API token unit pods mount (empty: no token is mounted).",
    )
    allow_privilege_escalation: bool = Field(
        default=False,
        title="Let unit pods gain privileges",
        description="Off: unit containers drop every capability and cannot gain privileges"
        " (setuid programs); on: the container runtime's defaults.",
    )

    def job_variables(self) -> dict[str, Any]:
        """Return the job variables for deployments on this pool (unset ones left out)."""
        values: dict[str, Any] = {
            "namespace": self.namespace,
            "image": self.image,
            "gpu_count": self.gpu_count,
            "gpu_product": self.gpu_product,
            "tolerations": self.tolerations,
            "queue_name": self.queue_name,
            "priority_class_name": self.priority_class_name,
            "active_deadline_seconds": self.active_deadline_seconds,
        }
        return {k: v for k, v in values.items() if v is not None}
