"""train: a training job (kind: train) through gpu_pipeline."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.pipeline import TEARDOWN_HOOKS, run_stages
from tasks.errors import InvalidSpec
from tasks.spec import JobSpec, load_spec


@flow(name="train", validate_parameters=False, **TEARDOWN_HOOKS)
def train(spec: JobSpec) -> Any:
    """Train a model on webdataset shards: provision, preflight, torchrun, collect, teardown."""
    job = load_spec(spec.model_dump() if isinstance(spec, JobSpec) else spec)
    if job.job.kind != "train":
        raise InvalidSpec(
            f"job.kind: the train flow runs train jobs, not {job.job.kind}; use gpu_pipeline."
        )
    return run_stages(job)
