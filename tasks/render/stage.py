"""The render stage: chunks of frames as Prefect tasks, at most `workers` at once, each a
Blender process pinned to one GPU; frames uploaded as they are saved.

A chunk renders only those of its frames not yet in storage, so a retried chunk or a
rerun flow picks up where the last one stopped. Chunk sizes come from the spec, or are
measured: Blender's start-up (timed when the scene was inspected, then per chunk) against
its per-frame time (from its log), so that start-up costs about a tenth of a chunk.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.actions import ArtifactUpdate
from prefect.futures import as_completed
from pydantic import BaseModel

from gpuflow.tasks.api_client import api_client
from gpuflow.tasks.contract import JobResult, RunOutcome, UnitRunner
from gpuflow.tasks.errors import (
    PREEMPTED_EXIT_CODE,
    JobCancelled,
    JobFailed,
    PreemptedError,
    TransientError,
    retry_unless,
)
from gpuflow.tasks.render import logparse, pod_chunk, report
from gpuflow.tasks.render import scene as scenes
from gpuflow.tasks.render.argv import output_pattern
from gpuflow.tasks.render.frames import ChunkSizer, label
from gpuflow.tasks.render.model import RenderJob
from gpuflow.tasks.render.output import (
    FrameRecord,
    SavedFrames,
    Uploader,
    existing_frames,
    frame_url,
    make_thumbnail,
)
from gpuflow.tasks.render.result import RenderResult
from gpuflow.tasks.render.units import chunk_unit, slots
from gpuflow.tasks.spec import JobSpec, job_as
from gpuflow.tasks.storage import s3_settings, store_for

# Failures after which Blender still renders every frame, but not as asked.
WRONG_SETTINGS = ("device_unknown", "device_absent", "python_error")
PREVIEW_MAX_FRAMES = 2000


class ChunkFailed(JobFailed):
    """A chunk failed for a reason a retry will not fix."""


class ChunkCrashed(TransientError):
    """A chunk's Blender crashed or was killed; its saved frames are kept and a retry
    renders the rest."""


class ChunkResult(BaseModel):
    index: int
    frames: list[int]
    rendered: list[int] = []
    invocations: int = 0
    wall_s: float = 0.0
    per_frame_s: float | None = None  # wall seconds between frames saved, measured here
    startup_s: float | None = None  # wall seconds before the first frame, less one frame


class _Progress:
    """Frames done so far for one run, and its progress artifact, updated at most every
    `every_s` seconds (the API is not told about each of thousands of frames)."""

    def __init__(
        self, runner: UnitRunner, total: int, done: dict[int, FrameRecord], every_s: float = 1.0
    ) -> None:
        self.runner = runner  # runs the chunks on the run's backend, under its limits
        self.total = total
        self.records = dict(done)
        self.skipped = len(done)
        self.lock = threading.Lock()
        self.every_s = every_s
        self.artifact_id: Any = None
        self.last = 0.0

    def add(self, record: FrameRecord) -> None:
        with self.lock:
            self.records[record.frame] = record
        self.publish()

    def done(self, frames: list[int]) -> set[int]:
        with self.lock:
            return {f for f in frames if f in self.records}

    def publish(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.artifact_id is None or (not force and now - self.last < self.every_s):
            return
        self.last = now
        with self.lock:
            count = len(self.records)
        update = ArtifactUpdate(
            data=100.0 * count / max(1, self.total),
            description=f"{count} of {self.total} frames in storage",
        )
        with contextlib.suppress(Exception), api_client() as client:  # shown, never worth failing
            client.update_artifact(self.artifact_id, update)


@task(name="render-chunk", cache_policy=NO_CACHE)
def render_chunk(
    spec: JobSpec,
    progress: _Progress,
    plan: scenes.RenderPlan,
    frames: list[int],
    index: int,
    slot: tuple[int, int | None],
    deadline: float,
    thumb_frames: list[int],
) -> ChunkResult:
    """Render those of `frames` not yet in storage on `slot` (node, GPU); raise
    ChunkCrashed (retried) when Blender died, ChunkFailed when the scene or settings are
    at fault."""
    job = job_as(spec, RenderJob)
    runner = progress.runner
    cluster = runner.cluster
    todo = [f for f in frames if f not in progress.done(frames)]
    result = ChunkResult(index=index, frames=frames)
    if not todo:
        return result
    here = cluster.capabilities.runs_here  # else in a pod, which uploads its own frames
    attempt = f"{index}-{time.monotonic_ns()}"
    scratch = Path(cluster.workspace) / "frames" / attempt
    if here:
        scratch.mkdir(parents=True, exist_ok=True)
    pattern, _ = output_pattern(job.pattern)
    unit = chunk_unit(spec, cluster, plan, todo, index, slot, scratch)
    s3 = runner.storage
    uploader = Uploader(
        store_for(job.output, s3),
        job.output,
        pattern,
        plan.extension,
        plan.file_format,
        index,
        Path(cluster.workspace) / "thumbs",
        set(thumb_frames),
        progress.add,
    )
    saved = SavedFrames(scratch, pattern, plan.extension, todo, uploader)
    expect = partial(frame_url, job.output, pattern, extension=plan.extension)
    said = _ChunkLines(index, todo, saved, progress, here, expect)
    started = time.monotonic()
    # a pod uploads its frames itself: it gets this host's access to storage
    storage_env = {} if here else s3.child_env()
    try:
        run = runner.run(unit, said.on_line, storage_env, deadline)
    finally:
        saved.hand_over(None)
        uploader.finish()  # frames Blender saved are uploaded even when we are interrupted
        shutil.rmtree(scratch, ignore_errors=True)
    result.invocations = 1
    result.wall_s = run.duration_s
    saved_at = saved.saved_at
    if len(saved_at) >= 2:
        result.per_frame_s = (saved_at[-1] - saved_at[0]) / (len(saved_at) - 1)
        result.startup_s = max(0.0, saved_at[0] - started - result.per_frame_s)
    result.rendered = sorted(progress.done(todo))
    said.problems |= uploader.problems
    return _judged(result, todo, run, runner, said)


class _ChunkLines:
    """A chunk's lines as they come: frames saved here (handed to the uploader), records of
    frames a pod uploaded itself, Blender's log for the verdict, and its last lines."""

    def __init__(
        self,
        index: int,
        todo: list[int],
        saved: SavedFrames,
        progress: _Progress,
        here: bool,
        expect: Callable[[int], str],
    ) -> None:
        self.index, self.todo, self.saved, self.progress = index, todo, saved, progress
        self.here, self.expect = here, expect  # expect: a frame's URL in storage
        self.problems: dict[int, str] = {}  # what the pod said of frames it could not upload
        self.log = logparse.RenderLog()
        self.last: deque[str] = deque(maxlen=20)
        self.logger = get_run_logger()

    def _from_pod(self, line: str) -> bool:
        said = pod_chunk.record_of(line)
        if isinstance(said, FrameRecord):
            # the chunk's own frames, where they belong (not a look-alike line of the scene's)
            if said.frame in self.todo and said.url == self.expect(said.frame):
                self.progress.add(said)
        elif said is not None:
            self.problems[said[0]] = said[1]
        return said is not None

    def on_line(self, stream: str, line: str) -> None:
        if not self.here and self._from_pod(line):
            return
        self.log.feed(line)
        if self.here and self.saved.feed(line):
            return
        if not self.here and logparse.saved_path(line) is not None:
            self.saved.saved_at.append(time.monotonic())
        elif "Fra:" not in line:
            redacted = self.progress.runner.redact(line)
            self.last.append(redacted)
            if line.strip():
                self.logger.info("chunk %d: %s", self.index, redacted)


def _judged(
    result: ChunkResult, todo: list[int], run: JobResult, runner: UnitRunner, said: _ChunkLines
) -> ChunkResult:
    """Return the chunk's result when its frames are in storage; else raise what its end
    says: stopped (idle, cancelled), preempted where the pool moves on, rendered with the
    wrong settings, or its frames missing."""
    index = result.index
    idled = runner.idle_stop()
    if run.cancelled and idled:
        raise ChunkFailed(f"chunk {index} (frames {label(todo)}): {idled.rstrip('.')}.")
    if run.cancelled:
        raise JobCancelled("the run was cancelled while frames rendered; Blender was stopped")
    missing = [f for f in todo if f not in result.rendered]
    if run.exit_code == PREEMPTED_EXIT_CODE and PreemptedError in runner.handed_on:
        # its machine is being taken back (even when Blender had just finished): the run's
        # pool resumes the render elsewhere, where the frames saved here are in storage
        left = f"frames {label(missing)} to render" if missing else "its frames rendered"
        raise PreemptedError(
            f"chunk {index} was preempted with {left}; the render resumes on the next"
            " candidate with the frames not in storage"
        )
    wrong = logparse.classify(said.log, run.exit_code, run.signal)
    if wrong is not None and wrong.kind in WRONG_SETTINGS:
        # The frames exist but were not rendered as asked (on the CPU, without the settings).
        raise ChunkFailed(f"chunk {index} (frames {label(todo)}): {wrong.message}.")
    said.logger.info(
        "chunk %d: frames %s rendered in %.1f s (%d in storage)",
        index,
        label(todo),
        run.duration_s,
        len(result.rendered),
    )
    if not missing:
        return result
    lines = list(said.last)
    raise _chunk_error(index, missing, said.log, run, said.problems, lines, runner.limit)


def _chunk_error(
    index: int,
    missing: list[int],
    log: logparse.RenderLog,
    run: JobResult,
    problems: dict[int, str],
    lines: list[str],
    limit: str,
) -> Exception:
    where = f"chunk {index} (frames {label(missing)} missing)"
    if run.timed_out:
        return ChunkFailed(
            f"{where}: the render ran past limits.{limit} and was stopped; raise it."
        )
    failure = logparse.classify(log, run.exit_code, run.signal)
    if failure is not None:
        kind = ChunkCrashed if failure.transient else ChunkFailed
        return kind(f"{where}: {failure.message}.")
    bad = [f"frame {f} {problems[f]}" for f in missing if f in problems]
    if bad:
        return ChunkFailed(f"{where}: {'; '.join(bad[:5])}.")
    last = " | ".join(line for line in lines[-3:] if line.strip()) or "nothing"
    return ChunkFailed(
        f"{where}: Blender exited {run.exit_code} without writing them; its last lines: {last}."
    )


def frames_to_render(spec: JobSpec, plan: scenes.RenderPlan, s3: Any) -> list[int]:
    """Return the planned frames not yet present and valid in storage."""
    job = job_as(spec, RenderJob)
    pattern, _ = output_pattern(job.pattern)
    found, _ = existing_frames(
        store_for(job.output, s3),
        job.output,
        pattern,
        plan.frames,
        plan.extension,
        plan.file_format,
    )
    return [f for f in plan.frames if f not in found]


def schedule(spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
    """The run stage of a render job: chunks until `deadline` (time.time()); writes
    outputs/result.json with the render's figures for collect."""
    outcome, figures = render_frames(spec, runner, deadline)
    outputs = Path(runner.cluster.workspace) / "outputs"
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / "result.json").write_text(figures.model_dump_json(indent=1))
    return outcome


def render_frames(
    spec: JobSpec, runner: UnitRunner, deadline: float
) -> tuple[RunOutcome, RenderResult]:
    """Render every planned frame not yet in storage; return the outcome (a failure
    sentence when a chunk failed for good) and the figures for result.json."""
    job = job_as(spec, RenderJob)
    logger = get_run_logger()
    cluster = runner.cluster
    s3 = s3_settings(spec)
    plan = scenes.plan(spec, s3, cluster.capabilities.runs_here)
    pattern, note = output_pattern(job.pattern)
    for warning in [*([note] if note else []), *plan.warnings]:
        logger.warning("%s", warning)
    store = store_for(job.output, s3)
    found, broken = existing_frames(
        store, job.output, pattern, plan.frames, plan.extension, plan.file_format
    )
    for line in broken:
        logger.warning("%s", line)
    todo = [f for f in plan.frames if f not in found]
    free_slots = slots(spec, cluster)
    workers = len(free_slots)
    logger.info(
        "render %s: %d frames, %d already in %s, %d to render with %d worker(s)",
        Path(plan.blend).name,
        len(plan.frames),
        len(found),
        job.output,
        len(todo),
        workers,
    )
    progress = _Progress(runner, len(plan.frames), found)
    progress.artifact_id = create_progress_artifact(
        100.0 * len(found) / len(plan.frames),
        key="gpuflow-render-progress",
        description=f"{len(found)} of {len(plan.frames)} frames in storage",
    )
    thumbs = set(report.sheet_frames(plan.frames)) if job.contact_sheet else set()
    if job.preview_video and shutil.which("ffmpeg") and len(plan.frames) <= PREVIEW_MAX_FRAMES:
        thumbs = set(plan.frames)
    started = datetime.now(UTC)
    try:
        results, failure, handed = _chunks(spec, plan, progress, todo, free_slots, thumbs, deadline)
    finally:
        progress.publish(force=True)
    if handed is not None and failure is None:
        raise handed
    ended = datetime.now(UTC)
    figures = _figures(plan, progress, results, (ended - started).total_seconds(), job.output)
    records = list(progress.records.values())
    outputs = Path(cluster.workspace) / "outputs"
    _write_report(outputs, records, Path(cluster.workspace) / "thumbs", plan, spec, store)
    result = JobResult(
        exit_code=1 if failure else 0,
        started_at=started,
        ended_at=ended,
        duration_s=(ended - started).total_seconds(),
        log_tail=[failure] if failure else [],
    )
    return RunOutcome(result=result, failure=failure), figures


def _chunks(
    spec: JobSpec,
    plan: scenes.RenderPlan,
    progress: _Progress,
    todo: list[int],
    free_slots: list[tuple[int, int | None]],
    thumbs: set[int],
    deadline: float,
) -> tuple[list[ChunkResult], str | None, Exception | None]:
    """Hand `todo` out in chunks (sized as they go) to the free slots, a chunk task per
    slot at a time; return the chunks' results, the first failure for good, and the first
    error the run's pool moves on for (no chunk starts after either)."""
    job = job_as(spec, RenderJob)
    runner = progress.runner
    sizer = ChunkSizer(job.chunk, plan.info.load_s, len(free_slots))
    # what the run's pool hands to its next candidate is not retried here
    chunk_task = render_chunk.with_options(
        retries=job.chunk_retries,
        retry_delay_seconds=1,
        retry_condition_fn=retry_unless(*runner.handed_on),
    )
    handed: Exception | None = None
    results: list[ChunkResult] = []
    failure: str | None = None
    pending = list(todo)
    in_flight: dict[Any, Any] = {}  # future -> the slot it holds
    submitted = 0
    while pending or in_flight:
        while pending and free_slots and failure is None:
            size = sizer.next(len(pending))
            frames, pending = pending[:size], pending[size:]
            slot = free_slots.pop(0)
            future = chunk_task.submit(
                spec, progress, plan, frames, submitted, slot, deadline,
                sorted(thumbs & set(frames)),
            )  # fmt: skip
            in_flight[future] = slot
            submitted += 1
        if not in_flight:
            break
        future = next(as_completed(list(in_flight)))
        free_slots.append(in_flight.pop(future))
        try:
            chunk_result = future.result()
        except JobCancelled:
            raise
        except runner.handed_on as exc:  # the pool moves the render on: no more chunks here
            handed = handed or exc
            pending = []  # those running finish their frames (or are preempted too)
            continue
        except Exception as exc:
            failure = failure or str(exc)
            pending = []  # stop starting chunks; those running finish their frames
            continue
        results.append(chunk_result)
        if chunk_result.per_frame_s is not None and chunk_result.startup_s is not None:
            sizer.learn(chunk_result.per_frame_s, chunk_result.startup_s)
    return results, failure, handed


def _figures(
    plan: scenes.RenderPlan,
    progress: _Progress,
    results: list[ChunkResult],
    seconds: float,
    output: str,
) -> RenderResult:
    """Return the render's figures for result.json."""
    records = list(progress.records.values())
    rendered = sum(len(r.rendered) for r in results)
    return RenderResult(
        frames=len(plan.frames),
        frames_skipped=progress.skipped,
        frames_rendered=len(records) - progress.skipped,
        frames_missing=len(plan.frames) - len(records),
        chunks=len(results),
        blender_invocations=sum(r.invocations for r in results),
        render_s=round(seconds, 3),
        blender_s=round(sum(r.wall_s for r in results), 3),
        frames_per_s=round(rendered / max(1e-9, seconds), 3),
        mean_frame_s=round(statistics.mean([r.seconds for r in records if r.seconds] or [0]), 4),
        blender=plan.info.blender,
        engine=plan.engine,
        output=output,
    )


def _write_report(
    outputs: Path,
    records: list[FrameRecord],
    thumbs_dir: Path,
    plan: scenes.RenderPlan,
    spec: JobSpec,
    store: Any,
) -> None:
    job = job_as(spec, RenderJob)
    outputs.mkdir(parents=True, exist_ok=True)
    (outputs / "frames.json").write_text(
        json.dumps([r.model_dump() for r in sorted(records, key=lambda r: r.frame)], indent=1)
    )
    thumbnails = {r.frame: Path(r.thumbnail) for r in records if r.thumbnail}
    wanted = (
        set(report.sheet_frames(sorted(r.frame for r in records))) if job.contact_sheet else set()
    )
    fetch = set(wanted)  # frames from an earlier run: fetch the few the sheet shows
    if job.preview_video and shutil.which("ffmpeg") and len(records) <= PREVIEW_MAX_FRAMES:
        fetch |= {r.frame for r in records if r.chunk is not None}  # rendered in pods
    for record in records:
        if record.frame in fetch and record.frame not in thumbnails:
            thumbnails.update(_thumbnail_from_store(store, record, thumbs_dir))
    if job.contact_sheet:
        sheet = {f: p for f, p in thumbnails.items() if f in wanted}
        report.contact_sheet(
            sheet, outputs / "contact-sheet.png", f"{spec.name}: {len(records)} frames"
        )
    if job.preview_video:
        report.preview_video(thumbnails, outputs / "preview.mp4", plan.info.fps)


def _thumbnail_from_store(store: Any, record: FrameRecord, thumbs_dir: Path) -> dict[int, Path]:
    scratch = thumbs_dir / f"fetched-{record.frame}{Path(record.url).suffix}"
    scratch.parent.mkdir(parents=True, exist_ok=True)
    try:
        store.download_file(record.url, scratch)
        made = make_thumbnail(scratch, thumbs_dir / f"{record.frame}.png")
    except Exception:
        return {}
    finally:
        scratch.unlink(missing_ok=True)
    return {record.frame: Path(made)} if made else {}
