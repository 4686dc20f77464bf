"""hpc: an MPI job (kind: hpc) through the pipeline: inputs, build, mpirun, outputs."""

from __future__ import annotations

from typing import Any

from prefect import flow

from gpuflow.flows.pipeline import TEARDOWN_HOOKS, run_kind
from gpuflow.tasks.spec import JobSpec


@flow(name="hpc", validate_parameters=False, **TEARDOWN_HOOKS)
def hpc(spec: JobSpec) -> Any:
    """Run an MPI program (or the built-in MD workload) across ranks: provision, preflight,
    build and mpirun, collect, teardown."""
    return run_kind(spec, "hpc")
