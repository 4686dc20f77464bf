"""gpuflow: GPU work as Prefect pipelines.

From a Prefect user's own flow::

    from prefect import flow
    from gpuflow import CommandJob, JobSpec, Resources, gpu_job

    @flow
    def nightly():
        run = gpu_job(JobSpec(name="eval", job=CommandJob(command=["python", "eval.py"]),
                              resources=Resources(gpus=1)))
        print(run.exit_code, run.gpu_hours, run.cost_usd, run.url)

The names below load on first use: `import gpuflow` alone imports neither Prefect's engine
nor gpuflow's CLI, and `python -m gpuflow.tasks...` on a node stays quick.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # what an editor completes
    from gpuflow.api import JobRun, gpu_job, gpu_job_async, gpu_jobs, job_spec, offers
    from gpuflow.blocks import (
        AlibabaCredentials,
        CvmGpuFleet,
        Ec2GpuFleet,
        EcsGpuFleet,
        GpuFleet,
        GpuPriceTable,
        KubernetesGpuPool,
        LocalGpuHost,
        SlurmCluster,
        TencentCredentials,
    )
    from gpuflow.tasks.backends.alibaba.backend import AlibabaPlacement
    from gpuflow.tasks.backends.ec2.backend import Ec2Placement
    from gpuflow.tasks.backends.fleet.state import FleetPlacement
    from gpuflow.tasks.backends.kubernetes.backend import KubernetesPlacement
    from gpuflow.tasks.backends.local.backend import LocalPlacement
    from gpuflow.tasks.backends.slurm.model import SlurmPlacement
    from gpuflow.tasks.backends.tencent.backend import TencentPlacement
    from gpuflow.tasks.errors import (
        CapacityError,
        CollectError,
        GpuflowError,
        InvalidSpec,
        JobCancelled,
        JobFailed,
        PreemptedError,
        PreflightFailed,
        ProvisionError,
    )
    from gpuflow.tasks.hpc.model import HpcJob
    from gpuflow.tasks.kinds.command import CommandJob
    from gpuflow.tasks.kinds.matmul import MatmulJob
    from gpuflow.tasks.render.model import RenderJob
    from gpuflow.tasks.service.model import ServiceJob
    from gpuflow.tasks.spec import (
        IdleGpu,
        JobSpec,
        Limits,
        MetricsSettings,
        Placement,
        PlacementPolicy,
        Resources,
        RetryPolicy,
        StageRetry,
        Storage,
    )
    from gpuflow.tasks.stream.model import StreamJob
    from gpuflow.tasks.training.model import TrainJob

# public name -> the module it lives in
_PUBLIC = {
    **dict.fromkeys(
        ["JobRun", "gpu_job", "gpu_job_async", "gpu_jobs", "job_spec", "offers"], "gpuflow.api"
    ),
    **dict.fromkeys(
        [
            "AlibabaCredentials",
            "CvmGpuFleet",
            "Ec2GpuFleet",
            "EcsGpuFleet",
            "GpuFleet",
            "GpuPriceTable",
            "KubernetesGpuPool",
            "LocalGpuHost",
            "SlurmCluster",
            "TencentCredentials",
        ],
        "gpuflow.blocks",
    ),
    **dict.fromkeys(
        [
            "CapacityError",
            "CollectError",
            "GpuflowError",
            "InvalidSpec",
            "JobCancelled",
            "JobFailed",
            "PreemptedError",
            "PreflightFailed",
            "ProvisionError",
        ],
        "gpuflow.tasks.errors",
    ),
    **dict.fromkeys(
        [
            "IdleGpu",
            "JobSpec",
            "Limits",
            "MetricsSettings",
            "Placement",
            "PlacementPolicy",
            "Resources",
            "RetryPolicy",
            "StageRetry",
            "Storage",
        ],
        "gpuflow.tasks.spec",
    ),
    "CommandJob": "gpuflow.tasks.kinds.command",
    "MatmulJob": "gpuflow.tasks.kinds.matmul",
    "TrainJob": "gpuflow.tasks.training.model",
    "RenderJob": "gpuflow.tasks.render.model",
    "HpcJob": "gpuflow.tasks.hpc.model",
    "ServiceJob": "gpuflow.tasks.service.model",
    "StreamJob": "gpuflow.tasks.stream.model",
    # each backend's placement: the shared fields and its own
    "LocalPlacement": "gpuflow.tasks.backends.local.backend",
    "KubernetesPlacement": "gpuflow.tasks.backends.kubernetes.backend",
    "Ec2Placement": "gpuflow.tasks.backends.ec2.backend",
    "SlurmPlacement": "gpuflow.tasks.backends.slurm.model",
    "FleetPlacement": "gpuflow.tasks.backends.fleet.state",
    "AlibabaPlacement": "gpuflow.tasks.backends.alibaba.backend",
    "TencentPlacement": "gpuflow.tasks.backends.tencent.backend",
}

__all__ = [
    "AlibabaCredentials",
    "AlibabaPlacement",
    "CapacityError",
    "CollectError",
    "CommandJob",
    "CvmGpuFleet",
    "Ec2GpuFleet",
    "Ec2Placement",
    "EcsGpuFleet",
    "FleetPlacement",
    "GpuFleet",
    "GpuPriceTable",
    "GpuflowError",
    "HpcJob",
    "IdleGpu",
    "InvalidSpec",
    "JobCancelled",
    "JobFailed",
    "JobRun",
    "JobSpec",
    "KubernetesGpuPool",
    "KubernetesPlacement",
    "Limits",
    "LocalGpuHost",
    "LocalPlacement",
    "MatmulJob",
    "MetricsSettings",
    "Placement",
    "PlacementPolicy",
    "PreemptedError",
    "PreflightFailed",
    "ProvisionError",
    "RenderJob",
    "Resources",
    "RetryPolicy",
    "ServiceJob",
    "SlurmCluster",
    "SlurmPlacement",
    "StageRetry",
    "Storage",
    "StreamJob",
    "TencentCredentials",
    "TencentPlacement",
    "TrainJob",
    "__version__",
    "gpu_job",
    "gpu_job_async",
    "gpu_jobs",
    "job_spec",
    "offers",
]


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name)
    if where is None:  # a job or placement model of a kind or backend registered later
        if name[:1].isupper() and name.endswith(("Job", "Placement")):
            import_module("gpuflow.tasks.pipeline.plugins")  # the built-in ones first
            registered = import_module("gpuflow.tasks.spec").registered_models()
            if name in registered:
                return registered[name]
        raise AttributeError(f"module 'gpuflow' has no attribute {name!r}")
    if where.startswith(("gpuflow.tasks.spec", "gpuflow.tasks.backends")):
        import_module("gpuflow.tasks.pipeline.plugins")  # every job and placement model
    value = getattr(import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
