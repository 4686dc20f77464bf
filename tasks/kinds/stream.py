"""Kind `stream`: an interactive render session streamed to browsers, a service whose
replica is gpuflow's session server (gpuflow.tasks.stream, docs/streaming.md)."""

from __future__ import annotations

import importlib.util
import json
import secrets
from pathlib import Path
from typing import Any

from gpuflow.tasks.contract import RUN_LABEL, Capabilities, Cluster, Needs, RunOutcome, UnitRunner
from gpuflow.tasks.errors import InvalidSpec
from gpuflow.tasks.kinds.base import Report
from gpuflow.tasks.kinds.service import ServiceKind
from gpuflow.tasks.service.serve import serve
from gpuflow.tasks.spec import JobSpec, job_as
from gpuflow.tasks.stream import encode
from gpuflow.tasks.stream.model import StreamFigures, StreamJob

# sizes the preflight's short encode tries, the largest first
SIZES = [(3840, 2160), (2560, 1440), (1920, 1080), (1280, 720), (854, 480), (640, 360)]


class StreamKind(ServiceKind):
    name = "stream"
    model = StreamJob

    def extra(self, spec: JobSpec, where: Capabilities) -> str | None:
        return "stream" if where.runs_here else None  # the session's encoder (PyAV)

    def needs(self, spec: JobSpec) -> Needs:
        return super().needs(spec).model_copy(update={"gpuflow": True})  # its session server

    def check(self, spec: JobSpec, where: Capabilities) -> None:
        job = job_as(spec, StreamJob)
        if where.serves_replicas:
            raise InvalidSpec(
                f"placement.backend: a stream session needs gpuflow's own endpoint, which"
                f" sees each client's connection; {spec.placement.backend} keeps a service's"
                " replicas itself; run it on this machine (local) or a fleet."
            )
        gpus = job.replica_gpus if job.replica_gpus is not None else spec.resources.gpus
        if job.encoder == "nvenc" and gpus == 0:
            raise InvalidSpec(
                "job.encoder: nvenc encodes on an NVIDIA GPU, but resources.gpus is 0; ask"
                " for a GPU (resources.gpus: 1) or use encoder x264 (or auto)."
            )
        if job.renderer:
            module, colon, factory = job.renderer.partition(":")
            if not colon or not module or not factory:
                raise InvalidSpec(
                    f"job.renderer: {job.renderer!r} is not module:factory; give e.g."
                    " my_scene:make (factory(width, height) returns render(camera, t))."
                )
            in_workdir = job.workdir and (
                (Path(job.workdir) / (module.replace(".", "/") + ".py")).is_file()
                or (Path(job.workdir) / module.split(".")[0]).is_dir()
            )
            if where.runs_here and not in_workdir and importlib.util.find_spec(module) is None:
                raise InvalidSpec(
                    f"job.renderer: module {module!r} cannot be imported here; put it in"
                    " job.workdir, or install it."
                )
        super().check(spec, where)

    def schedule(self, spec: JobSpec, runner: UnitRunner, deadline: float) -> RunOutcome:
        """Serve the session; its replicas push their figures to the run's Pushgateway."""
        job = job_as(spec, StreamJob)
        # a replica on this machine listens on loopback, behind the endpoint; on a fleet's
        # host where the endpoint here reaches it
        command = [*job.command, f"--host={'0.0.0.0' if job.replica_claims else '127.0.0.1'}"]
        gateway = spec.metrics.pushgateway
        if gateway:
            run_id = runner.cluster.owner.get(RUN_LABEL, runner.cluster.name)
            command += [
                f"--pushgateway={gateway}",
                f"--run-id={run_id}",
                f"--job={spec.name}",
                f"--push-interval-s={spec.metrics.push_interval_s:g}",
            ]
        spec = spec.model_copy(update={"job": job.model_copy(update={"command": command})})
        # the session's own key: its page and WebSocket admit only who holds it
        return serve(spec, runner, deadline, key=secrets.token_urlsafe(24))

    def preflight_rows(self, spec: JobSpec, cluster: Cluster) -> list[dict[str, str]]:
        """How the session will encode, and the largest size and rate this host keeps up
        with, from a short encode at each size (where the session runs here)."""
        job = job_as(spec, StreamJob)
        if not cluster.capabilities.runs_here:
            return [
                {
                    "name": "stream-encoder",
                    "level": "pass",
                    "message": "the session chooses its encoder on its host and says so"
                    " in the run's log when a client connects.",
                }
            ]
        try:
            kind, why = encode.choose(job.encoder, bool(cluster.gpu_indices))
        except encode.EncoderError as exc:
            return [{"name": "stream-encoder", "level": "fail", "message": f"{exc}."}]
        asked = (job.width, job.height)
        sizes = [size for size in SIZES if size[0] * size[1] <= asked[0] * asked[1]]
        if asked not in sizes:
            sizes.insert(0, asked)
        measured = encode.keeps_up(kind, sizes[:3], job.fps, frames=12)
        fits = [row for row in measured if row["fps"] >= job.fps]
        at_asked = measured[0]
        rows = [
            {
                "name": "stream-encoder",
                "level": "pass",
                "message": f"encodes with {why}; {', '.join(_said(row) for row in measured)}.",
            }
        ]
        if at_asked["fps"] < job.fps:
            best = (
                f"; {fits[0]['width']}x{fits[0]['height']} keeps up"
                if fits
                else "; no size tried keeps up"
            )
            rows.append(
                {
                    "name": "stream-keeps-up",
                    "level": "warn",
                    "message": f"{job.width}x{job.height} encodes at {at_asked['fps']} fps here,"
                    f" below the {job.fps} fps asked for{best}; frames will be dropped.",
                }
            )
        return rows

    def report(self, spec: JobSpec, cluster: Cluster, artifacts: Path, title: str) -> Report:
        """Each client's figures: frames, rate, glass-to-glass and input-to-photon
        percentiles, and each stage's share."""
        rows, lines = [], []
        for path in sorted((Path(cluster.workspace) / "outputs").glob("stream-*.json")):
            try:
                done = StreamFigures.model_validate(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            rows.append(_row(done))
            lines.append(f"- {done.client}: {_line(done)}")
        return Report(rows=rows, lines=lines)


def _said(row: dict[str, Any]) -> str:
    return f"{row['width']}x{row['height']} {row['encode_ms']:g} ms/frame (up to {row['fps']} fps)"


def _row(done: StreamFigures) -> dict[str, Any]:
    row: dict[str, Any] = {
        "client": done.client,
        "size": f"{done.width}x{done.height}",
        "encoder": done.encoder,
        "fps": done.fps,
        "kbit/s": done.bitrate_kbps,
        "dropped": done.dropped,
        "glass p50 ms": done.capture_to_display.p50,
        "glass p95 ms": done.capture_to_display.p95,
        "glass p99 ms": done.capture_to_display.p99,
        "input p50 ms": done.input_to_photon.p50,
        "input p95 ms": done.input_to_photon.p95,
    }
    for stage, figures in done.stages.items():
        row[f"{stage} p50 ms"] = figures.p50
    return row


def _line(done: StreamFigures) -> str:
    glass = done.capture_to_display
    text = f"{done.frames_shown} frames at {done.fps:g} fps ({done.width}x{done.height}, {done.encoder})"
    if glass.p50 is not None:
        text += f", capture to display p50 {glass.p50:g} / p95 {glass.p95:g} / p99 {glass.p99:g} ms"
    if done.input_to_photon.p50 is not None:
        text += f", input to photon p50 {done.input_to_photon.p50:g} ms"
    return text + f", {done.bitrate_kbps:g} kbit/s, {done.dropped} dropped"
