"""Kind `matmul`: the GPU smoke job (tasks.jobs.matmul_run), reporting achieved TFLOP/s."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tasks.compute.base import Cluster, WorkUnit
from tasks.jobs.base import JobKind, Report
from tasks.spec import JobSpec, MatmulJob


class MatmulKind(JobKind):
    name = "matmul"
    model = MatmulJob

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        job = spec.job
        assert isinstance(job, MatmulJob)
        command = [sys.executable, "-m", "tasks.jobs.matmul_run", "--size", str(job.size)]
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
        return [f"  matmul: {job['tflops']} TFLOP/s on {job['device']} ({job['dtype']})"]


def _result(artifacts: Path) -> dict[str, Any]:
    import json

    path = artifacts / "outputs" / "result.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
