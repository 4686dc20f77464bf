"""train: a training job (kind: train) through gpu_pipeline."""

from __future__ import annotations

from typing import Any

from prefect import flow

from gpuflow.flows.pipeline import TEARDOWN_HOOKS, run_kind
from gpuflow.tasks.spec import JobSpec


@flow(name="train", validate_parameters=False, **TEARDOWN_HOOKS)
def train(spec: JobSpec) -> Any:
    """Train a model on webdataset shards: provision, preflight, torchrun, collect, teardown."""
    return run_kind(spec, "train")
