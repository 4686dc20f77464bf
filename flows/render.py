"""render: a Blender render (kind: render) through gpu_pipeline, in chunks of frames."""

from __future__ import annotations

from typing import Any

from prefect import flow

from gpuflow.flows.pipeline import TEARDOWN_HOOKS, run_kind
from gpuflow.tasks.spec import JobSpec


@flow(name="render", validate_parameters=False, **TEARDOWN_HOOKS)
def render(spec: JobSpec) -> Any:
    """Render a scene's frames to storage: provision, preflight, chunks, collect, teardown."""
    return run_kind(spec, "render")
