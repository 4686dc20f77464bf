"""The Kubernetes backend's state on a cluster record (kept in its Service's annotation)."""

from __future__ import annotations

from pydantic import BaseModel

from gpuflow.tasks.backends.kubernetes.manifests import KubeSettings
from gpuflow.tasks.host import Orchestrator


class KubeState(BaseModel):
    """What the Kubernetes backend keeps on its cluster record (the Service's annotation)."""

    block: str | None = None
    namespace: str
    # who runs it and where it is recorded, for `gpuflow reap --backend kubernetes`
    orchestrator: Orchestrator
    api_url: str | None = None
    gpu_wait_s: float = 0.0
    settings: KubeSettings
