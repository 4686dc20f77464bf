"""Kind `matmul`: the GPU smoke job (gpuflow.tasks.kinds.matmul_run), reporting achieved TFLOP/s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from gpuflow.tasks.contract import Cluster, Needs, WorkUnit
from gpuflow.tasks.extras import installed
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.spec import JobSpec, SpecModel


class MatmulJob(SpecModel):
    """The smoke job: a torch matrix-multiply benchmark reporting achieved TFLOP/s."""

    kind: Literal["matmul"] = "matmul"
    size: int = Field(4096, ge=64, le=65536, description="Square matrix size n (n x n).")
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "bfloat16", description="Element type on GPU; the CPU path uses float32."
    )
    seconds: float = Field(5.0, gt=0, le=3600, description="How long to keep multiplying.")
    torch: bool = True


class MatmulKind(JobKind[MatmulJob]):
    name = "matmul"
    model = MatmulJob

    def uses_torch(self, spec: JobSpec) -> bool:
        # without torch (gpuflow's train extra) the smoke job multiplies with numpy on the
        # CPU and says so: there is no torch to check
        return super().uses_torch(spec) and installed("torch")

    def needs(self, spec: JobSpec) -> Needs:
        return Needs(gpuflow=True)  # gpuflow's own benchmark runs on the node

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        if installed("torch") or not cluster.capabilities.runs_here:
            return []
        return [
            {
                "name": "torch",
                "level": "warn",
                "message": "torch is not installed: the smoke job multiplies with numpy on the"
                " CPU; pip install 'gpuflow[train]' to measure the GPU.",
            }
        ]

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        job = self.job_of(spec)
        command = [sys.executable, "-m", "gpuflow.tasks.kinds.matmul_run", "--size", str(job.size)]
        command += ["--dtype", job.dtype, "--seconds", str(job.seconds)]
        return [WorkUnit(name="main", command=command)]

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        result = _result(artifacts)
        if "tflops" not in result:
            return Report()
        return Report(headline=[f"- **{result['tflops']} TFLOP/s** on {result.get('device')}"])

    def summary(self, job: dict[str, Any]) -> list[str]:
        if "tflops" not in job:
            return []
        library = ", numpy: torch is not installed" if "numpy" in job else ""
        return [f"  matmul: {job['tflops']} TFLOP/s on {job['device']} ({job['dtype']}{library})"]


def _result(artifacts: Path) -> dict[str, Any]:
    import json

    path = artifacts / "outputs" / "result.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
