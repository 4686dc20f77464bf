"""gpuflow's Kubernetes worker: prefect-kubernetes' worker, plus the checks gpuflow makes on
job variables, made where every run passes — the worker — instead of only at deploy time.

A run started from the UI's run form or `prefect deployment run --job-variable` never goes
through `gpuflow deploy`, so its job variables are checked and completed here, before any
Kubernetes object is made: an ill-typed variable fails the submission with one sentence
(the run is marked Crashed with it), and `gpu_product` is merged into the pod's node
selector, which the base job template alone cannot do (it can place a whole map, not add a
key to one). Where no job variable names the pod's termination grace, the worker sets it from
the run's spec: its limits.stop_grace_s and the time gpuflow's teardown takes.

Prefect finds the worker type `gpuflow-kubernetes` through gpuflow's `prefect.collections`
entry point, so `prefect worker start --pool gpuflow-gpu-k8s --type gpuflow-kubernetes`
works wherever gpuflow is installed (the job image has it).
"""

from __future__ import annotations

from typing import Any

from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.platform.pool_template import (
    check_job_variables,
    default_gpu_template,
    flow_run_grace_seconds,
)

WORKER_TYPE = "gpuflow-kubernetes"


class GpuJobConfiguration(KubernetesWorkerJobConfiguration):
    """A flow-run Job made from checked job variables (gpu_product in the node selector)."""

    @classmethod
    async def from_template_and_values(
        cls, base_job_template: dict[str, Any], values: dict[str, Any], client: Any = None
    ):
        # Dotted overrides (env.FOO=...) are Prefect's own nested form: checked by their head.
        dotted = {k: v for k, v in values.items() if "." in k}
        checked = check_job_variables(
            base_job_template, {k: v for k, v in values.items() if k not in dotted}
        )
        known = base_job_template["variables"]["properties"]
        for key in dotted:
            if key.split(".", 1)[0] not in known:
                raise InvalidSpec(
                    f"job_variables.{key}: {key.split('.', 1)[0]!r} is not a variable of this"
                    f" work pool; known: {', '.join(sorted(known))}"
                )
        return await super().from_template_and_values(
            base_job_template, {**checked, **dotted}, client=client
        )

    @classmethod
    def _base_environment(cls) -> dict[str, str]:
        """The worker's Prefect settings the pod inherits, less PREFECT_HOME: a folder on the
        worker's host, which the pod cannot make (the job variable `env` may still set one)."""
        inherited = super()._base_environment()
        inherited.pop("PREFECT_HOME", None)
        return inherited

    def prepare_for_flow_run(self, flow_run: Any, *args: Any, **kwargs: Any) -> None:
        super().prepare_for_flow_run(flow_run, *args, **kwargs)
        pod = self.job_manifest["spec"]["template"]["spec"]
        if "terminationGracePeriodSeconds" not in pod:  # no job variable names one
            pod["terminationGracePeriodSeconds"] = flow_run_grace_seconds(flow_run.parameters)


class GpuKubernetesWorker(KubernetesWorker):
    """Runs flow runs of the gpuflow-gpu-k8s pool as Kubernetes Jobs on GPU nodes."""

    type: str = WORKER_TYPE
    job_configuration = GpuJobConfiguration
    _display_name = "gpuflow GPU Kubernetes"
    _description = (
        "Runs flow runs as Kubernetes Jobs on GPU nodes: GPU count and product, tolerations,"
        " deadline, /dev/shm, Kueue queue; job variables are checked before anything is made."
    )

    @classmethod
    def get_default_base_job_template(cls) -> dict[str, Any]:
        return default_gpu_template()
