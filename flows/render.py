"""render: a Blender render (kind: render) through gpu_pipeline, in chunks of frames."""

from __future__ import annotations

from typing import Any

from prefect import flow

from flows.pipeline import TEARDOWN_HOOKS, run_stages
from tasks.errors import InvalidSpec
from tasks.spec import JobSpec, load_spec


@flow(name="render", validate_parameters=False, **TEARDOWN_HOOKS)
def render(spec: JobSpec) -> Any:
    """Render a scene's frames to storage: provision, preflight, chunks, collect, teardown."""
    job = load_spec(spec.model_dump() if isinstance(spec, JobSpec) else spec)
    if job.job.kind != "render":
        raise InvalidSpec(
            f"job.kind: the render flow runs render jobs, not {job.job.kind}; use gpu_pipeline."
        )
    return run_stages(job)
