"""Kind `render`: a Blender scene's frames rendered to storage in chunks.

Each chunk is a work unit: one Blender process for a run of frames, on one GPU, judged
by the frames it leaves (valid) in storage. The render stage hands chunks out as workers
free up, sized from measured start-up and per-frame times, and skips frames already in
storage (tasks.render.stage).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tasks.compute.base import Cluster, WorkUnit
from tasks.errors import InvalidSpec
from tasks.jobs.base import JobKind, Report
from tasks.spec import JobSpec, RenderJob
from tasks.storage import s3_settings


class RenderKind(JobKind):
    name = "render"
    model = RenderJob
    flow = "flows.render:render"

    def check(self, spec: JobSpec) -> None:
        from tasks.render import scene
        from tasks.storage import StorageError, check_writable

        assert isinstance(spec.job, RenderJob)
        if not renders_here(spec.placement.backend):
            for field, url in (("job.scene", spec.job.scene), ("job.output", spec.job.output)):
                if not url.startswith("s3://"):
                    raise InvalidSpec(
                        f"{field}: {url} is not in S3, and on {spec.placement.backend} chunks"
                        " render on the cluster's nodes, which read the scene and write frames"
                        " there; upload it and give an s3:// URL."
                    )
        try:
            settings = s3_settings(spec)
            check_writable(spec.job.output, settings)
            scene.plan(spec, settings)
        except StorageError as exc:
            raise InvalidSpec(str(exc)) from None

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        from tasks.render.scene import preflight_checks

        return preflight_checks(spec, s3_settings(spec))

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        from tasks.render.scene import plan

        return units_for(spec, cluster, plan(spec, s3_settings(spec)))

    def run_stage(self, spec: JobSpec, cluster: Cluster, prices: Any, flow_run_id: str) -> Any:
        from tasks.render.stage import render_stage

        return render_stage(spec, cluster, prices, flow_run_id)

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        from tasks.render.report import summary

        return Report(lines=summary(Path(cluster.workspace) / "outputs", artifacts, spec.name))

    def summary(self, job: dict[str, Any]) -> list[str]:
        if "frames_rendered" not in job:
            return []
        return [
            f"  rendered {job['frames_rendered']} frames ({job['frames_skipped']} already in"
            f" storage) in {job['chunks']} chunk(s), {job['frames_per_s']} frames/s -> {job['output']}"
        ]


def workers(spec: JobSpec, cluster: Cluster) -> int:
    """Return how many chunks render at once: job.max_workers, else one per GPU."""
    assert isinstance(spec.job, RenderJob)
    return spec.job.max_workers or max(1, cluster.gpus_per_node * cluster.nodes)


def renders_here(backend: str) -> bool:
    """Say whether chunks render on this host (Blender's frames uploaded from here), rather
    than in pods that fetch the scene and upload their frames themselves."""
    from tasks.compute import get_backend

    return bool(get_backend(backend).checks_host)


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
    into `scratch` on this host, or in a pod, the chunk program (tasks.render.pod_chunk)."""
    from tasks.render.argv import output_pattern, render_argv
    from tasks.render.frames import blender_frames
    from tasks.render.scene import blender_program

    job = spec.job
    assert isinstance(job, RenderJob)
    pattern, _ = output_pattern(job.pattern)
    settings = settings_of(job, plan.device)
    if renders_here(cluster.backend):
        argv = render_argv(
            blender_program(job),
            plan.blend,
            str(scratch / pattern),
            blender_frames(frames),
            settings,
        )
    else:
        from tasks.render.pod_chunk import PodChunk

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
        argv = [sys.executable, "-m", "tasks.render.pod_chunk", "--chunk-json"]
        argv.append(chunk.model_dump_json(exclude_defaults=True))
    node, gpu = slot
    return WorkUnit(
        name=f"chunk-{index}",
        command=argv,
        node=node,
        gpus=[gpu] if gpu is not None else [],
        judge="frames",
        frames=list(frames),
    )


def settings_of(job: RenderJob, device: str | None) -> Any:
    """Return the RenderSettings a chunk passes Blender: the job's overrides, the device."""
    from tasks.render.argv import RenderSettings

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
    from tasks.render.frames import ChunkSizer

    job = spec.job
    assert isinstance(job, RenderJob)
    pending = list(plan.frames if frames is None else frames)
    free = slots(spec, cluster)
    sizer = ChunkSizer(job.chunk, plan.info.load_s, len(free))
    units = []
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
