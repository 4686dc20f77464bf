"""The `stream` job: an interactive render session streamed to a browser, as a service
whose replica renders frames, encodes them at low latency and sends them over a
WebSocket through the service's endpoint (docs/streaming.md)."""

from __future__ import annotations

import sys
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from gpuflow.tasks.service.model import Probe, Replicas, Scaling, ServiceJob
from gpuflow.tasks.spec import Seconds

SERVER = "gpuflow.tasks.stream.server"
LARGEST = 4096  # pixels a side: what H.264 levels and browsers' decoders take


class StreamJob(ServiceJob):
    """Stream an interactive render to browsers: open the endpoint's page, the session
    renders (the built-in scene, or `renderer`), encodes with NVENC or x264 at zero
    latency and sends each frame over a WebSocket; keys and the mouse move the camera."""

    kind: Literal["stream"] = "stream"  # type: ignore[assignment]
    width: int = Field(1280, description="Frame width in pixels (even, at most 4096).")
    height: int = Field(720, description="Frame height in pixels (even, at most 4096).")
    fps: int = Field(30, description="Frames per second the session aims at (1-240).")
    encoder: Literal["auto", "nvenc", "x264"] = Field(
        "auto",
        description="nvenc: the GPU's encoder; x264: libx264 on the CPU (zero latency);"
        " auto: NVENC where the GPU has a free session, else x264.",
    )
    bitrate_kbps: int = Field(8000, ge=100, le=200_000, description="Target bitrate.")
    renderer: str | None = Field(
        None,
        description="Your renderer, `module:factory` (importable where the session runs,"
        " e.g. from job.workdir): factory(width, height) returns render(camera, t) giving"
        " an (height, width, 3) uint8 RGB array; none: the built-in scene.",
    )
    idle_after_s: Seconds = Field(
        60.0,
        gt=0,
        le=86400,
        description="A session with no client connected for this long ends its replica.",
    )
    clients: int = Field(
        4,
        ge=1,
        le=64,
        description="Clients served at once: one replica each (its own renderer, encoder"
        " and GPUs), started when a client comes, ended after idle_after_s once it left.",
    )
    # a session's endpoint: the page and its WebSocket; a replica at once ready
    ready: Probe = Field(default_factory=lambda: Probe(path="/health", period_s=0.2))
    # a replica encoding at full speed answers a little late now and then: not dead
    live: Probe | None = Field(
        default_factory=lambda: Probe(path="/health", period_s=2.0, timeout_s=5.0, failures=3)
    )
    replicas: Replicas = Field(default_factory=lambda: Replicas(min=0, max=4))
    scaling: Scaling = Field(default_factory=Scaling)

    @model_validator(mode="before")
    @classmethod
    def _the_server(cls, data: Any) -> Any:
        """The replica's command is the session server, with the job's settings."""
        if not isinstance(data, dict):
            return data
        command = data.get("command")
        if command is not None and SERVER not in command:  # (its own, when read again)
            raise ValueError(
                "job.command: a stream session runs gpuflow's session server; plug your"
                " renderer in with job.renderer (module:factory) instead of a command"
            )
        scaling = dict(data.get("scaling") or {})
        replicas = dict(data.get("replicas") or {})
        replicas.setdefault("min", 0)
        replicas.setdefault("max", data.get("clients", 4))  # a replica per client
        scaling.setdefault("connections", 1)  # ... holding its page's WebSocket
        if "to_zero_after_s" not in scaling and not replicas.get("min"):
            # the session ends with its last client
            scaling["to_zero_after_s"] = data.get("idle_after_s", 60.0)
        settings = [  # the fields' own checks judge them; the server reads them so
            f"--width={data.get('width', 1280)}",
            f"--height={data.get('height', 720)}",
            f"--fps={data.get('fps', 30)}",
            f"--encoder={data.get('encoder', 'auto')}",
            f"--bitrate-kbps={data.get('bitrate_kbps', 8000)}",
            "--clients=1",  # a replica per client: the endpoint sends it one
        ]
        if data.get("renderer"):
            settings.append(f"--renderer={data['renderer']}")
        return {
            **data,
            "command": [sys.executable, "-m", SERVER, *settings],
            "scaling": scaling,
            "replicas": replicas,
        }

    @field_validator("width", "height")
    @classmethod
    def _side(cls, value: int, info: Any) -> int:
        if value < 16 or value > LARGEST or value % 2:
            raise ValueError(
                f"{value} pixels: give an even number from 16 to {LARGEST} (H.264 with 4:2:0"
                " colour halves each side)"
            )
        return value

    @field_validator("fps")
    @classmethod
    def _fps(cls, value: int) -> int:
        if not 1 <= value <= 240:
            raise ValueError(f"{value} frames per second: give 1 to 240")
        return value


class StageFigures(BaseModel):
    """One stage's milliseconds per frame."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


class StreamFigures(BaseModel):
    """One client's session, as its server and its page measured it on one clock."""

    client: str
    width: int
    height: int
    encoder: str
    seconds: float
    frames_sent: int
    frames_shown: int
    fps: float
    bitrate_kbps: float
    dropped: int  # not sent (the client was behind) or not shown (a newer one was)
    clock_error_ms: float | None = None  # half the best round trip of the clock sync
    capture_to_display: StageFigures = StageFigures()
    input_to_photon: StageFigures = StageFigures()
    inputs: int = 0
    stages: dict[str, StageFigures] = {}  # render, encode, send, decode, draw
    ended: str = ""
