"""Kind `render`: a Blender scene's frames rendered to storage in chunks.

Each chunk is a work unit: one Blender process for a run of frames, on one GPU, judged
by the frames it leaves (valid) in storage. The render stage hands chunks out as workers
free up, sized from measured start-up and per-frame times, and skips frames already in
storage (gpuflow.tasks.render.stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import Capabilities, Cluster, Needs, RunOutcome, UnitRunner, WorkUnit
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import JobKind, Report
from gpuflow.tasks.render import scene, stage
from gpuflow.tasks.render.model import RenderJob
from gpuflow.tasks.render.report import summary
from gpuflow.tasks.render.result import RenderResult
from gpuflow.tasks.render.units import units_for
from gpuflow.tasks.spec import JobSpec
from gpuflow.tasks.storage import StorageError, check_writable, s3_settings


class RenderKind(JobKind[RenderJob]):
    name = "render"
    model = RenderJob
    result = RenderResult
    flow = "gpuflow.flows.render:render"
    schedules_units = True  # chunks are handed out as GPU slots free up

    def uses_torch(self, spec: JobSpec) -> bool:
        return self.job_of(spec).torch

    def needs(self, spec: JobSpec) -> Needs:
        job = self.job_of(spec)
        inputs = {"job.scene": job.scene, "job.output": job.output}
        # in an image, its Blender (looked for there when it is pinned)
        programs = {"job.blender": job.blender} if spec.image is not None else {}
        return Needs(inputs=inputs, programs=programs, gpuflow=True)

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        job = self.job_of(spec)
        if not where.runs_here:
            for field, url in (("job.scene", job.scene), ("job.output", job.output)):
                if not url.startswith("s3://"):
                    raise InvalidSpec(
                        f"{field}: {url} is not in S3, and on {spec.placement.backend} chunks"
                        f" render on {where.where}, which read the scene and write frames"
                        " there; upload it and give an s3:// URL."
                    )
        try:
            settings = s3_settings(spec)
            check_writable(job.output, settings)
            if not (spec.image is not None and where.runs_here):  # else once it is pinned
                scene.plan(spec, settings, here=where.runs_here)
        except StorageError as exc:
            raise InvalidSpec(str(exc)) from None

    def check_in_image(self, spec: JobSpec, where: Capabilities) -> None:
        if where.runs_here:  # the image's Blender reads the scene
            try:
                scene.plan(spec, s3_settings(spec), here=True)
            except StorageError as exc:
                raise InvalidSpec(str(exc)) from None

    def nothing_to_do(self, spec: JobSpec, where: Capabilities) -> str | None:
        job = self.job_of(spec)
        settings = s3_settings(spec)
        plan = scene.plan(spec, settings, where.runs_here)
        if stage.frames_to_render(spec, plan, settings):
            return None
        return f"all {len(plan.frames)} frames are already in {job.output}"

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        return scene.preflight_checks(spec, s3_settings(spec), cluster.capabilities.runs_here)

    def units(self, spec: JobSpec, cluster: Cluster) -> list[WorkUnit]:
        plan = scene.plan(spec, s3_settings(spec), cluster.capabilities.runs_here)
        return units_for(spec, cluster, plan)

    def schedule(self, spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
        return stage.schedule(spec, runner, deadline)

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        return Report(lines=summary(Path(cluster.workspace) / "outputs", artifacts, spec.name))

    def summary(self, job: dict[str, Any]) -> list[str]:
        done = self.figures(job)
        if not isinstance(done, RenderResult):
            return []
        return [
            f"  rendered {done.frames_rendered} frames ({done.frames_skipped} already in"
            f" storage) in {done.chunks} chunk(s), {done.frames_per_s} frames/s -> {done.output}"
        ]
