"""A render's work units: chunks of frames, each one Blender process on one GPU slot,
rendered here (frames uploaded from this host) or, where units run elsewhere, by the chunk
program (gpuflow.tasks.render.pod_chunk), which fetches the scene and uploads its own frames."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Cluster, WorkUnit
from gpuflow.tasks.render.argv import RenderSettings, output_pattern, render_argv
from gpuflow.tasks.render.frames import ChunkSizer, blender_frames
from gpuflow.tasks.render.model import RenderJob
from gpuflow.tasks.render.pod_chunk import PodChunk
from gpuflow.tasks.render.scene import program_of
from gpuflow.tasks.spec import JobSpec, job_as


def workers(spec: JobSpec, cluster: Cluster) -> int:
    """Return how many chunks render at once: job.max_workers, else one per GPU."""
    return job_as(spec, RenderJob).max_workers or max(1, cluster.gpus_per_node * cluster.nodes)


def chunk_unit(
    spec: JobSpec,
    cluster: Cluster,
    plan: Any,
    frames: list[int],
    index: int,
    slot: tuple[int, int | None],
    scratch: Path,
) -> WorkUnit:
    """Return the unit that renders `frames` on `slot` (node, GPU or None): Blender writing
    into `scratch` on this host, or in a pod, the chunk program (gpuflow.tasks.render.pod_chunk)."""
    job = job_as(spec, RenderJob)
    pattern, _ = output_pattern(job.pattern)
    settings = settings_of(job, plan.device)
    if cluster.capabilities.runs_here:
        argv = render_argv(
            program_of(spec, here=True),
            plan.blend,
            str(scratch / pattern),
            blender_frames(frames),
            settings,
        )
    else:
        chunk = PodChunk(
            scene=job.scene,
            blend=job.blend,
            output=job.output,
            pattern=pattern,
            extension=plan.extension,
            file_format=plan.file_format,
            frames=list(frames),
            index=index,
            blender=job.blender,
            settings=settings,
        )
        argv = [sys.executable, "-m", "gpuflow.tasks.render.pod_chunk", "--chunk-json"]
        argv.append(chunk.model_dump_json(exclude_defaults=True))
    node, gpu = slot
    return WorkUnit(
        name=f"chunk-{index}",
        command=argv,
        # Blender's temporary folder lies in the chunk's scratch, which the run removes: a
        # Blender that is killed or stopped leaves none in the host's /tmp
        env={"TMPDIR": str(scratch)} if cluster.capabilities.runs_here else {},
        reads=[plan.root] if cluster.capabilities.runs_here else [],  # an image mounts it
        node=node,
        gpus=[gpu] if gpu is not None else [],
        frames=list(frames),
    )


def settings_of(job: RenderJob, device: str | None) -> Any:
    """Return the RenderSettings a chunk passes Blender: the job's overrides, the device."""
    return RenderSettings(
        engine=job.engine,
        device=device,
        samples=job.samples,
        resolution_x=job.resolution_x,
        resolution_y=job.resolution_y,
        resolution_percentage=job.resolution_percentage,
        threads=job.threads,
        file_format=job.file_format,
        denoise=job.denoise,
    )


def slots(spec: JobSpec, cluster: Cluster) -> list[tuple[int, int | None]]:
    """Return one (node, GPU) slot per worker: GPUs in turn over the nodes, None for none."""
    gpus = [(node, gpu) for gpu in cluster.gpu_indices for node in range(cluster.nodes)]
    count = workers(spec, cluster)
    if not gpus:
        return [(i % cluster.nodes, None) for i in range(count)]
    return [gpus[i % len(gpus)] for i in range(count)]


def units_for(
    spec: JobSpec, cluster: Cluster, plan: Any, frames: list[int] | None = None
) -> list[WorkUnit]:
    """Return the chunks that render `frames` (default: the plan's) as the render stage
    first hands them out, before any chunk's timing is known."""
    job = job_as(spec, RenderJob)
    pending = list(plan.frames if frames is None else frames)
    free = slots(spec, cluster)
    sizer = ChunkSizer(job.chunk, plan.info.load_s, len(free))
    units: list[WorkUnit] = []
    while pending:
        size = sizer.next(len(pending))
        chunk, pending = pending[:size], pending[size:]
        scratch = Path(cluster.workspace) / "frames" / str(len(units))
        units.append(
            chunk_unit(
                spec, cluster, plan, chunk, len(units), free[len(units) % len(free)], scratch
            )
        )
    return units
